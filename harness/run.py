"""run.py: One run of one mode: its arguments, the process group, the model config and the
language; the reference/strategy pair built from one set of weights; small collective helpers."""
from __future__ import annotations

import argparse
import copy
import datetime
import os
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .data import Batch, MarkovLanguage, make_batch, pad_id
from .meter import METER
from .models import build_model, has_weights
from .plants import planted
from .strategy import make_reference


@dataclass
class Env:
    """This process's place in the job: its rank, the world size, its device and backend."""
    rank: int
    world: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


@dataclass
class Run:
    args: argparse.Namespace
    env: Env
    config: object
    lang: MarkovLanguage
    results: dict = field(default_factory=dict)

    def batch(self, step: int) -> Batch:
        return make_batch(self.lang, step, self.args.batch, self.args.length, self.env.device,
                          ignore=self.args.mode in ("correctness", "plants"),
                          pad_id=pad_id(self.config),
                          doc_mask=getattr(self.args, "doc_mask", False))

    def print(self, *a, **k):
        if self.env.is_main:
            print(*a, **k, flush=True)


def perturbed(model, seed: int, copy_first: bool = True) -> torch.nn.Module:
    """The model with every weight nudged (a copy unless copy_first=False): what a rank would
    hold had it initialised on its own."""
    m = copy.deepcopy(model) if copy_first else model
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=g, dtype=torch.float64)
                   .to(p.device, p.dtype))
    return m


def fail_config(msg: str, rank: int):
    """One line from rank 0, exit code 2. Under torchrun the other ranks wait (up to 30 s) so
    the launcher, which SIGTERMs every worker once one has exited, cannot kill rank 0 before it
    has printed: rank 0's exit code 2 is then torchrun's "root cause"."""
    if rank == 0:
        print(f"error: {msg}", file=sys.stderr, flush=True)
    elif "TORCHELASTIC_RUN_ID" in os.environ:
        time.sleep(30)
    sys.exit(2)


def fingerprint(model) -> torch.Tensor:
    """(tensors, 2): each parameter's and floating buffer's sum and L2 norm, reduced in float64
    over chunks of at most 2^24 elements (no float64 copy of a whole embedding on a GPU)."""
    rows = []
    for t in (*model.parameters(), *model.buffers()):
        if t.is_floating_point():
            parts = t.detach().reshape(-1).split(1 << 24)
            rows.append(torch.stack([sum(p.double().sum() for p in parts),
                                     sum(p.double().square().sum() for p in parts).sqrt()]))
    return torch.stack(rows)


def same_build(model, env):
    """Every rank built the same weights, or the run ends here in one line (exit 2 on every
    rank). A seeded random init is reproducible across ranks on the CPU; on a GPU it need not
    be (each device's generator, a kernel's order), and only DDP broadcasts rank 0's weights:
    every other strategy would cut its shards from different models without a word. One
    all-gather of the fingerprints at set-up, none in a step. Two builds that agree to 1e-9 of
    each tensor's norm are one (a float64 sum's order may differ between machines); two random
    inits differ by O(1) of it."""
    if planted("build-per-rank") and env.rank == 1:   # plant: rank 1's init drawn differently
        with torch.no_grad():
            next(model.parameters()).add_(1e-3)
    mine = fingerprint(model)
    every = [torch.empty_like(mine) for _ in range(env.world)]
    with METER.paused():
        dist.all_gather(every, mine)
    differ = [r for r, f in enumerate(every)
              if not bool(((f - every[0]).abs() <= 1e-9 * every[0][:, 1:]).all())]
    if differ:
        dist.destroy_process_group()
        fail_config(f"the model built on rank{'s' if len(differ) > 1 else ''} "
                    f"{', '.join(map(str, differ))} differs from rank 0's (a random init that "
                    f"is not reproducible across devices): load a checkpoint (--model DIR), or "
                    f"build on the CPU and move it", env.rank)


def make_pair(run: Run, cls, perturb: bool, with_ref: bool):
    """(reference on rank 0 or None, strategy) from one reference build, the same on every
    rank (same_build). A rank that keeps no reference hands the build itself to the strategy
    (no second copy of the model)."""
    ref_model = build_model(run.args, run.config, run.env.device)
    if not cls.syncs_initial_params and not has_weights(run.args.model):   # (else: the same)
        same_build(ref_model, run.env)
    if getattr(run.args, "fp8", None):   # (both sides: the reference trains in FP8 too)
        cls.convert_fp8(ref_model, run.args.fp8)
    keep_ref = with_ref and run.env.is_main
    local = copy.deepcopy(ref_model) if keep_ref else ref_model
    if perturb and cls.syncs_initial_params and run.env.rank != 0:
        local = perturbed(local, 1000 + run.env.rank, copy_first=False)
    ref = make_reference(cls, ref_model, run.args, run.env) if keep_ref else None
    del ref_model
    with METER.measuring():  # count the one-time set-up traffic (e.g. the initial broadcast)
        METER.reset()
        strat = cls(local, run.args, run.env)
        setup = METER.snapshot()
    if getattr(run.args, "optimizer", "adamw") != "adamw":   # named in every report line
        strat.name = f"{strat.name}+{run.args.optimizer}"
    if getattr(run.args, "lora", 0):
        strat.name = f"{strat.name}+lora{run.args.lora}"
    # after the strategy installed its layers and attention (cp_ring) into `local`, in place
    mode = getattr(run.args, "recompute", "none")
    if mode != "none":
        # (imported here: `python -m harness.recompute` must not find it imported by the package)
        from .recompute import apply_recompute, recompute_what
        apply_recompute(local, mode)
        run.print(f"recompute {mode}: {recompute_what(local)}")
    METER.reset()
    return ref, strat, setup


def broadcast_verdict(ok: bool) -> bool:
    t = torch.tensor([1 if ok else 0], dtype=torch.int32)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    with METER.paused():
        dist.broadcast(t, 0)
    return bool(t.item())


_WAIT_GROUPS: dict = {}


def rank0_group(timeout: float):
    """A gloo group whose timeout leaves rank 0 an hour to run the references alone while the
    others wait (correctness; the process group's --timeout is for a peer that died mid-step, and
    a dead rank 0 ends the job through torchrun anyway). Made once per process, by every rank
    together, before rank 0 goes off alone."""
    key = max(timeout, 3600.0)
    if key not in _WAIT_GROUPS:
        _WAIT_GROUPS[key] = dist.new_group(backend="gloo",
                                           timeout=datetime.timedelta(seconds=key))
    return _WAIT_GROUPS[key]


def wait_for_rank0(timeout: float):
    """Every rank waits here until rank 0 arrives (on rank0_group)."""
    t = torch.zeros(1, dtype=torch.int64)
    with METER.paused():
        dist.broadcast(t, 0, group=rank0_group(timeout))


def max_over_ranks(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    with METER.paused():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def gather_objects(obj):
    out = [None] * dist.get_world_size()
    with METER.paused():
        dist.all_gather_object(out, obj)
    return out
