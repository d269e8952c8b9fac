"""hostsync.py: the host synchronisations inside a training step, counted by call site.

On a GPU the host queues kernels ahead of the device; a host read of a device value (`.item()`,
`int(t)`, `.tolist()`) or a tensor built from host data inside the step (`torch.tensor([...],
device=...)`, a pageable host-to-device copy) makes the host wait until the stream has drained,
which undoes every overlap a strategy builds. gloo on CPU hides the cost, so the step is watched
for them directly, by two detectors:

    dispatch   a TorchDispatchMode over every aten op of the step: `_local_scalar_dense` (a
               device value read on the host: .item(), int(t), bool(t)) and `lift_fresh` (a
               tensor made from host data). Runs on any device, so the CPU tests see much of
               what a GPU would pay for; not `.tolist()`, `.cpu()` or ops whose output shape
               depends on values (nonzero, boolean masks), which only the cuda detector sees.
    cuda       on CUDA, torch's own `torch.cuda.set_sync_debug_mode("warn")`: the synchronising
               CUDA calls it knows of (by its own warning, not yet all of them): device-to-host
               copies, `.tolist()`, `nonzero`, boolean-mask indexing, pageable host-to-device
               copies; each warning recorded where it was raised.

A site is the innermost frame in this repository (and, when it differs, the innermost frame
outside torch, e.g. a transformers model's forward). Allowed sites, each with its reason:
ALLOWED. Everything else is a host synchronisation the step should not make.

    with HostSyncs(device).watching(StrategyClass) as hs:   # counts inside StrategyClass.step
        ...
    hs.report()   # {"steps", "sites": {site: {"count", "kind", "allowed"}}, "unexpected", ...}
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import traceback
import warnings

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOST_READ = {"aten::_local_scalar_dense"}
HOST_TENSOR = {"aten::lift_fresh", "aten::lift_fresh_copy"}
ALLOWED = {   # (file relative to the repository, function): why the step must read the host there
    ("harness/loss.py", "scalar"): "the step's logged loss (one read per step)",
    ("compose4d.py", "loss_flag_norm"): "compose4d's one read per step: its loss, the "
                                        "preemption flag and the gradient norm together",
    ("harness/routing.py", "experts_forward"): "the harness's routing statistics around the "
                                               "experts (instrumentation, a host list kept on "
                                               "the host)",
    ("ep_moe.py", "dispatch_combine"): "all_to_all_single takes its split sizes as host ints "
                                       "(one read per MoE layer and forward)",
}
ALLOWED_LIBRARY = {   # (file under site-packages, function): a library's own read, the reason
    ("transformers/masking_utils.py", "find_packed_sequence_indices"):
        "transformers' causal-mask preparation asks whether the position ids pack several "
        "sequences (one read per forward of an HF model without a KV cache or attention mask)",
}
_THIS = os.path.abspath(__file__)
# the repository's torch function / dispatch modes (models.Float64Kept) pass every call on: the
# site is the code that made the call, not the mode's frame
PASS_THROUGH = {("harness/models.py", "__torch_function__")}   # (models.Float64Kept)


def _site(stack) -> tuple[str, str]:
    """(site text, why it is allowed or "") for a stack (outermost first)."""
    repo = [f for f in stack if f.filename.startswith(ROOT + os.sep) and "-packages/" not in
            f.filename and os.path.abspath(f.filename) != _THIS   # (not a venv inside it)
            and (os.path.relpath(f.filename, ROOT), f.name) not in PASS_THROUGH]
    if not repo:
        f = stack[-1]
        return f"(outside the repository) {os.path.basename(f.filename)}:{f.lineno} {f.name}", ""
    r = repo[-1]
    rel = os.path.relpath(r.filename, ROOT)
    text = f"{rel}:{r.lineno} {r.name}"
    # the innermost library frame below the repository's (HF's forward), not torch's own nor
    # Python's (warnings.py): the site is then that library's, and so is the allowance
    inner = [f for f in stack[stack.index(r) + 1:] if "site-packages/" in f.filename
             and not f.filename.split("site-packages/")[-1].startswith("torch/")]
    if inner:
        path = inner[-1].filename.split("site-packages/")[-1]
        return (f"{text} > {path}:{inner[-1].lineno} {inner[-1].name}",
                ALLOWED_LIBRARY.get((path, inner[-1].name), ""))
    return text, ALLOWED.get((rel, r.name), "")


class _Dispatch(TorchDispatchMode):
    def __init__(self, record, device):
        super().__init__()
        self.record, self.device = record, device

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        out = func(*args, **(kwargs or {}))
        if name in HOST_READ:
            self.record("host read", name)
        elif name in HOST_TENSOR and out.device.type == self.device.type:
            self.record("host tensor", name)     # (a host tensor that stays on a GPU run's host: none)
        return out


class HostSyncs:
    """Counts host synchronisations inside a region (module docstring)."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.sites: dict = {}
        self.steps = 0
        self._lock = threading.Lock()
        self._depth = 0

    def record(self, kind: str, what: str, stack=None):
        stack = stack if stack is not None else traceback.extract_stack()[:-2]
        text, why = _site(stack)
        detector = "cuda" if kind == "cuda sync" else "dispatch"
        text = f"{detector}: {text}"   # (on a GPU both detectors see most syncs: kept apart)
        with self._lock:
            s = self.sites.setdefault(text, dict(count=0, kind=kind, op=what, allowed=bool(why),
                                                 why=why))
            s["count"] += 1

    @contextlib.contextmanager
    def region(self):
        """Watch everything run inside: one step."""
        if self._depth:          # a step calling another step (a subclass's super().step)
            yield
            return
        self._depth += 1
        cuda = self.device.type == "cuda"
        old_show = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if "called a synchronizing" in str(message):
                self.record("cuda sync", str(message).splitlines()[0][:80],
                            traceback.extract_stack()[:-1])
            else:
                old_show(message, category, filename, lineno, file, line)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = show
                if cuda:
                    before = torch.cuda.get_sync_debug_mode()
                    torch.cuda.set_sync_debug_mode("warn")
                try:
                    with _Dispatch(self.record, self.device):
                        yield
                finally:
                    if cuda:
                        torch.cuda.set_sync_debug_mode(before)   # (a user's "error" kept)
        finally:
            warnings.showwarning = old_show
            self._depth -= 1
            self.steps += 1

    @contextlib.contextmanager
    def watching(self, owner, name: str = "step"):
        """Count inside every call of `owner.name` while the block runs (owner: a Strategy
        class, whose `step` it is by default, or a module with a step function, such as
        trainer4d.train and its `step_rows`)."""
        owners = [owner]
        if isinstance(owner, type):   # and the module's other strategies: SP's constructor
            from .strategy import Reference, Strategy   # returns a MegatronSP or an Ulysses
            owners += [c for c in vars(sys.modules[owner.__module__]).values()
                       if isinstance(c, type) and issubclass(c, Strategy) and c is not owner
                       and not issubclass(c, Reference) and c.__module__ == owner.__module__]
        saved = []
        for o in owners:
            fn = getattr(o, name)

            def watched(*a, _fn=fn, **k):
                with self.region():
                    return _fn(*a, **k)
            saved.append((o, o.__dict__.get(name)))
            setattr(o, name, watched)
        try:
            yield self
        finally:
            for o, original in reversed(saved):
                if original is None:
                    delattr(o, name)
                else:
                    setattr(o, name, original)

    def report(self) -> dict:
        """Counts per detector; `unexpected` is the larger detector's count of syncs outside
        ALLOWED (the two see the same events where both see them)."""
        n = max(self.steps, 1)

        def count(detector, allowed):
            return sum(v["count"] for k, v in self.sites.items()
                       if k.startswith(detector) and v["allowed"] == allowed)
        bad = max(count("dispatch", False), count("cuda", False))
        ok = max(count("dispatch", True), count("cuda", True))
        return dict(steps=self.steps, sites=self.sites, unexpected=bad,
                    unexpected_per_step=bad / n, allowed_per_step=ok / n,
                    by_detector={d: dict(unexpected=count(d, False), allowed=count(d, True))
                                 for d in ("dispatch", "cuda")})


def host_sync_check(watch: HostSyncs) -> tuple[str, bool, str]:
    """The correctness mode's check row (--host-syncs): no host sync outside ALLOWED in any
    watched step, on any rank (collective: every rank's sites are gathered)."""
    import torch.distributed as dist
    r = watch.report()
    mine = {k: v["count"] for k, v in r["sites"].items() if not v["allowed"]}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    bad: dict = {}
    for d in every:
        for k, n in d.items():
            bad[k] = max(bad.get(k, 0), n)
    allowed = sorted({k for k, v in r["sites"].items() if v["allowed"]})
    detail = (f"{r['steps']} steps watched; " + (
        f"{sum(bad.values())} outside ALLOWED: " + "; ".join(
            f"{k} x{n}" for k, n in sorted(bad.items(), key=lambda x: -x[1])[:4])
        if bad else "none outside ALLOWED") + (f"; allowed: {', '.join(allowed)}" if allowed else ""))
    return "no host sync inside the step", not bad, detail
