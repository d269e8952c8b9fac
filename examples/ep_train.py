"""Expert parallelism on an HF Mixtral: torchrun --nproc_per_node=2 examples/ep_train.py

ep_moe.parallelize keeps E/W experts on each rank; every MoE layer sends each token's rows to
its chosen experts' ranks and back (all_to_all). Everything else is replicated, with its
gradients summed over the ranks (each rank's loss is its share of the global mean)."""
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import MixtralConfig, MixtralForCausalLM

sys.path.insert(0, __file__.rsplit("/examples/", 1)[0])
import ddp  # noqa: E402
import ep_moe  # noqa: E402
from common import SEQ, STEPS, VOCAB, batch, finish, init, log  # noqa: E402

device, rank = init()
W = dist.get_world_size()
torch.manual_seed(0)                                   # the same full model on every rank
cfg = MixtralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                    num_experts_per_tok=2, max_position_embeddings=SEQ)
model = MixtralForCausalLM(cfg).to(device)
ep_moe.parallelize(model, None)                        # E/W experts per rank
dense = [q for n, q in model.named_parameters() if not ep_moe.is_expert(n)]
model = ddp.DataParallel(model, params=dense, average=False)   # the replicated rest: summed
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
for step in range(STEPS):
    seq = batch(rank, step).to(device)                 # every rank: its own sequences
    logits = model(input_ids=seq[:, :-1]).logits
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), seq[:, 1:].reshape(-1),
                           reduction="sum") / (seq[:, 1:].numel() * W)
    loss.backward()                                    # experts: the all-to-all's backward
    opt.step()
    opt.zero_grad()
    log(step, loss, summed=True)           # each rank: its share of the mean
finish()
