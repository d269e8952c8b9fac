"""Expert parallelism on an HF Mixtral: torchrun --nproc_per_node=2 examples/ep_train.py

ep_moe.parallelize keeps E/W experts on each rank; every MoE layer sends each token's rows to
its chosen experts' ranks and back (all_to_all). Everything else is replicated, with its
gradients summed over the ranks (each rank's loss is its share of the global mean): the
DataParallel that ep_moe.parallelize's docstring names, params= the replicated parameters and
average=False (both documented in DataParallel.__init__)."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import MixtralConfig, MixtralForCausalLM

import ddp
import ep_moe
from common import SEQ, STEPS, VOCAB, batch, finish, init, log

device, rank = init()
W = dist.get_world_size()
torch.manual_seed(0)                                   # the same full model on every rank
cfg = MixtralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                    num_experts_per_tok=2, max_position_embeddings=SEQ)
model = MixtralForCausalLM(cfg).to(device)
ep_moe.parallelize(model, None)                        # E/W experts per rank
dense = [q for n, q in model.named_parameters() if not ep_moe.is_expert(n)]
experts = [q for n, q in model.named_parameters() if ep_moe.is_expert(n)]
model = ddp.DataParallel(model, params=dense, average=False)   # the replicated rest: summed
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)


def grad_norm():
    """The global gradient norm: the replicated gradients are identical on every rank (counted
    once), the experts' are disjoint (their squares summed over the ranks)."""
    sq_experts = sum(q.grad.pow(2).sum() for q in experts if q.grad is not None)
    sq_experts = torch.as_tensor(sq_experts, dtype=torch.float32, device=device)
    dist.all_reduce(sq_experts)
    sq_dense = sum(q.grad.pow(2).sum() for q in dense if q.grad is not None)
    return (sq_dense + sq_experts).sqrt()


for step in range(STEPS):
    seq = batch(rank, step).to(device)                 # every rank: its own sequences
    logits = model(input_ids=seq[:, :-1]).logits
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), seq[:, 1:].reshape(-1),
                           reduction="sum") / (seq[:, 1:].numel() * W)
    loss.backward()                                    # experts: the all-to-all's backward
    torch.nn.utils.clip_grads_with_norm_(model.parameters(), 1.0, grad_norm())
    opt.step()
    opt.zero_grad()
    log(step, loss, summed=True)                       # the shares summed: the global mean
finish()
