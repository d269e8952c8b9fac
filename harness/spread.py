"""spread.py: a floor under each gradient's noise, from the gradient's own computation.

Why (docs/correctness.md, "Numerics policy"): the measured noise samples (compare.noise_sources)
are single-device runs with the reference's shapes. A parallel strategy computes the same sums
with other shapes (a rank's slice of the rows, a micro-batch of the tokens), and a BLAS picks
its blocking, and so its rounding, by shape; a sample in the reference's shapes need not cover
another shape's kernel. (The false FAIL that prompted this, tp.py on an AMD EPYC, family 26,
was not this: its error came from the previous Adam update, which compare.py's role pooling
covers; this floor is the other half of "cannot fall below the arithmetic's own spread".)

A weight's gradient is a sum of K products over the tokens: g_ij = sum_t dY_ti X_tj for a
linear layer. Higham & Mary's probabilistic model of rounding (SIAM J. Sci. Comput. 41(5),
2019, Thm 3.1: roundings independent and mean zero, a model, not a guarantee; round-to-nearest
on sums of one sign can do worse) bounds its rounding in any summation order, with probability
at least 1 - 2K exp(-lambda^2 (1 - u)^2 / 2), by

    |fl(g_ij) - g_ij| <= lambda sqrt(K) u M_ij,     M_ij = sum_t |dY_ti| |X_tj|,

u the unit roundoff, to first order in u. The size is set by the magnitudes summed (M), not by
the result (g), which is what a sum that cancels heavily needs. `Spread` measures M on the
float64 target's own step, from hooks on the modules that own parameters, and gives each tensor

    floor = sqrt(K) u max_ij M_ij   (absolute; compare.py divides it by max |g| and judges
                                     against TOL_K = 8 times it: lambda = 8 on the strategy's
                                     side; the float64 target rounds at the same u, so the
                                     difference of the two is up to sqrt(2) beyond that).

The floor covers the last sum; the error a strategy carries into dY and X from the layers before
is what the measured samples see. It applies to float64 runs (compare.NoisePolicy.unit_roundoff):
where a sum cancels, M / |g| grows like sqrt(K) and the floor like K u relative to g, harmless in
float64 (1e-11 at 131k tokens) but ~1e-4 in float32 at 8192 tokens, room enough to hide a bug;
float32 and bf16 runs measure their noise in their own dtype.

Modules whose gradient is such a sum, and their M:
    nn.Linear      weight |dY|^T |X| over the rows, bias sum |dY|
    nn.Embedding   weight: |dY| summed into the rows of the tokens that used them
    RMS norms      a leaf module whose only parameter is a 1-D `weight` (Llama's, Gemma's 1 + w,
                   Qwen3's per-head q/k norms): sum |dY| |x_hat|, |x_hat| being the module's
                   derivative in w on |x| (an RMS norm of |x| is |x_hat|)
    nn.LayerNorm   weight sum |dY| |x_hat|, bias sum |dY|
Other parameters (MoE experts' stacked matrices, a router's bare weight) get no floor: their
measured samples stand alone. A tied weight sums both uses (M and K)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def _kind(m: nn.Module) -> str | None:
    """Which sum a module's gradient is (the table above), or None: a Linear, Embedding or
    LayerNorm subclass with a forward of its own (OPT's learned positions, called with the
    attention mask) is not the sum these formulas write."""
    for base, kind in ((nn.Linear, "linear"), (nn.Embedding, "embedding"),
                       (nn.LayerNorm, "layernorm")):
        if isinstance(m, base):
            return kind if type(m).forward is base.forward else None
    own = dict(m.named_parameters(recurse=False))
    rms = (not any(True for _ in m.children()) and list(own) == ["weight"]
           and own["weight"].dim() == 1)
    return "rms" if rms else None


class Spread:
    """`with Spread(model) as s: loss.backward()` (the forward inside too); then
    `s.floors(u)` -> {parameter name: sqrt(K) u max M}. Hooks are removed on exit."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.names = {id(p): n for n, p in model.named_parameters()}   # (tied: the first name)
        self.mag: dict[int, torch.Tensor] = {}   # id(parameter) -> M
        self.terms: dict[int, int] = {}          # id(parameter) -> K
        self.handles = []

    def __enter__(self):
        for m in self.model.modules():
            kind = _kind(m)
            if kind is not None:
                self.handles.append(m.register_forward_hook(
                    lambda m, inputs, out, kind=kind: self._forward(kind, m, inputs, out)))
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        self.handles = []

    def _add(self, p, mag: torch.Tensor, rows: int):
        if p is None or not p.requires_grad:
            return
        k = id(p)
        self.mag[k] = mag if k not in self.mag else self.mag[k] + mag
        self.terms[k] = self.terms.get(k, 0) + rows

    def _forward(self, kind, m, inputs, out):
        if not torch.is_grad_enabled() or not isinstance(out, torch.Tensor) or not out.requires_grad:
            return
        if not any(p.requires_grad for p in m.parameters(recurse=False)):
            return   # (a frozen module, LoRA's base: no gradient to floor)
        if not inputs or not isinstance(inputs[0], torch.Tensor):
            return   # (called with keywords: no floor rather than a guess)
        x = inputs[0].detach()
        if kind == "embedding" and x.is_floating_point():
            return
        if kind == "layernorm":
            x = F.layer_norm(x, m.normalized_shape, eps=m.eps).abs()   # |x_hat|
        elif kind == "rms":
            x = self._coefficient(m, x.abs())   # |x_hat|, shaped as out
            if x.shape != out.shape:
                return
        out.register_hook(lambda dy: self._backward(kind, m, x, dy.detach()))

    @staticmethod
    @torch.no_grad()
    def _coefficient(m, ax):
        """d out_j / d w_j of a norm whose output is linear in its weight (w x_hat, Gemma's
        (1 + w) x_hat), on |x|: its forward at w + 1 less its forward at w. (m.forward, not
        m(...): no hook runs twice; no backward inside the backward, which deadlocks.)"""
        w = m.weight.data
        y0 = m.forward(ax)
        m.weight.data = w + 1
        try:
            y1 = m.forward(ax)
        finally:
            m.weight.data = w
        return y1 - y0

    @torch.no_grad()
    def _backward(self, kind, m, x, dy):
        if dy.shape[:-1] != x.shape[:(x.dim() if kind == "embedding" else -1)]:
            return   # (not one row of x per row of dY: not the sum these formulas write)
        rows = dy.numel() // dy.shape[-1]
        ady = dy.abs().reshape(rows, dy.shape[-1])                  # (K, out)
        if kind == "linear":
            ax = x.abs().reshape(rows, x.shape[-1]).to(ady.dtype)  # (K, in)
            self._add(m.weight, ady.T @ ax, rows)                  # (out, in)
            self._add(m.bias, ady.sum(0), rows)
        elif kind == "embedding":
            mag = torch.zeros_like(m.weight, dtype=ady.dtype)      # (V, H)
            self._add(m.weight, mag.index_add_(0, x.reshape(-1), ady), rows)
        else:   # a norm: x is |x_hat| already (the forward hook)
            self._add(m.weight, (ady * x.reshape(rows, -1).to(ady.dtype)).sum(0), rows)
            self._add(getattr(m, "bias", None), ady.sum(0), rows)

    def floors(self, u: float) -> dict[str, float]:
        """{name: sqrt(K) u max_ij M_ij}, absolute, for every parameter a hook saw."""
        return {self.names[k]: math.sqrt(self.terms[k]) * u * float(mag.max())
                for k, mag in self.mag.items() if k in self.names and mag.numel()}
