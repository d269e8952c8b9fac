"""The strategies as a user meets them, in a plain training loop, against PyTorch's own
implementation or the unsharded torch optimizer as the oracle. Run under torchrun (gloo, CPU,
float64); every case prints one `PASS name: ...` or `FAIL name: ...` line on rank 0, and the
negative controls (a planted difference the comparison must see) print `PASS control ...` when
the comparison did see it. Exit code 1 when any line is a FAIL.

    torchrun --nproc_per_node=2 tests/library_oracles.py [--only ddp,zero,fsdp]
"""
import argparse
import contextlib
import copy
import json
import os
import re
import sys
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, __file__.rsplit("/tests/", 1)[0])
import ddp  # noqa: E402
import fsdp  # noqa: E402
import zero  # noqa: E402
from harness import teardown  # noqa: E402

V, H, B, S, STEPS = 16, 8, 4, 5, 5
TOL = 1e-12          # float64; the oracles run the same arithmetic, so errors are ~1e-16
CONTROL = 1e-6       # a planted difference must be at least this large
results: list[tuple[bool, str]] = []


class Net(nn.Module):
    """Tied embedding/head, a frozen layer, a BatchNorm (buffers that change every forward),
    and optionally a layer the forward never uses."""

    def __init__(self, unused: bool = True, checkpoint: bool = False):
        super().__init__()
        self.checkpoint = checkpoint   # activation checkpointing of fc2 (True: reentrant)
        self.route = False
        self.emb = nn.Embedding(V, H)
        self.fc1 = nn.Linear(H, H, bias=False)   # a bias before BatchNorm has no gradient
        self.norm = nn.BatchNorm1d(H)
        self.frozen = nn.Linear(H, H)
        self.frozen.requires_grad_(False)
        self.fc2 = nn.Linear(H, H)
        if unused:
            self.unused = nn.Linear(H, H)
        self.head = nn.Linear(H, V, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.linspace(0.5, 1.5, H))

    def forward(self, x):
        h = self.emb(x) * self.scale
        h = torch.tanh(self.norm(self.fc1(h).reshape(-1, H))).reshape(*x.shape, H)
        h = self.frozen(h)
        if self.checkpoint:
            from torch.utils.checkpoint import checkpoint
            h = checkpoint(self.fc2, h, use_reentrant=self.checkpoint != "non-reentrant")
        else:
            h = self.fc2(h)
        if self.route:   # a layer this rank's data uses (data-dependent, as an MoE expert)
            h = h + self.unused(h)
        return self.head(h)


def build(seed, unused=True):
    torch.manual_seed(seed)
    return Net(unused).double()


class TwoDtypes(Net):
    """Net in float64 with one float32 parameter (a per-feature gain on the logits): two
    dtypes, so DataParallel keeps a bucket per dtype, each all-reduced in its own."""

    def __init__(self):
        super().__init__(unused=False)
        self.double()
        self.gain = nn.Parameter(torch.linspace(0.9, 1.1, V, dtype=torch.float32))

    def forward(self, x):
        return super().forward(x) * self.gain.double()


def tokens(rank, step, k=0):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + k)
    return torch.randint(0, V, (B, S), generator=g)


def loss_fn(model, x):
    logits = model(x[:, :-1])
    return F.cross_entropy(logits.reshape(-1, V), x[:, 1:].reshape(-1))


def groups(model, **decay):
    """AdamW-style groups: no weight decay on biases and norms."""
    plain = [p for n, p in model.named_parameters() if p.dim() < 2]
    other = [p for n, p in model.named_parameters() if p.dim() >= 2]
    return [dict(params=other, **decay), dict(params=plain, weight_decay=0.0)]


def state(model, buffers=True) -> list[torch.Tensor]:
    return [t.detach().clone() for t in list(model.parameters())
            + (list(model.buffers()) if buffers else [])]


def rel_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        if x.is_floating_point():
            worst = max(worst, ((x - y).abs().max() / y.abs().max().clamp_min(1e-30)).item())
        elif not torch.equal(x, y):
            return float("inf")
    return worst


def report(name: str, err: float, control: bool = False):
    """One verdict on the worst difference over all ranks."""
    worst = torch.tensor([err], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    err = worst.item()
    ok = err >= CONTROL if control else err <= TOL
    what = "control " if control else ""
    verdict = "PASS" if ok else "FAIL"
    bound = f">= {CONTROL:g}" if control else f"<= {TOL:g}"
    results.append((ok, f"{verdict} {what}{name}: max relative difference {err:.1e} ({bound})"))


def train(model, opt, rank, accum=1, set_to_none=True, no_sync=None, clip=None, steps=STEPS,
          start=0, buffers=True, snap=None, zero=None, last=None):
    """The user's loop; returns the parameters (and buffers) after every step (snap(): how to
    read them, for sharded modules; last(): a context for the step's last backward)."""
    snaps = []
    for step in range(start, start + steps):
        for k in range(accum):
            ctx = no_sync() if no_sync is not None and k < accum - 1 else contextlib.nullcontext()
            if last is not None and k == accum - 1:
                ctx = last()
            with ctx:
                (loss_fn(model, tokens(rank, step, k)) / accum).backward()
        if clip is not None:
            clip()
        opt.step()
        (zero or opt.zero_grad)(set_to_none=set_to_none)
        snaps.append(snap() if snap is not None else
                     state(model.module if hasattr(model, "module") else model, buffers))
    return snaps


# ------------------------------------------------------------------------------------------
# ddp.DataParallel vs torch.nn.parallel.DistributedDataParallel
# ------------------------------------------------------------------------------------------
def check_ddp(rank):
    from torch.nn.parallel import DistributedDataParallel as TorchDDP
    cases = [  # name, optimizer, accumulation, set_to_none, find_unused
        ("adamw, set_to_none, no_sync x2, find_unused", "adamw", 2, True, True),
        ("sgd momentum, zero in place, unused param", "sgd", 1, False, False),
    ]
    for name, kind, accum, to_none, find_unused in cases:
        def make_opt(m):
            if kind == "adamw":
                return torch.optim.AdamW(groups(m, weight_decay=0.1), lr=1e-2)
            return torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        base = build(seed=100 + rank)            # every rank starts from its own weights
        theirs = TorchDDP(copy.deepcopy(base), find_unused_parameters=True)
        ours = ddp.DataParallel(copy.deepcopy(base), bucket_mb=0.0005,
                                find_unused_parameters=find_unused)
        assert len(ours.buckets) > 2, len(ours.buckets)
        want = train(theirs, make_opt(theirs.module), rank, accum, to_none, theirs.no_sync)
        got = train(ours, make_opt(ours.module), rank, accum, to_none, ours.no_sync)
        report(f"ddp {name}: DataParallel vs torch DDP, {STEPS} steps",
               max(rel_diff(g, w) for g, w in zip(got, want)))
        if kind == "sgd":   # reentrant checkpointing: the inner backward must not finish it
            # (summing, as CP and EP use it: a second reduction would double the sum)
            runs = []
            for ckpt in (False, True):
                m = ddp.DataParallel(copy.deepcopy(base), bucket_mb=0.0005, average=False)
                m.module.checkpoint = ckpt
                runs.append(train(m, make_opt(m.module), rank, accum, to_none, m.no_sync))
            report("ddp with reentrant activation checkpointing, summing: DataParallel vs "
                   f"itself without, {STEPS} steps",
                   max(rel_diff(g, w) for g, w in zip(runs[1], runs[0])))
        if kind == "sgd":   # parameters of two dtypes: a bucket per dtype
            torch.manual_seed(200 + rank)
            mixed = TwoDtypes()
            theirs = TorchDDP(copy.deepcopy(mixed))
            ours = ddp.DataParallel(copy.deepcopy(mixed), bucket_mb=0.0005)
            dtypes = {b.buffer.dtype for b in ours.buckets}
            assert dtypes == {torch.float32, torch.float64}, dtypes
            want = train(theirs, make_opt(theirs.module), rank, accum, to_none)
            got = train(ours, make_opt(ours.module), rank, accum, to_none)
            # each tensor's difference in its own dtype's units: the float32 ones within 16
            # float32 epsilons (mapped onto TOL), as the ranks' sums may associate differently
            # per element (W=3: 1 float32 ulp)
            scale = TOL / (16 * torch.finfo(torch.float32).eps)
            err = max(rel_diff([x], [y]) * (scale if x.dtype == torch.float32 else 1.0)
                      for g, w in zip(got, want) for x, y in zip(g, w))
            report(f"ddp float64 and float32 parameters: DataParallel vs torch DDP, {STEPS} "
                   "steps", err)
        if kind == "adamw":   # the comparison sees a missing broadcast and a missing sync
            bad = ddp.DataParallel(copy.deepcopy(base), broadcast=False)
            got = train(bad, make_opt(bad.module), rank, accum, to_none, bad.no_sync)
            report("ddp without the initial broadcast",
                   max(rel_diff(g, w) for g, w in zip(got, want)), control=True)
            local = copy.deepcopy(base)   # rank 0's weights, gradients never synchronised
            ddp.broadcast_coalesced(list(local.parameters()) + list(local.buffers()))
            got = train(local, make_opt(local), rank, accum, to_none)
            report("ddp without the gradient all-reduce",
                   max(rel_diff(g, w) for g, w in zip(got, want)), control=True)


# ------------------------------------------------------------------------------------------
# zero.ZeroOptimizer vs the unsharded torch optimizer on the global batch
# ------------------------------------------------------------------------------------------
OTHER_ELEMENTWISE = (torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.RMSprop,
                     torch.optim.Adagrad)


def reference_run(W, kind, accum, clip, steps=STEPS):
    """One process, the whole global batch: the mean over ranks of each rank's mean loss."""
    model = build(seed=7, unused=False)
    opt = make(kind, model)
    return model, opt, reference_steps(model, opt, W, accum, clip, start=0, steps=steps)


def make(kind, model, **wrap):
    cls, kw = {"adamw": (torch.optim.AdamW, dict(lr=1e-2, betas=(0.9, 0.95))),
               "sgd": (torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
               "adam": (torch.optim.Adam, dict(lr=1e-2))}[kind]
    params = groups(model, weight_decay=0.1) if kind == "adamw" else model.parameters()
    if wrap:
        return zero.ZeroOptimizer(params, cls, **wrap, **kw)
    return cls(params, **kw)


def check_zero(rank, W):
    cases = [  # stage, optimizer, accumulation, clip
        (1, "adamw", 1, None), (2, "adamw", 2, 0.05), (2, "sgd", 2, None), (1, "adam", 1, None)]
    # one bucket at the default size: the last reduction of a micro-batch is still in flight
    # when the next backward reaches the same unit; and the loop zeroes through the model
    for stage in (2, 1):
        ref_model, ref_opt, want = reference_run(W, "sgd", 2, None)
        model = build(seed=7, unused=False)
        opt = make("sgd", model, stage=stage)
        got = train(model, opt, rank, 2, buffers=False, zero=model.zero_grad)
        report(f"zero stage {stage} sgd, accum 2, one bucket, model.zero_grad(): "
               f"ZeroOptimizer vs torch.optim, {STEPS} steps",
               max(rel_diff(g, w) for g, w in zip(got, want)))
    for stage, kind, accum, clip in cases:
        ref_model, ref_opt, want = reference_run(W, kind, accum, clip)
        model = build(seed=7 if rank == 0 else 8 + rank, unused=False)   # broadcast fixes it
        opt = make(kind, model, stage=stage, bucket_mb=0.0005)
        got = train(model, opt, rank, accum, clip=(lambda: opt.clip_grad_norm_(clip))
                    if clip else None, buffers=False)
        name = f"zero stage {stage} {kind}" + (f", accum {accum}" if accum > 1 else "") + \
            (f", clip {clip}" if clip else "")
        report(f"{name}: ZeroOptimizer vs torch.optim on the global batch, {STEPS} steps",
               max(rel_diff(g, w) for g, w in zip(got, want)))
        sd, ref_sd = opt.state_dict(), ref_opt.state_dict()
        err = 0.0 if sd["state"].keys() == ref_sd["state"].keys() else float("inf")
        for i in ref_sd["state"]:
            for k, x in ref_sd["state"][i].items():
                if torch.is_tensor(x):
                    err = max(err, rel_diff([sd["state"][i][k]], [x]))
        same_groups = [{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]]
        ref_groups = [{k: v for k, v in g.items() if k != "params"}
                      for g in ref_sd["param_groups"]]
        report(f"{name}: state_dict() vs the torch optimizer's",
               err if same_groups == ref_groups else float("inf"))
        # resume: a fresh model and ZeroOptimizer load the torch optimizer's state and go on
        fresh = copy.deepcopy(ref_model)
        opt2 = make(kind, fresh, stage=stage, bucket_mb=0.0005)
        opt2.load_state_dict(ref_sd)
        got = train(fresh, opt2, rank, accum, steps=2, start=STEPS, buffers=False,
                    clip=(lambda: opt2.clip_grad_norm_(clip)) if clip else None)
        ref_more = reference_steps(ref_model, ref_opt, W, accum, clip, start=STEPS)
        report(f"{name}: load_state_dict(torch's) then 2 more steps",
               max(rel_diff(g, w) for g, w in zip(got, ref_more)))
    # the other elementwise optimizers, each under an LR schedule (the scheduler drives
    # ZeroOptimizer's param_groups, which step() hands to the inner optimizer)
    for cls in OTHER_ELEMENTWISE:
        def opt_and_sched(model, **wrap):
            opt = (zero.ZeroOptimizer(model.parameters(), cls, **wrap, lr=1e-2) if wrap
                   else cls(model.parameters(), lr=1e-2))
            return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        ref_model = build(seed=7, unused=False)
        ref_opt, ref_sched = opt_and_sched(ref_model)
        want = []
        for step in range(STEPS):
            want += reference_steps(ref_model, ref_opt, W, 1, None, start=step, steps=1)
            ref_sched.step()
        model = build(seed=7, unused=False)
        opt, sched = opt_and_sched(model, stage=2, bucket_mb=0.0005)
        got = []
        for step in range(STEPS):
            got += train(model, opt, rank, steps=1, start=step, buffers=False)
            sched.step()
        report(f"zero stage 2 {cls.__name__.lower()}, StepLR: ZeroOptimizer vs torch.optim, "
               f"{STEPS} steps", max(rel_diff(g, w) for g, w in zip(got, want)))
    # stage 1 reduce-scattering during the last backward (overlapped), small buckets
    ref_model, ref_opt, want = reference_run(W, "adamw", 2, 0.05)
    model = build(seed=7, unused=False)
    opt = make("adamw", model, stage=1, bucket_mb=0.0005)
    got = train(model, opt, rank, 2, clip=lambda: opt.clip_grad_norm_(0.05), buffers=False,
                last=opt.reduce_in_backward)
    report("zero stage 1 adamw, accum 2, clip 0.05, last backward in reduce_in_backward(): "
           f"ZeroOptimizer vs torch.optim, {STEPS} steps",
           max(rel_diff(g, w) for g, w in zip(got, want)))
    with opt.reduce_in_backward():
        loss_fn(model, tokens(rank, 0, 0)).backward()
    try:    # a backward after the reducing one, in the same step: refused
        loss_fn(model, tokens(rank, 0, 1)).backward()
        err = 0.0
    except RuntimeError as e:
        err = float("inf") if "must be the last before step()" in str(e) else 0.0
    report("zero stage 1: a backward after reduce_in_backward's is refused", err, control=True)
    opt.zero_grad()
    # the comparison sees unaveraged gradients
    ref_model, ref_opt, want = reference_run(W, "sgd", 1, None)
    model = build(seed=7, unused=False)
    opt = make("sgd", model, stage=2, average=False)
    got = train(model, opt, rank, buffers=False)
    report("zero stage 2 summing instead of averaging",
           max(rel_diff(g, w) for g, w in zip(got, want)), control=True)


def reference_steps(model, opt, W, accum, clip, start, steps=2):
    """The reference loop from step `start`: every rank's batch in one process; the parameters
    after each step (the buffers are each rank's own statistics)."""
    snaps = []
    for step in range(start, start + steps):
        for k in range(accum):
            (sum(loss_fn(model, tokens(r, step, k)) for r in range(W)) / (W * accum)).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        snaps.append(state(model, buffers=False))
    return snaps


# ------------------------------------------------------------------------------------------
# fsdp.fully_shard + a plain torch optimizer vs FSDP2's fully_shard, and vs one device
# ------------------------------------------------------------------------------------------
@contextlib.contextmanager
def without_sync(model):
    """Gradient accumulation without reduction, as FSDP2 spells it (both libraries)."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def check_fsdp(rank, W):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from harness.plants import planting
    mesh = init_device_mesh("cpu", (W,))

    def shard(model, ours, mp=None, reshard=None, ignored=None):
        """fc1, fc2, then the root (the tied embedding and head, the frozen layer, the norm)."""
        for unit in (model.fc1, model.fc2, model):
            if ours:
                fsdp.fully_shard(unit, mp_policy=mp, reshard_after_forward=reshard,
                                 ignored_params=ignored)
            else:
                torch_fully_shard(unit, mesh=mesh, reshard_after_forward=reshard,
                                  mp_policy=TorchPolicy(mp.param_dtype, mp.reduce_dtype)
                                  if mp else TorchPolicy())
        return model

    def optimizer(kind, model, wd=0.1):
        if kind == "sgd":
            return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        return torch.optim.AdamW(groups(model, weight_decay=wd), lr=1e-2)

    def full(model, ours):
        if ours:
            return [t.clone() for t in fsdp.full_tensors(model).values()] + \
                [b.clone() for b in model.buffers()]
        return [p.full_tensor().detach().clone() for p in model.parameters()] + \
            [b.clone() for b in model.buffers()]

    def run(ours, kind, accum=1, sync_each=False, clip=None, unused=False, reshard=None,
            mp=None, dtype=torch.float64, wd=0.1, ignored=None, steps=STEPS, ckpt=False):
        """The standard loop on a sharded Net (ours from per-rank seeds: fully_shard
        broadcasts rank 0's; FSDP2 needs equal weights); the full parameters after each step,
        and the model after one more backward (its .grad shards)."""
        torch.manual_seed(7 if rank == 0 or not ours else 9 + rank)
        model = Net(unused).to(dtype)
        if mp is not None:   # (BatchNorm's fp32 statistics take no bf16 input, in FSDP2 too)
            model.norm = nn.LayerNorm(H, dtype=dtype)
        model.checkpoint = ckpt
        shard(model, ours, mp, reshard, ignored(model) if ignored else None)
        opt = optimizer(kind, model, wd)
        clip_fn = None
        if clip:
            clip_fn = ((lambda: fsdp.clip_grad_norm_(model, clip)) if ours else
                       (lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        snaps = train(model, opt, rank, accum, clip=clip_fn, snap=lambda: full(model, ours),
                      no_sync=None if sync_each else (lambda: without_sync(model)),
                      steps=steps)
        loss_fn(model, tokens(rank, 99)).backward()
        return snaps, model

    def versus_fsdp2(name, control=False, tol=None, **kw):
        want, theirs = run(False, **kw)
        got, ours = run(True, **kw)
        err = max(rel_diff(g, w) for g, w in zip(got, want))
        if control:
            return report(name, err, control=True)
        err = max(err, shards_vs_to_local(ours, theirs))
        report(name, err if tol is None else err * TOL / tol)   # tol: mapped onto TOL

    def shards_vs_to_local(ours, theirs) -> float:
        """Each shard and its .grad against FSDP2's: both DTensors of the whole shape, their
        to_local() equal in shape, dtype and value."""
        err = 0.0
        for (n, p), (_, q) in zip(ours.named_parameters(), theirs.named_parameters()):
            for x, y in ((p, q), (p.grad, q.grad)):
                if y is None and x is not None:   # a parameter no rank used: ours reduces a
                    err = max(err, 0.0 if not x.count_nonzero() else float("inf"))   # zero
                elif (x is None) != (y is None):
                    err = float("inf")
                elif x is not None:
                    if not hasattr(x, "to_local") or x.shape != y.shape:
                        return float("inf")
                    x, y = x.to_local(), y.to_local()
                    same = x.shape == y.shape and x.dtype == y.dtype
                    err = max(err, rel_diff([x.detach()], [y.detach()]) if same and x.numel()
                              else (0.0 if same else float("inf")))
        return err

    def hf_llama(ours, kind, mp):
        """A tiny HF Llama, each decoder layer a unit and the model the root, 3 steps of the
        standard loop in float32; its full parameters and the model after one more backward."""
        from transformers import LlamaConfig, LlamaForCausalLM
        cfg = LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=32)
        torch.manual_seed(5)
        model = LlamaForCausalLM(cfg).float()
        for unit in [*model.model.layers, model]:
            if ours:
                fsdp.fully_shard(unit, mp_policy=mp)
            else:
                torch_fully_shard(unit, mesh=mesh, mp_policy=TorchPolicy(
                    mp.param_dtype, mp.reduce_dtype) if mp else TorchPolicy())
        opt = optimizer(kind, model)
        for step in range(3):
            x = tokens(rank, step)
            F.cross_entropy(model(x[:, :-1]).logits.float().reshape(-1, V),
                            x[:, 1:].reshape(-1)).backward()
            opt.step()
            opt.zero_grad()
        x = tokens(rank, 99)
        F.cross_entropy(model(x[:, :-1]).logits.float().reshape(-1, V),
                        x[:, 1:].reshape(-1)).backward()
        return full(model, ours), model

    versus_fsdp2(f"fsdp adamw, accum 2 without sync, clip 0.05: fully_shard vs FSDP2, {STEPS} "
                 "steps, shards and grads as to_local()", kind="adamw", accum=2, clip=0.05)
    versus_fsdp2(f"fsdp sgd, reshard_after_forward=False: fully_shard vs FSDP2, {STEPS} steps, "
                 "shards and grads as to_local()", kind="sgd", reshard=False)
    # accumulation onto an existing .grad (a reduction every micro-batch), an unused layer
    # (FSDP2 leaves its .grad None, ours a reduced zero, which weight decay would shrink)
    versus_fsdp2(f"fsdp adamw, accum 2 reducing each, an unused layer: fully_shard vs FSDP2, "
                 f"{STEPS} steps, shards and grads as to_local()", kind="adamw", accum=2,
                 sync_each=True, unused=True, wd=0.0)
    # mixed precision: fp32 shards, bf16 / fp16 compute, fp32 reduction, on both sides
    for low in (torch.bfloat16, torch.float16):
        policy = fsdp.MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)
        eps = torch.finfo(torch.float32).eps
        versus_fsdp2(f"fsdp adamw, float32 with a {str(low)[6:]} policy: fully_shard vs FSDP2, "
                     f"3 steps, within 8 float32 ulps", tol=8 * eps, kind="adamw",
                     mp=policy, dtype=torch.float32, steps=3)
        torch.manual_seed(7)
        model = Net(unused=False).float()
        before = [p.detach().clone() for p in model.parameters()]
        for plant in (None, "masters-rounded"):
            with planting(plant):
                sharded = shard(copy.deepcopy(model), True, policy)
            err = rel_diff(list(fsdp.full_tensors(sharded).values()), before)
            report(f"fsdp {str(low)[6:]} policy: the fp32 shards are the initial weights" if
                   plant is None else f"fsdp {str(low)[6:]} policy: masters rounded through "
                   "param_dtype", err, control=plant is not None)
    # an HF model: SGD in float32, AdamW under a bf16 policy
    for kind, low in (("sgd", None), ("adamw", torch.bfloat16)):
        policy = low and fsdp.MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)
        (want, theirs), (got, ours) = hf_llama(False, kind, policy), hf_llama(True, kind, policy)
        err = max(rel_diff(got, want), shards_vs_to_local(ours, theirs))
        report(f"fsdp HF Llama {kind}, float32" + (" with a bfloat16 policy" if low else "")
               + ": fully_shard vs FSDP2, 3 steps, within 8 float32 ulps",
               err * TOL / (8 * torch.finfo(torch.float32).eps))
    # one device: the same loop on the global batch, with torch's optimizer unsharded
    for kind, accum, clip in (("sgd", 2, None), ("adamw", 1, 0.05)):
        _, _, want = reference_run(W, kind, accum, clip)
        torch.manual_seed(11 + rank)   # fully_shard broadcasts rank 0's weights
        model = shard(build(seed=7, unused=False), True)
        opt = make(kind, model)
        got = train(model, opt, rank, accum, buffers=False,
                    no_sync=lambda: without_sync(model),
                    clip=(lambda: fsdp.clip_grad_norm_(model, clip)) if clip else None,
                    snap=lambda: list(fsdp.full_tensors(model).values()))
        report(f"fsdp {kind}" + (f", accum {accum}" if accum > 1 else "")
               + (f", clip {clip}" if clip else "")
               + f": fully_shard vs torch.optim on the global batch, {STEPS} steps",
               max(rel_diff(g, w) for g, w in zip(got, want)))
    # ignored parameters: whole on every rank, averaged like DDP: the same run as sharded
    want, _ = run(True, "adamw", accum=2, clip=0.05)
    got, model = run(True, "adamw", accum=2, clip=0.05,
                     ignored=lambda m: {m.fc2.weight, m.fc2.bias})
    g = model.fc2.weight.grad
    spread = torch.stack([g.detach().clone().sum(), -g.detach().sum()])
    dist.all_reduce(spread, op=dist.ReduceOp.MAX)
    same = (spread[0] + spread[1]).abs().item()   # max - min over ranks of the gradient's sum
    report(f"fsdp fc2 in ignored_params: vs sharded, {STEPS} steps, its gradient identical on "
           f"every rank", max(max(rel_diff(a, b) for a, b in zip(got, want)), same))
    # the state dicts: model.state_dict() holds the shards (FSDP2's to_local() shapes);
    # full_state_dict -> load_full_state_dict into a model from other weights gives the same
    # full tensors and the same next step; unshard()/reshard() and summon_full_params show the
    # full parameters and put the shards back
    _, theirs = run(False, "sgd", steps=1)
    _, ours = run(True, "sgd", steps=1)
    ours.zero_grad()   # (run() ends with a backward)
    sharded = ours.state_dict()
    err = max(0.0 if sharded[n].shape == q.shape
              and sharded[n].to_local().shape == q.to_local().shape else float("inf")
              for n, q in theirs.named_parameters())
    whole = {n: t.clone() for n, t in fsdp.full_state_dict(ours).items()}
    torch.manual_seed(50 + rank)
    other = shard(Net(unused=False), True)   # (its own weights, rank 0's broadcast)
    fsdp.load_full_state_dict(other, whole)
    err = max(err, rel_diff(list(fsdp.full_state_dict(other).values()), list(whole.values())))
    for m in (ours, other):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        loss_fn(m, tokens(rank, 7)).backward()
        opt.step()
    err = max(err, rel_diff(list(fsdp.full_tensors(other).values()),
                            list(fsdp.full_tensors(ours).values())))
    ours.fc1.unshard()
    err = max(err, rel_diff([ours.fc1.weight.detach()], [fsdp.full_tensors(ours)["fc1.weight"]]))
    ours.fc1.reshard()
    with fsdp.summon_full_params(ours):
        shapes = {n: tuple(p.shape) for n, p in ours.named_parameters()}
    back = {n: tuple(p.shape) for n, p in ours.named_parameters()}
    if shapes != {n: tuple(t.shape) for n, t in whole.items() if n in shapes} or \
            back != {n: tuple(v.shape) for n, v in sharded.items() if n in back}:
        err = float("inf")
    report("fsdp state_dict() as to_local(), full_state_dict -> load_full_state_dict -> a step, "
           "unshard(), summon_full_params", err)
    # fc2 under activation checkpointing (its forward re-run inside the backward): as without
    want, _ = run(True, "sgd", accum=2)
    for ckpt in ("reentrant", "non-reentrant"):
        got, _ = run(True, "sgd", accum=2, ckpt=ckpt)
        report(f"fsdp sgd, accum 2, fc2 under {ckpt} checkpointing: vs without, {STEPS} steps",
               max(rel_diff(g, w) for g, w in zip(got, want)))
    # a layer only rank 0's data uses (FSDP2 would reduce different buffers per rank): ours
    # reduces a zero for it on the other ranks, as torch DDP with find_unused_parameters
    from torch.nn.parallel import DistributedDataParallel as TorchDDP
    snaps = []
    for ours in (True, False):
        torch.manual_seed(7)
        model = Net(unused=True)
        model.route = rank == 0
        wrapped = shard(model, True) if ours else TorchDDP(model, find_unused_parameters=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        snaps.append(train(wrapped, opt, rank, buffers=False,
                           snap=(lambda m=model: list(fsdp.full_tensors(m).values())) if ours
                           else None))
    report(f"fsdp sgd, a layer used on rank 0 only: fully_shard vs torch DDP, {STEPS} steps",
           max(rel_diff(g, w) for g, w in zip(*snaps)))
    # the comparison sees planted bugs: summed gradients (SGD: Adam and clipping would hide
    # them), the micro-batches without sync dropped
    for plant, kw in (("no-average", dict(kind="sgd")),
                      ("sync-drops-accumulated", dict(kind="adamw", accum=2))):
        with planting(plant):
            versus_fsdp2(f"fsdp {plant}", control=True, **kw)
    # a matrix optimizer over shards is refused at its first step; kept whole, it runs
    if hasattr(torch.optim, "Muon"):
        torch.manual_seed(7)
        model = shard(Net(unused=False), True)
        matrices = [p for p in model.parameters() if p.dim() == 2 and p.requires_grad]
        opt = torch.optim.Muon(matrices, lr=0.02)
        loss_fn(model, tokens(rank, 0)).backward()
        try:
            opt.step()
            results.append((False, "FAIL error: Muon over shards was not refused"))
        except ValueError as e:
            results.append(("would update a shard" in str(e),
                            f"PASS error: Muon over fully_shard's shards: {e}"))
    try:
        torch.manual_seed(7)
        tied = Net(unused=False)
        fsdp.fully_shard(tied.emb)
        fsdp.fully_shard(tied)
        results.append((False, "FAIL error: a tie across units was not refused"))
    except ValueError as e:
        results.append(("tied" in str(e), f"PASS error: a tie across units: {e}"))


def check_errors():
    """Bad input: one clear line, before any collective."""
    model = build(seed=0, unused=False)
    for cls in (torch.optim.LBFGS, getattr(torch.optim, "Adafactor", torch.optim.LBFGS)):
        try:
            zero.ZeroOptimizer(model.parameters(), cls, lr=0.1)
            results.append((False, f"FAIL error: ZeroOptimizer accepted {cls.__name__}"))
        except ValueError as e:
            results.append(("not known to update elementwise" in str(e),
                            f"PASS error: ZeroOptimizer({cls.__name__}): {e}"))
    with torch.device("meta"):
        meta = Net()
    try:
        ddp.DataParallel(meta)
        results.append((False, "FAIL error: DataParallel accepted a module on the meta device"))
    except ValueError as e:
        results.append(("meta device" in str(e), f"PASS error: DataParallel(meta module): {e}"))


def write_rows(path: str, world: int):
    """--out FILE: each verdict line as {world, case, value}, merged with the file's rows of the
    other world sizes (docs/api.md renders the table from it: scripts/docs.py)."""
    rows = []
    for ok, line in results:
        m = re.match(r"(?:PASS|FAIL) (.*?): max relative difference (\S+)", line)
        case, value = (m.group(1), m.group(2)) if m else (line[5:].split(": ")[0], "refused")
        rows.append(dict(world=world, case=case, value=value, ok=ok))
    old = json.load(open(path))["rows"] if os.path.exists(path) else []
    with open(path, "w") as f:
        json.dump(dict(command="torchrun --nproc_per_node=W tests/library_oracles.py --out FILE",
                       machine=f"CPU, {os.cpu_count()} cores, gloo", dtype="float64",
                       rows=[r for r in old if r["world"] != world] + rows), f, indent=1)


CHECKS = {"ddp": check_ddp, "zero": check_zero, "fsdp": check_fsdp, "errors": check_errors}

if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--only", default=",".join(CHECKS))
    p.add_argument("--timeout", default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_default_dtype(torch.float64)
    dist.init_process_group("gloo")
    rank, W = dist.get_rank(), dist.get_world_size()
    for name in args.only.split(","):
        fn = CHECKS[name]
        fn(*[rank, W][:fn.__code__.co_argcount])
    for ok, line in results:
        line = line if ok or line.startswith("FAIL") else "FAIL" + line[4:]
        if rank == 0 or not ok:
            print(line if rank == 0 else f"rank {rank}: {line}", flush=True)
    failed = any(not ok for ok, _ in results)
    if args.out and rank == 0:
        write_rows(args.out, W)
    teardown()   # not a bare destroy: gloo can abort at interpreter shutdown (see teardown)
    sys.exit(1 if failed else 0)
