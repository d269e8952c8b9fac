"""Tensor parallelism on an HF Llama: torchrun --nproc_per_node=2 examples/tp_train.py [--sp]

tp.parallelize splits every attention and MLP block, the embedding and the LM head over the
ranks, in place; HF's own forward then runs on each rank's shards. All ranks of a tensor-
parallel group see the same tokens. --sp: Megatron sequence parallelism (sp.parallelize), the
same loop, with the residual stream between the blocks split along the sequence too. Every
parameter is a DTensor over its shard, so torch's clip_grad_norm_ (and torch.distributed.checkpoint,
torch.compile) see whole tensors, as on PyTorch's DTensor TP."""
import argparse

import torch
from transformers import LlamaForCausalLM

import sp
import tp
from common import STEPS, batch, finish, init, llama_config, log

p = argparse.ArgumentParser()
p.add_argument("--sp", action="store_true")
args = p.parse_args()
device, rank = init()
torch.manual_seed(0)                                   # the same full weights on every rank
model = LlamaForCausalLM(llama_config()).to(device)
tpm = (sp.parallelize if args.sp else tp.parallelize)(model, None)   # 1/T of the layers each
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
for step in range(STEPS):
    seq = batch(0, step).to(device)                    # one batch for the whole TP group
    logits = model(input_ids=seq[:, :-1]).logits       # this rank's slice of the vocabulary
    loss = tpm.loss_sum(logits, seq[:, 1:]) / seq[:, 1:].numel()
    loss.backward()
    tpm.reduce_partial_grads()                         # replicated kv heads, SP's norms
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)   # DTensor labels: the global norm
    opt.step()
    opt.zero_grad()
    log(step, loss)
full = tpm.full({n: p.detach() for n, p in model.named_parameters()})   # collective
if rank == 0:
    print(f"gathered {len(full)} full parameters", flush=True)
finish()
