"""correctness.py: Modes `correctness` and `plants`.

correctness  rank 0 runs the reference (plain HF model + torch.optim.AdamW on the whole global
             batch) in float64 (the target) and in the low dtype (the noise) while the strategy
             runs on every rank, same batches, >= 2 optimizer steps. Every gradient (before
             clipping), every parameter and the loss at every step, and the pre-clip gradient
             norm, are judged by compare.py's policy; a per-tensor table; PASS or FAIL last.
plants       the clean correctness run, then each planted bug (--plants a,b; default: the plants
             declared for this configuration) in one process group: PASS when the clean run
             PASSes and every plant FAILs.
"""
from __future__ import annotations

import copy
import os

from .compare import Comparison, Judged, NoisePolicy, noise_sources, preclip_grads
from .launch import base_parser
from .models import param_count
from .nccl import nccl_checked
from .plants import planting
from .report import write_json
from .run import Run, broadcast_verdict, make_pair
from .strategy import HARNESS_PLANTS, Plant, full_tensor, natives


def run_correctness(run: Run, cls) -> bool:
    args = run.args
    ok = True
    classes = [cls] + (natives(cls, args) if args.compare_native else [])
    for c in classes:
        with planting(None if c is not cls else args.plant_bug):   # PyTorch's own: no plant
            ok &= _correctness_one(run, c)
    return ok


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
    rows = []
    for name in [None] + names:
        args = copy.copy(run.args)
        args.mode, args.plant_bug = "correctness", name
        sub = Run(args, run.env, run.config, run.lang, run.results)
        run.print(f"\n=== plant: {name or '(none: the clean run must PASS)'}")
        with planting(name):
            passed = (nccl_checked(_correctness_one, sub, cls) if args.nccl_semantics
                      else _correctness_one(sub, cls))
        rows.append((name or "(none)", passed, passed == (name is None)))
    run.print(f"\nplants: {cls.name} W={run.env.world} {run.args.dtype}"
              f"{' clip=%g' % run.args.clip if run.args.clip else ''}")
    for name, passed, good in rows:
        doc = ({**HARNESS_PLANTS, **cls.plants}[name].doc if name != "(none)"
               else "no bug planted")
        run.print(f"  {name:<24}{'PASS' if passed else 'FAIL':<6}"
                  f"{'as expected' if good else 'WRONG VERDICT':<15}{doc}")
    ok = all(g for _, _, g in rows)
    caught = sum(1 for n, p, _ in rows[1:] if not p)
    run.results["plants"] = [dict(plant=n, passed=p, expected=g) for n, p, g in rows]
    write_json(run, "plants.json", run.results["plants"])
    run.print(f"{'PASS' if ok else 'FAIL'} plants {cls.name} W={run.env.world}: clean run "
              f"{'PASS' if rows[0][1] else 'FAIL'}, {caught}/{len(rows) - 1} planted bugs caught")
    return ok


def _correctness_one(run: Run, cls) -> bool:
    args, env = run.args, run.env
    ref, strat, _ = make_pair(run, cls, perturb=True, with_ref=True)
    policy = NoisePolicy(args.dtype, k=args.tol_k)
    target, sources = noise_sources(run, cls, ref, policy) if env.is_main else (None, [])
    names = [n for n, _ in ref.model.named_parameters()] if ref else []
    shapes = {n: tuple(p.shape) for n, p in ref.model.named_parameters()} if ref else {}
    cmp = Comparison(names, shapes, policy)
    run.print(f"correctness: {strat.name} W={env.world} {args.dtype} model={args.model} "
              f"batch={args.batch} length={args.length} steps={args.steps} "
              f"params={param_count(ref.model) if ref else '?'}"
              f"{' clip=%g' % args.clip if args.clip else ''}"
              f"{' PLANTED BUG: ' + args.plant_bug if args.plant_bug else ''}")
    for s in range(args.steps):
        batch = run.batch(s)
        loss = strat.step(batch)
        grads = preclip_grads(strat, strat.full_grads(), args.clip)
        params = strat.full_params()
        if args.plant_bug == "grad" and env.is_main and grads:
            k = next(iter(grads))
            grads = dict(grads)
            grads[k] = grads[k] * (1 + 1e-6) + 1e-6 * grads[k].abs().max()
        if env.is_main:
            t_loss = target.step(batch)
            n_loss = [src.ref.step(batch) for src in sources]
            t_grads = preclip_grads(target, target.full_grads(), args.clip)
            noisy = [(preclip_grads(x.ref, x.ref.full_grads(), args.clip), x.scale)
                     for x in sources]
            cmp.add("grad", s, grads, t_grads, noisy)
            cmp.add("param", s, params, target.full_params(),
                    [(x.ref.full_params(), x.scale) for x in sources],
                    policy.update_floor(args.lr, s + 1)
                    + max((x.lr_flip for x in sources), default=0.0) * args.lr * (s + 1))
            cmp.add_scalar("loss", s, loss, t_loss, [(v, x.scale) for v, x in zip(n_loss, sources)])
            if args.clip:
                norm = lambda x: float(full_tensor(x.grad_norm))  # noqa: E731
                cmp.add_scalar("grad norm", s, norm(strat), norm(target),
                               [(norm(x.ref), x.scale) for x in sources])
            j = cmp.scalars["loss"]
            run.print(f"  step {s}: loss {loss:.12f}  float64 reference {t_loss:.12f}  rel err "
                      f"{abs(loss - t_loss) / abs(t_loss):.2e}  (noise, worst step so far "
                      f"{j.noise:.2e})")
    extra = strat.extra_checks()
    verdict = False
    if env.is_main:
        verdict = _report_correctness(run, strat.name, cmp, extra)
    return broadcast_verdict(verdict)


def _report_correctness(run, name, cmp: Comparison, extra) -> bool:
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
    if bad:
        problems.append(f"{len(bad)} tensors over tolerance (first: {bad[0]})")
    if cmp.missing:
        problems.append(f"{len(cmp.missing)} tensors missing (first: {sorted(cmp.missing)[0]})")
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
        checks=[dict(name=a, ok=b, detail=c) for a, b, c in extra]))
    write_json(run, "correctness.json", run.results["correctness"])
    run.print(("PASS " if ok else "FAIL ") + summary + ("" if ok else " -- " + "; ".join(problems)))
    return ok
