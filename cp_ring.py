"""cp_ring.py: context parallelism with ring attention (zig-zag load-balanced), from raw p2p.

The idea (Liu et al., "Ring Attention with Blockwise Transformers", 2023; Brandon et al.,
"Striped Attention", 2023, and Llama 3's zig-zag/all-gather context parallelism)
    The sequence is sharded over W ranks; every layer except attention is per-token, so only
    attention needs the other ranks' keys and values. Ring attention computes it in W steps:
    each rank attends its queries to the K/V block it holds, then passes the block to the next
    rank (send to r+1, receive from r-1), overlapping the transfer with the block's compute.
    Blocks are combined with the online softmax (Milakov & Gimelshein 2018; FlashAttention-2):
    every query row keeps its running score max m, the sum l = sum exp(s - m) and the
    unnormalised output acc = sum exp(s - m) v; a new block rescales both to the larger max,
        m' = max(m, m_b),   l' = l e^(m - m') + l_b e^(m_b - m'),
        acc' = acc e^(m - m') + acc_b e^(m_b - m')
    and at the end out = acc / l, lse = m + log l (what the backward needs), in fp32 (fp64 in
    float64 runs). Each rescale factor is the exp of a difference of two scores (m is a score),
    exact but for one rounding. Merging normalised block outputs by their log-sum-exps instead,
    out <- out - sigmoid(lse_b - lse) (out - out_b), is the same algebra but weighs each block
    by a difference of two lse's that carry eps * |lse| each: with large logits (|s| ~ 100)
    out then disagrees with the backward's P = exp(s - lse) by ~100 eps, and dQ/dK came out up
    to 6x less accurate than torch's SDPA (`python tests/cp_attention_check.py --kernel`).
    The backward is a custom autograd Function: dQ accumulates locally, while dK/dV travel
    around the ring with their K/V and arrive home after a last hop.

Layouts (--variant)
    zigzag     the sequence is cut into 2W chunks; rank r holds chunks r and 2W-1-r, so every
               rank has the same causal work (default)
    ring       contiguous chunks: rank W-1 attends to everything, rank 0 to its own block only;
               kept to show why zig-zag exists
    allgather  zig-zag layout, but K/V are all-gathered per layer and dK/dV reduce-scattered
               (Llama 3's choice: simpler, and fine when K/V are small thanks to GQA)
    Causal work per (query chunk, key chunk) pair is decided from global positions: a chunk
    entirely after the key chunk attends in full, one entirely before it skips, and the diagonal
    takes the mask. Under zig-zag half of each off-diagonal block is skipped.

GQA: only the kv heads travel. RoPE: each rank passes its tokens' global position ids (not
contiguous under zig-zag). Integration: an attention function registered in HF's attention
registry, with no copy of the model code. The loss is the global token mean, and weight
gradients are summed over the CP group (ddp.DataParallel: every rank saw different tokens).

Communication per layer (s = S/W local tokens, kv = H_kv * d, b bytes, batch B)
    ring/zigzag  forward: W-1 hops of K and V, each B*s*2kv*b; backward: W-1 hops of K, V, dK,
                 dV plus the last hop of dK, dV home. Forward bytes sent per rank
                 = 2 (W-1)/W * S * kv * b * B, the textbook figure.
    allgather    forward: one all_gather of K and V (B*S*2kv*b); backward: one reduce_scatter
                 of dK and dV (same size).
Block kernel: pure torch (returns lse); used for every dtype here (CPU, float64).

Planted bugs (`--plant-bug NAME`, `CP.plants`; each must FAIL the correctness mode): the
gradient sum not averaged, the diagonal block attending in full, the merge not rescaling the
running output, dK/dV not brought home, tokens split contiguously under the zig-zag layout,
and (allgather) dK/dV kept instead of reduce-scattered.
"""
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from harness import Expect, Plant, Strategy, DTYPES, main, make_adamw, METER, phase
import ddp

NEG_INF = float("-inf")


# ----------------------------------------------------------------------------------------------
# Layout: which global positions each rank holds, as contiguous chunks
# ----------------------------------------------------------------------------------------------
def layout(variant: str, world: int, seq: int) -> list[list[tuple[int, int]]]:
    """For each rank, its chunks [(start, end), ...] in local order."""
    if variant == "ring":
        s = seq // world
        return [[(r * s, (r + 1) * s)] for r in range(world)]
    c = seq // (2 * world)  # zigzag and allgather
    return [[(r * c, (r + 1) * c), ((2 * world - 1 - r) * c, (2 * world - r) * c)]
            for r in range(world)]


def positions(chunks) -> torch.Tensor:
    return torch.cat([torch.arange(a, b) for a, b in chunks])


def relation(q: tuple[int, int], k: tuple[int, int]) -> str:
    """Causal work of query chunk q against key chunk k (global position ranges)."""
    if q[0] >= k[1]:
        return "full"       # every query is after every key
    if q[1] <= k[0]:
        return "skip"       # every query is before every key
    return "mask"           # overlapping (the diagonal): position mask


class CPContext:
    """What the attention function needs: group, layout, and counters for the benchmark.
    world/rank default to the group's (given, they let one process play every rank of the
    block loop: tests/cp_attention_check.py --kernel). plant: a planted bug's name or None."""

    def __init__(self, variant, group, seq, world=None, rank=None, plant=None):
        self.variant, self.group, self.plant = variant, group, plant
        self.W = dist.get_world_size(group) if world is None else world
        self.rank = dist.get_rank(group) if rank is None else rank
        self.chunks = layout(variant, self.W, seq)
        self.flops = 0          # attention forward FLOPs computed on this rank
        self.seconds = 0.0      # time computing attention blocks, forward + backward

    def offsets(self, rank):
        """(start, end) of each chunk inside rank's local tensor, with its global range."""
        out, off = [], 0
        for a, b in self.chunks[rank]:
            out.append((off, off + b - a, (a, b)))
            off += b - a
        return out


# ----------------------------------------------------------------------------------------------
# Block kernels (pure torch; they return the log-sum-exp)
# ----------------------------------------------------------------------------------------------
def _expand(x, n_rep):
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


def _reduce_rep(x, n_rep):
    if n_rep == 1:
        return x
    B, H, n, d = x.shape
    return x.view(B, H // n_rep, n_rep, n, d).sum(2)


def _scores(q, k, scale, rel, qr, kr):
    s = (q @ k.transpose(-1, -2)) * scale
    if rel == "mask":
        qpos = torch.arange(*qr, device=q.device)
        kpos = torch.arange(*kr, device=q.device)
        s = s.masked_fill(kpos[None, :] > qpos[:, None], NEG_INF)
    return s


def _finite(m):
    """The row max as a shift: 0 where the row has seen nothing yet (m = -inf), so that
    exp(s - m) stays exp(-inf) = 0 there instead of NaN."""
    return m.masked_fill(m == NEG_INF, 0.0)


def block_forward(q, k, v, scale, rel, qr, kr):
    """(acc, l, m) of q attending to one K/V block: the row max m of the scores, the row sum
    l = sum exp(s - m) and the unnormalised output acc = exp(s - m) @ v. A fully masked row
    gives acc 0, l 0, m -inf."""
    s = _scores(q, k, scale, rel, qr, kr)
    m = s.amax(-1)
    p = torch.exp(s - _finite(m)[..., None])
    return p @ v, p.sum(-1), m


def merge(state, block, plant=None):
    """Online softmax: add a block's (acc, l, m) to the running (acc, l, m), both rescaled to
    the larger max (each factor exp(m - m') <= 1, the difference of two scores)."""
    if state is None:
        return block
    (acc, l, m), (acc_b, l_b, m_b) = state, block
    new_m = torch.maximum(m, m_b)
    a, b = torch.exp(m - _finite(new_m)), torch.exp(m_b - _finite(new_m))
    if plant == "merge-no-rescale":   # planted bug: the running output keeps its old max
        return acc + acc_b * b[..., None], l * a + l_b * b, new_m
    return acc * a[..., None] + acc_b * b[..., None], l * a + l_b * b, new_m


def block_backward(q, k, v, do, lse, delta, scale, rel, qr, kr):
    """(dq, dk, dv) of one block from the final lse and delta = rowsum(dO * O)."""
    s = _scores(q, k, scale, rel, qr, kr)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    dv = p.transpose(-1, -2) @ do
    ds = p * (do @ v.transpose(-1, -2) - delta[..., None])
    return (ds @ k) * scale, (ds.transpose(-1, -2) @ q) * scale, dv


# ----------------------------------------------------------------------------------------------
# Attention over the sharded sequence: the ring and the all-gather drivers
# ----------------------------------------------------------------------------------------------
def _acc_dtype(x):
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _hop(tensors: list, cp: CPContext):
    """Send `tensors` to the next rank and receive the previous rank's (async; every send and
    its recv are posted together, so no ordering can deadlock). Returns (buffers, requests)."""
    def peer(r):
        return dist.get_global_rank(cp.group, r % cp.W) if cp.group else r % cp.W
    recv = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, peer(cp.rank + 1), cp.group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, t, peer(cp.rank - 1), cp.group) for t in recv]
    return recv, dist.batch_isend_irecv(ops)


def _wait(reqs):
    for r in reqs:
        r.wait()


def _pairs(cp, src):
    """(query chunk, key chunk, relation) for this rank's queries against rank src's K/V,
    each chunk as (local start, local end, global range); pairs with no causal work left out."""
    for qa, qb, qr in cp.offsets(cp.rank):
        for ka, kb, kr in cp.offsets(src):
            rel = relation(qr, kr)
            if cp.plant == "unmasked-diagonal" and rel == "mask":
                rel = "full"   # planted bug: the diagonal block attends to its future too
            if rel != "skip":
                yield (qa, qb, qr), (ka, kb, kr), rel


def _attend(q, k, v, cp, src, scale, n_rep, acc):
    """Accumulate q's attention to rank src's K/V block into acc[(q chunk)] = (acc, l, m)."""
    for (qa, qb, qr), (ka, kb, kr), rel in _pairs(cp, src):
        t0 = time.perf_counter()
        qq = q[:, :, qa:qb].to(acc["dtype"])
        kk = _expand(k[:, :, ka:kb], n_rep).to(acc["dtype"])
        vv = _expand(v[:, :, ka:kb], n_rep).to(acc["dtype"])
        acc[qa] = merge(acc.get(qa), block_forward(qq, kk, vv, scale, rel, qr, kr), cp.plant)
        cp.flops += 4 * qq.shape[0] * qq.shape[1] * (qb - qa) * (kb - ka) * qq.shape[-1]
        cp.seconds += time.perf_counter() - t0


def _grad(q, k, v, do, lse, delta, cp, src, scale, n_rep, dq, dkv):
    """Accumulate the block's contributions into dq (local) and dkv (src's block)."""
    for (qa, qb, qr), (ka, kb, kr), rel in _pairs(cp, src):
        t0 = time.perf_counter()
        dt = dq.dtype
        kk = _expand(k[:, :, ka:kb], n_rep).to(dt)
        vv = _expand(v[:, :, ka:kb], n_rep).to(dt)
        dq_b, dk_b, dv_b = block_backward(q[:, :, qa:qb].to(dt), kk, vv, do[:, :, qa:qb],
                                          lse[:, :, qa:qb], delta[:, :, qa:qb], scale, rel,
                                          qr, kr)
        dq[:, :, qa:qb] += dq_b
        dkv[0][:, :, ka:kb] += _reduce_rep(dk_b, n_rep)
        dkv[1][:, :, ka:kb] += _reduce_rep(dv_b, n_rep)
        cp.seconds += time.perf_counter() - t0


def _finish(acc):
    """(out, lse) of the local queries: out = acc / l, lse = m + log l, chunks in local order.
    A row that saw nothing (l = 0; never under a causal layout) gives out 0, lse -inf."""
    keys = sorted(k for k in acc if k != "dtype")
    a, l, m = (torch.cat([acc[k][i] for k in keys], dim=2) for i in range(3))
    return a / torch.where(l > 0, l, 1.0)[..., None], m + torch.log(l)


def _backward_setup(ctx, dout):
    """What both backwards start from: saved tensors, dO in the accumulation dtype, the row sums
    delta = rowsum(dO * O) of the softmax backward, and a zero dQ."""
    q, k, v, out, lse = ctx.saved_tensors
    do = dout.to(out.dtype)
    return (q, k, v, lse, ctx.cp, ctx.scale, q.shape[1] // k.shape[1], do, (do * out).sum(-1),
            torch.zeros_like(q, dtype=out.dtype))


class RingAttention(torch.autograd.Function):
    """Causal attention of local q (B, H, s, d) to the whole sharded sequence, K/V (B, Hkv, s, d)
    passed around the ring."""

    @staticmethod
    def forward(ctx, q, k, v, cp, scale):
        n_rep = q.shape[1] // k.shape[1]
        acc = {"dtype": _acc_dtype(q)}
        kv = torch.stack([k, v]).contiguous()          # only kv heads travel
        for step in range(cp.W):
            src = (cp.rank - step) % cp.W
            if step < cp.W - 1:
                nxt, reqs = _hop([kv], cp)             # overlaps the block below
            _attend(q, kv[0], kv[1], cp, src, scale, n_rep, acc)
            if step < cp.W - 1:
                _wait(reqs)
                kv = nxt[0]
        out, lse = _finish(acc)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cp, ctx.scale = cp, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, lse, cp, scale, n_rep, do, delta, dq = _backward_setup(ctx, dout)
        dt = dq.dtype
        kv = torch.stack([k, v]).contiguous()
        dkv = torch.zeros_like(kv, dtype=dt)           # travels with kv, home after W hops
        for step in range(cp.W):
            src = (cp.rank - step) % cp.W
            _grad(q, kv[0], kv[1], do, lse, delta, cp, src, scale, n_rep, dq, dkv)
            if cp.W == 1:
                break
            if step < cp.W - 1:                        # K/V and their dK/dV move on together
                (kv, dkv), reqs = _hop([kv, dkv], cp)
            elif cp.plant == "dkv-not-home":           # planted bug: no last hop, the
                break                                  # neighbour's dK/dV are taken as ours
            else:                                      # the last hop brings our dK/dV home
                (dkv,), reqs = _hop([dkv], cp)
            _wait(reqs)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None


def _gather_kv(k, v, cp):
    """Every rank's K and V as (W, B, 2, Hkv, s, d): one all-gather, rank blocks on dim 0."""
    kv = torch.stack([k, v], dim=1).contiguous()
    full = torch.empty((cp.W * kv.shape[0],) + kv.shape[1:], dtype=kv.dtype, device=kv.device)
    dist.all_gather_into_tensor(full, kv, group=cp.group)
    return full.view((cp.W,) + kv.shape)


class AllGatherAttention(torch.autograd.Function):
    """Llama 3 style: all-gather K/V once per layer, reduce-scatter dK/dV in the backward."""

    @staticmethod
    def forward(ctx, q, k, v, cp, scale):
        n_rep = q.shape[1] // k.shape[1]
        full = _gather_kv(k, v, cp)
        acc = {"dtype": _acc_dtype(q)}
        for src in range(cp.W):
            _attend(q, full[src][:, 0], full[src][:, 1], cp, src, scale, n_rep, acc)
        out, lse = _finish(acc)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cp, ctx.scale = cp, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, lse, cp, scale, n_rep, do, delta, dq = _backward_setup(ctx, dout)
        dt = dq.dtype
        full = _gather_kv(k, v, cp)                      # K/V were not kept: gather again
        dfull = torch.zeros(full.shape, dtype=dt, device=q.device)
        for src in range(cp.W):
            blk = [dfull[src][:, 0], dfull[src][:, 1]]
            _grad(q, full[src][:, 0], full[src][:, 1], do, lse, delta, cp, src, scale, n_rep,
                  dq, blk)
        mine = torch.empty(full.shape[1:], dtype=full.dtype, device=full.device)
        if cp.plant == "no-reduce-scatter":   # planted bug: only our own queries' dK/dV
            mine = dfull[cp.rank].to(full.dtype)
        else:
            dist.reduce_scatter_tensor(mine, dfull.to(full.dtype).view((-1,) + full.shape[2:]),
                                       group=cp.group)
        return dq.to(q.dtype), mine[:, 0], mine[:, 1], None, None


def cp_attention(q, k, v, cp: CPContext, scale: float):
    fn = AllGatherAttention if cp.variant == "allgather" else RingAttention
    return fn.apply(q, k, v, cp, scale)


def hf_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                 **kwargs):
    """HF attention-interface function: local (B, heads, s, d) in, (B, s, heads, d) out."""
    with phase("attention"):
        out = cp_attention(query, key, value, module.cp, scaling or query.shape[-1] ** -0.5)
    return out.transpose(1, 2).contiguous(), None


def install(model, cp: CPContext):
    """Route every decoder layer's attention through hf_attention over cp's group (HF's
    attention registry). The caller feeds each rank its tokens with their global positions."""
    from transformers import AttentionInterface
    AttentionInterface.register("ring_cp", hf_attention)
    model.config._attn_implementation = "ring_cp"
    for layer in model.model.layers:
        layer.self_attn.cp = cp


def reference_attention(q, k, v, scale):
    """Full causal attention on one device (for the standalone check)."""
    n_rep = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, _expand(k, n_rep), _expand(v, n_rep),
                                          is_causal=True, scale=scale)


# ----------------------------------------------------------------------------------------------
# Harness adapter
# ----------------------------------------------------------------------------------------------
def cp_constraints(args, world, config) -> list[str]:
    errs = []
    parts = world if args.variant == "ring" else 2 * world
    if args.length % parts:
        what = "W" if args.variant == "ring" else "2W"
        errs.append(f"sequence length {args.length} is not divisible by {what} = {parts} "
                    f"({args.variant} layout over {world} ranks)")
    return errs


# Where each planted bug must FAIL: the tour's model, float32 with clipping (a scale bug must
# show through the clip too).
PLANT_ARGS = ("--dtype", "float32", "--clip", "0.5")


class CP(Strategy):
    name = "cp"
    plants = {
        "no-average": Plant("the CP group's gradient all_reduce sums instead of "
                                   "averaging (W x; clipping would hide it)", PLANT_ARGS),
        "unmasked-diagonal": Plant("the diagonal block attends in full: each query "
                                          "also sees the later keys of its own chunk",
                                          PLANT_ARGS),
        "merge-no-rescale": Plant("the online-softmax merge rescales l but not the "
                                         "running output when the row max grows", PLANT_ARGS),
        "dkv-not-home": Plant("the backward skips the last ring hop: each rank keeps "
                                     "its neighbour's dK/dV as its own", PLANT_ARGS),
        "contiguous-tokens": Plant("tokens split into contiguous chunks (with their "
                                          "positions) while attention assumes the zig-zag "
                                          "layout", PLANT_ARGS),
        "no-reduce-scatter": Plant("allgather: dK/dV keep only this rank's queries' "
                                          "share instead of the reduce-scatter's sum",
                                          ("--variant", "allgather", *PLANT_ARGS)),
    }

    @staticmethod
    def add_args(p):
        p.add_argument("--variant", default="zigzag", choices=["zigzag", "ring", "allgather"])

    constraints = staticmethod(cp_constraints)

    def __init__(self, model, args, env):
        self.args, self.env, self.model = args, env, model
        self.name = f"cp-{args.variant}"
        self.cp = CPContext(args.variant, None, args.length, plant=args.plant_bug)
        install(model, self.cp)
        mine = self.cp.chunks[env.rank]
        if args.plant_bug == "contiguous-tokens":   # planted bug: the usual contiguous split
            mine = layout("ring", env.world, args.length)[env.rank]
        self.pos = positions(mine).to(env.device)
        # Same weights, different tokens: gradients are summed over the CP group.
        self.dp = ddp.DataParallel(model, broadcast=False, average=args.plant_bug != "no-average")
        self.optimizer = make_adamw(model.parameters(), args)

    def step(self, batch):
        return ddp.token_sharded_step(self, batch, self.pos)

    def expected_comm(self):
        cfg, a, W = self.model.config, self.args, self.env.world
        L, B = cfg.num_hidden_layers, a.batch
        hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv = cfg.num_key_value_heads * hd
        b = DTYPES[a.dtype].itemsize
        s = a.length // W
        blk = B * s * 2 * kv * b                       # one rank's K and V
        grads = sum(p.numel() for p in self.model.parameters()) * b
        rows = [Expect("all_reduce", "world", len(self.dp.buckets), grads,
                       f"weight gradients summed over CP: Psi*b = {grads:,} B")]
        if self.args.variant == "allgather":
            full = W * blk
            return rows + [
                Expect("all_gather_into_tensor", "world", 2 * L, 2 * L * full,
                       f"K,V per layer, forward and again in backward: {full:,} B"),
                Expect("reduce_scatter_tensor", "world", L, L * full,
                       f"dK,dV per layer: {full:,} B")]
        if W == 1:
            return rows
        per_layer = (W - 1) * blk + (W - 1) * 2 * blk + blk
        return rows + [Expect(op, "world", L * (3 * (W - 1) + 1), L * per_layer,
                              f"per layer: fwd (W-1) hops of K,V ({blk:,} B) = "
                              f"2(W-1)/W*S*kv*b*B; bwd (W-1) hops of K,V + dK,dV, then dK,dV home")
                       for op in ("isend", "irecv")]

    def report_lines(self):
        # per-rank attention work: balance of ring vs zigzag (a collective)
        stats = [None] * self.env.world
        with METER.paused():
            dist.all_gather_object(stats, (self.cp.flops, self.cp.seconds))
        fl = [f for f, _ in stats]
        sec = [t for _, t in stats]
        self.cp.flops, self.cp.seconds = 0, 0.0
        return ["attention forward FLOPs per rank (all steps so far): "
                + ", ".join(f"{f / 1e6:.1f}M" for f in fl)
                + f"; balance max/min {max(fl) / max(min(fl), 1):.2f}",
                "attention block compute time per rank (fwd+bwd, s): "
                + ", ".join(f"{t:.3f}" for t in sec)
                + f"; balance max/min {max(sec) / max(min(sec), 1e-12):.2f}"]


if __name__ == "__main__":
    main(CP)
