"""correctness.py: Modes `correctness` and `plants`.

correctness  rank 0 alone runs the reference (plain HF model + torch.optim.AdamW on the
             whole global batch) in float64, the target, and keeps its outputs; then the
             strategy runs on every rank, the same batches, >= 2 optimizer steps, compared with
             the target step by step; then rank 0 runs the noise sources
             (compare.noise_sources), one model at a time. Every gradient (before clipping),
             every parameter and the loss at every step, and the pre-clip gradient norm, are
             judged by compare.py's policy; a per-tensor table; each rank's peak resident
             memory; PASS or FAIL last.
plants       the clean correctness run, then each planted bug (--plants a,b; default: the plants
             declared for this configuration) in one process group: PASS when the clean run
             PASSes and every plant FAILs.
"""
from __future__ import annotations

import contextlib
import copy
import os
from dataclasses import dataclass, field

from .compare import (Comparison, Judged, NoisePolicy, noise_sources,
                      preclip_grads, reference_in)
from .loading import release_memory, rss_peak, rss_reset
from .dropout import rates
from .hostsync import HostSyncs, host_sync_check
from .launch import base_parser
from .models import DTYPES, loaded_once, param_count
from .nccl import nccl_checked
from .plants import planting
from .report import write_json
from .spread import Spread
from .run import (Run, broadcast_verdict, gather_objects, make_pair, rank0_group,
                  wait_for_rank0)
from .strategy import HARNESS_PLANTS, Plant, full_tensor, natives


def run_correctness(run: Run, cls) -> bool:
    args = run.args
    ok = True
    classes = [cls] + (natives(cls, args) if args.compare_native else [])
    for c in classes:
        with planting(None if c is not cls else args.plant_bug), loaded_once(run.env.is_main):
            ok &= _correctness_one(run, c)   # (PyTorch's own above: no plant)
    return ok


NULL = contextlib.nullcontext()


def _declared_for(plant: Plant, cls, args) -> bool:
    """Whether this run is the configuration a plant declares: every option its args set has
    the same value here (sp.py's plants name their --variant, zero's their --stage, ...)."""
    parser = base_parser("plants", cls.modes, cls.plants)
    cls.add_args(parser)
    unset = object()
    parser.set_defaults(**{k: unset for k in vars(parser.parse_args([]))})
    given = {k: v for k, v in vars(parser.parse_args(list(plant.args))).items() if v is not unset}
    norm = lambda v: os.path.realpath(v) if isinstance(v, str) and os.path.exists(v) else v  # noqa: E731
    return all(norm(getattr(args, k, None)) == norm(v) for k, v in given.items())


def run_plants(run: Run, cls) -> bool:
    """The check of the checks: the clean correctness run must PASS and every planted bug must
    FAIL, in this one configuration. One process group for all of them (a run per plant would
    pay the start-up again each time)."""
    names = (run.args.plants.split(",") if run.args.plants else
             [n for n, p in cls.plants.items() if _declared_for(p, cls, run.args)])
    if not names:
        run.print(f"FAIL plants {cls.name}: no plant is declared for this configuration; "
                  f"name them with --plants, or run one of: " + "; ".join(
                      sorted({' '.join(p.args) for p in cls.plants.values()})))
        return False
    rows, ratios = [], []
    for name in [None] + names:
        args = copy.copy(run.args)
        args.mode, args.plant_bug = "correctness", name
        sub = Run(args, run.env, run.config, run.lang, run.results)
        run.print(f"\n=== plant: {name or '(none: the clean run must PASS)'}")
        with planting(name), loaded_once(run.env.is_main):
            passed = (nccl_checked(_correctness_one, sub, cls) if args.nccl_semantics
                      else _correctness_one(sub, cls))
        done = run.results.get("correctness") or [{}]   # (rank 0's report; None elsewhere)
        ratios.append(done[-1].get("worst_ratio") if run.env.is_main else None)
        rows.append((name or "(none)", passed, passed == (name is None)))
    run.print(f"\nplants: {cls.name} W={run.env.world} {run.args.dtype}"
              f"{' clip=%g' % run.args.clip if run.args.clip else ''}")
    width = max(24, *(len(n) + 2 for n, _, _ in rows))
    for name, passed, good in rows:
        doc = ({**HARNESS_PLANTS, **cls.plants}[name].doc if name != "(none)"
               else "no bug planted")
        run.print(f"  {name:<{width}}{'PASS' if passed else 'FAIL':<6}"
                  f"{'as expected' if good else 'WRONG VERDICT':<15}{doc}")
    ok = all(g for _, _, g in rows)
    caught = sum(1 for n, p, _ in rows[1:] if not p)
    run.results["plants"] = [dict(plant=n, passed=p, expected=g, worst_ratio=r)
                             for (n, p, g), r in zip(rows, ratios)]
    write_json(run, "plants.json", run.results["plants"])
    separation = ""
    if run.env.is_main and ratios[0] is not None and len(ratios) > 1:   # (the margin between
        # the clean run's worst tensor and the closest plant's: 1 is the verdict's line)
        separation = (f"; err/tol: clean run {ratios[0]:.2f}, closest plant "
                      f"{min(r for r in ratios[1:] if r is not None):.3g}")
    run.print(f"{'PASS' if ok else 'FAIL'} plants {cls.name} W={run.env.world}: clean run "
              f"{'PASS' if rows[0][1] else 'FAIL'}, {caught}/{len(rows) - 1} planted bugs caught"
              + separation)
    return ok


@dataclass
class Outputs:
    """What one run produced at one step, as the comparison needs it (rank 0)."""
    loss: float
    grads: dict
    params: dict
    norm: float | None   # the pre-clip gradient norm it reports (with --clip)
    floors: dict = field(default_factory=dict)   # the target's gradients' rounding floors


def _kept(model, loss: float, clip: float) -> Outputs:
    """The model's outputs as copies of their own (kept across steps: the live parameters and
    gradients change at the next step), made one at a time so that a gathered temporary is
    freed as its copy is made."""
    out = Outputs(loss, dict(preclip_grads(model, model.full_grads(), clip)),
                  dict(model.full_params()), float(full_tensor(model.grad_norm)) if clip else None)
    for d in (out.grads, out.params):
        for n in list(d):
            d[n] = None if d[n] is None else d[n].detach().clone()
    return out


def _correctness_one(run: Run, cls) -> bool:
    """Rank 0 runs the float64 target alone first and keeps its per-step outputs; then the
    strategy runs on every rank, rank 0 comparing each step with the target as it comes; then
    rank 0 alone runs the noise sources one after another against the kept target. One model
    with its optimizer is alive at a time, so a real checkpoint fits: the peak is printed last."""
    args, env = run.args, run.env
    start = gather_objects(rss_reset())   # the peak counts from here
    rank0_group(args.timeout)   # (made by every rank before rank 0 goes off alone)
    # --fp8 tensorwise where every rank runs every FP8 linear: the scales checked exactly, and
    # the tensors within FP8's own noise (cli refuses a low-precision --fp8 run without it)
    scales = getattr(args, "fp8", None) == "tensorwise" and cls.fp8_amax_log is not None
    policy = NoisePolicy(args.dtype, k=args.tol_k, fp8=scales)
    target = _target(run, cls, policy) if env.is_main else None
    release_memory()   # the reference model rank 0 freed
    wait_for_rank0(args.timeout)   # the others wait while rank 0 runs the target
    cmp = Comparison(target.names, target.shapes, policy, target.frozen) if target else None
    _, strat, _ = make_pair(run, cls, perturb=True, with_ref=False)
    run.print(f"correctness: {strat.name} W={env.world} {args.dtype} model={args.model} "
              f"batch={args.batch} length={args.length} steps={args.steps} "
              f"params={target.n_params if target else '?'}"
              f"{' clip=%g' % args.clip if args.clip else ''}"
              f"{' dropout=%s' % rates(run.config) if rates(run.config) else ''}"
              f"{' PLANTED BUG: ' + args.plant_bug if args.plant_bug else ''}")
    watch = HostSyncs(env.device) if args.host_syncs else None
    amaxes = cls.fp8_amax_log(strat.fp8_stage) if scales else None
    for s in range(args.steps):
        batch = run.batch(s)
        with watch.region() if watch else NULL, amaxes or NULL:
            loss = strat.step(batch)
        # (read on every rank: a DTensor baseline's norm may be a collective to read)
        norm = float(full_tensor(strat.grad_norm)) if args.clip else None
        grads = preclip_grads(strat, strat.full_grads(), args.clip)
        params = strat.full_params()
        if env.is_main:
            if args.plant_bug == "grad" and grads:
                k = next(iter(grads))
                grads = dict(grads)
                grads[k] = grads[k] * (1 + 1e-6) + 1e-6 * grads[k].abs().max()
            t = target.steps[s]
            cmp.error("grad", s, grads, t.grads)
            cmp.error("param", s, params, t.params)
            cmp.spread(s, t.floors)
            cmp.scalar("loss", s, t.loss, got=loss)
            if args.clip:
                cmp.scalar("grad norm", s, t.norm, got=norm)
            run.print(f"  step {s}: loss {loss:.12f}  float64 reference {t.loss:.12f}  rel err "
                      f"{abs(loss - t.loss) / abs(t.loss):.2e}")
        del grads, params
    extra = (strat.extra_checks() + ([host_sync_check(watch)] if watch else [])
             + ([amaxes.check()] if amaxes else []))
    name = strat.name
    del strat
    release_memory()
    replica = 0
    if env.is_main:
        _measure_noise(run, cls, cmp, target)
        replica = 4 * target.n_params * DTYPES[args.dtype].itemsize
        del target
    wait_for_rank0(args.timeout)   # the others wait while rank 0 measures the noise
    memory = _memory(run, start, gather_objects(rss_peak()), replica)
    verdict = _report_correctness(run, name, cmp, extra, memory) if env.is_main else False
    return broadcast_verdict(verdict)


def _memory(run: Run, start: list, end: list, replica: int) -> dict:
    """Each rank's peak resident set during the run (Linux VmHWM, reset at its start) and what
    it added to the resident set the run started with, against one training replica; printed
    (before the verdict's last line) and returned for correctness.json."""
    if None in start or None in end:
        return {}   # not Linux
    G = 2 ** 30
    run.print("peak resident memory per rank (VmHWM; + over the run's start): " + ", ".join(
        f"rank {r} {p / G:.2f} GiB (+{(p - b) / G:.2f})" for r, (p, b)
        in enumerate(zip(end, start))) + (
        f"; one training replica (parameters, gradients, AdamW's two states in "
        f"{run.args.dtype}) {replica / G:.2f} GiB: rank 0 at {end[0] / replica:.1f}x "
        f"(+{(end[0] - start[0]) / replica:.1f}x)" if replica else ""))
    return dict(peak_rss_bytes=end, start_rss_bytes=start, replica_bytes=replica)


@dataclass
class Target:
    """The float64 reference's outputs at every step, kept on rank 0 for the comparisons."""
    names: list
    shapes: dict
    n_params: int
    steps: list   # [Outputs]
    frozen: frozenset = frozenset()   # --lora: the base's names (no gradient)


def _target(run: Run, cls, policy: NoisePolicy) -> Target:
    """Rank 0: the float64 reference, run alone; the model is freed, its outputs kept."""
    args = run.args
    ref = reference_in(run, cls, "float64")
    target = Target([n for n, _ in ref.model.named_parameters()],
                    {n: tuple(p.shape) for n, p in ref.model.named_parameters()},
                    param_count(ref.model), [],
                    frozenset(n for n, p in ref.model.named_parameters() if not p.requires_grad))
    u = policy.unit_roundoff
    for s in range(args.steps):   # (float64 runs: the magnitudes its gradients sum, spread.py)
        with Spread(ref.model) if u else contextlib.nullcontext() as spread:
            loss = ref.step(run.batch(s))
        target.steps.append(_kept(ref, loss, args.clip))
        target.steps[-1].floors = spread.floors(u) if u else {}
    return target


def _measure_noise(run: Run, cls, cmp: Comparison, target: Target):
    """Rank 0: each noise source (compare.noise_sources), built, run and compared with the kept
    target, then freed, one after another; then every step is judged."""
    args, policy = run.args, cmp.policy
    for s in range(args.steps):
        cmp.floor("param", s, policy.update_floor(args.lr, s + 1))
    for build in noise_sources(run, cls, policy):
        _run_noise(run, cmp, target, build())   # (its models are freed as it returns)
        release_memory()
    cmp.judge()


def _run_noise(run: Run, cmp: Comparison, target: Target, sources: list):
    args, policy = run.args, cmp.policy
    for s, t in enumerate(target.steps):
        batch = run.batch(s)
        losses = [x.ref.step(batch) for x in sources]   # in order: a mirror reads its model
        for x, loss in zip(sources, losses):   # (one full set of tensors at a time)
            cmp.noise("grad", s, preclip_grads(x.ref, x.ref.full_grads(), args.clip),
                      t.grads, x.scale)
            cmp.noise("param", s, x.ref.full_params(), t.params, x.scale)
            cmp.floor("param", s, policy.update_floor(args.lr, s + 1)
                      + x.lr_flip * args.lr * (s + 1))
            cmp.scalar("loss", s, t.loss, noisy=loss, scale=x.scale)
            if args.clip:
                cmp.scalar("grad norm", s, t.norm, scale=x.scale,
                           noisy=float(full_tensor(x.ref.grad_norm)))


def _report_correctness(run, name, cmp: Comparison, extra, memory: dict) -> bool:
    args, env, policy = run.args, run.env, cmp.policy
    w = max([len(n) for n in cmp.names] + [12]) + 2
    run.print(f"{'tensor':<{w}}{'shape':<16}{'grad err':>10}{'noise':>10}"
              f"{'param err':>11}{'noise':>10}{'err/tol':>9}  ok")
    bad = []
    for n in cmp.names:
        g, p = cmp.rows[n]["grad"], cmp.rows[n]["param"]
        good = g.ok and p.ok
        if not good:
            bad.append(n)
        run.print(f"{n:<{w}}{str(cmp.shapes[n]):<16}{g.err:>10.1e}{g.noise:>10.1e}"
                  f"{p.err:>11.1e}{p.noise:>10.1e}{max(g.ratio, p.ratio):>9.2f}  "
                  f"{'ok' if good else 'FAIL'}")
    for label, j in cmp.scalars.items():
        run.print(f"{label:<{w}}{'()':<16}{j.err:>10.1e}{j.noise:>10.1e}{'':>21}{j.ratio:>9.2f}"
                  f"  {'ok' if j.ok else 'FAIL'}")
    n = len(cmp.names)
    n_grad = n - sum(1 for m in cmp.missing if m.startswith("grad:"))
    n_param = n - sum(1 for m in cmp.missing if m.startswith("param:"))
    for check, good, detail in extra:
        run.print(f"check {check}: {'ok' if good else 'FAIL'} ({detail})")
    problems = []
    if cmp.frozen:
        run.print(f"frozen: {len(cmp.frozen)} of {n} tensors (no gradient on either side, "
                  f"parameters bit-identical to the start)")
    if cmp.thawed:
        problems.append(f"{len(cmp.thawed)} frozen tensors have a gradient (first: "
                        f"{sorted(cmp.thawed)[0]})")
    if bad:
        problems.append(f"{len(bad)} tensors over tolerance (first: {bad[0]})")
    if cmp.missing:
        problems.append(f"{len(cmp.missing)} tensors missing (first: {sorted(cmp.missing)[0]})")
    if cmp.implausible:
        label, worst_noise = max(cmp.implausible.items(), key=lambda x: x[1])
        problems.append(f"a noise sample that is not noise: {len(cmp.implausible)} tensors' "
                        f"(first: {label} {worst_noise:.2f}) > {cmp.policy.noise_max} of the tensor's own "
                        f"scale; a noise source is broken, its tolerance would accept anything")
    if cmp.extra:
        problems.append(f"unexpected tensors {cmp.extra[:3]}")
    problems += [f"{label} err {j.err:.2e} > tol {j.tol:.1e} (noise {j.noise:.1e})"
                 for label, j in cmp.scalars.items() if not j.ok]
    problems += [f"check {nm} failed" for nm, g, _ in extra if not g]
    worst_label, worst = cmp.worst()
    loss = cmp.scalars.get("loss", Judged())
    summary = (f"{name} W={env.world} {args.dtype}: {args.steps} steps, "
               f"{n_grad}/{n} grads{' (pre-clip)' if args.clip else ''} + {n_param}/{n} params "
               f"compared, max err grad {cmp.max_err('grad'):.1e} (noise {cmp.max_noise('grad'):.1e})"
               f", param {cmp.max_err('param'):.1e} (noise {cmp.max_noise('param'):.1e}), "
               f"loss {loss.err:.1e} (noise {loss.noise:.1e}); worst err/tol {worst.ratio:.2f} "
               f"({worst_label}); {policy.describe()}")
    ok = not problems
    run.results.setdefault("correctness", []).append(dict(
        strategy=name, world=env.world, dtype=args.dtype, steps=args.steps, clip=args.clip,
        plant_bug=args.plant_bug, model=args.model,
        tensors=n, grads_compared=n_grad, params_compared=n_param, max_rel_err=cmp.max_err(),
        max_grad_err=cmp.max_err("grad"), max_param_err=cmp.max_err("param"),
        max_grad_noise=cmp.max_noise("grad"), max_param_noise=cmp.max_noise("param"),
        loss_rel_err=loss.err, loss_noise=loss.noise,
        worst_ratio=worst.ratio, worst=worst_label,
        tol_k=policy.k, tol_k_param=policy.factor("param"), tol_floor=policy.floor, noise_dtype=policy.noise_dtype,
        noise_scale=policy.scale, ok=ok, problems=problems,
        scalars={k: vars(v) for k, v in cmp.scalars.items()},
        rows={n: {k: vars(j) for k, j in r.items()} for n, r in cmp.rows.items()},
        checks=[dict(name=a, ok=b, detail=c) for a, b, c in extra], **memory))
    write_json(run, "correctness.json", run.results["correctness"])
    run.print(("PASS " if ok else "FAIL ") + summary + ("" if ok else " -- " + "; ".join(problems)))
    return ok
