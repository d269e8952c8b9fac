"""cp_ring.py: context parallelism with ring attention (zig-zag load-balanced), from raw p2p.

The idea (Liu et al., "Ring Attention with Blockwise Transformers", 2023; the zig-zag layout is
Megatron-LM's and ring-flash-attention's (Zhu, 2024); Llama 3 (2024) all-gathers K/V instead)
    The sequence is sharded over the W ranks of the cp group; every layer except attention is
    per-token, so only attention needs the other ranks' keys and values. Ring attention computes
    it in W steps: each rank attends its queries to the K/V block it holds, then passes the block
    on (send to r+1, receive from r-1), overlapping the transfer with the block's compute.
    Blocks are combined with the online softmax (Milakov & Gimelshein 2018; FlashAttention-2):
    each query row keeps its running max m, l = sum exp(s - m) and acc = sum exp(s - m) v,
        m' = max(m, m_b),   l' = l e^(m - m') + l_b e^(m_b - m'),
        acc' = acc e^(m - m') + acc_b e^(m_b - m')
    and at the end out = acc / l, lse = m + log l, in fp32 (fp64 in float64 runs). Backward (an
    autograd Function): dQ accumulates locally, dK/dV travel around the ring with their K/V and
    arrive home after a last hop.
    Layouts (--variant): zigzag (default) cuts the sequence into 2W chunks, rank r holding r and
    2W-1-r, so every rank has the same causal work; ring: contiguous (rank W-1 attends to all,
    rank 0 to its own block); allgather: zig-zag, K/V all-gathered per layer, dK/dV
    reduce-scattered. GQA: only the kv heads travel. Shapes: s = S/W local tokens in n chunks
    of c (2 of s/2 zig-zag), as views; a zig-zag step one fused call (own K/V: causal over the
    local order; an earlier rank's 1st chunk: all queries; a later rank's: our 2nd chunk).

Communication per layer (s = S/W local tokens, kv = H_kv * d, b bytes, batch B)
    ring/zigzag  forward: W-1 hops of K and V, each B*s*2kv*b; backward: W-1 hops of K, V, dK,
                 dV plus the last hop of dK, dV home. Forward bytes sent per rank
                 = 2 (W-1)/W * S * kv * b * B, the textbook figure.
    allgather    forward: one all_gather of K and V (B*S*2kv*b); backward: one reduce_scatter
                 of dK and dV (same size). More: docs/internals.md, 'cp_ring.py'.

Public API
    cp = parallelize(model, group, seq_len, variant="zigzag"): ring attention in place,
        cp.positions this rank's tokens; gradients summed by ddp.DataParallel(..., average=False)
    Block kernels: TorchKernel (below: the contract); fused SDPA ones in cp_kernels.py.

Run:  torchrun --nproc_per_node=2 cp_ring.py --mode correctness   (learning, benchmark, plants)
"""
import torch
import torch.distributed as dist

from harness import attention_of, parts, phase, planted
from harness.data import document_mask

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


def positions(chunks) -> torch.Tensor:   # (s,) global positions
    return torch.cat([torch.arange(a, b) for a, b in chunks])


def relation(q: tuple[int, int], k: tuple[int, int]) -> str:
    """Causal work of query chunk q against key chunk k (global position ranges)."""
    if q[0] >= k[1]:
        return "full"       # every query is after every key
    if q[1] <= k[0]:
        return "skip"       # every query is before every key
    return "mask"           # overlapping (the diagonal): position mask


class CPContext:
    """What the attention function needs: group, layout and block kernel.
    world/rank default to the group's (given, they let one process play every rank of the
    block loop: tests/cp_attention_check.py --kernel)."""

    def __init__(self, variant, group, seq, world=None, rank=None, kernel=None):
        self.variant, self.group = variant, group
        self.world = dist.get_world_size(group) if world is None else world
        self.rank = dist.get_rank(group) if rank is None else rank
        self.chunks = layout(variant, self.world, seq)
        self.kernel = kernel or TorchKernel()   # the block kernel (cp_kernels.pick_kernel)
        self.blocks = {}   # (q range, k range) -> packed documents' mask or "skip" (set_documents)

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
def _group(x, n_rep):
    """(B, n_h, c, ...) -> (B, n_kv, n_rep * c, ...): each kv head's n_rep query heads as
    one block of rows, so that GQA is a matmul against the kv head itself (no repeated K/V)."""
    return x if n_rep == 1 else x.reshape(x.shape[0], x.shape[1] // n_rep, n_rep * x.shape[2],
                                          *x.shape[3:])


def _ungroup(x, n_rep):
    """The inverse of _group: (B, n_kv, n_rep * c, ...) -> (B, n_h, c, ...)."""
    return x if n_rep == 1 else x.reshape(x.shape[0], x.shape[1] * n_rep, x.shape[2] // n_rep,
                                          *x.shape[3:])


def _scores(q, k, scale, rel, qr, kr, n_rep=1):
    """Scores of grouped queries (rows: n_rep heads x the positions qr) against k; rel a
    (B, c_q, c_k) tensor: packed documents' own mask (set_documents), True where a query sees."""
    s = (q @ k.transpose(-1, -2)) * scale   # q (B, n_kv, n_rep*c_q, d) -> (B, n_kv, n_rep*c_q, c_k)
    if isinstance(rel, torch.Tensor):       # (B, c_q, c_k) -> (B, 1, n_rep*c_q, c_k)
        return s.masked_fill(~rel.repeat(1, n_rep, 1)[:, None], NEG_INF)
    if rel == "mask":
        qpos = torch.arange(*qr, device=q.device).repeat(n_rep)   # (n_rep*c_q,)
        kpos = torch.arange(*kr, device=q.device)
        s = s.masked_fill(kpos[None, :] > qpos[:, None], NEG_INF)
    return s


def _finite(m):
    """The row max as a shift: 0 where the row has seen nothing yet (m = -inf), so that
    exp(s - m) stays exp(-inf) = 0 there instead of NaN."""
    return m.masked_fill(m == NEG_INF, 0.0)


def block_forward(q, k, v, scale, rel, qr, kr):
    """(acc, l, m) of q (B, n_h, c_q, d) attending to one K/V block (B, n_kv, c_k, d): the row
    max m of the scores, the row sum l = sum exp(s - m) and the unnormalised output
    acc = exp(s - m) @ v. A fully masked row gives acc 0, l 0, m -inf."""
    n_rep = q.shape[1] // k.shape[1]
    s = _scores(_group(q, n_rep), k, scale, rel, qr, kr, n_rep)   # (B, n_kv, n_rep*c_q, c_k)
    m = s.amax(-1)
    p = torch.exp(s - _finite(m)[..., None])
    # acc (B, n_h, c_q, d), l and m (B, n_h, c_q)
    return _ungroup(p @ v, n_rep), _ungroup(p.sum(-1), n_rep), _ungroup(m, n_rep)


def merge(state, block):
    """Online softmax: a block's (acc, l, m) into the running one, rescaled to the larger max."""
    if state is None:
        return block
    (acc, l, m), (acc_b, l_b, m_b) = state, block
    new_m = torch.maximum(m, m_b)
    a, b = torch.exp(torch.stack([m, m_b]) - _finite(new_m))   # both factors in one pass
    l = torch.addcmul(l * a, l_b, b)
    if planted("merge-no-rescale"):   # plant: the running output keeps its old max
        return torch.addcmul(acc, acc_b, b[..., None]), l, new_m
    return torch.addcmul(acc * a[..., None], acc_b, b[..., None]), l, new_m


def block_backward(q, k, v, do, lse, delta, scale, rel, qr, kr):
    """(dq, dk, dv) of one block from the final lse and delta = rowsum(dO * O); dk and dv at
    the kv heads (each summed over its query heads by the grouped matmuls)."""
    n_rep = q.shape[1] // k.shape[1]
    q, do, lse, delta = (_group(t, n_rep) for t in (q, do, lse, delta))   # (B, n_kv, n_rep*c_q, ..)
    s = _scores(q, k, scale, rel, qr, kr, n_rep)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    dv = p.transpose(-1, -2) @ do                             # (B, n_kv, c_k, d)
    ds = p * (do @ v.transpose(-1, -2) - delta[..., None])    # (B, n_kv, n_rep*c_q, c_k)
    # dq (B, n_h, c_q, d); dk (B, n_kv, c_k, d)
    return _ungroup(ds @ k, n_rep) * scale, (ds.transpose(-1, -2) @ q) * scale, dv


class TorchKernel:
    """The block kernel in plain torch, on any device and dtype (the float64 proofs): scores of
    the block materialised in the accumulation dtype (fp32 for bf16 inputs), any causal
    relation. The contract every kernel keeps:

        forward(q, k, v, scale, rel, qr, kr, acc_dtype) -> (acc, l, m)  the block's state for
            `merge`: out = acc / l, lse = m + log l (a fused kernel gives (out, 1, lse))
        backward(q, k, v, do, out, lse, delta, scale, rel, qr, kr) -> (dq, dk, dv) of the
            block, from the final out, lse and delta = rowsum(dO * out) of the whole row

    q is (B, n_h, c_q, d), k and v (B, n_kv, c_k, d), each contiguous: GQA by the kernel's own
    grouped heads (no repeated K/V), dk and dv returned at the kv heads; dO and O come in
    operand_dtype(q)."""
    name = "torch"

    def operand_dtype(self, q):   # the dtype its backward takes dO and O in
        return _acc_dtype(q)

    def forward(self, q, k, v, scale, rel, qr, kr, acc_dtype):
        return block_forward(q.to(acc_dtype), k.to(acc_dtype), v.to(acc_dtype), scale, rel,
                             qr, kr)

    def backward(self, q, k, v, do, out, lse, delta, scale, rel, qr, kr):
        dt = _acc_dtype(q)   # (dO may come in the inputs' dtype: a fused kernel's fallback)
        return block_backward(q.to(dt), k.to(dt), v.to(dt), do.to(dt), lse, delta, scale, rel,
                              qr, kr)


# ----------------------------------------------------------------------------------------------
# Attention over the sharded sequence: the ring and the all-gather drivers
# ----------------------------------------------------------------------------------------------
def _acc_dtype(x):
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _hop(tensors: list, cp: CPContext):
    """Send `tensors` to the next rank and receive the previous rank's (async; every send and
    its recv are posted together, so no ordering can deadlock). Returns (buffers, requests)."""
    def peer(r):
        return dist.get_global_rank(cp.group, r % cp.world) if cp.group else r % cp.world
    recv = [torch.empty_like(t) for t in tensors]   # K/V blocks or their dK/dV
    ops = [dist.P2POp(dist.isend, t, peer(cp.rank + 1), cp.group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, t, peer(cp.rank - 1), cp.group) for t in recv]
    return recv, dist.batch_isend_irecv(ops)       # (2, B, n_kv, s, d) each way


def _wait(reqs):
    for r in reqs:
        r.wait()


def set_documents(cp, doc_positions):
    """Packed documents for the next forwards (--doc-mask): the sequences' (B, S) positions in
    their documents (None: one per row). Each block pair gets its mask, causal within a document
    (B, c_q, c_k); a pair in which no query may see any key is skipped (one host read a step)."""
    cp.blocks, docs = {}, doc_positions
    for qr, kr in ((qr, kr) for _, _, qr in cp.offsets(cp.rank) for r in range(cp.world)
                   for _, _, kr in cp.offsets(r) if docs is not None):
        qi, ki = (torch.arange(*x, device=docs.device) for x in (qr, kr))
        cp.blocks[qr, kr] = document_mask(docs, qi, ki)        # (B, c_q, c_k)
    seen = torch.stack([m.any() for m in cp.blocks.values()]).tolist() if docs is not None else []
    if planted("doc-skip-by-corner"):   # plant: an off-diagonal pair judged by one corner pair
        seen = [s if qk[0] == qk[1] else bool(m[:, -1, 0].any())
                for (qk, m), s in zip(cp.blocks.items(), seen)]
    cp.blocks = {key: m if any_ else "skip" for (key, m), any_ in zip(cp.blocks.items(), seen)}


def _pairs(cp, src):
    """((query chunk's local rows, global range), (key chunk's), relation) with causal work."""
    for qa, qb, qr in cp.offsets(cp.rank):
        for ka, kb, kr in cp.offsets(src):
            rel = cp.blocks.get((qr, kr), relation(qr, kr))   # (packed documents: their mask)
            if planted("doc-mask-own-rank-only"):   # plant: other ranks' blocks causal only
                rel = rel if src == cp.rank else relation(qr, kr)
            if not (isinstance(rel, str) and rel == "skip"):
                yield (qa, qb, qr), (ka, kb, kr), rel


def _calls(cp, src):
    """One ring step's kernel calls, as _pairs: a zig-zag step is one for a fused kernel (the
    module docstring); documents, other layouts, the pure kernel (s^2 scores held): each pair."""
    s = cp.offsets(cp.rank)[-1][1]
    zigzag = cp.variant != "ring" and cp.chunks == layout("zigzag", cp.world, s * cp.world)
    if cp.blocks or not (zigzag and getattr(cp.kernel, "one_call", False)):
        calls = _pairs(cp, src)
    elif src == cp.rank:
        calls = [((0, s, (0, s)), (0, s, (0, s)), "mask")]
    else:   # an earlier rank's first chunk, or a later rank's chunks for our second one
        calls = [((0, s, None), (0, s // 2, None), "full") if src < cp.rank else
                 ((s // 2, s, None), (0, s, None), "full")]
    for q, k, rel in calls:
        if planted("unmasked-diagonal"):   # plant: the diagonal block attends to its future
            rel = "full" if isinstance(rel, str) and rel == "mask" else rel
        yield q, k, rel


def _attend(q, kv, cp, src, scale, acc):
    """q (B, n_h, s, d) attends to src's K/V (2, B, n_kv, s, d): acc[a] = the (acc, l, m) of
    this rank's chunk starting at local row a."""
    for (qa, qb, qr), (ka, kb, kr), rel in _calls(cp, src):
        block = cp.kernel.forward(q[:, :, qa:qb], kv[0, :, :, ka:kb], kv[1, :, :, ka:kb], scale,
                                  rel, qr, kr, acc["dtype"])
        for a, b, _ in (o for o in cp.offsets(cp.rank) if qa <= o[0] < qb):   # each chunk's rows
            acc[a] = merge(acc.get(a), tuple(t.narrow(2, a - qa, b - a) for t in block))


def _grad(q, kv, do, out, lse, delta, cp, src, scale, dq, dkv):
    """The calls' gradients into dq (B, n_h, s, d) and dkv (src's K/V layout)."""
    for (qa, qb, qr), (ka, kb, kr), rel in _calls(cp, src):   # as in _attend
        dq_b, dk_b, dv_b = cp.kernel.backward(   # (B, n_h, c_q, d); (B, n_kv, c_k, d) twice
            q[:, :, qa:qb], kv[0, :, :, ka:kb], kv[1, :, :, ka:kb],
            *(t[:, :, qa:qb] for t in (do, out, lse, delta)), scale, rel, qr, kr)
        dq[:, :, qa:qb].add_(dq_b)     # (`+=` would also dispatch a copy_ onto itself)
        dkv[0, :, :, ka:kb].add_(dk_b)     # (at the kv heads: the kernel groups the query heads)
        dkv[1, :, :, ka:kb].add_(dv_b)


def _finish(acc):
    """(out, lse) (B, n_h, s, d), (B, n_h, s): acc / l, m + log l, the chunks in local order. A
    row that saw nothing (l = 0; never under a causal layout) gives out 0, lse -inf."""
    a, l, m = (torch.cat([acc[r][j] for r in sorted(acc.keys() - {"dtype"})], 2) for j in range(3))
    return a / torch.where(l > 0, l, 1.0)[..., None], m + torch.log(l)


def _backward_setup(ctx, dout):
    """What both backwards start from: q, dO and O (the kernel's operand dtype), lse, the
    softmax backward's row sums delta = rowsum(dO * O) (fp32/64) and a zero dQ."""
    q, k, v, out, lse = ctx.saved_tensors
    do = dout.to(ctx.cp.kernel.operand_dtype(q))
    return (q, k, v, out.to(do.dtype), lse, ctx.cp, ctx.scale, do,
            (do.to(out.dtype) * out).sum(-1), torch.zeros_like(out))   # delta (B, n_h, s)


class RingAttention(torch.autograd.Function):
    """Causal attention of the local queries to the whole sharded sequence, K/V on a ring."""

    @staticmethod
    def forward(ctx, q, k, v, cp, scale):   # q (B, n_h, s, d), k, v (B, n_kv, s, d) -> q's shape
        acc, kv = {"dtype": _acc_dtype(q)}, torch.stack([k, v])   # (2, B, n_kv, s, d) travels
        for step in range(cp.world):
            src = (cp.rank - step) % cp.world
            if step < cp.world - 1:
                nxt, reqs = _hop([kv], cp)             # overlaps the blocks below
            _attend(q, kv, cp, src, scale, acc)
            if step < cp.world - 1:
                _wait(reqs)
                kv = nxt[0]
        out, lse = _finish(acc)                        # kept for the backward
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cp, ctx.scale = cp, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):   # (B, n_h, s, d) -> dq (B, n_h, s, d), dk, dv (B, n_kv, s, d)
        q, k, v, out, lse, cp, scale, do, delta, dq = _backward_setup(ctx, dout)
        kv, dt = torch.stack([k, v]), dq.dtype          # (2, B, n_kv, s, d)
        # Both transfers hide behind a block's compute (as ring-flash-attention does): the next
        # K/V hop is posted before this block's gradients; the dK/dV accumulated so far for the
        # block held now arrive meanwhile, get this rank's part and go on: home after W hops.
        dkv_reqs = None
        for step in range(cp.world):
            src = (cp.rank - step) % cp.world
            if step < cp.world - 1:
                nxt, kv_reqs = _hop([kv], cp)
            dkv = torch.zeros_like(kv, dtype=dt)       # our part of block src's dK/dV
            _grad(q, kv, do, out, lse, delta, cp, src, scale, dq, dkv)
            if cp.world == 1:
                break
            if dkv_reqs is not None:                   # the earlier ranks' parts for block src
                _wait(dkv_reqs)
                dkv += arrived
            if planted("dkv-not-home"):   # plant: no last hop, the neighbour's dK/dV kept
                if step == cp.world - 1:
                    break
            (arrived,), dkv_reqs = _hop([dkv], cp)     # the last one brings our dK/dV home
            if step < cp.world - 1:
                _wait(kv_reqs)
                kv = nxt[0]
        else:
            _wait(dkv_reqs)
            dkv = arrived
        dk, dv = dkv.unbind(0)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def _gather_kv(k, v, cp):
    """Every rank's K/V as (W, 2, B, n_kv, s, d): one all-gather, ranks on dim 0."""
    kv = torch.stack([k, v])                           # (2, B, n_kv, s, d)
    full = torch.empty((cp.world * 2,) + kv.shape[1:], dtype=kv.dtype, device=kv.device)
    dist.all_gather_into_tensor(full, kv, group=cp.group)   # (2, ..) -> (W*2, B, n_kv, s, d)
    return full.view((cp.world,) + kv.shape)               # (W, 2, B, n_kv, s, d)


class AllGatherAttention(torch.autograd.Function):
    """Llama 3 style: all-gather K/V once per layer, reduce-scatter dK/dV in the backward."""

    @staticmethod
    def forward(ctx, q, k, v, cp, scale):   # q (B, n_h, s, d), k, v (B, n_kv, s, d) -> q's shape
        acc, full = {"dtype": _acc_dtype(q)}, _gather_kv(k, v, cp)   # (W, 2, B, n_kv, s, d)
        for src in range(cp.world):                           # src's K/V
            _attend(q, full[src], cp, src, scale, acc)
        out, lse = _finish(acc)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cp, ctx.scale = cp, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):   # (B, n_h, s, d) -> dq (B, n_h, s, d), dk, dv (B, n_kv, s, d)
        q, k, v, out, lse, cp, scale, do, delta, dq = _backward_setup(ctx, dout)
        full = _gather_kv(k, v, cp)                     # not kept: gathered again
        dfull = torch.zeros(full.shape, dtype=dq.dtype, device=q.device)  # (W, 2, B, n_kv, s, d)
        for src in range(cp.world):
            _grad(q, full[src], do, out, lse, delta, cp, src, scale, dq, dfull[src])
        # (2, B, n_kv, s, d): this rank's dK/dV
        mine = torch.empty(full.shape[1:], dtype=full.dtype, device=full.device)
        if planted("no-reduce-scatter"):   # plant: only our own queries' dK/dV
            mine = dfull[cp.rank].to(full.dtype)
        else:
            dist.reduce_scatter_tensor(mine, dfull.to(full.dtype).view((-1,) + full.shape[2:]),
                                       group=cp.group)   # (W*2, ..) -> (2, ..)
        return dq.to(q.dtype), mine[0], mine[1], None, None


def cp_attention(q, k, v, cp: CPContext, scale: float):
    fn = AllGatherAttention if cp.variant == "allgather" else RingAttention
    return fn.apply(q, k, v, cp, scale)


def hf_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                 **kwargs):
    """HF attention-interface function: local (B, n_h, s, d) in, (B, s, n_h, d) out."""
    with phase("attention"):
        out = cp_attention(query, key, value, module.cp, scaling or query.shape[-1] ** -0.5)
    return out.transpose(1, 2).contiguous(), None   # (B, n_h, s, d) -> (B, s, n_h, d)


def install(model, cp: CPContext):
    """Route every decoder layer's attention through hf_attention over cp's group (HF's
    attention registry). The caller feeds each rank its tokens with their global positions."""
    from transformers import AttentionInterface
    AttentionInterface.register("ring_cp", hf_attention)
    model.config._attn_implementation = "ring_cp"
    for layer in parts(model).layers:
        attention_of(layer).cp = cp


def parallelize(model, group, seq_len: int, variant: str = "zigzag", kernel=None) -> CPContext:
    """Context parallelism for an HF Llama-family model over the ranks of `group`, in place
    (the entry the harness, compose4d and users call). Returns the context, whose `positions`
    are this rank's global token positions. In a loop:

        cp = cp_ring.parallelize(model, group, seq_len)
        dp = ddp.DataParallel(model, group, average=False)   # same weights, other tokens
        pos = cp.positions.to(device)
        logits = model(input_ids=ids[:, pos], position_ids=pos[None].expand(B, -1)).logits
        (loss_sum(logits, labels[:, pos]) / n_tokens_global).backward()   # grads summed
    """
    cp = CPContext(variant, group, seq_len, kernel=kernel)
    install(model, cp)
    cp.positions = positions(cp.chunks[cp.rank])
    return cp


# ----------------------------------------------------------------------------------------------
# Formulas (rig/cp_ring.py, trainer4d/comm.py and trainer4d/plan.py count with these)
# ----------------------------------------------------------------------------------------------
ALLGATHER_COLLECTIVES = (2, 1)   # --variant allgather, per layer: K,V gathered twice, dK,dV once


def ring_messages(world: int) -> int:
    """Point-to-point messages per layer and micro-batch, each way (isend and irecv): W-1 K,V
    hops forward; W-1 K,V hops and W-1 dK,dV hops backward; the dK,dV home."""
    return 3 * (world - 1) + 1 if world > 1 else 0


def ring_bytes(world: int, kv_block: int, dkv_block: int) -> int:
    """Their bytes: kv_block = one rank's K and V (its n blocks (n, 2, B, n_kv, S/(W n), d));
    dkv_block the same in the accumulation dtype (at least float32)."""
    return (world - 1) * kv_block + (world - 1) * (kv_block + dkv_block) + dkv_block


if __name__ == "__main__":   # torchrun cp_ring.py --mode ...: the test rig runs it
    from rig.cp_ring import main
    main()
