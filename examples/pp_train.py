"""Pipeline parallelism on an HF Llama: torchrun --nproc_per_node=2 examples/pp_train.py

pp.Pipeline keeps this rank's stage (the other layers are dropped) and runs a schedule (GPipe,
1F1B, ZB-H1; interleaved 1F1B with V > 1 chunks per rank) over one global batch split into
micro-batches: activations go forward and their gradients back with point-to-point sends.
pipe.run takes the suite's Batch (input ids and their shifted labels; the harness package
exports it) and returns the CE sum of the micro-batches whose loss this stage computed."""
import argparse

import torch
import torch.distributed as dist
from transformers import LlamaForCausalLM

import pp
from common import STEPS, batch, finish, init, llama_config, log
from harness import Batch

p = argparse.ArgumentParser()
p.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b", "zb"])
args = p.parse_args()
device, rank = init()
P = dist.get_world_size()
torch.manual_seed(0)                                   # the same full model on every rank
model = LlamaForCausalLM(llama_config(layers=4)).to(device)
pipe = pp.Pipeline(model, P, 1, rank, args.schedule)   # now this rank holds one stage
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
for step in range(STEPS):
    seq = batch(0, step, size=16).to(device)           # the global batch, on every stage
    b = Batch(seq[:, :-1], seq[:, 1:], step)           # inputs and their shifted labels
    loss_sum = pipe.run(b, 4)                          # 4 micro-batches; forward and backward
    pp.clip_across_stages(model, 1.0, pipe)            # one global norm over the stages
    opt.step()
    opt.zero_grad()
    log(step, loss_sum / b.n_tokens, printer=P - 1)    # the last stage has the loss
finish()
