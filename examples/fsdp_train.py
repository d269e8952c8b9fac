"""Fully sharded data parallelism on your own model:
torchrun --nproc_per_node=2 examples/fsdp_train.py

fsdp.fully_shard shards parameters, gradients and optimizer state; each block you name is a
unit, gathered just before it runs and freed after."""
import torch

import fsdp
import zero
from common import STEPS, TinyLM, batch, finish, init, log, loss_fn, no_decay_groups

device, rank = init()
model = TinyLM().to(device)
fs = fsdp.fully_shard(model, units=list(model.blocks))    # the rest (embedding, norm, head):
opt = zero.ZeroOptimizer(no_decay_groups(model, 0.1),     # the root unit
                         torch.optim.AdamW, engine=fs, lr=3e-3)
for step in range(STEPS):
    loss = loss_fn(model, batch(rank, step).to(device))
    loss.backward()                                       # gathers, reduce-scatters, frees
    opt.clip_grad_norm_(1.0)
    opt.step()
    opt.zero_grad()
    log(step, loss)
full = fs.full_tensors("param")                           # collective: full weights
if rank == 0:
    print(f"gathered {len(full)} full parameters", flush=True)
finish()
