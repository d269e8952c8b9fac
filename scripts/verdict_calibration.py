"""The verdicts' calibration: do correct runs PASS on this CPU with room to spare, and do the
planted bugs FAIL by a wide margin? (docs/correctness.md, "Calibration")

    python scripts/verdict_calibration.py --out results/verdict-calibration-cpu.json
    python scripts/verdict_calibration.py --only tp --seeds 4,2,2      # a quick look, no file

Every strategy's quick-tier configuration (tests/test_hostsync.py QUICK: clipping and, where
the strategy has it, dropout on) runs its correctness mode over many seeds (model, language and
samples all follow --seed): 20 in float64, 10 in float32 and 10 in bfloat16 by default, at W=2
and at W=3 where the strategy takes it (the batch 6; cp's length 48 so that 2W chunks divide it,
pp's 3 micro-batches;
a strategy whose constraints refuse W=3 says why in one line). One torchrun per strategy and W
(`--runs`). A row per strategy, dtype and W: runs, fails (must be 0), the largest err/tol (the
margin) with its seed and tensor. Then every planted bug in the configuration it declares
(tour.plant_groups, --mode plants): the smallest err/tol of a plant that FAILed on a tensor
(the separation), and the plants caught by another check. The machine's CPU is recorded."""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [HERE, os.path.join(HERE, "tests")]

from test_hostsync import QUICK, SMALL   # noqa: E402  (the quick tier's configurations)
from tour import plant_groups            # noqa: E402

BASE = [a for a in SMALL if a != "--host-syncs"]
W3 = {"cp": ["--length", "48"],          # (2W chunks of the sequence: 6 divide 48)
      "pp": ["--microbatches", "3"]}     # (3 micro-batches of the batch 6; 4 layers on 3 stages)


def cpu() -> dict:
    info = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                k, _, v = line.partition(":")
                k = k.strip()
                if k in ("model name", "cpu family", "model", "flags") and k not in info:
                    info[k] = v.strip()
    except OSError:
        pass
    flags = info.pop("flags", "").split()
    import torch
    import transformers
    return dict(model_name=info.get("model name", platform.processor()),
                family=info.get("cpu family"), model=info.get("model"),
                avx512=("avx512f" in flags), avx2=("avx2" in flags), cores=os.cpu_count(),
                torch=torch.__version__, transformers=transformers.__version__,
                python=platform.python_version())


def launch(script: str, world: int, argvs: list, base: str, timeout: int):
    """One torchrun of `script` over several argument lists; (returncode, output)."""
    spec = os.path.join(base, "runs.json")
    with open(spec, "w") as f:
        json.dump(argvs, f)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={world}", os.path.join(HERE, script), "--runs", spec]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run(cmd, cwd=HERE, env=env, capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout + p.stderr


def entries(out_dir: str) -> list:
    path = os.path.join(out_dir, "correctness.json")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return json.load(f)


def seeds_phase(only, counts, worlds, tmp, extra_args=()) -> tuple[list, list]:
    """(rows, refusals): correct runs over seeds (extra_args: added to every run, e.g. a
    --plant-bug, to see the count of fails move)."""
    def dtypes(seed):   # the dtypes that seed runs in
        return [d for d, n in zip(("float64", "float32", "bfloat16"), counts) if seed < n]
    rows, refused = {}, []
    for script, key, extra in QUICK:
        if only and key not in only:
            continue
        for world in worlds:
            argv = (BASE + extra + (["--batch", "6", *W3.get(key, [])] if world == 3 else [])
                    + list(extra_args))
            argvs, base = [], tempfile.mkdtemp(prefix=f"cal-{key}-W{world}-", dir=tmp)
            for seed in range(max(counts)):
                argvs.append(argv + ["--seed", str(seed), "--dtype", ",".join(dtypes(seed)),
                                     "--timeout", "120",
                                     "--out", os.path.join(base, f"seed{seed}")])
            t0 = time.time()
            rc, out = launch(script, world, argvs, base, timeout=600 + 60 * len(argvs))
            err = [ln for ln in out.splitlines() if ln.startswith("error:")]
            if rc != 0 and err and not entries(os.path.join(base, "seed0")):
                refused.append(dict(strategy=key, world=world, reason=err[0][len("error:"):]
                                    .strip()))
                print(f"{key} W={world}: refused: {err[0]}", flush=True)
                continue
            for seed in range(max(counts)):
                got = entries(os.path.join(base, f"seed{seed}"))
                for d in dtypes(seed):
                    e = next((x for x in got if x["dtype"] == d), None)
                    r = rows.setdefault((key, d, world), dict(
                        strategy=key, script=script, dtype=d, world=world,
                        args=" ".join(argv), runs=0, fails=0, max_ratio=0.0, seed=None,
                        worst=None, failed=[]))
                    r["runs"] += 1
                    if e is None or not e["ok"]:
                        r["fails"] += 1
                        r["failed"].append(dict(seed=seed, problems=(e or {}).get(
                            "problems", ["no result (the run crashed)"])[:2]))
                    if e is not None and e["worst_ratio"] >= r["max_ratio"]:
                        r.update(max_ratio=e["worst_ratio"], seed=seed, worst=e["worst"])
            print(f"{key} W={world}: {time.time() - t0:.0f} s; " + "; ".join(
                f"{d} {r['runs']} runs {r['fails']} fails max err/tol {r['max_ratio']:.2f}"
                for (k, d, w), r in rows.items() if k == key and w == world), flush=True)
    return list(rows.values()), refused


def plants_phase(only, tmp) -> list:
    """Every plant in its declared configuration: (script, world, args, plant, ok, ratio,
    how it failed)."""
    out = []
    for script, world, args, names in plant_groups():
        key = script[:-3]
        if only and not any(key.startswith(o) or o.startswith(key) for o in only):
            continue
        base = tempfile.mkdtemp(prefix=f"plants-{key}-W{world}-", dir=tmp)
        t0 = time.time()
        argv = ["--mode", "plants", "--plants", ",".join(names), *args, "--timeout", "120",
                "--out", os.path.join(base, "out")]
        rc, _ = launch(script, world, [argv], base, timeout=600 + 120 * len(names))
        verdicts = os.path.join(base, "out", "plants.json")   # (the run's verdicts: a check
        # outside the comparison, --nccl-semantics', fails a run its correctness.json PASSes)
        passed = {}
        if os.path.exists(verdicts):
            with open(verdicts) as f:
                passed = {v["plant"]: v["passed"] for v in json.load(f)}
        got = entries(os.path.join(base, "out"))
        for name in {None, *names} - {e["plant_bug"] for e in got}:   # (a crash: no entry)
            out.append(dict(script=script, world=world, args=" ".join(args), plant=name,
                            dtype=None, ok=name is not None, ratio=None, worst=None,
                            caught_by=f"no result (launch exit {rc})"))
        for e in got:
            ok = passed.get(e["plant_bug"] or "(none)", e["ok"])
            on_tensor = any("over tolerance" in p or " err " in p for p in e["problems"])
            out.append(dict(script=script, world=world, args=" ".join(args),
                            plant=e["plant_bug"], dtype=e["dtype"], ok=ok,
                            ratio=e["worst_ratio"], worst=e["worst"],
                            caught_by=None if ok else "err/tol" if on_tensor else
                            e["problems"][0][:100] if e["problems"] else "another check (" +
                            ("NCCL semantics" if "--nccl-semantics" in args else "the run") + ")"))
        print(f"plants {script} W={world} {' '.join(args)}: {time.time() - t0:.0f} s", flush=True)
    return out


def summary(data: dict) -> list[str]:
    lines = [f"machine: {data['machine']['model_name']} (family {data['machine']['family']}, "
             f"AVX-512 {'yes' if data['machine']['avx512'] else 'no'}), "
             f"torch {data['machine']['torch']}"]
    lines.append(f"{'strategy':<10}{'W':>3}{'dtype':>10}{'runs':>6}{'fails':>7}"
                 f"{'max err/tol':>13}  worst (seed)")
    for r in data["rows"]:
        lines.append(f"{r['strategy']:<10}{r['world']:>3}{r['dtype']:>10}{r['runs']:>6}"
                     f"{r['fails']:>7}{r['max_ratio']:>13.2f}  {r['worst']} ({r['seed']})")
    for r in data["refused"]:
        lines.append(f"{r['strategy']:<10}{r['world']:>3}  refused: {r['reason']}")
    s = data.get("separation")
    if s:
        lines.append(f"margin: largest err/tol of a correct run {s['correct_max_ratio']:.2f}; "
                     f"separation: smallest err/tol of a plant caught on a tensor "
                     f"{s['plant_min_ratio']:.3g} ({s['plant_min']}); {s['plants']} plant runs, "
                     f"{s['caught_on_tensor']} caught on a tensor, {s['caught_by_check']} by "
                     f"another check, {s['missed']} missed; clean runs of the plant configs: "
                     f"{s['clean_fails']} fails")
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="", help="strategy keys (tp,sp,...), comma-separated")
    ap.add_argument("--seeds", default="20,10,10", help="float64,float32,bfloat16 seed counts")
    ap.add_argument("--worlds", default="2,3")
    ap.add_argument("--no-plants", action="store_true")
    ap.add_argument("--extra", default="", help="arguments added to every seeded run "
                    "(tests: '--plant-bug no-average' must count every run as a fail)")
    ap.add_argument("--out", help="write the JSON here (results/verdict-calibration-cpu.json)")
    args = ap.parse_args()
    only = [o for o in args.only.split(",") if o]
    counts = tuple(int(x) for x in args.seeds.split(","))
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        rows, refused = seeds_phase(only, counts, [int(w) for w in args.worlds.split(",")], tmp,
                                    args.extra.split())
        plants = [] if args.no_plants else plants_phase(only, tmp)
    data = dict(command="python scripts/verdict_calibration.py " + " ".join(sys.argv[1:]),
                machine=cpu(), seconds=round(time.time() - t0), rows=rows, refused=refused,
                plants=plants)
    planted = [p for p in plants if p["plant"]]
    tensor = [p for p in planted if not p["ok"] and p["caught_by"] == "err/tol"]
    # (a plant with no result counts as missed: ok=True above; a clean run that FAILs, or has
    # no result, is a false FAIL: both fail the calibration)
    if planted:
        low = min(tensor, key=lambda p: p["ratio"]) if tensor else None
        data["separation"] = dict(
            correct_max_ratio=max((r["max_ratio"] for r in rows), default=0.0),
            plant_min_ratio=low["ratio"] if low else None,
            plant_min=f"{low['script']} {low['plant']} {low['dtype']}" if low else None,
            plants=len(planted), caught_on_tensor=len(tensor),
            caught_by_check=sum(1 for p in planted if not p["ok"]) - len(tensor),
            missed=sum(1 for p in planted if p["ok"]),
            clean_fails=sum(1 for p in plants if not p["plant"] and not p["ok"]))
    print("\n".join(summary(data)))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(data, f, indent=1)
            f.write("\n")
    sep = data.get("separation") or {}
    bad = sum(r["fails"] for r in rows) + sep.get("missed", 0) + sep.get("clean_fails", 0)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
