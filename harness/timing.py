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
                if cuda:
                    start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                    start.record()
                t0 = time.perf_counter()
                strat.step(batch)
                if cuda:
                    end.record()
                sync(env)
                times.append(start.elapsed_time(end) / 1e3 if cuda
                             else time.perf_counter() - t0)
                fwd.append(phase.collect().get("forward", float("nan")))
    finally:
        phase.use_events(False)
    return sorted(times)[len(times) // 2], sorted(fwd)[len(fwd) // 2]


class ActionTimeline:
    """Wall-clock spans of the actions inside a step, recorded from outside the algorithm.

    Wrap the functions that do an action's work with `timed(fn, key)` and run each step inside
    `with timeline.step():`. Every call of a wrapped function inside the step appends
    (*key(*args), start, end), in seconds since the step began; `steps` keeps the last `keep`
    steps. Only the time inside the wrapped calls counts as busy: whatever the algorithm does
    between them (waiting for a peer's data) shows as idle, which is how pp.py measures its
    pipeline bubble without a clock in its schedule loop."""

    def __init__(self, keep: int = 2, cuda: bool = False):
        self.keep, self.cuda, self._steps = keep, cuda, []
        self._t0, self._current = self._now(), []

    def _now(self):
        """A timestamp: a recorded CUDA event (no synchronisation), or the clock."""
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    @contextlib.contextmanager
    def step(self):
        self._t0, self._current = self._now(), []
        yield
        self._steps = (self._steps + [(self._t0, self._current)])[-self.keep:]

    def timed(self, fn, key):
        """fn, recording each call's span under key(*args, **kwargs) (a tuple)."""
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            start = self._now()
            out = fn(*args, **kwargs)
            self._current.append((*key(*args, **kwargs), start, self._now()))
            return out
        return wrapper

    @property
    def steps(self) -> list[list[tuple]]:
        """The kept steps' actions as (*key, start, end) in seconds since their step began."""
        if self.cuda:
            torch.cuda.synchronize()
            since = lambda t0, ev: t0.elapsed_time(ev) / 1e3  # noqa: E731
        else:
            since = lambda t0, t: t - t0  # noqa: E731
        return [[(*a[:-2], since(t0, a[-2]), since(t0, a[-1])) for a in actions]
                for t0, actions in self._steps]


class CallTimer:
    """Time spent inside the calls of wrapped functions, and a work count (e.g. FLOPs) per call,
    recorded from outside the algorithm (cp_ring's block kernel). On CUDA each call records a
    pair of CUDA events, read when `total()` is called (after the step), so nothing inside the
    step waits for the device; on CPU the clock."""

    def __init__(self, cuda: bool):
        self.cuda, self.seconds, self.work, self._events = cuda, 0.0, 0, []

    def wrap(self, fn, work=None):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if work is not None:
                self.work += work(*args, **kwargs)
            if self.cuda:
                start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                start.record()
                out = fn(*args, **kwargs)
                end.record()
                self._events.append((start, end))
                return out
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            self.seconds += time.perf_counter() - t0
            return out
        return wrapper

    def total(self) -> tuple[float, float]:
        """(seconds, work) since the last reset."""
        if self._events:
            torch.cuda.synchronize()
            self.seconds += sum(s.elapsed_time(e) for s, e in self._events) / 1e3
            self._events = []
        return self.seconds, self.work

    def reset(self):
        self.seconds, self.work, self._events = 0.0, 0, []
