"""Context parallelism (ring attention) on an HF Llama:
torchrun --nproc_per_node=2 examples/cp_train.py

cp_ring.parallelize routes attention through a ring that passes K and V between the ranks;
each rank computes 1/W of every sequence's tokens (zig-zag chunks, so causal work balances),
and the weights' gradients are summed over the ranks."""
import sys

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, __file__.rsplit("/examples/", 1)[0])
import cp_ring  # noqa: E402
import ddp  # noqa: E402
from common import SEQ, STEPS, VOCAB, batch, finish, init, log  # noqa: E402

device, rank = init()
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
model = LlamaForCausalLM(cfg).to(device)
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
    opt.step()
    opt.zero_grad()
    log(step, loss, summed=True)           # each rank: its share of the mean
finish()
