"""Context parallelism (ring attention) on an HF Llama:
torchrun --nproc_per_node=2 examples/cp_train.py

cp_ring.parallelize routes attention through a ring that passes K and V between the ranks;
each rank computes 1/W of every sequence's tokens (zig-zag chunks, so causal work balances),
and the weights' gradients are summed over the ranks: ddp.DataParallel with average=False
(documented in DataParallel.__init__ and in cp_ring's Public API), since each rank's loss is
already its share of the global mean."""
import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM

import cp_ring
import ddp
from common import SEQ, STEPS, VOCAB, batch, finish, init, llama_config, log

device, rank = init()
torch.manual_seed(0)
model = LlamaForCausalLM(llama_config()).to(device)
cp = cp_ring.parallelize(model, None, SEQ)             # SEQ tokens per sequence, 2W chunks
model = ddp.DataParallel(model, average=False)         # same weights, other tokens: sum
pos = cp.positions.to(device)                          # this rank's global positions
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
for step in range(STEPS):
    seq = batch(0, step).to(device)                    # every rank: the same sequences
    ids, labels = seq[:, :-1], seq[:, 1:]
    logits = model(input_ids=ids[:, pos], position_ids=pos[None].expand(len(ids), -1)).logits
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), labels[:, pos].reshape(-1),
                           reduction="sum") / labels.numel()   # this rank's share of the mean
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)   # summed: the same on every rank
    opt.step()
    opt.zero_grad()
    log(step, loss, summed=True)                       # the shares summed: the global mean
finish()
