"""Fully sharded data parallelism on your own model, in the loop FSDP2 teaches:
torchrun --nproc_per_node=2 examples/fsdp_train.py

fsdp.fully_shard makes each block one unit (gathered just before it runs, freed after), then
the model the root unit (embedding, norm, head). Afterwards every parameter *is* this rank's
dim-0 shard, so a plain torch optimizer over model.parameters() steps the shards. The policy:
fp32 shards (the masters), bf16 compute copies, fp32 gradient reduction."""
import torch

import fsdp
from common import STEPS, TinyLM, batch, finish, init, log, loss_fn, no_decay_groups

device, rank = init()
model = TinyLM().to(device)
policy = fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
for block in model.blocks:
    fsdp.fully_shard(block, mp_policy=policy)
fsdp.fully_shard(model, mp_policy=fsdp.MixedPrecisionPolicy(    # the logits in fp32
    param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32))
opt = torch.optim.AdamW(no_decay_groups(model, 0.1), lr=3e-3)    # after fully_shard
for step in range(STEPS):
    loss = loss_fn(model, batch(rank, step).to(device))
    loss.backward()                                # gathers, reduce-scatters into .grad shards
    fsdp.clip_grad_norm_(model, 1.0)
    opt.step()
    opt.zero_grad()
    log(step, loss)
full = fsdp.full_state_dict(model)                 # collective: full fp32 weights, every rank
if rank == 0:
    print(f"gathered {len(full)} full tensors", flush=True)
finish()
