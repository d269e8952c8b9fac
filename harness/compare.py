"""compare.py: the verdicts, the tolerance policy of the correctness mode (README: "Numerics
policy"); the comment below gives the reasons."""
from __future__ import annotations

import copy
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from .dropout import HiddenDropout
from .loss import IGNORE_INDEX
from .models import LOW_PRECISION, build_model
from .oracle import OracleAdamW
from .run import Run
from .strategy import Reference, Strategy, full_tensor, make_reference


# Verdicts: an error is judged against the measured numerical noise of the same computation
# A fixed tolerance ("1e-5 in float32") encodes one machine's BLAS and one model's conditioning:
# the gradient of a replicated norm in a trained model is a sum over tokens that cancels heavily,
# so its error relative to its own size is large however correct the code. What is portable is a
# comparison of errors. On rank 0 the correctness mode runs the reference twice more:
#
#   target  the reference in float64: the best answer we can compute;
#   noise   the reference on one device in the low dtype N, compared with the target: how far
#           plain, correct arithmetic in N lands from it on this machine, for this model, for
#           this tensor (N = the run's dtype for float32/bfloat16; float32 for float64 runs,
#           scaled by eps64/eps32 = 2^-29: rounding errors propagate linearly in the unit
#           roundoff, so the float32 error profile, rescaled, is float64's own noise).
#
#   PASS  when, for every tensor, step and kind (gradient, parameter, loss, gradient norm),
#         err(strategy, target) <= TOL_K * noise + TOL_FLOOR_ULPS * eps(dtype)
#
# where err is max |got - target| / max |target| over the tensor, and a tensor's noise is at least
# its role's median (the same tensor in the other layers; a gradient after the first step in
# float64/float32: the role's largest) and, for a gradient in float64, its rounding floor:
# sqrt(K) u times the magnitudes its sum adds, measured on the target's own step
# (harness/spread.py: the samples have the reference's shapes). A parallel strategy reorders
# sums (over ranks, over shards, over sequence chunks) and so may be a few times noisier than
# one device: TOL_K = 8 leaves that room; a real bug (a missing average, a wrong position, one
# lost micro-batch) is off by 1e-3 to 1, orders of magnitude beyond. The floor keeps a tensor
# whose noise happens to be zero from demanding bit-equality. Gradients are compared as they
# were before clipping (the clipped ones divided by the coefficient the strategy applied, from
# the norm it reports), and the norm itself is compared on its own row, so no scale bug can hide
# behind clipping.
EPS = {"float64": 2.0 ** -52, "float32": 2.0 ** -23, "bfloat16": 2.0 ** -7}


TOL_K = 8.0


# Parameters after an Adam step: each entry moves by lr * m / (sqrt(v) + eps), which multiplies
# that entry's gradient error by about 1 / (|g| + eps). The parameter error is therefore set by
# the few entries whose gradient is near zero, a small-sample extreme that differs between two
# equally correct runs by more than the gradient errors do (measured: up to 6x on the realistic
# checkpoint in float64). Parameters get PARAM_K_FACTOR times the factor; the bugs only they
# can show (optimizer state, learning rate, the updated-parameter gather) are off by a fraction
# of lr, orders of magnitude beyond either.
PARAM_K_FACTOR = 4.0


# And one entry whose gradient is within rounding of Adam's eps can take a visibly different
# update on rounding alone: lr * g / (|g| + eps) moves by up to lr when g's rounding is
# comparable to eps. A strategy's rounding lands on other entries than the single-device run's,
# so per tensor the noise sample can miss it (measured: TP's vocab-parallel softmax on an untied
# lm_head, float32, 0.01 lr on one entry vs 2e-4 lr of noise). Parameters therefore also get
#     PARAM_LR_FLOOR * lr * steps * min(1, eps(dtype) / ADAM_EPS)      (absolute)
# 5% of an lr step per step in float32 and bfloat16, and ~1e-9 lr in float64, where rounding is
# far below Adam's eps. A learning-rate, optimizer-state or stale-parameter bug moves every entry
# by a large fraction of lr; float64 runs still see a missing weight decay (1e-4 lr).
PARAM_LR_FLOOR = 0.05
# In bfloat16 / float16 a gradient's own rounding (~1e-2 of its scale) exceeds many of its
# entries, and Adam's first update of an entry is lr * sign(g) whatever |g|: a sign flipped on
# rounding alone moves it by 2 lr, in any tensor, at every step (an all-or-nothing event a
# per-tensor noise sample need not contain; measured: Gemma2's zero-initialised norm weights
# under tp/sp in bf16, err 2.0 of the tensor's 2 lr scale where the single-device samples
# flipped none). Low-precision parameters therefore get LOW_PRECISION_LR_FLIP lr per step.
LOW_PRECISION_LR_FLIP = 2.0


ADAM_EPS = 1e-8   # make_adamw's eps


TOL_FLOOR_ULPS = 4.0


# A noise sample is the distance of a correct single-device run from the float64 target; it
# cannot be a large fraction of the tensor it is measured on (plain bf16 rounds each operation
# by 2^-9; the bf16 runs of the tiny model measure at most ~0.05 of a tensor's scale, float32
# ~1e-4). A larger one means the noise source itself is broken (the permuted bf16 reference
# whose masters were built before its weights were permuted measured 1.4-1.6), and a tolerance
# of 8 x garbage accepts anything: the verdict is then FAIL, naming the tensor, never PASS.
NOISE_MAX = 0.25
# ... and in a bf16 run with FP8 casts (--fp8), where a bf16 rounding now and then moves a value
# across an FP8 rounding boundary, by 1/8 of it in e4m3 and 1/4 in e5m2 (the gradients), and the
# flips compound through the layers: one device's bf16 FP8 gradients measured up to 0.37 of a
# tensor's scale from the float64 FP8 target (ddp W=2, tiny, tensorwise). A sample of the
# tensor's whole scale is still broken. The tensors then catch gross errors only (a missing
# average: err/tol 1.1-2.1); FP8's own invariant, each rank casting with the whole tensor's
# scale, is checked exactly beside them (Strategy.fp8_amax_log: only there does the limit
# apply; harness/cli.py refuses other low-precision FP8 correctness runs), and float64 proves
# the rest.
NOISE_MAX_FP8 = 1.0
# ... except on a tensor whose gradient is zero in exact arithmetic, where rounding is all
# there is (OPT's k_proj.bias: a key bias adds q.b to every key's score, which the softmax
# cancels): its target gradient is a rounding residue, below ZERO_GRAD_ULPS of the step's
# largest, so any noise sample is O(1) of it, and Adam turns it into lr-sized steps of random
# sign in the parameter. Such a tensor is still judged (err against 8 x its noise), never
# called implausible. The rule reads the target only: a strategy that zeroes a gradient does
# not move it.
ZERO_GRAD_ULPS = 64


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| / max |ref|: an error relative to the tensor's scale, so entries near
    zero do not blow it up."""
    got, ref = got.detach().double().cpu(), ref.detach().double().cpu()
    if got.shape != ref.shape:
        return math.inf
    if not ref.numel():
        return 0.0
    inf = float("inf")   # (max |x| without an |x| temporary: the embedding's is 200 MB at 135M)
    abs_err = torch.linalg.vector_norm(got - ref, inf).item()
    scale = torch.linalg.vector_norm(ref, inf).item()
    return abs_err / scale if scale > 0 else (0.0 if abs_err == 0 else math.inf)


def role(name: str) -> str:
    """A parameter's role: its name with the layer index dropped
    (model.layers.3.mlp.up_proj.weight -> model.layers.*.mlp.up_proj.weight)."""
    return re.sub(r"\.\d+\.", ".*.", name)


@dataclass
class NoisePolicy:
    dtype: str                   # the run's dtype
    k: float = TOL_K
    floor_ulps: float = TOL_FLOOR_ULPS
    fp8: bool = False            # --fp8 with its scales checked exactly (fp8_amax_log)

    @property
    def noise_max(self) -> float:
        """The largest plausible noise sample, relative to the tensor's scale."""
        return NOISE_MAX_FP8 if self.fp8 and self.dtype in LOW_PRECISION else NOISE_MAX

    @property
    def noise_dtype(self) -> str:
        """The dtype whose single-device run measures the noise."""
        return "float32" if self.dtype == "float64" else self.dtype

    @property
    def scale(self) -> float:
        return EPS[self.dtype] / EPS[self.noise_dtype]

    @property
    def floor(self) -> float:
        return self.floor_ulps * EPS[self.dtype]

    @property
    def unit_roundoff(self) -> float | None:
        """u for the rounding floor of the gradients (harness/spread.py): float64 runs only.
        (float32 runs measure their noise in their own dtype; and where a sum cancels, the
        floor grows like K u relative to the gradient, ~1e-4 in float32 at 8192 tokens, room
        enough to hide a 1e-4 normalisation bug.)"""
        return EPS[self.dtype] / 2 if self.dtype == "float64" else None

    @property
    def pools_role(self) -> bool:
        """Whether a gradient after the first step takes its role's largest noise sample: in
        float64 and float32, where the samples are roundoff (in bf16 one layer's 0.05 would
        widen every layer's tolerance to 0.4)."""
        return self.dtype in ("float64", "float32")

    def factor(self, kind: str) -> float:
        return self.k * (PARAM_K_FACTOR if kind == "param" else 1.0)

    def tol(self, noise: float, kind: str = "grad", extra: float = 0.0) -> float:
        return self.factor(kind) * noise + self.floor + extra

    def update_floor(self, lr: float, steps: int) -> float:
        """The absolute parameter floor after `steps` AdamW steps (see PARAM_LR_FLOOR)."""
        return self.lr_floor_per_step * lr * steps

    @property
    def lr_floor_per_step(self) -> float:
        if self.dtype in LOW_PRECISION:
            return LOW_PRECISION_LR_FLIP
        return PARAM_LR_FLOOR * min(1.0, EPS[self.dtype] / ADAM_EPS)

    def describe(self) -> str:
        src = (f"single-device {self.noise_dtype} vs float64"
               + (f" x eps ratio {self.scale:.1e}, and float64 on a permuted model"
                  if self.scale != 1 else f", and {self.dtype} on a permuted model"))
        floor = (" (grads: noise at least sqrt(K) u sum|terms|)"
                 if self.unit_roundoff else "")
        return (f"err <= {self.k:g} x noise{floor} + {self.floor_ulps:g} ulp, params "
                f"{self.factor('param'):g} x + {self.lr_floor_per_step:.0e}"
                f" lr/step ({src})")


@dataclass
class Judged:
    """One compared quantity at its worst step: its error and the noise it was judged by."""
    err: float = 0.0
    noise: float = 0.0
    tol: float = 0.0
    step: int = -1
    value: float = math.nan      # the target's value (scalars: the loss, the pre-clip norm)

    @property
    def ratio(self) -> float:
        return self.err / self.tol if self.tol > 0 else (0.0 if self.err == 0 else math.inf)

    @property
    def ok(self) -> bool:
        return self.err <= self.tol   # False for NaN


class Comparison:
    """Per tensor and kind ("grad", "param"), plus the loss and the gradient norm: the worst
    step by err / tol. The errors (the strategy against the target) and the noise samples (each
    noise source against the target) are recorded as numbers, so the runs they come from can
    run one after another and be freed (correctness.py keeps only the target's tensors); `add`
    records a step whole and judges it at once, `judge` judges every recorded step."""

    KINDS = ("grad", "param")

    def __init__(self, names: list[str], shapes: dict, policy: NoisePolicy,
                 frozen: frozenset = frozenset()):
        self.names, self.shapes, self.policy = names, shapes, policy
        # frozen tensors (--lora's base): no gradient on either side, parameters bit-identical
        self.frozen, self.thawed = frozenset(frozen), set()
        self.rows = {n: {k: Judged() for k in self.KINDS} for n in names}
        self.scalars: dict[str, Judged] = {}     # "loss", "grad norm"
        self.missing: set[str] = set()
        self.implausible: dict[str, float] = {}   # label -> a noise sample > policy.noise_max
        self.extra: list[str] = []
        self._err: dict = {}     # (kind, step) -> {name: err}, and {name: max |target|}
        self._noise: dict = {}   # (kind, step) -> {name: noise, or None where a source lacks it}
        self._floor: dict = {}   # (kind, step) -> the absolute floor (parameters)
        self._scalar: dict = {}  # (name, step) -> [err, noise, target]
        self._spread: dict = {}  # step -> {name: the gradient's rounding floor (absolute)}
        self.zero_grads: set[str] = set()   # tensors whose target gradient is a rounding residue

    def _judge(self, old: Judged, err: float, noise: float, step: int, kind: str,
               extra: float = 0.0) -> Judged:
        new = Judged(err, noise, self.policy.tol(noise, kind, extra), step)
        key = lambda j: math.inf if math.isnan(j.ratio) else j.ratio  # noqa: E731
        return new if old.step < 0 or key(new) > key(old) else old

    def error(self, kind: str, step: int, got: dict, target: dict):
        """The strategy's tensors at one step against the target's."""
        errs, scale = {}, {}
        if kind == "grad":   # a frozen tensor the strategy gave a gradient (or the target did)
            self.thawed |= {n for n in self.frozen
                            if got.get(n) is not None or target.get(n) is not None}
        for n in self.names:
            t = target.get(n)
            if t is not None and got.get(n) is not None:
                # (a frozen tensor: against the target rounded to the run's dtype, exactly)
                errs[n] = rel_err(got[n], t.to(got[n].dtype) if n in self.frozen else t)
                scale[n] = (torch.linalg.vector_norm(t.detach(), float("inf")).item()
                            if t.numel() else 0.0)
        self._err[kind, step] = errs, scale
        self.extra = sorted(set(got) - set(self.names))

    def noise(self, kind: str, step: int, noisy: dict, target: dict, scale: float):
        """One noise source's tensors at one step: its distance from the target, times `scale`;
        a tensor's noise is the largest over the sources."""
        rec = self._noise.setdefault((kind, step), {})
        for n in self.names:
            mine = noisy.get(n)   # (read once: a mapping may compute it on reading)
            if target.get(n) is None or mine is None:
                rec[n] = None
            elif n not in rec or rec[n] is not None:
                rec[n] = max(rec.get(n) or 0.0, rel_err(mine, target[n]) * scale)

    def spread(self, step: int, floors: dict):
        """The gradients' rounding floors at one step (harness/spread.py: sqrt(K) u max M,
        absolute, from the target's own sums): a tensor's noise is at least its floor."""
        self._spread[step] = dict(floors)

    def floor(self, kind: str, step: int, floor_abs: float):
        """An absolute tolerance (parameters: policy.update_floor), relative to each tensor's
        max |target|; the largest recorded counts."""
        self._floor[kind, step] = max(self._floor.get((kind, step), 0.0), floor_abs)

    def scalar(self, name: str, step: int, target: float, got: float | None = None,
               noisy: float | None = None, scale: float = 1.0):
        """The strategy's value (got) or a noise source's (noisy, times scale) of a scalar."""
        rel = lambda x: abs(x - target) / abs(target) if target else abs(x - target)  # noqa: E731
        rec = self._scalar.setdefault((name, step), [math.nan, 0.0, target])
        if got is not None:
            rec[0] = rel(got)
        if noisy is not None:
            rec[1] = max(rec[1], rel(noisy) * scale)

    def _judge_step(self, kind: str, step: int):
        errs, scale = self._err.get((kind, step), ({}, {}))
        noise = {n: e for n, e in self._noise.get((kind, step), {}).items() if e is not None}
        # One noise sample per tensor can be unusually small (a lucky rounding on a tensor whose
        # entries are all alike). Tensors of the same role in other layers (every layer's
        # mlp.up_proj.weight) have the same conditioning: a tensor is judged against at least
        # the median noise of its role, a gradient after the first step (float64, float32:
        # roundoff samples, none a zero gradient's residue) against the largest.
        # (From the second step on, a gradient's error is mostly the previous update's: Adam
        # moved a few entries whose gradient was near its eps by rounding alone, and which
        # entries those are differs from run to run; measured on an AMD EPYC, family 26: tp.py's
        # layer-0 up_proj gradient at
        # step 1 came out 2.6e-14 from the target where both its samples measured 2e-15 and the
        # same role's layer 1 measured 2.9e-14. The largest of the role's samples pools them.)
        by_role: dict[str, list[float]] = {}
        for n, e in noise.items():
            by_role.setdefault(role(n), []).append(e)
        floor_abs = self._floor.get((kind, step), 0.0)
        if kind == "grad" and scale:   # (sorted: every grad step is judged before the params)
            top = max(scale.values())
            self.zero_grads |= {n for n, s in scale.items()
                                if s <= ZERO_GRAD_ULPS * EPS[self.policy.dtype] * top}
        pool: dict[str, float] = {}   # role -> its largest finite sample, residues left out
        for n, e in noise.items():
            if math.isfinite(e) and n not in self.zero_grads:
                pool[role(n)] = max(pool.get(role(n), 0.0), e)
        for n in self.names:
            if n in self.frozen:   # judged exactly: no gradient, the parameter unchanged
                err = (math.inf if n in self.thawed else 0.0) if kind == "grad" else errs.get(n)
                if err is None:
                    self.missing.add(f"{kind}:{n}")
                elif err > 0 or self.rows[n][kind].step < 0:
                    self.rows[n][kind] = self._judge(self.rows[n][kind], err, 0.0, step, kind,
                                                     -self.policy.floor)
                continue
            if n not in errs or n not in noise:
                self.missing.add(f"{kind}:{n}")
                continue
            level = max(noise[n], float(np.median(by_role[role(n)])))
            if kind == "grad" and step > 0 and self.policy.pools_role:
                level = max(level, pool.get(role(n), 0.0))
            if kind == "grad" and scale[n] > 0:   # (the rounding floor, harness/spread.py)
                level = max(level, self._spread.get(step, {}).get(n, 0.0) / scale[n])
            extra = floor_abs / scale[n] if scale[n] > 0 else 0.0
            # (less the absolute floor: a zero-initialised tensor's scale after a step is ~lr,
            # and one Adam sign flip in a noise source, which the floor allows, is 2 of it)
            if noise[n] - extra > self.policy.noise_max and n not in self.zero_grads:
                self.implausible[f"{kind}:{n}"] = max(noise[n],
                                                      self.implausible.get(f"{kind}:{n}", 0.0))
            self.rows[n][kind] = self._judge(self.rows[n][kind], errs[n], level, step, kind, extra)

    def _judge_scalar(self, name: str, step: int):
        err, noise, target = self._scalar[name, step]
        if noise > self.policy.noise_max:
            self.implausible[name] = max(noise, self.implausible.get(name, 0.0))
        self.scalars[name] = self._judge(self.scalars.get(name, Judged()), err, noise, step, name)
        if self.scalars[name].step == step:
            self.scalars[name].value = target

    def judge(self):
        """Every recorded step, once all its noise sources are in."""
        self.rows = {n: {k: Judged() for k in self.KINDS} for n in self.names}
        self.scalars, self.missing, self.implausible = {}, set(), {}
        self.zero_grads = set()
        for kind, step in sorted(self._err):
            self._judge_step(kind, step)
        for name, step in sorted(self._scalar):
            self._judge_scalar(name, step)

    def add(self, kind: str, step: int, got: dict, target: dict, noisy: list,
            floor_abs: float = 0.0):
        """A step whole, judged now. noisy: [(tensors of a noise source, the scale of its
        error)]."""
        self.error(kind, step, got, target)
        for d, sc in noisy:
            self.noise(kind, step, d, target, sc)
        self.floor(kind, step, floor_abs)
        self._judge_step(kind, step)

    def add_scalar(self, name: str, step: int, got: float, target: float, noisy: list):
        self.scalar(name, step, target, got=got)
        for v, sc in noisy:
            self.scalar(name, step, target, noisy=v, scale=sc)
        self._judge_scalar(name, step)

    def all(self):
        """(label, Judged) for everything compared."""
        for n in self.names:
            for k in self.KINDS:
                yield f"{k}:{n}", self.rows[n][k]
        yield from self.scalars.items()

    def max_err(self, kind=None) -> float:
        kinds = [kind] if kind else list(self.KINDS)
        return max((self.rows[n][k].err for n in self.names for k in kinds), default=0.0)

    def max_noise(self, kind=None) -> float:
        kinds = [kind] if kind else list(self.KINDS)
        return max((self.rows[n][k].noise for n in self.names for k in kinds), default=0.0)

    def worst(self) -> tuple[str, Judged]:
        return max(self.all(), key=lambda x: math.inf if math.isnan(x[1].ratio) else x[1].ratio,
                   default=("-", Judged()))


def clip_coef(norm: float, max_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_'s coefficient."""
    return min(1.0, max_norm / (norm + 1e-6))


def preclip_grads(strat, grads: dict, max_norm: float) -> dict:
    """The gradients before clipping: the clipped ones divided by the coefficient the strategy
    applied, computed from the pre-clip global norm it reports as `grad_norm` (a float or a
    0-d tensor). A wrong norm then shows on the norm's own row; a wrongly scaled gradient on the
    gradient rows, whatever clipping did to it."""
    if not max_norm:
        return grads
    norm = getattr(strat, "grad_norm", None)
    if norm is None:
        raise RuntimeError(f"{strat.name} clips (--clip) but does not report grad_norm")
    coef = clip_coef(float(full_tensor(norm)), max_norm)
    return {n: (g / coef if g is not None else None) for n, g in grads.items()}


def reference_in(run: Run, cls, dtype: str, prepare=None):
    """The single-device reference in another dtype, from the same weights, stepped by
    OracleAdamW. `prepare(model)` edits the model before the reference (and with it its
    optimizer's fp32 masters) is built."""
    a = copy.copy(run.args)
    a.dtype = dtype
    model = build_model(a, run.config, run.env.device)
    if prepare is not None:
        prepare(model)
    if getattr(a, "fp8", None):   # (the strategy's FP8 layers, on one device)
        cls.convert_fp8(model, a.fp8)
    a.reference_optimizer = OracleAdamW   # (harness.Reference builds it)
    return make_reference(cls, model, a, run.env)


@dataclass
class NoiseSource:
    """A single-device reference whose distance from the float64 target is a noise sample."""
    ref: Strategy
    scale: float       # multiplies its error (eps64/eps32 for float32 noise in a float64 run)
    lr_flip: float = 0.0   # lr per step an entry's update may differ by on this rounding alone:
    # coarse (int8) rounding can flip the sign of any gradient entry smaller than its error,
    # and Adam's update is ~lr * sign(g) whatever |g|, so one such entry moves by 2 lr per
    # step, an all-or-nothing event a per-tensor noise sample need not contain (lossy_noise
    # models set `lr_flip` to 2; parameters then get 2 lr * steps absolute)


class PermutedReference:
    """The reference (float64, or the run's low dtype) on an exactly equivalent model, a direct
    sample of that dtype's own noise on this machine. Hidden units, MLP units, kv-head groups
    (each with its query heads) and the vocabulary (the embedding's and the LM head's rows, the
    batch's token ids and labels renamed to match; the padding row kept) are permuted, and so
    are the batch's sequences: the same function, computed with a different summation order in
    every matmul (over the hidden size, the heads, the MLP width, the vocabulary and the
    tokens), as a parallel strategy reorders them. `full_grads` / `full_params` map back to
    the original layout. (The vocabulary: a vocab-parallel LM head sums the gradient of the
    final norm over vocabulary shards; without it a correct tp.py run on a 32000-token tiny
    model measured err/tol 1.01 in float64.)

    Why, beside the scaled float32 noise: scaling by eps64/eps32 assumes both dtypes' kernels
    grow their rounding alike. They need not: MKL on an AMD EPYC (AVX2) grows dgemm's error
    linearly in the reduction length (55 ulp at K = 4096) while sgemm's stays near 6, so the
    scaled float32 noise underestimates float64's by up to ~9x there, and correct float64 runs
    of tp and sp failed. `build` returns None for a model with a parameter it cannot permute
    (e.g. MoE experts): the scaled float32 noise then stands alone."""

    RULES = [  # parameter-name suffix -> the permutation of each dim (None: kept)
        ("embed_tokens.weight", ("v", "h")), ("lm_head.weight", ("v", "h")),
        ("model.norm.weight", ("h",)), (".input_layernorm.weight", ("h",)),
        (".post_attention_layernorm.weight", ("h",)),
        ("q_proj.weight", ("q", "h")), ("q_proj.bias", ("q",)),
        ("k_proj.weight", ("kv", "h")), ("k_proj.bias", ("kv",)),
        ("v_proj.weight", ("kv", "h")), ("v_proj.bias", ("kv",)),
        ("o_proj.weight", ("h", "q")), ("o_proj.bias", ("h",)),
        ("gate_proj.weight", ("i", "h")), ("gate_proj.bias", ("i",)),
        ("up_proj.weight", ("i", "h")), ("up_proj.bias", ("i",)),
        ("down_proj.weight", ("h", "i")), ("down_proj.bias", ("h",)),
    ]

    def __init__(self, ref, perms: dict, rows: torch.Tensor, plan: dict):
        self.ref, self.perms, self.rows, self.plan = ref, perms, rows, plan
        if ref.micro_rows:   # --fp8's micro-batches: the same rows, at their permuted places
            at = torch.argsort(rows)   # original row -> its row in the permuted batch
            ref.micro_rows = [at[torch.tensor(r)].tolist() for r in ref.micro_rows]
        self.model = ref.model
        self.token = torch.argsort(perms["v"])   # old token id -> its row in the permuted model

    @classmethod
    def build(cls, run: Run, strategy_cls, dtype: str = "float64"):
        """The permuted reference, or None where a parameter has no rule. The weights are
        permuted before the reference and its optimizer exist: MasterAdamW copies its fp32
        masters from them when it is built, and masters of the unpermuted weights (the bug
        this order fixes) made every bf16 parameter's noise sample 1.4-1.6 of the tensor's
        scale after one step, a tolerance that accepted anything."""
        if getattr(run.args, "fp8", None) == "blockwise":
            return None   # (FP8's 128 x 128 blocks and 1 x 128 tiles do not follow a
            # permutation of the units: not an equivalent model; tensorwise's and rowwise's
            # scales do, a whole tensor's or a whole row's amax)
        built = {}

        def permute(model):
            built["perm"] = cls._permute(model, run)
        ref = reference_in(run, strategy_cls, dtype, prepare=permute)
        if built["perm"] is None or type(ref).objective is not Reference.objective:
            return None   # (an objective beyond the LM loss, MoE's: its terms are not mapped)
        perms, rows, plan = built["perm"]
        return cls(ref, perms, rows, plan)

    @classmethod
    def _permute(cls, model, run: Run):
        """Permute `model` in place; (perms, rows, plan), or None (and the model untouched)
        where a parameter has no rule."""
        cfg = run.config
        H, I = cfg.hidden_size, getattr(cfg, "intermediate_size", None)
        nh = cfg.num_attention_heads
        nkv = getattr(cfg, "num_key_value_heads", None) or nh   # (GPT-NeoX: no GQA field)
        d = getattr(cfg, "head_dim", None) or H // nh
        size = {"h": H, "i": I, "q": nh * d, "kv": nkv * d, "v": cfg.vocab_size}
        plan = {}
        for n, p in model.named_parameters():   # any other parameter (q_norm, experts, a
            rule = next((dims for suffix, dims in cls.RULES if n.endswith(suffix)), None)
            if rule is None or len(rule) != p.dim() or any(   # size that does not fit): none
                    k is not None and p.shape[i] != size[k] for i, k in enumerate(rule)):
                return None
            plan[n] = rule
        g = torch.Generator().manual_seed(12345)
        groups = torch.randperm(nkv, generator=g)     # kv heads, each with its q heads
        per = nh // nkv
        q_heads = torch.cat([grp * per + torch.randperm(per, generator=g) for grp in groups])
        rows_of = lambda heads: (heads[:, None] * d + torch.arange(d)).reshape(-1)  # noqa: E731
        perms = {"h": torch.randperm(H, generator=g), "i": torch.randperm(I, generator=g),
                 "q": rows_of(q_heads), "kv": rows_of(groups)}
        rows = torch.randperm(run.args.batch, generator=g)
        perms["v"] = torch.randperm(cfg.vocab_size, generator=g)
        pad = model.get_input_embeddings().padding_idx   # its gradient is zero: kept in place
        if pad is not None:
            at = int((perms["v"] == pad).nonzero())
            perms["v"][[at, pad]] = perms["v"][[pad, at]]
        for m in model.modules():   # dropout (dropout.py) keyed by the original heads, units
            if hasattr(m, "dropout_layer"):
                m.dropout_heads = q_heads
            if isinstance(m, HiddenDropout):
                m.features = perms["h"]
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(cls._apply_to(perms, plan, p, n, inverse=False))
        return perms, rows, plan

    @staticmethod
    def _apply_to(perms, plan, t, name, inverse):
        for dim, key in enumerate(plan[name]):
            if key is not None:
                idx = perms[key].to(t.device)
                if inverse:
                    idx = torch.argsort(idx)
                t = t.index_select(dim, idx)
        return t

    def _apply(self, t, name, inverse):
        return self._apply_to(self.perms, self.plan, t, name, inverse)

    def step(self, batch):
        rows, token = self.rows.to(batch.input_ids.device), self.token.to(batch.input_ids.device)
        ids, labels = batch.input_ids[rows], batch.labels[rows]
        labels = torch.where(labels == IGNORE_INDEX, labels, token[labels.clamp(min=0)])
        docs = None if batch.doc_positions is None else batch.doc_positions[rows]
        return self.ref.step(type(batch)(token[ids], labels, batch.index,
                                         batch.row_ids()[self.rows], batch.positions, docs))

    @property
    def grad_norm(self):
        return self.ref.grad_norm

    def full_grads(self):
        return _Unpermuted(self, lambda p: p.grad)

    def full_params(self):
        return _Unpermuted(self, lambda p: p.detach())


class _Unpermuted(Mapping):
    """A permuted model's tensors in the original layout, each mapped back when it is read:
    the comparison reads one tensor at a time, so one mapped copy at a time is alive."""

    def __init__(self, perm: PermutedReference, get):
        self.perm, self.get_of = perm, get
        self.params = dict(perm.model.named_parameters())

    def __getitem__(self, name):
        t = self.get_of(self.params[name])
        return None if t is None else self.perm._apply(t, name, inverse=True)

    def __iter__(self):
        return iter(self.params)

    def __len__(self):
        return len(self.params)


def noise_sources(run: Run, cls, policy) -> list:
    """The noise sources, as functions that build them, for rank 0 to run one after another
    against the float64 target (each builder returns a list of NoiseSource that step together).
    float32/bfloat16 runs: the reference in that dtype, and the same on a permuted model
    (PermutedReference in that dtype): one sample of a single summation order can land far
    closer to the target than another (on an AMD EPYC with AVX512, the realistic checkpoint's
    float32 o_proj gradient: 1.0e-6 in the reference's order, 7.8e-6 in the permuted one, where
    a correct TP run measured 1.8e-5 and FAILed on the first alone). float64 runs: the float32
    reference, its error scaled by eps64/eps32 (rounding propagates linearly in the unit
    roundoff: forward, backward, everything), and float64 itself on the permuted model. What
    scaling cannot carry, Adam's update error on entries whose gradient is near its eps (a
    float32 parameter's error is floored by its own rounding, an ulp of |p|), the parameter
    floor covers (NoisePolicy.update_floor). A strategy that rounds on purpose (zeropp.py's
    int8 communication) supplies `lossy_noise(run)`, a single-device model of that rounding (or
    a list of them that step together): its distance from the target is one more noise sample
    (scale 1), so the verdict stays error vs error."""
    low = policy.dtype if policy.dtype != "float64" else policy.noise_dtype
    permuted_dtype = policy.dtype if policy.dtype != "float64" else "float64"

    def plain():
        return [NoiseSource(reference_in(run, cls, low), policy.scale)]

    def permuted():
        p = PermutedReference.build(run, cls, permuted_dtype)
        return [] if p is None else [NoiseSource(p, 1.0)]

    def lossy():
        models = cls.lossy_noise(run) if hasattr(cls, "lossy_noise") else None
        models = [] if models is None else models if isinstance(models, list) else [models]
        return [NoiseSource(m, 1.0, getattr(m, "lr_flip", 0.0)) for m in models]
    return [lossy, permuted, plain]   # the largest first: a smaller model reuses its memory
