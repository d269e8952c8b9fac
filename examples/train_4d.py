"""Tensor x pipeline x data (x context) parallelism on an HF Llama, composed in a user's loop:

    torchrun --nproc_per_node=8 examples/train_4d.py --tp 2 --pp 2          # DP = 8 / 4 = 2
    torchrun --nproc_per_node=8 examples/train_4d.py --tp 2 --pp 2 --cp 2   # DP = 1
    torchrun --nproc_per_node=4 examples/train_4d.py --tp 2 --pp 2          # DP = 1 (the tests)

The blocks are the library's, applied to one model in place, in this order:
    tp.parallelize(model, tp_group)           1/T of every attention and MLP block, the vocab
    cp_ring.parallelize(model, cp_group, S)   ring attention over this rank's zig-zag tokens
    pp.Pipeline(model, P, 1, pp_rank, ...)    this rank's stage; the other layers dropped
    zero.Zero + zero.ZeroOptimizer            AdamW's state sharded over dp x cp, gradients
                                              averaged there (ZeRO-1)
Rank grid: rank = tp + T (cp + C (dp + D pp)), TP innermost (the fastest links), PP outermost;
D = W / (T C P). Each dp rank takes its B/D of the global batch's sequences, each cp rank its
zig-zag 1/C of their tokens, and all ranks hold the same number of tokens, so the mean of the
D C local means is the global mean. compose4d.py is the same composition with Megatron SP,
interleaved schedules, tied embeddings, checkpoints and a correctness mode against one device."""
import argparse

import torch
import torch.distributed as dist
from transformers import LlamaForCausalLM

import cp_ring
import pp
import tp
import zero
from common import SEQ, STEPS, batch, finish, init, llama_config, log
from harness import Batch

p = argparse.ArgumentParser()
p.add_argument("--tp", type=int, default=2)
p.add_argument("--pp", type=int, default=2)
p.add_argument("--cp", type=int, default=1)
p.add_argument("--micro-batches", type=int, default=4)
p.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
args = p.parse_args()
device, rank = init()
W, T, P, C, M = dist.get_world_size(), args.tp, args.pp, args.cp, args.micro_batches
D = W // (T * P * C)
assert D * T * P * C == W and args.batch % (D * M) == 0, "W = D T P C, D M divides the batch"
cfg = llama_config(layers=4)
assert cfg.num_key_value_heads % T == 0, "this loop keeps T <= kv heads (tp.clip covers more)"

# ---- the rank grid: every rank creates every group, in the same order ----
coords = [dict(tp=r % T, cp=r // T % C, dp=r // (T * C) % D, pp=r // (T * C * D))
          for r in range(W)]
me = coords[rank]


def group_over(*dims):
    """This rank's group among those in which `dims` vary and the other coordinates are fixed."""
    members = {}
    for r, c in enumerate(coords):
        members.setdefault(tuple(v for d, v in c.items() if d not in dims), []).append(r)
    return dist.new_subgroups_by_enumeration(list(members.values()))[0]


tp_group, cp_group, pp_group, dpcp_group = (group_over("tp"), group_over("cp"), group_over("pp"),
                                            group_over("dp", "cp"))

# ---- the model, cut four ways ----
torch.manual_seed(0)                                   # the same full weights on every rank
model = LlamaForCausalLM(cfg).to(device)
tpm = tp.parallelize(model, tp_group, dtensor=False)   # plain shards: ZeRO flattens them
pos = cp_ring.parallelize(model, cp_group, SEQ).positions.to(device) if C > 1 else None
pipe = pp.Pipeline(model, P, 1, me["pp"], "1f1b", group=pp_group,
                   loss_sum=tpm.loss_sum,              # the last stage: vocab-parallel CE
                   positions=pos)                      # RoPE at this rank's global positions
# ZeRO's flat units over what this stage kept: one of the TP-split parameters, one of those
# every tp rank holds whole (the norms), so the clip below can count each element once.
named = list(model.named_parameters())
units = [("tp-split", [q for n, q in named if n in tpm.split_dim]),
         ("tp-replicated", [q for n, q in named if n not in tpm.split_dim])]
engine = zero.Zero(model, group=dpcp_group, stage=1, units=[u for u in units if u[1]])
opt = zero.ZeroOptimizer(model.parameters(), torch.optim.AdamW, engine=engine, lr=3e-3)
counted = [1.0 if name == "tp-split" or me["tp"] == 0 else 0.0
           for name, params in units if params]


def clip_(max_norm):
    """Global-norm clipping of the averaged gradients over all four dimensions: the squares of
    this rank's gradient shards, TP-replicated ones on tp rank 0 only, summed over the world."""
    opt.reduce_gradients()                             # reduce-scatter over dp x cp: averaged
    shards = opt.grad_shards()
    sq = sum(k * g.double().pow(2).sum() for k, g in zip(counted, shards))
    dist.all_reduce(sq)
    norm = sq.sqrt()
    for g in shards:
        g.mul_((max_norm / (norm + 1e-6)).clamp(max=1.0).to(g.dtype))
    return norm


for step in range(STEPS):
    seq = batch(0, step, size=args.batch).to(device)   # the global batch, on every rank
    n = args.batch // D
    seq = seq[me["dp"] * n:(me["dp"] + 1) * n]         # this dp rank's sequences
    ids, labels = seq[:, :-1], seq[:, 1:]
    if pos is not None:
        ids, labels = ids[:, pos], labels[:, pos]      # this cp rank's tokens
    local = Batch(ids, labels, step)
    loss_sum = pipe.run(local, M)                      # each micro-batch: CE_sum / local tokens
    tpm.reduce_partial_grads()                         # (replicated kv heads: none at T <= kv)
    norm = clip_(1.0)
    opt.step()                                         # AdamW on the shards, all-gather
    opt.zero_grad()
    loss = loss_sum / local.n_tokens / (D * C)         # the last stage: its share of the mean
    if me["pp"] == P - 1:
        dist.all_reduce(loss, group=dpcp_group)
    log(step, loss, printer=W - 1, extra=f"  grad norm {float(norm):.6f}")
finish()
