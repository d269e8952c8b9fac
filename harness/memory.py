"""memory.py: a live-storage tracker (TorchDispatchMode) that works on CPU and CUDA.
Storages that exist when tracking starts are seeded from the strategy's model states; every
storage created by an op inside the block is added, and removed when Python frees it. Storages
created inside phase("forward") are also counted as activations (saved tensors and forward
temporaries). `steady_peak` is what oom_search.py's trials report; `limit` turns the tracker
into a simulated out-of-memory on CPU."""
from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .meter import phase


def _storage_tensor(t):
    """The tensor that owns the storage: a DTensor's local part (fsdp.py's shards), else t."""
    return getattr(t, "_local_tensor", t)


def unique_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        t = _storage_tensor(t)
        if t is None or t.device.type == "meta":
            continue
        st = t.untyped_storage()
        if st._cdata in seen:   # the StorageImpl (also distinct for FakeTensors, unlike data_ptr)
            continue
        seen.add(st._cdata)
        total += st.nbytes()
    return total


class SimulatedOOM(RuntimeError):
    """The live-tensor tracker went over its --mem-budget-gb limit (CPU: a simulated OOM)."""


class MemoryTracker(TorchDispatchMode):
    def __init__(self, preexisting=(), limit: int | None = None):
        super().__init__()
        self.live: dict[int, tuple[int, bool]] = {}   # id(storage) -> (bytes, is_activation)
        self.cur = self.peak = self.act_cur = self.act_peak = 0
        self.limit = limit
        for t in preexisting:
            self._track(t, False)

    def _track(self, t, is_act):
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        self._track_storage(_storage_tensor(t).untyped_storage(), is_act)

    def _track_storage(self, st, is_act):
        key = id(st)
        if key in self.live or st.nbytes() == 0:
            return
        self.live[key] = (0, is_act)
        self._set(key, st.nbytes())
        weakref.finalize(st, self._free, key)

    def _set(self, key, nbytes):
        old, is_act = self.live[key]
        self.live[key] = (nbytes, is_act)
        self.cur += nbytes - old
        self.peak = max(self.peak, self.cur)
        if self.limit is not None and self.cur > self.limit:
            self.limit = None  # raise once; the step unwinds
            raise SimulatedOOM(f"live tensors {self.cur:,} B exceed the budget")
        if is_act:
            self.act_cur += nbytes - old
            self.act_peak = max(self.act_peak, self.act_cur)

    def _resized(self, st):
        """storage.resize_ (how ZeRO-3/FSDP free and re-gather parameters) is no dispatcher op,
        so the tracker wraps it while active."""
        if id(st) in self.live:
            self._set(id(st), st.nbytes())
        else:
            self._track_storage(st, False)

    def __enter__(self):
        orig = self._orig_resize = torch.UntypedStorage.resize_

        def resize_(st, nbytes):
            out = orig(st, nbytes)
            self._resized(st)
            return out
        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._orig_resize
        return super().__exit__(*exc)

    def _free(self, key):
        nbytes, is_act = self.live.pop(key, (0, False))
        self.cur -= nbytes
        if is_act:
            self.act_cur -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        is_act = "forward" in phase.stack  # phases nest (e.g. attention inside forward)
        for t in tree_flatten(out)[0]:
            self._track(t, is_act)
        return out


def measure_memory(run, strat, limit: int | None = None, step: int = 10_000) -> dict:
    """One more step under the live-storage tracker (CPU) or the CUDA allocator's peak.
    run: the harness Run (its env and batches); limit: raise SimulatedOOM when the tracked bytes
    exceed it (peak mode's CPU budget)."""
    env = run.env
    states = strat.model_states()
    pre = [t for ts in states.values() for t in ts if t is not None]
    batch = run.batch(step)
    if env.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    tracker = MemoryTracker(pre, limit)
    with tracker:
        strat.step(batch)
    states = strat.model_states()
    out = {k: unique_bytes(v) for k, v in states.items()}
    out["model_states"] = unique_bytes(t for v in states.values() for t in v)
    out["activations"] = tracker.act_peak
    if env.device.type == "cuda":
        out["peak"] = torch.cuda.max_memory_allocated()
        out["peak_source"] = "torch.cuda.max_memory_allocated"
    else:
        out["peak"] = tracker.peak
        out["peak_source"] = "live-tensor tracker (CPU)"
    return out


def steady_peak(run, strat, limit: int | None = None) -> dict:
    """The peak of a training step in steady state: the first step creates the optimizer's
    states in its optimizer phase, after the activations are gone; from the second step on they
    are live through the forward and backward as well. So two steps are tracked and the second
    step's breakdown is returned, with the peak of both (the first can be the larger one, e.g.
    while AdamW's states are being created next to the full gradients)."""
    first = measure_memory(run, strat, limit, step=0)
    mem = measure_memory(run, strat, limit, step=1)
    mem["peak"] = max(first["peak"], mem["peak"])
    return mem


OOM_EXIT = 3
