"""timing.py: Timing: timed steps with ranks aligned, forward and step times (max over ranks);
spans recorded from outside an algorithm: per-action timelines inside a step (`ActionTimeline`)
and the time inside a wrapped function (`CallTimer`). Every timestamp is a `meter.mark`: a CUDA
event on GPU (read after the step's one synchronisation), the clock on CPU."""
from __future__ import annotations

import contextlib
import functools

import torch

from .meter import mark, phase, seconds_between
from .run import Run


def sync(env):
    if env.device.type == "cuda":
        torch.cuda.synchronize()


def timed_steps(run: Run, strat, timed=contextlib.nullcontext,
                 before_each=lambda: None) -> tuple[float, float]:
    """--warmup steps, then --bench-iters timed ones inside `timed()` (e.g. the comm meter):
    medians of (step, forward) seconds on this rank. On CUDA, steps and phases are timed by CUDA
    events with one synchronisation after each step (none inside it); on CPU by the clock."""
    args, env = run.args, run.env
    cuda = env.device.type == "cuda"
    for s in range(args.warmup):
        strat.step(run.batch(s))
    times, fwd = [], []
    phase.use_events(cuda)
    try:
        with timed():
            for i in range(args.bench_iters):
                batch = run.batch(args.warmup + i)
                before_each()
                sync(env)
                phase.reset()
                start = mark(cuda)
                strat.step(batch)
                end = mark(cuda)
                sync(env)
                times.append(seconds_between(start, end))
                fwd.append(phase.collect().get("forward", float("nan")))
    finally:
        phase.use_events(False)
    return sorted(times)[len(times) // 2], sorted(fwd)[len(fwd) // 2]


class ActionTimeline:
    """Spans of the actions inside a step, recorded from outside the algorithm.

    Wrap the functions that do an action's work with `timed(fn, key)` and run each step inside
    `with timeline.step():`. Every call of a wrapped function inside the step appends
    (*key(*args), start, end), in seconds since the step began; `steps` keeps the last `keep`
    steps. Only the time inside the wrapped calls counts as busy: whatever the algorithm does
    between them (waiting for a peer's data) shows as idle, which is how pp.py measures its
    pipeline bubble without a clock in its schedule loop."""

    def __init__(self, keep: int = 2, cuda: bool = False):
        self.keep, self.cuda, self._steps = keep, cuda, []
        self._t0, self._current = mark(cuda), []

    @contextlib.contextmanager
    def step(self):
        self._t0, self._current = mark(self.cuda), []
        yield
        self._steps = (self._steps + [(self._t0, self._current)])[-self.keep:]

    def timed(self, fn, key):
        """fn, recording each call's span under key(*args, **kwargs) (a tuple)."""
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            start = mark(self.cuda)
            out = fn(*args, **kwargs)
            self._current.append((*key(*args, **kwargs), start, mark(self.cuda)))
            return out
        return wrapper

    @property
    def steps(self) -> list[list[tuple]]:
        """The kept steps' actions as (*key, start, end) in seconds since their step began."""
        if self.cuda:
            torch.cuda.synchronize()
        return [[(*a[:-2], seconds_between(t0, a[-2]), seconds_between(t0, a[-1]))
                 for a in actions] for t0, actions in self._steps]


class CallTimer:
    """Time spent inside the calls of wrapped functions, and a work count (e.g. FLOPs) per call,
    recorded from outside the algorithm (cp_ring's block kernel). Each call keeps a pair of
    marks (CUDA events on GPU), read when `total()` is called after the step, so nothing inside
    the step waits for the device."""

    def __init__(self, cuda: bool):
        self.cuda, self.seconds, self.work, self._spans = cuda, 0.0, 0, []

    def wrap(self, fn, work=None):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if work is not None:
                self.work += work(*args, **kwargs)
            start = mark(self.cuda)
            out = fn(*args, **kwargs)
            self._spans.append((start, mark(self.cuda)))
            return out
        return wrapper

    def total(self) -> tuple[float, float]:
        """(seconds, work) since the last reset."""
        if self._spans:
            if self.cuda:
                torch.cuda.synchronize()
            self.seconds += sum(seconds_between(s, e) for s, e in self._spans)
            self._spans = []
        return self.seconds, self.work

    def reset(self):
        self.seconds, self.work, self._spans = 0.0, 0, []
