"""reduce_probe.py: a data-parallel gradient reduction's own error, observed from outside.

`ReductionProbe(dp)` wraps two methods of a ddp.DataParallel for one synchronising backward
(the benchmark's first warm-up step): `_launch(bucket)`, where a bucket's local gradients are
about to be summed (it keeps an fp64 copy of them), and `finish()`, after which every bucket
holds the reduced gradients. It then sums the fp64 copies itself (one all_reduce, outside the
communication meter) and keeps the reduction's error against that exact sum; the wrappers
remove themselves. DataParallel carries no probe code: its dispatch and reduction run as they
always do, and the metered step sees the same collectives.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .meter import METER


class ReductionProbe:
    def __init__(self, dp):
        self.dp, self.exact, self.error = dp, [], None
        dp._launch, dp.finish = self._observe_launch, self._observe_finish   # shadow the methods

    def _observe_launch(self, b):
        b.settle()                            # the values _launch reduces (it settles them too)
        self.exact.append(b.buffer.double())
        type(self.dp)._launch(self.dp, b)

    def _observe_finish(self):
        done = self.dp.callback_queued        # finish() is idempotent: measure a real one only
        type(self.dp).finish(self.dp)
        if done:
            self._measure()
            del self.dp._launch, self.dp.finish   # one step: the class's methods again

    def _measure(self):
        """max |got - exact| / max |exact| over the buckets, the same beyond the storage
        dtype's own rounding of the exact sum, and the fraction of entries that differ from
        that rounding."""
        dp, exact = self.dp, torch.cat(self.exact)
        with METER.paused():
            dist.all_reduce(exact, group=dp.group)
        if dp.average:
            exact /= dp.world
        got = torch.cat([b.buffer.double() for b in dp.buckets])
        stored = exact.to(dp.buckets[0].buffer.dtype).double()   # the storage's own rounding
        scale = exact.abs().max().clamp_min(torch.finfo(torch.float64).tiny)
        self.error = (((got - exact).abs().max() / scale).item(),
                      ((got - stored).abs().max() / scale).item(),
                      (got != stored).double().mean().item())
        self.exact = []

    def report_lines(self, reduce_dtype_arg: str) -> list[str]:
        """The benchmark's line on the gradient reduction's error (--reduce-dtype's value)."""
        if self.error is None:
            return []
        dt = self.dp.reduce_dtype or self.dp.buckets[0].buffer.dtype
        err, beyond, frac = self.error
        return [f"gradient all-reduce in {str(dt).replace('torch.', '')} (--reduce-dtype "
                f"{reduce_dtype_arg}), first step, against an fp64 sum of the same local "
                f"gradients: error {err:.1e}; beyond the storage's own rounding of that sum "
                f"{beyond:.1e} ({frac:.1%} of the entries differ from it)"]
