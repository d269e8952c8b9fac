"""Data parallelism on your own model: torchrun --nproc_per_node=2 examples/ddp_train.py

ddp.DataParallel is used exactly like torch's DistributedDataParallel: rank 0's weights are
broadcast at construction, gradients are averaged by the end of every backward, and no_sync()
skips the communication for the micro-batches before the last one (gradient accumulation)."""
import contextlib

import torch

import ddp
from common import STEPS, TinyLM, batch, finish, init, log, loss_fn

device, rank = init()
model = ddp.DataParallel(TinyLM().to(device))          # rank 0's weights win
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
accum = 2
for step in range(STEPS):
    for k in range(accum):
        last = k == accum - 1                          # only the last backward communicates
        with contextlib.nullcontext() if last else model.no_sync():
            loss = loss_fn(model, batch(rank * accum + k, step).to(device)) / accum
            loss.backward()                            # averaged over ranks by the end
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)   # the same on every rank
    opt.step()
    opt.zero_grad()                                    # set_to_none, torch's default
    log(step, loss * accum)
finish()
