"""Ulysses sequence parallelism on an HF Llama:
torchrun --nproc_per_node=2 examples/ulysses_train.py

Every rank holds the full weights and a contiguous 1/W of every sequence's tokens, with their
global position ids (so RoPE is right). sp.parallelize_ulysses installs an attention that
all-to-alls (local tokens, all heads) into (all tokens, local heads), runs ordinary causal
attention, and all-to-alls back; the model comes back wrapped in ddp.DataParallel, which
averages the replicated weights' gradients over the ranks. W must divide the attention heads
and the kv heads (4 and 2 here: W = 2)."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import LlamaForCausalLM

import sp
from common import SEQ, STEPS, VOCAB, batch, finish, init, llama_config, log

device, rank = init()
W = dist.get_world_size()
torch.manual_seed(0)                                   # the same full weights on every rank
model = sp.parallelize_ulysses(LlamaForCausalLM(llama_config()).to(device))   # -> DataParallel
s = SEQ // W                                           # tokens per rank
pos = torch.arange(rank * s, (rank + 1) * s, device=device)   # this rank's global positions
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
for step in range(STEPS):
    seq = batch(0, step).to(device)                    # every rank: the same sequences
    ids, labels = seq[:, :-1], seq[:, 1:]
    logits = model(input_ids=ids[:, pos], position_ids=pos[None].expand(len(ids), -1)).logits
    # Every rank holds the same number of targets, so the mean of the W local means (what
    # DataParallel's averaging gives the gradients) is the global mean. With padding or uneven
    # shards, weigh by token counts (ddp.py's "Loss scaling").
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), labels[:, pos].reshape(-1))
    loss.backward()                                    # the all-to-alls' backward, then the
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)   # average: the same everywhere
    opt.step()
    opt.zero_grad()
    log(step, loss / W, summed=True)                   # the mean of the local means
finish()
