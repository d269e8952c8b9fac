"""async_tp.py: asynchronous tensor parallelism: sp.py's regions as rings of chunked matmuls.

    torchrun --nproc_per_node=2 sp.py --variant megatron --async-tp
    torchrun --nproc_per_node=4 compose4d.py --tp 2 --sp --async-tp --pp 2

The idea (Wang et al., "Overlap Communication with Dependent Computation via Decomposition in
Large Deep Learning Models", ASPLOS 2023; Megatron-core's --tp-comm-overlap; torchtitan's async
TP): cut each edge of a Megatron SP region (sp.py) along the sequence into the T ranks' chunks,
so it becomes T ring steps whose matmul runs on the chunk that is here while the next travels:
  all-gather + matmul      step j multiplies rank r - j's chunk by every column weight of the
                           region while the chunk moves on to r + 1 (AllGatherMatmul)
  matmul + reduce-scatter  step j adds this rank's partial sum of chunk r - j - 1 to the
                           accumulator arriving from r - 1 and sends it on to r + 1; after
                           T - 1 hops each chunk's sum is at its owner (MatmulReduceScatter)
Each hop is one batch_isend_irecv (to r + 1, from r - 1). The backwards mirror the forwards: a
reduce-scatter ring for d(input), a re-gather ring for d(weight) (summed in fp32), an
all-gather ring for the row layer's. AsyncSPRegion replaces sp.SPRegion; FusedColumns runs one
ring for all of a region's column layers. In full: docs/internals.md, 'async_tp.py'.

Communication: the bytes of the collectives they replace: per ring and rank T - 1 sends and
T - 1 receives of one chunk, B (S/T) H b. Per step sp.py's 6L+3 all-gathers and 4L+1
reduce-scatters become 10L+3 rings (all but the first layer's split, whose backward stays an
all-gather): (10L+3)(T-1) isend and as many irecv of N H b / T (rig.sp.MegatronSP.expected_comm).

Public API
    sp.parallelize(model, group, async_tp=True)   the regions of tp.parallelize, sequence
        sharded, their collectives decomposed; the training loop is unchanged

Run:  torchrun --nproc_per_node=2 sp.py --mode correctness --variant megatron --async-tp
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F

from harness import planted


# ----------------------------------------------------------------------------------------------
# The two rings
# ----------------------------------------------------------------------------------------------
def _hop(send: torch.Tensor, recv: torch.Tensor, group) -> list:
    """Start one ring hop: `send` to the next rank, `recv` from the previous, one batch. Both
    the same shape: a chunk or an accumulator, (B, S/T, H)."""
    W, r = dist.get_world_size(group), dist.get_rank(group)
    return dist.batch_isend_irecv([
        dist.P2POp(dist.isend, send, group=group, group_peer=(r + 1) % W),
        dist.P2POp(dist.irecv, recv, group=group, group_peer=(r - 1) % W)])


def ring_gather(chunk: torch.Tensor, group, use) -> None:
    """Every rank's chunk, one at a time: use(source rank, chunk) runs on each while the next one
    travels (this rank's own first)."""
    W, r = dist.get_world_size(group), dist.get_rank(group)
    cur = chunk.contiguous()                 # (B, S/T, H): rank (r - j)'s chunk at step j
    for j in range(W):
        works = None
        if j < W - 1:
            nxt = torch.empty_like(cur)
            works = _hop(cur, nxt, group)    # (B, S/T, H) to r + 1, (B, S/T, H) from r - 1
        use((r - j) % W, cur)
        if works is not None:
            for w in works:
                w.wait()
            cur = nxt


def ring_reduce_scatter(partial, group) -> torch.Tensor:
    """The sum over the ranks of partial(c) for this rank's chunk c = r: partial(c) is this
    rank's share of chunk c, computed while the accumulator of the previous chunk travels."""
    W, r = dist.get_world_size(group), dist.get_rank(group)
    works, sending, arrived = None, None, None
    for j in range(W):
        c = (r - j - 1) % W
        acc = partial(c)              # (B, S/T, H): this rank's share of chunk c
        if works is not None:
            for w in works:
                w.wait()
            acc = acc + arrived       # the other ranks' shares of chunk c, so far
        if j == W - 1:
            return acc                # c == r: every rank's share of my chunk
        sending = acc.contiguous()
        arrived = torch.empty_like(sending)
        works = _hop(sending, arrived, group)   # (B, S/T, H) to r + 1, (B, S/T, H) from r - 1


def _rows(t: torch.Tensor, c: int, s: int) -> torch.Tensor:
    return t[:, c * s:(c + 1) * s]      # (B, S, ...) -> (B, S/T, ...): chunk c's tokens, a view


def _wide(t: torch.Tensor) -> torch.Tensor:
    """A weight gradient summed over T chunk products accumulates in at least float32 (one
    GEMM over the whole sequence would accumulate there too, and round once)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


_MM_OUT_DTYPE_OK: dict = {}


def mm_out_dtype_works(device, dtype) -> bool:
    """Whether torch.mm(a, b, out_dtype=torch.float32) runs for `dtype` operands on `device`:
    only CUDA is asked (torch 2.13 registers aten::mm.dtype for CUDA and Meta, not the CPU), and
    only bfloat16 / float16 (the op's fp32 output is for those). Probed once per (device type,
    dtype) on a 1 x 1 product, outside the step (fuse_columns): no host read either way."""
    key = (torch.device(device).type, dtype)
    if key not in _MM_OUT_DTYPE_OK:
        ok = key[0] == "cuda" and dtype in (torch.bfloat16, torch.float16)
        if ok:
            try:
                one = torch.ones(1, 1, dtype=dtype, device=device)
                ok = torch.mm(one, one, out_dtype=torch.float32).dtype == torch.float32
            except (RuntimeError, NotImplementedError, TypeError):   # (TypeError: no kwarg)
                ok = False
        _MM_OUT_DTYPE_OK[key] = ok
    return _MM_OUT_DTYPE_OK[key]


def _wgrad_path(a: torch.Tensor, b: torch.Tensor) -> str:
    """Which GEMM _wgrad_mm runs for these operands (see there)."""
    if a.dtype in (torch.float32, torch.float64) and b.dtype == a.dtype:
        return "plain"
    if a.dtype == b.dtype and mm_out_dtype_works(a.device, a.dtype):
        return "out_dtype"
    return "upcast"


def _wgrad_mm(a: torch.Tensor, b: torch.Tensor, path: str | None = None) -> torch.Tensor:
    """One chunk's weight-gradient product a @ b, in at least float32 (the sum over the T
    chunks accumulates there, as one GEMM over the whole sequence would, rounding once):
      out_dtype  CUDA, bfloat16/float16 operands: torch.mm(a, b, out_dtype=torch.float32), the
                 tensor cores' bf16 GEMM accumulating and writing fp32: no fp32 copies of the
                 operands, at the bf16 rate (an H100's datasheet: ~15x fp32's without TF32);
      upcast     elsewhere (the CPU: torch 2.13 has no CPU kernel for aten::mm.dtype; a CUDA
                 build without it): both operands copied to float32, one fp32 GEMM. The same
                 sum: bf16 products are exact in fp32, only the accumulation order differs;
      plain      float32 / float64 operands: a @ b, already wide enough.
    path: force one (the tests); None picks by the operands' device and dtype."""
    path = path or _wgrad_path(a, b)
    if path == "out_dtype":
        return torch.mm(a, b, out_dtype=torch.float32)
    if path == "upcast":
        return _wide(a) @ _wide(b)
    return a @ b


# ----------------------------------------------------------------------------------------------
# The decomposed region edges as autograd Functions (each backward mirrors its forward)
# ----------------------------------------------------------------------------------------------
class AllGatherMatmul(torch.autograd.Function):
    """(B, S/T, H) chunk -> [(B, S, out_i)]: the gathered sequence through n weights (and
    biases, None allowed), gathered and multiplied one chunk at a time."""

    @staticmethod
    def forward(ctx, x, group, n, *wb):   # x (B, S/T, H), n weights [out_i, H], n biases [out_i]
        weights, biases = wb[:n], wb[n:]
        ctx.save_for_backward(x, *weights)
        ctx.group, ctx.has_bias = group, [b is not None for b in biases]
        W, (B, s) = dist.get_world_size(group), x.shape[:2]
        outs = [x.new_empty((B, W * s, w.shape[0])) for w in weights]   # (B, S, out_i) each

        def use(src, chunk):
            dst = src
            if planted("async-chunk-rows"):   # plant: the chunk lands in the next rank's rows
                dst = (src + 1) % W
            for o, w, b in zip(outs, weights, biases):
                _rows(o, dst, s).copy_(F.linear(chunk, w, b))   # (B, S/T, H) -> (B, S/T, out_i)
        ring_gather(x, group, use)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):        # (B, S, out_i) each -> (B, S/T, H), [out_i, H], [out_i]
        x, *weights = ctx.saved_tensors
        group, s, H = ctx.group, x.shape[1], x.shape[2]
        # d(input): each chunk's rows of sum_i g_i W_i, summed over the ranks, lands on its owner
        gx = ring_reduce_scatter(     # (B, S/T, out_i) @ [out_i, H] -> (B, S/T, H), summed
            lambda c: sum(_rows(g, c, s) @ w for g, w in zip(grads, weights)), group)
        # d(weights): sum over the chunks of g_i[chunk]^T x[chunk], the input re-gathered
        gw = [_wide(torch.zeros_like(w)) for w in weights]                  # [out_i, H], fp32

        def use(src, chunk):
            xc = chunk.reshape(-1, H)                            # (B, S/T, H) -> (N/T, H)
            if _wgrad_path(grads[0], xc) == "upcast":
                xc = _wide(xc)      # (copied to fp32 once for every weight it multiplies)
            for acc, g in zip(gw, grads):   # (B, S/T, out_i) -> (N/T, out_i), transposed:
                # (out_i, N/T) @ (N/T, H) -> [out_i, H], fp32
                acc += _wgrad_mm(_rows(g, src, s).reshape(-1, g.shape[-1]).T, xc)
        ring_gather(x, group, use)
        gb = [g.sum((0, 1)) if has else None for g, has in zip(grads, ctx.has_bias)]  # [out_i]
        return (gx, None, None, *[a.to(w.dtype) for a, w in zip(gw, weights)], *gb)


class MatmulReduceScatter(torch.autograd.Function):
    """(B, S, in) -> this rank's (B, S/T, out) chunk of the sum over the ranks of x W^T, the
    partial sums formed one chunk at a time (in = n_h d/T or I/T, out = H)."""

    @staticmethod
    def forward(ctx, x, weight, group):   # x (B, S, in), weight [out, in] -> (B, S/T, out)
        ctx.save_for_backward(x, weight)
        ctx.group = group
        s = x.shape[1] // dist.get_world_size(group)
        # chunk c: (B, S/T, in) @ [out, in]^T -> (B, S/T, out), summed over the ring
        return ring_reduce_scatter(lambda c: F.linear(_rows(x, c, s), weight), group)

    @staticmethod
    def backward(ctx, grad):          # (B, S/T, out) -> (B, S, in), [out, in]
        x, weight = ctx.saved_tensors
        s = grad.shape[1]
        gx, gw = torch.empty_like(x), _wide(torch.zeros_like(weight))

        def use(src, chunk):       # chunk: rank src's rows of the output gradient
            _rows(gx, src, s).copy_(chunk @ weight)   # (B, S/T, out) @ [out, in] -> (B, S/T, in)
            # (B, S/T, out) -> (N/T, out) -> (out, N/T);  (B, S/T, in) -> (N/T, in)
            gw.add_(_wgrad_mm(chunk.reshape(-1, chunk.shape[-1]).T,
                              _rows(x, src, s).reshape(-1, x.shape[-1])))   # [out, in], fp32
        ring_gather(grad, ctx.group, use)
        return gx, gw.to(weight.dtype), None


# ----------------------------------------------------------------------------------------------
# The region and its fused column layers
# ----------------------------------------------------------------------------------------------
class FusedColumns:
    """The column-parallel layers that read one region's input (q, k, v; gate, up; the LM
    head): bound to it, the first one called runs AllGatherMatmul for all of them, and the
    others take their outputs of that ring. (Every weight is read at the first call: a
    sharding that gathers k_proj's weight in k_proj's own pre-hook would be too late.)"""

    def __init__(self, region, modules):
        self.region, self.modules = region, list(modules)
        self.key, self.outs = None, None     # the stand-in the outputs belong to
        for i, m in enumerate(self.modules):
            m.forward = (lambda x, i=i: self.output(i, x))

    def output(self, i: int, x):
        stand_in, chunk = self.region.current or (None, None)
        if x is not stand_in:
            raise RuntimeError("async TP: a column-parallel layer was called on something other "
                               "than its region's input")
        if self.key is not stand_in:    # a new region input (or a recomputed forward)
            ms = self.modules
            # (B, S/T, H) -> one (B, S, out_i) per module
            self.outs = AllGatherMatmul.apply(chunk, self.region.group, len(ms),
                                              *[m.weight for m in ms], *[m.bias for m in ms])
            self.key = stand_in
            self.region.active.append(self)
        return self.outs[i]


class AsyncSPRegion:
    """sp.SPRegion's interface (tp.TPRegion's verbs) with the decomposed
    collectives; built by sp.parallelize(..., async_tp=True)."""

    def __init__(self, group, base):
        self.group, self.base = group, base   # base: sp.SPRegion, for the embedding's exit
        self.active: list[FusedColumns] = []  # those whose ring ran in the current region
        self.current = None

    def region_in(self, x):
        """x: this rank's (B, S/T, H) chunk. Returns a stand-in of the gathered (B, S, H) shape:
        one NaN expanded (anything that reads it instead of the fused layers gets NaN); the
        region's FusedColumns read the chunk from self.current."""
        stand_in = x.new_full((1,), float("nan")).expand(   # (1,) -> (B, S, H), all strides 0
            x.shape[0], x.shape[1] * dist.get_world_size(self.group), x.shape[2])
        self.current = (stand_in, x)
        return stand_in

    def after_module(self):
        self.current = None
        for f in self.active:
            f.key = f.outs = None
        self.active.clear()

    def row_linear(self, x, weight):         # (B, S, in), [H, in] -> (B, S/T, H)
        return MatmulReduceScatter.apply(x, weight, self.group)

    def region_out(self, x):
        raise RuntimeError("async TP: a row-parallel layer calls region.row_linear(x, weight)")

    def embedding_out(self, x):
        return self.base.embedding_out(x)


def fuse_columns(model, region: AsyncSPRegion):
    """Bind every region's column-parallel layers (attention, dense MLP, LM head) to one
    FusedColumns each (after tp.parallelize)."""
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        FusedColumns(region, [a.qkv_proj] if hasattr(a, "qkv_proj") else
                     [a.q_proj, a.k_proj, a.v_proj])
        if not hasattr(m, "experts"):
            FusedColumns(region, [m.gate_up_proj] if hasattr(m, "gate_up_proj") else
                         [m.gate_proj, m.up_proj])
    FusedColumns(region, [model.lm_head])
    w = model.lm_head.weight
    if not w.is_meta:
        mm_out_dtype_works(w.device, w.dtype)   # the weight gradients' probe now, not in a step
