"""What the examples share: a small model (TinyLM, or a small HF Llama config), a toy task, the
process group and the loss log. A user's own code has its own versions of these; the parallel
part is in each example's loop. The examples import the suite's files as an installed package
(`pip install -e .` at the repository root, or PYTHONPATH set to it) and this file from their
own folder (torchrun puts a script's folder on sys.path)."""
import gc
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

VOCAB, SEQ = 32, 16
STEPS = 60


class TinyLM(nn.Module):
    """Embedding, a few residual MLP blocks, a tied LM head."""

    def __init__(self, width=64, depth=4):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width),
                                                  nn.GELU(), nn.Linear(4 * width, width))
                                    for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        h = self.emb(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(self.norm(h))


def llama_config(layers: int = 2):
    """A small HF Llama: 4 attention heads, 2 kv heads (GQA), untied embeddings."""
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=SEQ, tie_word_embeddings=False)


def batch(rank: int, step: int, size: int = 8):
    """A learnable toy task: predict the next token of an arithmetic sequence (x, x+d, ...);
    every rank draws its own samples."""
    g = torch.Generator().manual_seed(step * 1000 + rank)
    start = torch.randint(0, VOCAB, (size, 1), generator=g)
    stride = torch.randint(1, 4, (size, 1), generator=g)
    return (start + stride * torch.arange(SEQ + 1)) % VOCAB


def loss_fn(model, seq):
    logits = model(seq[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), seq[:, 1:].reshape(-1))


def init():
    """torchrun's environment: gloo on CPU, NCCL with one GPU per process."""
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    torch.manual_seed(dist.get_rank())      # different on every rank: the wrappers broadcast
    return torch.device("cuda" if cuda else "cpu"), dist.get_rank()


def no_decay_groups(model, weight_decay):
    """The usual AdamW groups: no weight decay on biases and norm weights."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def log(step, loss, *, summed=False, printer=0, extra=""):
    """Every 20 steps and the last, rank `printer` prints the loss. summed: each rank holds its
    share of the global mean, all-reduced first (a collective: call it on every rank)."""
    if step % 20 and step != STEPS - 1:
        return
    if summed:
        loss = loss.detach().clone()
        dist.all_reduce(loss)
    if dist.get_rank() == printer:
        print(f"step {step:3d}  loss {float(loss):.4f}{extra}", flush=True)


def finish():
    """The end of a run: a barrier, so no rank tears gloo down while a peer is still using it,
    then destroy the groups and collect the cyclic garbage (a wrapper's gradient hooks and the
    wrapper refer to each other), so every process group is destructed and its threads joined
    now, not during interpreter shutdown, where gloo can abort the process ("terminate called
    without an active exception"; seen on a loaded 2-core CI machine, once in many runs)."""
    dist.barrier()
    dist.destroy_process_group()
    gc.collect()
