"""learning.py: Mode `learning`: --steps steps on the synthetic language, reference and strategy
side by side, against the language's exact entropy rate (the loss floor)."""
from __future__ import annotations

import csv
import math
import os
import time

from .report import plot_learning
from .run import Run, broadcast_verdict, make_pair


def run_learning(run: Run, cls) -> bool:
    args, env = run.args, run.env
    ref, strat, _ = make_pair(run, cls, perturb=False, with_ref=True)
    floor = run.lang.entropy_rate
    run.print(f"learning: {strat.name} W={env.world} {args.dtype} model={args.model} "
              f"steps={args.steps} lr={args.lr} batch={args.batch} length={args.length}; "
              f"entropy floor {floor:.4f} nats (uniform would be {math.log(run.config.vocab_size):.4f})")
    run.print(f"{'step':>6}{'reference':>12}{strat.name:>12}{'rel diff':>11}{'floor':>9}")
    rows, t0 = [], time.time()
    for s in range(args.steps):
        batch = run.batch(s)
        loss = strat.step(batch)
        ref_loss = ref.step(batch) if ref else float("nan")
        rows.append((s, ref_loss, loss))
        if env.is_main and (s % args.log_every == 0 or s == args.steps - 1):
            run.print(f"{s:>6}{ref_loss:>12.4f}{loss:>12.4f}"
                      f"{abs(loss - ref_loss) / ref_loss:>11.1e}{floor:>9.4f}"
                      f"   [{s + 1}/{args.steps}, {time.time() - t0:.0f}s]")
    for line in strat.learning_lines():
        run.print(line)
    ok = True
    if env.is_main:
        ok = _report_learning(run, strat.name, rows, floor)
    return broadcast_verdict(ok)


LEARNING_TOL = {"float64": 1e-6, "float32": 2e-3, "bfloat16": 5e-2}


def _report_learning(run, name, rows, floor) -> bool:
    args = run.args
    diffs = [abs(l - r) / r for _, r, l in rows]
    first = rows[0][2]
    tail = rows[-min(5, len(rows)):]
    last = sum(l for _, _, l in tail) / len(tail)
    tol = LEARNING_TOL[args.dtype]
    # "well below the initial loss": at least half of the way from the start to the floor
    target = first - (first - floor) / 2
    agree, learned = max(diffs) <= tol, last <= target
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "learning.csv"), "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["step", "reference", name, "floor"])
            w.writerows([(s, r, l, floor) for s, r, l in rows])
        plot_learning(args.out, name, rows, floor)
    summary = (f"{name} W={run.env.world} {args.dtype}: loss {first:.3f} -> {last:.3f} "
               f"(floor {floor:.3f}, target <= {target:.3f}), max rel diff vs reference "
               f"{max(diffs):.1e} (tol {tol:.0e})")
    run.results["learning"] = dict(strategy=name, world=run.env.world, dtype=args.dtype,
                                   first=first, last=last, floor=floor,
                                   max_rel_diff=max(diffs), ok=agree and learned)
    run.print(("PASS " if agree and learned else "FAIL ") + summary)
    return agree and learned
