"""compare.py: the verdicts, the tolerance policy of the correctness mode (README: "Numerics
policy"); the comment below gives the reasons."""
from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass

import numpy as np
import torch

from .models import build_model
from .run import Run
from .strategy import Reference, Strategy, full_tensor, reference_class


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
# the median noise of its role (the same tensor in the other layers). A parallel strategy reorders
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


ADAM_EPS = 1e-8   # make_adamw's eps


TOL_FLOOR_ULPS = 4.0


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| / max |ref|: an error relative to the tensor's scale, so entries near
    zero do not blow it up."""
    got, ref = got.detach().double().cpu(), ref.detach().double().cpu()
    if got.shape != ref.shape:
        return math.inf
    if not ref.numel():
        return 0.0
    abs_err = (got - ref).abs().max().item()
    scale = ref.abs().max().item()
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

    def factor(self, kind: str) -> float:
        return self.k * (PARAM_K_FACTOR if kind == "param" else 1.0)

    def tol(self, noise: float, kind: str = "grad", extra: float = 0.0) -> float:
        return self.factor(kind) * noise + self.floor + extra

    def update_floor(self, lr: float, steps: int) -> float:
        """The absolute parameter floor after `steps` AdamW steps (see PARAM_LR_FLOOR)."""
        return PARAM_LR_FLOOR * lr * steps * min(1.0, EPS[self.dtype] / ADAM_EPS)

    def describe(self) -> str:
        src = (f"single-device {self.noise_dtype} vs float64"
               + (f" x eps ratio {self.scale:.1e}, and float64 on a permuted model"
                  if self.scale != 1 else f", and {self.dtype} on a permuted model"))
        return (f"err <= {self.k:g} x noise + {self.floor_ulps:g} ulp, params "
                f"{self.factor('param'):g} x + {PARAM_LR_FLOOR * min(1, EPS[self.dtype] / ADAM_EPS):.0e}"
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
    step by err / tol."""

    KINDS = ("grad", "param")

    def __init__(self, names: list[str], shapes: dict, policy: NoisePolicy):
        self.names, self.shapes, self.policy = names, shapes, policy
        self.rows = {n: {k: Judged() for k in self.KINDS} for n in names}
        self.scalars: dict[str, Judged] = {}     # "loss", "grad norm"
        self.missing: set[str] = set()
        self.extra: list[str] = []

    def _judge(self, old: Judged, err: float, noise: float, step: int, kind: str,
               extra: float = 0.0) -> Judged:
        new = Judged(err, noise, self.policy.tol(noise, kind, extra), step)
        key = lambda j: math.inf if math.isnan(j.ratio) else j.ratio  # noqa: E731
        return new if old.step < 0 or key(new) > key(old) else old

    def add(self, kind: str, step: int, got: dict, target: dict, noisy: list,
            floor_abs: float = 0.0):
        """noisy: [(tensors of a noise source, the scale of its error)]; the noise of a tensor
        is the largest scaled error over the sources. floor_abs: an absolute tolerance added
        (parameters: policy.update_floor), relative to each tensor's max |target|."""
        noise = {n: max(rel_err(d[n], target[n]) * sc for d, sc in noisy) for n in self.names
                 if target.get(n) is not None and all(d.get(n) is not None for d, _ in noisy)}
        # One noise sample per tensor can be unusually small (a lucky rounding on a tensor whose
        # entries are all alike). Tensors of the same role in other layers (every layer's
        # mlp.up_proj.weight) have the same conditioning: a tensor is judged against at least
        # the median noise of its role.
        by_role: dict[str, list[float]] = {}
        for n, e in noise.items():
            by_role.setdefault(role(n), []).append(e)
        for n in self.names:
            if n not in got or got[n] is None or n not in noise:
                self.missing.add(f"{kind}:{n}")
                continue
            level = max(noise[n], float(np.median(by_role[role(n)])))
            scale = target[n].detach().abs().max().item() if target[n].numel() else 0.0
            extra = floor_abs / scale if scale > 0 else 0.0
            self.rows[n][kind] = self._judge(self.rows[n][kind], rel_err(got[n], target[n]),
                                             level, step, kind, extra)
        self.extra = sorted(set(got) - set(self.names))

    def add_scalar(self, name: str, step: int, got: float, target: float, noisy: list):
        rel = lambda x: abs(x - target) / abs(target) if target else abs(x - target)  # noqa: E731
        err, noise = rel(got), max(rel(v) * sc for v, sc in noisy)
        self.scalars[name] = self._judge(self.scalars.get(name, Judged()), err, noise, step, name)
        if self.scalars[name].step == step:
            self.scalars[name].value = target

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


def reference_in(run: Run, cls, dtype: str):
    """The single-device reference in another dtype, from the same weights."""
    a = copy.copy(run.args)
    a.dtype = dtype
    return reference_class(cls)(build_model(a, run.config, run.env.device), a, run.env)


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
    sample of that dtype's own noise on this machine. Hidden units, MLP units and kv-head groups (each with its query
    heads) are permuted, and so are the batch's sequences: the same function, computed with a
    different summation order in every matmul (over the hidden size, the heads, the MLP width
    and the tokens), as a parallel strategy reorders them. `full_grads` / `full_params` map
    back to the original layout.

    Why, beside the scaled float32 noise: scaling by eps64/eps32 assumes both dtypes' kernels
    grow their rounding alike. They need not: MKL on an AMD EPYC (AVX2) grows dgemm's error
    linearly in the reduction length (55 ulp at K = 4096) while sgemm's stays near 6, so the
    scaled float32 noise underestimates float64's by up to ~9x there, and correct float64 runs
    of tp and sp failed. `build` returns None for a model with a parameter it cannot permute
    (e.g. MoE experts): the scaled float32 noise then stands alone."""

    RULES = [  # parameter-name suffix -> the permutation of each dim (None: kept)
        ("embed_tokens.weight", (None, "h")), ("lm_head.weight", (None, "h")),
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
        self.model = ref.model

    @classmethod
    def build(cls, run: Run, strategy_cls, dtype: str = "float64"):
        ref = reference_in(run, strategy_cls, dtype)
        cfg = run.config
        if type(ref).objective is not Reference.objective:
            return None   # an objective beyond the LM loss (MoE): its terms are not mapped
        H, I = cfg.hidden_size, cfg.intermediate_size
        nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
        d = getattr(cfg, "head_dim", None) or H // nh
        size = {"h": H, "i": I, "q": nh * d, "kv": nkv * d}
        plan = {}
        for n, p in ref.model.named_parameters():   # any other parameter (q_norm, experts, a
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
        B = run.args.batch
        self = cls(ref, perms, torch.randperm(B, generator=g), plan)
        with torch.no_grad():
            for n, p in ref.model.named_parameters():
                p.copy_(self._apply(p, n, inverse=False))
        return self

    def _apply(self, t, name, inverse):
        for dim, key in enumerate(self.plan[name]):
            if key is not None:
                idx = self.perms[key].to(t.device)
                if inverse:
                    idx = torch.argsort(idx)
                t = t.index_select(dim, idx)
        return t

    def step(self, batch):
        rows = self.rows.to(batch.input_ids.device)
        return self.ref.step(type(batch)(batch.input_ids[rows], batch.labels[rows], batch.index))

    @property
    def grad_norm(self):
        return self.ref.grad_norm

    def full_grads(self):
        return {n: None if p.grad is None else self._apply(p.grad, n, inverse=True)
                for n, p in self.model.named_parameters()}

    def full_params(self):
        return {n: self._apply(p.detach(), n, inverse=True)
                for n, p in self.model.named_parameters()}


def noise_sources(run: Run, cls, ref, policy) -> tuple:
    """(target, [NoiseSource]) on rank 0. float32/bfloat16 runs: the reference in that dtype,
    and the same on a permuted model (PermutedReference in that dtype): one sample of a single
    summation order can land far closer to the target than another (on an AMD EPYC with AVX512,
    the realistic checkpoint's float32 o_proj gradient: 1.0e-6 in the reference's order, 7.8e-6
    in the permuted one, where a correct TP run measured 1.8e-5 and FAILed on the first alone).
    float64 runs: the float32 reference, its error scaled by eps64/eps32 (rounding propagates
    linearly in the unit roundoff: forward, backward, everything). What scaling cannot carry,
    Adam's update error on entries whose gradient is near its eps (a float32 parameter's error
    is floored by its own rounding, an ulp of |p|), the parameter floor covers
    (NoisePolicy.update_floor). A strategy that rounds on purpose (zeropp.py's int8
    communication) supplies `lossy_noise(run)`, a single-device model of that rounding (or a
    list of them): its distance from the target is one more noise sample (scale 1), so the
    verdict stays error vs error."""
    lossy = cls.lossy_noise(run) if hasattr(cls, "lossy_noise") else None
    lossy = [] if lossy is None else lossy if isinstance(lossy, list) else [lossy]
    extra = [NoiseSource(m, 1.0, getattr(m, "lr_flip", 0.0))   # rounding on purpose
             for m in lossy]
    if policy.dtype != "float64":
        permuted = PermutedReference.build(run, cls, policy.dtype)
        return reference_in(run, cls, "float64"), [NoiseSource(ref, 1.0)] + (
            [] if permuted is None else [NoiseSource(permuted, 1.0)]) + extra
    sources = [NoiseSource(reference_in(run, cls, policy.noise_dtype), policy.scale)]
    permuted = PermutedReference.build(run, cls)
    if permuted is not None:   # float64's own noise, measured (PermutedReference)
        sources.append(NoiseSource(permuted, 1.0))
    return ref, sources + extra
