"""Data parallelism on your own model: torchrun --nproc_per_node=2 examples/ddp_train.py

ddp.DataParallel is used exactly like torch's DistributedDataParallel."""
import sys

import torch

sys.path.insert(0, __file__.rsplit("/examples/", 1)[0])
import ddp  # noqa: E402
from common import STEPS, TinyLM, batch, finish, init, log, loss_fn  # noqa: E402

device, rank = init()
model = ddp.DataParallel(TinyLM().to(device))          # rank 0's weights win
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
accum = 2
for step in range(STEPS):
    for k in range(accum):                              # gradient accumulation: no
        ctx = model.no_sync() if k < accum - 1 else torch.enable_grad()  # communication
        with ctx:                                       # until the last micro-batch
            loss = loss_fn(model, batch(rank * accum + k, step).to(device)) / accum
            loss.backward()                             # averaged over ranks by the end
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()                                     # set_to_none, torch's default
    log(step, loss * accum)
finish()
