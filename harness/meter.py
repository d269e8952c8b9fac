"""meter.py: phases and the communication meter.

Strategy code marks its forward and backward with `with phase("forward"):` so the benchmark
can time them and the memory tracker can tell activations from the rest.

Communication is counted by wrapping the `torch.distributed` functions while a step runs, so
strategy code calls plain `dist.all_reduce(...)`. Bytes are the logical buffer per call: the
tensor for all_reduce/broadcast/send/recv, the *full* (gathered) tensor for all_gather and
reduce_scatter, the send buffer for all_to_all. Per-rank wire traffic for a ring algorithm is
derived from that: all_reduce 2(W-1)/W, all_gather and reduce_scatter (W-1)/W, all_to_all (W-1)/W,
W the size of the call's group (`METER.sizes`; the world's where none was named).
Loss logging (one scalar all_reduce) runs under `meter.paused()` and is not counted.
"""
from __future__ import annotations

import contextlib
import inspect
import os
import sys
import time
import warnings
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

# torch 2.13 renames all_gather_into_tensor/reduce_scatter_tensor to *_single; 2.11 lacks the new
# names, so strategies keep the old ones (both are metered) and the warning is noise.
warnings.filterwarnings("ignore", message=r".*(all_gather_into_tensor|reduce_scatter_tensor).*deprecated")



def mark(cuda: bool):
    """A timestamp: a CUDA event recorded on the current stream (no host synchronisation), or
    the clock. Two marks of one kind give seconds through `seconds_between`."""
    if cuda:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev
    return time.perf_counter()


def seconds_between(a, b) -> float:
    """Seconds from mark a to mark b (CUDA marks: once the device has passed b)."""
    return a.elapsed_time(b) / 1e3 if isinstance(a, torch.cuda.Event) else b - a


def quantile(xs: list, q: float) -> float:
    """The q-quantile of sorted xs, linearly interpolated (of timed steps: the benchmark's paired
    ratios, harness.recompute's extra time)."""
    if len(xs) == 1:
        return xs[0]
    at = q * (len(xs) - 1)
    i = min(int(at), len(xs) - 2)
    return xs[i] + (xs[i + 1] - xs[i]) * (at - i)


class Phases:
    """Named spans of a step (`with phase("forward"):`), summed per name into `elapsed` seconds.

    On CPU a span is wall-clock time. On CUDA (`use_events(True)`, set by the benchmark) a span
    is a pair of CUDA events recorded on the current stream: no host synchronisation inside the
    step, so what is measured is not distorted by measuring it. `collect()`, called after the
    step's one synchronisation, turns the recorded pairs into seconds."""

    def __init__(self):
        self.stack: list[str] = []
        self.elapsed: dict[str, float] = {}
        self._events = None  # list of (name, start, end) CUDA events while use_events(True)

    def use_events(self, on: bool):
        self._events = [] if on else None

    @contextlib.contextmanager
    def __call__(self, name: str):
        cuda = self._events is not None
        start = mark(cuda)
        self.stack.append(name)
        try:
            yield
        finally:
            self.stack.pop()
            if cuda:
                self._events.append((name, start, mark(True)))
            else:
                self.elapsed[name] = self.elapsed.get(name, 0.0) + seconds_between(
                    start, mark(False))

    def collect(self) -> dict[str, float]:
        """The recorded CUDA spans into `elapsed` (call after the device is synchronised)."""
        for name, start, end in self._events or []:
            self.elapsed[name] = self.elapsed.get(name, 0.0) + seconds_between(start, end)
        if self._events is not None:
            self._events = []
        return self.elapsed

    @property
    def current(self) -> str | None:
        return self.stack[-1] if self.stack else None

    def reset(self):
        self.elapsed = {}
        if self._events is not None:
            self._events = []


phase = Phases()


# Communication meter: wraps torch.distributed functions while active. Strategies name their
# groups with `name_group(group, "dp")` so reports say which group carried the bytes.
_GROUP_NAMES = weakref.WeakKeyDictionary()   # a name must not keep a destroyed group alive


def name_group(group, name: str):
    if isinstance(group, dist.ProcessGroup):   # not None / NON_GROUP_MEMBER (not a member)
        _GROUP_NAMES[group] = name
    return group


def group_name(group) -> str:
    if group is None or group is dist.group.WORLD:
        return "world"
    return _GROUP_NAMES.get(group, f"group{id(group) % 10000}")


def _nbytes(t) -> int:
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return t.numel() * t.element_size()


# op -> the argument whose size is "the bytes" (names as in torch.distributed's signatures)
_METERED = {
    "all_reduce": "tensor", "broadcast": "tensor", "reduce": "tensor",
    "all_gather_into_tensor": "output_tensor",   # the full (gathered) tensor
    "all_gather_single": "output_tensor",        # torch >= 2.13 name of the same
    "reduce_scatter_tensor": "input",            # the full (unreduced) tensor
    "reduce_scatter_single": "input",
    "all_gather": "tensor_list", "reduce_scatter": "input_list",
    "all_to_all_single": "input",                # the send buffer
    "send": "tensor", "recv": "tensor", "isend": "tensor", "irecv": "tensor",
    "batch_isend_irecv": "p2p_op_list",
}


RING_FACTOR = {  # per-rank wire bytes / logical bytes, for ring algorithms on W ranks
    "all_reduce": lambda w: 2 * (w - 1) / w, "all_gather_into_tensor": lambda w: (w - 1) / w,
    "reduce_scatter_tensor": lambda w: (w - 1) / w, "all_gather": lambda w: (w - 1) / w,
    "all_gather_single": lambda w: (w - 1) / w, "reduce_scatter_single": lambda w: (w - 1) / w,
    "reduce_scatter": lambda w: (w - 1) / w, "all_to_all_single": lambda w: (w - 1) / w,
    "broadcast": lambda w: (w - 1) / w, "reduce": lambda w: (w - 1) / w,
}


_HARNESS = (os.path.abspath(__file__),
            os.path.join(os.path.dirname(os.path.abspath(__file__)), "nccl.py"))
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))


def call_site() -> str:
    """file:line of the first caller outside torch and the harness's wrappers (meter, nccl)."""
    f = sys._getframe(1)
    while f is not None and (f.f_code.co_filename.startswith(_TORCH)
                             or os.path.abspath(f.f_code.co_filename) in _HARNESS):
        f = f.f_back
    return f"{os.path.basename(f.f_code.co_filename)}:{f.f_lineno}" if f else "?"


def patch_dist(names, wrap) -> dict:
    """Replace each torch.distributed function in `names` by wrap(name, fn), in torch.distributed
    and in distributed_c10d's globals (where P2POp checks that its op is isend/irecv and where
    one collective calls another). Returns what restore_dist() puts back."""
    c10d, saved = dist.distributed_c10d, {}
    for name in names:
        fn = getattr(dist, name, None)
        if fn is None:  # e.g. all_gather_single before torch 2.13
            continue
        wrapped = wrap(name, fn)
        for mod in (dist, c10d):
            if getattr(mod, name, None) is fn:
                saved[(mod, name)] = fn
                setattr(mod, name, wrapped)
    return saved


def restore_dist(saved: dict):
    for (mod, name), fn in saved.items():
        setattr(mod, name, fn)


class CommMeter:
    def __init__(self):
        self.counts: dict[tuple[str, str], list[int]] = {}
        self._depth = 0       # only the outermost call counts (batch_isend_irecv -> isend)
        self._paused = 0
        self._saved: dict = {}
        self.device = None    # the run's device (set by launch): collectives' tensors live there
        self.sizes: dict[str, int] = {}   # group name -> ranks (subgroups seen while measuring)

    def _wrap(self, name, fn):
        sig = inspect.signature(fn)

        def wrapper(*args, **kwargs):
            bound = sig.bind(*args, **kwargs).arguments if self._depth == 0 else None
            if bound is not None:
                self.check_device(name, bound)
            if bound is not None and not self._paused:
                if name == "batch_isend_irecv":
                    for op in bound["p2p_op_list"]:
                        opn = getattr(op.op, "__name__", "p2p").lstrip("_")
                        self._add(opn, group_name(op.group), _nbytes(op.tensor))
                else:
                    group = bound.get("group")
                    self._add(name, group_name(group), _nbytes(bound[_METERED[name]]))
                    if group is not None:   # the wire factor takes the group's size
                        self.sizes[group_name(group)] = dist.get_world_size(group)
            self._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1
        wrapper.__name__ = name
        wrapper.__wrapped__ = fn
        return wrapper

    def check_device(self, name, bound):
        """NCCL takes tensors on the run's device only: a CPU tensor handed to a collective in a
        CUDA run fails here, on CPU too when `device` says so (tests), with the call's site."""
        if self.device is None:
            return
        tensors = []
        for v in bound.values():   # every tensor argument (input and output buffers)
            for x in (v if isinstance(v, (list, tuple)) else [v]):
                x = getattr(x, "tensor", x)   # a P2POp
                if isinstance(x, torch.Tensor):
                    tensors.append(x)
        want = self.device if self.device.type == "cuda" and self.device.index is not None \
            else None
        bad = next((t for t in tensors if t.device.type != self.device.type
                    or (want is not None and t.device != want)), None)
        if bad is not None:
            raise RuntimeError(f"{name} at {call_site()} got a tensor on {bad.device} in a run on "
                               f"{self.device}: NCCL takes tensors on the run's device only")

    def _add(self, op, group, nbytes):
        c = self.counts.setdefault((op, group), [0, 0])
        c[0] += 1
        c[1] += nbytes

    @contextlib.contextmanager
    def measuring(self):
        """Count every metered call in the block (cumulative until reset()). The wrappers go
        into torch.distributed and into distributed_c10d's globals, where P2POp checks that its
        op is isend/irecv and where one collective calls another (the depth guard then keeps
        the inner call from being counted twice)."""
        assert not self._saved, "meter already active"
        self._saved = patch_dist(_METERED, self._wrap)
        try:
            yield self
        finally:
            restore_dist(self._saved)
            self._saved = {}

    @contextlib.contextmanager
    def paused(self):
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def reset(self):
        self.counts = {}

    @property
    def active(self) -> bool:
        """True while measuring() and not paused (strategies may track data-dependent
        expectations over exactly the metered steps)."""
        return bool(self._saved) and not self._paused

    def snapshot(self, per: int = 1) -> dict[tuple[str, str], tuple[float, float]]:
        return {k: (c / per, b / per) for k, (c, b) in sorted(self.counts.items())}


METER = CommMeter()


@dataclass
class Expect:
    """One row of the textbook communication per optimizer step. ranks="rank 0" compares with
    rank 0's measured traffic; ranks="sum" with the sum over all ranks (for data-dependent
    traffic such as MoE all-to-all, whose per-rank share depends on the routing)."""
    op: str
    group: str
    calls: float
    bytes: float
    formula: str
    ranks: str = "rank 0"
