"""compose4d at W=1 against the single-device reference, from the same weights and batches: the
step time ratio, measured interleaved, and what compose4d does that the reference does not,
from a profile of both (torch.profiler, CPU, self time per aten op and per step).

    python scripts/compose4d_overhead.py [--model tiny] [--rounds 10] [--out FILE] [compose4d args]
    python scripts/compose4d_overhead.py --model configs/tiny-tied.json --out results/compose4d-overhead-cpu.json

W=1 is compose4d with every dimension at 1: its pipeline is plain gradient accumulation over
--grad-accum micro-batches (1 here, as the reference), ZeRO over a group of one, AdamW on flat
fp32 shards. Whatever it spends beyond the reference is the price of its machinery at size one.
The timing rounds run unprofiled (A B, B A, ...); then --profile-rounds more under the profiler.
"""
import json
import os
import sys
import time
from collections import defaultdict

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from harness.cli import main as harness_main  # noqa: E402
from harness.launch import MODE_DEFAULTS  # noqa: E402
from harness.run import make_pair  # noqa: E402
from rig.compose4d import Compose4D  # noqa: E402


def timed(side, batch):
    t0 = time.perf_counter()
    side.step(batch)
    return time.perf_counter() - t0


def profiled(side, batch) -> dict:
    """{aten op: [self CPU microseconds, calls]} of one step."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
        side.step(batch)
    return {e.key: [e.self_cpu_time_total, e.count] for e in p.key_averages()}


def run_overhead(run, cls) -> bool:
    args = run.args
    ref, strat, _ = make_pair(run, cls, perturb=False, with_ref=True)
    sides = {"compose4d": strat, "reference": ref}
    for s in range(args.warmup):
        for side in sides.values():
            side.step(run.batch(s))
    times = defaultdict(list)
    for i in range(args.rounds):
        batch = run.batch(args.warmup + i)
        for name in (list(sides) if i % 2 == 0 else list(sides)[::-1]):
            times[name].append(timed(sides[name], batch))
    ratios = sorted(a / b for a, b in zip(times["compose4d"], times["reference"]))
    ops = {name: defaultdict(lambda: [0.0, 0]) for name in sides}
    for i in range(args.profile_rounds):
        batch = run.batch(args.warmup + args.rounds + i)
        for name in (list(sides) if i % 2 == 0 else list(sides)[::-1]):
            for key, (us, n) in profiled(sides[name], batch).items():
                ops[name][key][0] += us / args.profile_rounds / 1e3   # ms per step
                ops[name][key][1] += n / args.profile_rounds
    keys = set(ops["compose4d"]) | set(ops["reference"])
    rows = sorted(({"op": k, "compose4d_ms": round(ops["compose4d"][k][0], 3),
                    "reference_ms": round(ops["reference"][k][0], 3),
                    "compose4d_calls": ops["compose4d"][k][1],
                    "reference_calls": ops["reference"][k][1]} for k in keys),
                  key=lambda r: r["reference_ms"] - r["compose4d_ms"])
    total = {n: sum(v[0] for v in ops[n].values()) for n in sides}
    med = lambda xs: sorted(xs)[len(xs) // 2]   # noqa: E731
    doc = dict(model=args.model, dtype=args.dtype, batch=args.batch, length=args.length,
               world=run.env.world, machine=f"CPU, {torch.get_num_threads()} threads",
               rounds=args.rounds, step_ratio_median=med(ratios), step_ratios=ratios,
               compose4d_step_s=med(times["compose4d"]), reference_step_s=med(times["reference"]),
               profiled_ms_per_step=total, ops_by_extra_time=rows[:25],
               command="python scripts/compose4d_overhead.py " + " ".join(sys.argv[1:]))
    run.print(f"compose4d W=1 / reference step time: median {doc['step_ratio_median']:.3f} over "
              f"{args.rounds} interleaved rounds ({doc['compose4d_step_s'] * 1e3:.1f} ms vs "
              f"{doc['reference_step_s'] * 1e3:.1f} ms); profiled self time per step "
              f"{total['compose4d']:.1f} ms vs {total['reference']:.1f} ms")
    run.print(f"{'op':<44}{'compose4d ms':>13}{'calls':>8}{'reference ms':>14}{'calls':>8}")
    for r in rows[:15]:
        run.print(f"{r['op'][:43]:<44}{r['compose4d_ms']:>13.3f}{r['compose4d_calls']:>8.0f}"
                  f"{r['reference_ms']:>14.3f}{r['reference_calls']:>8.0f}")
    if args.out_file and run.env.is_main:
        os.makedirs(os.path.dirname(os.path.abspath(args.out_file)), exist_ok=True)
        with open(args.out_file, "w") as f:
            json.dump(doc, f, indent=1)
    return True


class Overhead(Compose4D):
    modes = {**Compose4D.modes, "overhead": run_overhead}

    @staticmethod
    def add_args(p):
        Compose4D.add_args(p)
        p.add_argument("--rounds", type=int, default=10)
        p.add_argument("--profile-rounds", type=int, default=3)
        p.add_argument("--out-file", default=None)
        p.set_defaults(mode="overhead", warmup=3)


if __name__ == "__main__":
    MODE_DEFAULTS["overhead"] = MODE_DEFAULTS["benchmark"]   # (steps, dtype: float32 on CPU)
    argv = [("--out-file" if a == "--out" else a) for a in sys.argv[1:]]
    harness_main(Overhead, ["--mode", "overhead", *argv])
