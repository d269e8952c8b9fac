"""timing.py: Timing: timed steps with ranks aligned, forward and step times (max over ranks);
per-action timelines inside a step (`ActionTimeline`)."""
from __future__ import annotations

import contextlib
import functools
import time

import torch

from .meter import phase
from .run import Run


def sync(env):
    if env.device.type == "cuda":
        torch.cuda.synchronize()


def timed_steps(run: Run, strat, timed=contextlib.nullcontext,
                 before_each=lambda: None) -> tuple[float, float]:
    """--warmup steps, then --bench-iters timed ones inside `timed()` (e.g. the comm meter):
    medians of (step, forward) seconds on this rank. CUDA work is synchronised around each step
    and phase, so the times are real."""
    args, env = run.args, run.env
    phase.sync = (lambda: torch.cuda.synchronize()) if env.device.type == "cuda" else None
    for s in range(args.warmup):
        strat.step(run.batch(s))
    times, fwd = [], []
    with timed():
        for i in range(args.bench_iters):
            batch = run.batch(args.warmup + i)
            before_each()
            sync(env)
            phase.reset()
            t0 = time.perf_counter()
            strat.step(batch)
            sync(env)
            times.append(time.perf_counter() - t0)
            fwd.append(phase.elapsed.get("forward", float("nan")))
    phase.sync = None
    return sorted(times)[len(times) // 2], sorted(fwd)[len(fwd) // 2]


class ActionTimeline:
    """Wall-clock spans of the actions inside a step, recorded from outside the algorithm.

    Wrap the functions that do an action's work with `timed(fn, key)` and run each step inside
    `with timeline.step():`. Every call of a wrapped function inside the step appends
    (*key(*args), start, end), in seconds since the step began; `steps` keeps the last `keep`
    steps. Only the time inside the wrapped calls counts as busy: whatever the algorithm does
    between them (waiting for a peer's data) shows as idle, which is how pp.py measures its
    pipeline bubble without a clock in its schedule loop."""

    def __init__(self, keep: int = 2):
        self.keep, self.steps = keep, []
        self._t0, self._current = time.perf_counter(), []

    @contextlib.contextmanager
    def step(self):
        self._t0, self._current = time.perf_counter(), []
        yield
        self.steps = (self.steps + [self._current])[-self.keep:]

    def timed(self, fn, key):
        """fn, recording each call's span under key(*args, **kwargs) (a tuple)."""
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            start = time.perf_counter() - self._t0
            out = fn(*args, **kwargs)
            self._current.append((*key(*args, **kwargs), start, time.perf_counter() - self._t0))
            return out
        return wrapper
