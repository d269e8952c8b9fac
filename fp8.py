"""fp8.py: FP8 training of a model's linear layers from raw torch, three scaling recipes.

The idea (Micikevicius et al. 2022, "FP8 Formats for Deep Learning"; torchao's Float8 training;
DeepSeek-AI 2024, "DeepSeek-V3", section 3.3: fine-grained quantization)
    A linear layer's three GEMMs run on 8-bit floats, each operand cast with its own scale:
        forward   Y  = X W^T     X, W in e4m3 (max 448, 3 mantissa bits)
        backward  dX = dY W      dY in e5m2 (max 57344: gradients need range) or e4m3
                  dW = dY^T X
    cast: q = fp8(clamp(t s, -max, max)), s = max / amax (amax over the scale's group, in fp32),
    and the GEMM multiplies back: A B^T ~ (q_A q_B^T) / (s_A s_B), accumulated in fp32
    (torch._scaled_mm; CPU and CUDA in torch 2.13). Every operand is scaled along the GEMM's
    contracted dimension K, so for per-tensor and per-row scales one factor per output element
    undoes them (blockwise scales vary along K: each tile's partial product is rescaled).
    Recipes (which group shares a scale):
      tensorwise  one dynamic scale per tensor; dY in e5m2 (torchao's "tensorwise")
      rowwise     one per row of each operand, amax over K, scales rounded down to a power of
                  2, all e4m3 (torchao's "rowwise"); the backward re-scales along its own K
      blockwise   DeepSeek-V3's: activations and gradients in 1 x 128 tiles along K, weights in
                  128 x 128 blocks (dW: tiles along the tokens for both); each tile's product
                  promoted to fp32 (here emulated: the dequantised operands' fp32 product,
                  since _scaled_mm takes no block scales on CPU)
      delayed     tensorwise, the scale from the largest amax of the last `history` calls (the
                  older recipe: the scale is known before this tensor's amax is); a value
                  above that history saturates at max, which tests/test_fp8.py shows
    What stays in high precision (convert's rule, from the model's parts, not from names): the
    embedding and the LM head (harness.parts), attention's own matmuls (not nn.Linear), norms,
    MoE expert stacks, and a linear whose in/out features the kernel cannot tile (multiples of
    16; of 128 for blockwise).
Under a strategy (`Scopes`, `scope`): a rank holding part of a scale's group of elements
sees part of its amax; the amax is MAXed over the groups that hold the rest (tensorwise: every
split of the tensor; rowwise: the splits of the contracted dim K), so a rank casts exactly as
one device does on the whole batch, and a float64 run meets the single-device FP8 run at
float64's noise (docs/internals.md, 'fp8.py', the table of each GEMM's splits). tp.py's
parallel layers keep a converted layer's GEMMs (carry: the tp group on the split dimension);
FSDP can all-gather the weights in e4m3 (GatherFP8).
Memory and traffic per converted linear: each cast reads an operand and (here, through fp32
temporaries a fused kernel would not make) writes a 1-byte copy; tensorwise and rowwise run
their three GEMMs at 8 bits (H100: twice bf16's dense peak; blockwise is emulated in fp32);
X and W are saved in their own dtype for the backward, as torchao 0.18 saves them.

Public API
    fp8.convert(model, recipe="tensorwise")   in place: eligible nn.Linear -> Float8Linear
    fp8.fp8_mm(x, w, recipe)                  x [N, in] @ w [out, in]^T through the three FP8 GEMMs
    fp8.quantize(t, fmt, groups, pow2)        (q, inverse scale) of one operand
    fp8.scope(model, tokens=[group])          the groups a data-parallel run splits tokens over
    fp8.gather_in_fp8(model)                  before fsdp.fully_shard: weights all-gathered in e4m3
    fp8.convert, then tp.parallelize          the parallel layers stay in FP8 (carry, automatic)

Run:  torchrun --nproc_per_node=2 fp8.py --mode correctness   (DDP in FP8; --fp8 R on any strategy)
      python -m pytest tests/test_fp8.py   (torchao as the oracle, and one device in bf16)
"""
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from harness import parts, planted

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
EPS = 1e-12           # amax floor (torchao's): an all-zero operand gets a finite scale
BLOCK = 128           # blockwise: DeepSeek-V3's tile and block edge
RECIPES = ("tensorwise", "rowwise", "blockwise", "delayed")


class Scopes(NamedTuple):
    """Which process groups split a converted layer's dimensions (empty: held whole):
    tokens (data, context parallel: every operand's token dim), out and in (the weight's rows
    and columns: tensor parallel's column and row layers, or FSDP's shards cast before the
    all-gather). A scale spans its group of elements (module docstring), so its amax is the
    MAX over every rank that holds some of them: tensorwise over all the splits of the tensor,
    rowwise over the splits of the contracted dim K (a row's amax runs over K)."""
    tokens: tuple = ()
    out: tuple = ()
    inn: tuple = ()


def global_amax(a: torch.Tensor, over) -> torch.Tensor:
    """a (a local amax: a scalar or per row) made the MAX over the groups `over`, in place."""
    if planted("fp8-amax-per-rank"):   # plant: each rank scales by its own part's amax
        return a
    for g in over:
        dist.all_reduce(a, op=dist.ReduceOp.MAX, group=g)
    return a


def quantize(t: torch.Tensor, fmt, groups: str, pow2: bool = False, amax=None, over=()):
    """(q, inv): t [M, K] cast to `fmt` with one scale per group, and the inverse scale shaped
    to broadcast over t. groups: "tensor" (one), "row" (each row, amax over K), "tile" (1 x
    BLOCK along K), "block" (BLOCK x BLOCK). `amax`: a given one (delayed scaling). `over`:
    the process groups that hold the rest of each scale's group (see `Scopes`): the amax is
    their MAX, so every rank casts with the scale one device would. In fp32 (torchao's); a
    float64 operand in float64 (the proofs': fp32's rounding of t s would flip FP8 roundings
    between layouts whose operands differ by a constant factor, a loss scaled by W)."""
    x = t if t.dtype == torch.float64 else t.float()
    M, K = x.shape
    if groups == "tensor":
        a = x.abs().amax() if amax is None else amax
    elif groups == "row":
        a = x.abs().amax(dim=1, keepdim=True)                           # [M, 1]
        if planted("fp8-rowwise-wrong-axis"):   # plant: each column's amax (over M, not K)
            a = x.abs().amax(dim=0, keepdim=True)   # [1, K] (float64: dequantised; else refused)
    elif groups == "tile":
        a = x.view(M, K // BLOCK, BLOCK).abs().amax(dim=2, keepdim=True)  # [M, K/128, 1]
        a = a.expand(M, K // BLOCK, BLOCK).reshape(M, K)
    else:                                                               # 128 x 128 blocks
        a = x.view(M // BLOCK, BLOCK, K // BLOCK, BLOCK).abs().amax(dim=(1, 3), keepdim=True)
        a = a.expand(M // BLOCK, BLOCK, K // BLOCK, BLOCK).reshape(M, K)
    if amax is None:
        a = global_amax(a, over)
    scale = scale_of(a, fmt, x.dtype)                                   # s = max / amax
    fmax = torch.finfo(fmt).max
    if pow2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))              # (rowwise: exact 1/s)
    inv = scale.reciprocal()                                            # what the GEMM undoes
    if planted("fp8-scale-not-inverted"):   # plant: the GEMM multiplied by s, not 1/s
        inv = scale
    q = (x * scale).clamp(-fmax, fmax)
    if planted("fp8-no-saturation"):   # plant: no clamp (e5m2 overflows to inf)
        q = x * scale
    return q.to(fmt), inv


def scale_of(amax: torch.Tensor, fmt, dtype) -> torch.Tensor:
    """s = max / amax in `dtype` (fp32, or float64 for float64 operands), amax floored at EPS."""
    return (torch.finfo(fmt).max / amax.double().clamp(min=EPS)).to(dtype)


def _pad_rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """t [M, K] with zero rows appended to a multiple of n (zeros change neither amax nor a
    sum over K; the kernel tiles K in 16s, blockwise in 128s)."""
    pad = -t.shape[0] % n
    return torch.cat([t, t.new_zeros(pad, t.shape[1])]) if pad else t


def gemm(a: torch.Tensor, b: torch.Tensor, fmt_a, fmt_b, recipe: str, out_dtype, amax=None,
         b_is_weight: bool = True, split_a=((), ()), split_b=((), ())):
    """a [M, K] @ b [N, K]^T in FP8, each operand scaled along K by the recipe: [M, N].
    split_a, split_b: (the groups splitting its rows, those splitting K). A tensorwise scale
    spans the whole operand (every split), a rowwise one a whole row (the splits of K)."""
    if recipe == "blockwise":
        # activations and gradients in 1 x 128 tiles along K, the weight in 128 x 128 blocks
        # (dW's operands are both activations: tiles along the tokens); the product of the
        # dequantised operands, accumulated in fp32 (a numerical emulation: no FP8 GEMM)
        qa, ia = quantize(a, fmt_a, "tile")
        qb, ib = quantize(b, fmt_b, "block" if b_is_weight else "tile")
        acc = torch.float64 if out_dtype == torch.float64 else torch.float32
        return ((qa.to(acc) * ia) @ (qb.to(acc) * ib).t()).to(out_dtype)
    groups, pow2 = ("row", True) if recipe == "rowwise" else ("tensor", False)
    over = (lambda split: split[1]) if recipe == "rowwise" else (lambda split: split[0] + split[1])
    qa, ia = quantize(a, fmt_a, groups, pow2, None if amax is None else amax[0], over(split_a))
    qb, ib = quantize(b, fmt_b, groups, pow2, None if amax is None else amax[1], over(split_b))
    if out_dtype == torch.float64:   # (no FP8 GEMM into float64: the dequantised product,
        return (qa.double() * ia) @ (qb.double() * ib).t()    # each term exact in float64)
    # [M, K] e4m3 @ [K, N] (column-major: b's rows) -> [M, N], scales [M, 1] x [1, N] (or [])
    return torch._scaled_mm(qa, qb.t(), scale_a=ia, scale_b=ib.t() if ib.dim() else ib,
                            out_dtype=out_dtype)


class FP8MatMul(torch.autograd.Function):
    """x [N, in] @ w [out, in]^T with all three GEMMs in FP8 (the module docstring's table);
    the token dim N, contracted in dW, is padded to the kernel's tile."""

    @staticmethod
    def forward(ctx, x, w, recipe, history, scopes=None):
        ctx.save_for_backward(x, w)
        ctx.recipe, ctx.history = recipe, history
        t, o, i = ctx.scopes = scopes or Scopes()   # tokens, out features, in features
        amax = None
        if recipe == "delayed":   # the backward casts x and w with these same amaxes
            amax = ctx.amax = (history.scale_amax("x", x), history.scale_amax("w", w))
        elif recipe == "tensorwise":   # one amax per tensor, reduced once; X^T's is X's
            amax = ctx.amax = (tensor_amax(x, t + i), tensor_amax(w, o + i))
        rec = "tensorwise" if recipe == "delayed" else recipe
        return gemm(x, w, E4M3, E4M3, rec, x.dtype, amax, split_a=(t, i), split_b=(o, i))

    @staticmethod
    def backward(ctx, dy):                                              # dy [N, out]
        x, w = ctx.saved_tensors
        recipe, history = ctx.recipe, ctx.history
        rec = "tensorwise" if recipe == "delayed" else recipe
        g_fmt = E5M2 if rec == "tensorwise" else E4M3                   # gradients: range
        if planted("fp8-grad-e4m3"):   # plant: tensorwise's gradients in e4m3 (no range)
            g_fmt = E4M3
        tile = BLOCK if rec == "blockwise" else 16
        t, o, i = ctx.scopes
        amax_dx = amax_dw = None
        if rec == "tensorwise":   # the forward's x and w amaxes; dy's (delayed: its history)
            a_x, a_w = ctx.amax
            a_dy = (history.scale_amax("dy", dy) if recipe == "delayed"
                    else tensor_amax(dy, t + o))
            if planted("fp8-grad-unscaled"):   # plant: dY cast as it is (scale 1)
                a_dy = torch.full_like(a_dy, torch.finfo(g_fmt).max)
            amax_dx, amax_dw = (a_dy, a_w), (a_dy, a_x)
        # dX = dY W: [N, out] @ [in, out]^T, contracted over out
        dx = gemm(dy, w.t().contiguous(), g_fmt, E4M3, rec, dy.dtype, amax_dx,
                  split_a=(t, o), split_b=(i, o))
        # dW = dY^T X: [out, N] @ [in, N]^T, contracted over the tokens (padded to the tile)
        dyt, xt = _pad_rows(dy, tile).t().contiguous(), _pad_rows(x, tile).t().contiguous()
        dw = gemm(dyt, xt, g_fmt, E4M3, rec, w.dtype, amax_dw, b_is_weight=False,
                  split_a=(o, t), split_b=(i, t))
        return dx, dw, None, None, None


def tensor_amax(t: torch.Tensor, over) -> torch.Tensor:
    """max |t| over the whole tensor, its parts on the groups `over` included (a scalar, in
    float32; float64's own for a float64 tensor, as quantize casts it)."""
    a = t.detach().abs().amax()
    return global_amax(a if a.dtype == torch.float64 else a.float(), over)


class AmaxHistory:
    """Delayed scaling's state for one layer: per operand (x, w, dy) the amax of the last `n`
    calls on the device (no host read). The scale uses the history's max; the current amax is
    recorded after it is used. A lesson, not a training option: it advances per forward (each
    micro-batch counts; a recomputed forward would cast with another scale) and is not in the
    state dict (torchao's delayed recipe syncs once per step: sync_float8_amax_and_scale_history)."""

    def __init__(self, n: int = 16):
        self.n, self.hist = n, {}

    def scale_amax(self, key: str, t: torch.Tensor) -> torch.Tensor:
        now = t.detach().float().abs().amax()
        h = self.hist.get(key)
        if h is None:                       # the first step: its own amax, as dynamic scaling
            h = self.hist[key] = now.repeat(self.n)
        used = h.max()
        self.hist[key] = torch.cat([h[1:], now[None]])
        return used


class Float8Linear(nn.Module):
    """An nn.Linear whose matmul runs through FP8MatMul; the same weight and bias Parameters
    (so optimizers, sharding and checkpoints see the original tensors), the bias added in the
    input's dtype after the GEMM."""

    def __init__(self, linear: nn.Linear, recipe: str, history: int = 16):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias, self.recipe = linear.weight, linear.bias, recipe
        self.history = AmaxHistory(history) if recipe == "delayed" else None
        self.scopes = Scopes()              # set by scope(): the groups that split it
        self.gather = None                  # gather_in_fp8(): FSDP all-gathers it in e4m3

    def forward(self, x):                   # (..., in) -> (..., out)
        return linear(x, self.weight, self.bias, self.recipe, self.scopes, self.history)


def linear(x, w, b, recipe: str, scopes=None, history=None):
    """(..., in) @ w [out, in]^T (+ b, in x's dtype after the GEMM) -> (..., out), in FP8."""
    y = FP8MatMul.apply(x.reshape(-1, w.shape[1]), w, recipe, history,
                        scopes).view(*x.shape[:-1], w.shape[0])
    return y + b if b is not None else y


class SplitFP8(NamedTuple):
    """The FP8 GEMMs of a Float8Linear that tp.py replaced by a parallel layer (carry): its
    recipe, and its Scopes with the tensor-parallel group on the split dimension."""
    recipe: str
    scopes: Scopes

    def __call__(self, x, w, b=None):   # (..., in_local) -> (..., out_local)
        return linear(x, w, b, self.recipe, self.scopes)


def carry(old: nn.Module, new: nn.Module, kind: str, group) -> None:
    """tp.py, as it replaces `old` by its parallel layer `new`: a Float8Linear's GEMMs stay in
    FP8 (new.fp8), every amax MAXed over the group that splits the weight: a column layer's
    output features (W's rows, dY's columns), a row layer's input features (X's and W's
    columns). Then each rank casts with the scales one device uses on the whole weight."""
    if not isinstance(old, Float8Linear):
        return
    if kind not in ("column", "fused", "row"):
        raise ValueError(f"fp8: a {kind} layer under TP has no FP8 split (kv heads replicated "
                         f"over T > kv heads)")
    split = dict(out=(group,)) if kind != "row" else dict(inn=(group,))
    new.fp8 = SplitFP8(old.recipe, old.scopes._replace(**split))


def eligible(linear: nn.Linear, recipe: str) -> bool:
    """The kernel's tiling: in and out features multiples of 16 (blockwise: of 128)."""
    n = BLOCK if recipe == "blockwise" else 16
    return linear.in_features % n == 0 and linear.out_features % n == 0


def convert(model: nn.Module, recipe: str = "tensorwise", history: int = 16) -> list[str]:
    """In place: every nn.Linear inside the model's decoder layers (harness.parts: not the
    embedding, not the LM head) that the kernel can tile becomes a Float8Linear. Returns the
    converted modules' names; the rest stay in their dtype."""
    if recipe not in RECIPES:
        raise ValueError(f"fp8: recipe {recipe!r}: one of {', '.join(RECIPES)}")
    if recipe == "rowwise" and any(p.is_cuda and p.dtype == torch.float32
                                   for p in model.parameters()):
        raise ValueError("fp8: rowwise on a float32 model on CUDA: _scaled_mm's rowwise kernel "
                         "gives bfloat16 only; train in bfloat16 or use tensorwise")
    layers = parts(model).layers
    if layers is None:
        raise ValueError(f"fp8: {type(model).__name__} has no decoder layers found by HF's "
                         f"accessors")
    done = []
    for i, layer in enumerate(layers):
        for name, m in list(layer.named_modules()):
            if type(m) is nn.Linear and eligible(m, recipe):
                owner, _, attr = name.rpartition(".")
                setattr(layer.get_submodule(owner), attr, Float8Linear(m, recipe, history))
                done.append(f"layers.{i}.{name}")
    return done


def scope(model: nn.Module, tokens=()) -> int:
    """Every converted layer of `model` (and every parallel layer carrying one: carry) learns
    the groups over which its tokens are split (a data-parallel rank holds some of the batch's
    rows: its amaxes of x and dy are MAXed over `tokens`, so each rank casts with the whole
    batch's scale). Returns the layers scoped."""
    layers = [m for m in model.modules() if isinstance(m, Float8Linear)]
    for m in layers:
        m.scopes = m.scopes._replace(tokens=tuple(tokens))
        if m.recipe == "delayed" and tokens:
            raise ValueError("fp8: delayed scaling is a single-device lesson here (its history "
                             "would need the same reduction); use tensorwise under a strategy")
    carried = [m for m in model.modules() if isinstance(getattr(m, "fp8", None), SplitFP8)]
    for m in carried:   # (tp.py's parallel layers, carry: their tp scopes kept)
        m.fp8 = m.fp8._replace(scopes=m.fp8.scopes._replace(tokens=tuple(tokens)))
    return len(layers) + len(carried)


class GatherFP8:
    """FSDP's FP8 all-gather of one tensorwise Float8Linear's weight (torchao's
    enable_fsdp_float8_all_gather): each rank casts its rows to e4m3 with the whole weight's
    scale before the all-gather, so the wire carries 1 byte per element (bf16: 2) and the bytes
    gathered are those one device casts from the weight as it is now. The scale comes first: at
    each forward of the model, one all-reduce MAX of every marked weight's amax over its shards'
    group (precompute_scales; torchao's precompute_float8_dynamic_scale_for_fsdp, which its
    user calls after the optimizer step); a gather of rows changed since (the step, without a
    forward of the model) is refused. fsdp.py calls quantize() on each shard and dequantize()
    into its compute buffer, in place; the layer then casts that buffer with its own amax, the
    gathered 448 / s, and gets the gathered bytes back: a dequantised value times the new
    scale is q (1 + e), |e| <= 2^-8 (the compute dtype's rounding of q / s and of the amax),
    under e4m3's smallest relative half-spacing, 2^-5 (and 448 stays 448). Not in fp16, whose
    range cannot hold q / s for every amax (refused). The memory is not saved here: the
    compute buffer stays in param_dtype beside a transient 1-byte one (torchao hands the bytes
    to the GEMM and keeps no high-precision copy)."""
    fmt = E4M3

    def __init__(self):
        self.amax = None      # the whole weight's, in its own dtype (set by precompute_scales)
        self.version = None   # of the local rows it was taken from (an optimizer step bumps it)

    def quantize(self, rows: torch.Tensor, dtype) -> torch.Tensor:
        """This rank's rows [n] (the shard itself) -> [n] e4m3, cast from the compute dtype
        with the whole weight's amax (rounding is monotone: that of the rows in `dtype` is the
        rounded amax)."""
        if self.amax is None or rows._version != self.version:
            raise RuntimeError("fp8: an FP8 all-gather of a weight whose scale predates its "
                               "rows (changed since the model's last forward): call the model, "
                               "or fp8.precompute_scales(model) after the optimizer step")
        if dtype == torch.float16:
            raise ValueError("fp8: the FP8 all-gather dequantises into param_dtype, and "
                             "float16's range cannot hold every q / s: bfloat16 or float32")
        q, _ = quantize(rows.to(dtype).view(1, -1), E4M3, "tensor", amax=self.amax_in(dtype))
        return q.view(-1)

    def dequantize(self, q: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """q [n] e4m3 -> out [n] in its dtype, q / s with quantize's s, in place (no fp32
        temporary)."""
        a = self.amax_in(out.dtype)
        return out.copy_(q).mul_(scale_of(a, E4M3, a.dtype).reciprocal())

    def amax_in(self, dtype) -> torch.Tensor:
        """The amax of the weight rounded to `dtype`, in the precision quantize casts with
        (float64's own, else float32: tensor_amax's rule)."""
        a = self.amax.to(dtype)
        return a if a.dtype == torch.float64 else a.float()


def precompute_scales(model: nn.Module, *_) -> None:
    """Every marked weight's amax over the whole tensor: its local rows' (a DTensor's local
    part: FSDP's shard), one all-reduce MAX per group holding the rest (its mesh's)."""
    marked = [m for m in model.modules() if isinstance(m, Float8Linear) and m.gather]
    by_group = {}
    for m in marked:
        w = m.weight
        rows = w.to_local() if isinstance(w, DTensor) else w
        g = w.device_mesh.get_group() if isinstance(w, DTensor) else None
        m.gather.version = rows._version
        by_group.setdefault(g, []).append((m, rows.detach().abs().amax() if rows.numel()
                                           else rows.new_zeros(())))
    for g, pairs in by_group.items():
        a = torch.stack([x for _, x in pairs])
        if g is not None:
            global_amax(a, [g])
        if planted("fp8-gather-shard-amax"):   # plant: each rank's rows scaled by their own amax
            a = torch.stack([x for _, x in pairs])
        for (m, _), x in zip(pairs, a):
            m.gather.amax = x


def gather_in_fp8(model: nn.Module) -> int:
    """Before fsdp.fully_shard: every tensorwise Float8Linear's weight is all-gathered in e4m3
    (GatherFP8), its scale computed at each forward of `model` before FSDP's hooks run (a
    forward pre-hook, prepended). Returns the weights so marked."""
    layers = [m for m in model.modules() if isinstance(m, Float8Linear)]
    if any(m.recipe != "tensorwise" for m in layers):
        raise ValueError("fp8: the FP8 all-gather casts with one scale per weight: tensorwise "
                         "only (as torchao's)")
    if any(hasattr(m.weight, "_fsdp_param") for m in layers):
        raise ValueError("fp8: gather_in_fp8 after fsdp.fully_shard: call it before, the "
                         "shards read their wire format when they are made")
    if any(m.in_features % 16 for m in layers):   # (each shard's bytes keep the buffer aligned)
        raise ValueError("fp8: the FP8 all-gather needs in_features that are multiples of 16")
    for m in layers:
        m.gather = m.weight.fsdp_cast = GatherFP8()
    model.register_forward_pre_hook(precompute_scales, prepend=True)
    return len(layers)


def fp8_mm(x: torch.Tensor, w: torch.Tensor, recipe: str = "tensorwise") -> torch.Tensor:
    """x [N, in] @ w [out, in]^T through the three FP8 GEMMs (autograd)."""
    return FP8MatMul.apply(x, w, recipe, AmaxHistory() if recipe == "delayed" else None)


if __name__ == "__main__":   # torchrun fp8.py --mode ...: DDP in FP8, the test rig runs it
    from rig.fp8 import main
    main()
