"""Pipeline parallelism on an HF Llama: torchrun --nproc_per_node=2 examples/pp_train.py

pp.Pipeline keeps this rank's stage (the other layers are dropped) and runs a schedule (GPipe,
1F1B, interleaved 1F1B, ZB-H1) over one global batch split into micro-batches: activations go
forward and their gradients back with point-to-point sends."""
import argparse
import sys

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, __file__.rsplit("/examples/", 1)[0])
import pp  # noqa: E402
from common import SEQ, STEPS, VOCAB, batch, finish, init, log  # noqa: E402
from harness.data import Batch  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b", "zb"])
args = p.parse_args()
device, rank = init()
P = dist.get_world_size()
torch.manual_seed(0)                                   # the same full model on every rank
cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
model = LlamaForCausalLM(cfg).to(device)
pipe = pp.Pipeline(model, P, 1, rank, args.schedule)   # now this rank holds one stage
opt = torch.optim.AdamW([q for q in model.parameters()], lr=3e-3)
for step in range(STEPS):
    seq = batch(0, step, size=16).to(device)           # the global batch, on every stage
    b = Batch(seq[:, :-1], seq[:, 1:], step)           # inputs and their shifted labels
    loss_sum = pipe.run(b, 4)                          # 4 micro-batches; forward and backward
    opt.step()
    opt.zero_grad()
    log(step, loss_sum / b.n_tokens, printer=P - 1)   # the last stage has the loss
finish()
