"""tour.py: run every strategy's correctness check under torchrun on CPU and summarise.

    python tour.py              # every entry whose script exists
    python tour.py --only ddp   # entries whose label starts with "ddp"
    python tour.py --plants     # every planted bug (--plant-bug NAME) must FAIL, clean runs PASS
    python tour.py --out results/tour-cpu.json   # also write the rows (the docs quote them)

Each entry is one `torchrun --standalone --nproc_per_node=W script --mode correctness` run
against the single-device reference; the table shows what each compared and its worst error.
A strategy joins the tour by adding its lines to TOUR below.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))

# (label, script, world size, extra arguments)
TOUR = [
    ("ddp", "ddp.py", 2, []),
    ("ddp float32 grad-accum 2", "ddp.py", 2, ["--dtype", "float32", "--grad-accum", "2"]),
    ("ddp W=3 grad-accum 2", "ddp.py", 3, ["--batch", "6", "--grad-accum", "2"]),
    ("zero1 clip", "zero.py", 2, ["--stage", "1", "--clip", "0.5"]),
    ("zero2 clip", "zero.py", 2, ["--stage", "2", "--clip", "0.5"]),
    ("zero3 clip", "zero.py", 2, ["--stage", "3", "--clip", "0.5"]),
    ("zero3 W=3 uneven shards", "zero.py", 3, ["--stage", "3", "--batch", "6"]),
    ("fsdp clip", "fsdp.py", 2, ["--clip", "0.5"]),
    ("fsdp W=3 uneven shards", "fsdp.py", 3, ["--batch", "6"]),
    ("tp", "tp.py", 2, ["--model", "configs/tiny-gqa8.json"]),
    ("tp W=4 padded vocab", "tp.py", 4, ["--model", "configs/tiny-gqa8.json"]),
    ("sp megatron", "sp.py", 2, ["--model", "configs/tiny-gqa8.json"]),
    ("sp megatron W=4", "sp.py", 4, ["--model", "configs/tiny-gqa8.json"]),
    ("sp ulysses", "sp.py", 2, ["--variant", "ulysses", "--model", "configs/tiny-gqa8.json"]),
    ("sp ulysses W=4", "sp.py", 4, ["--variant", "ulysses", "--model", "configs/tiny-gqa8.json"]),
    ("cp zigzag", "cp_ring.py", 2, []),
    ("cp zigzag W=4", "cp_ring.py", 4, []),
    ("cp ring W=4", "cp_ring.py", 4, ["--variant", "ring"]),
    ("cp allgather W=4", "cp_ring.py", 4, ["--variant", "allgather"]),
    ("pp gpipe", "pp.py", 2, ["--schedule", "gpipe"]),
    ("pp 1f1b W=4", "pp.py", 4, ["--schedule", "1f1b"]),
    ("pp interleaved V=2", "pp.py", 2, ["--schedule", "interleaved"]),
    ("pp zb-h1 W=4", "pp.py", 4, ["--schedule", "zb"]),
    ("pp dualpipev M=4", "pp.py", 2, ["--schedule", "dualpipev", "--microbatches", "4"]),
    ("ep dropless aux-loss", "ep_moe.py", 2, []),
    ("ep W=4 capacity 1.0 z-loss", "ep_moe.py", 4, ["--capacity-factor", "1.0", "--z-coef", "1e-3"]),
    ("ep W=4 aux-free bias", "ep_moe.py", 4, ["--aux-free-bias", "--aux-coef", "0", "--steps", "3"]),
    ("4d tp2 x pp2 x cp2 +sp (8 procs)", "compose4d.py", 8,
     ["--tp", "2", "--pp", "2", "--cp", "2", "--sp", "--grad-accum", "2", "--clip", "0.5"]),
    ("4d dp2 x tp2 zero2", "compose4d.py", 4, ["--tp", "2", "--zero", "2"]),
    ("4d dp2 x pp2 interleaved", "compose4d.py", 4,
     ["--pp", "2", "--schedule", "interleaved", "--grad-accum", "2"]),
]


def torchrun_cmd(nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={nproc}"]


def run_entry(script, nproc, extra, timeout=600):
    with tempfile.TemporaryDirectory() as out:
        cmd = torchrun_cmd(nproc) + [os.path.join(HERE, script), "--mode", "correctness",
                                     "--out", out] + [os.path.join(HERE, a) if a.startswith(
                                         "configs/") else a for a in extra]
        t0 = time.time()
        env = dict(os.environ, OMP_NUM_THREADS="1")
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        secs = time.time() - t0
        path = os.path.join(out, "correctness.json")
        results = json.load(open(path)) if os.path.exists(path) else []
    last = next((l for l in reversed(p.stdout.splitlines()) if l.startswith(("PASS", "FAIL"))),
                None)
    return p.returncode, results, last, secs, p


STRATEGIES = {"ddp.py": "DDP", "zero.py": "ZeRO", "zeropp.py": "ZeroPlusPlus", "fsdp.py": "FSDP",
              "tp.py": "TP", "sp.py": "SP", "pp.py": "PP", "cp_ring.py": "CP",
              "ep_moe.py": "ExpertParallel", "compose4d.py": "Compose4D"}


def rig_module(script: str) -> str:
    """Where a script's adapter class lives: its module in rig/."""
    return "rig." + script[:-3]


def plant_groups(only=None):
    """(script, world, args, [plant names]): each strategy's planted bugs, grouped by the
    configuration they declare (harness.Plant.args)."""
    import importlib
    sys.path.insert(0, HERE)
    out = {}
    for script, cls_name in STRATEGIES.items():
        if only and not script.startswith(only):
            continue
        cls = getattr(importlib.import_module(rig_module(script)), cls_name)
        for name, plant in cls.plants.items():
            out.setdefault((script, plant.world, tuple(plant.args)), []).append(name)
    from harness import HARNESS_PLANTS   # the shared optimizer's (MasterAdamW), under ddp.py
    for name, plant in HARNESS_PLANTS.items():
        if plant.args and (not only or "ddp.py".startswith(only)):
            out.setdefault(("ddp.py", plant.world, tuple(plant.args)), []).append(name)
    return [(s, w, list(a), names) for (s, w, a), names in out.items()]


def write_rows(path, hdr, rows, **extra):
    """--out: the summary as JSON, one dict per row, with the machine it ran on."""
    if path:
        import platform
        with open(path, "w") as f:
            json.dump(dict(command=" ".join(["python", "tour.py"] + sys.argv[1:]),
                           machine=f"{platform.machine()} CPU, {os.cpu_count()} cores, gloo",
                           rows=[dict(zip(hdr, row)) for row in rows], **extra), f, indent=1)


def run_plants(only=None, out=None):
    """Every planted bug must FAIL and each clean configuration PASS (`--mode plants`)."""
    rows, failed = [], 0
    groups = plant_groups(only)
    for i, (script, nproc, extra, names) in enumerate(groups):
        cmd = torchrun_cmd(nproc) + [os.path.join(HERE, script), "--mode", "plants",
                                     "--plants", ",".join(names)] + [
            os.path.join(HERE, a) if a.startswith("configs/") else a for a in extra]
        print(f"[{i + 1}/{len(groups)}] {' '.join(cmd[2:])}", flush=True)
        with tempfile.TemporaryDirectory() as out:
            p = subprocess.run(cmd + ["--out", out], capture_output=True, text=True,
                               timeout=900, env=dict(os.environ, OMP_NUM_THREADS="1"))
            path = os.path.join(out, "plants.json")
            res = json.load(open(path)) if os.path.exists(path) else []
        verdicts = {r["plant"]: r["passed"] for r in res}
        if p.returncode or verdicts.get("(none)") is not True:
            failed += 1
            print(p.stdout[-3000:] + p.stderr[-3000:])
        for n in ["(none)"] + names:
            v = verdicts.get(n)
            expect = n == "(none)"
            rows.append((script, nproc, " ".join(extra) or "-", n,
                         "?" if v is None else ("PASS" if v else "FAIL"),
                         "ok" if v is expect else "WRONG"))
    hdr = ("script", "W", "configuration", "plant", "verdict", "")
    widths = [max(len(str(x)) for x in col) for col in zip(hdr, *rows)]
    print()
    for row in [hdr] + rows:
        print("  ".join(str(x).ljust(w) for x, w in zip(row, widths)))
    wrong = sum(1 for r in rows if r[-1] != "ok")
    caught = sum(1 for r in rows if r[3] != '(none)' and r[-1] == 'ok')
    print(f"\n{caught} planted bugs caught, {wrong} wrong verdicts")
    write_rows(out, ("script", "world", "configuration", "plant", "verdict", "as_expected"), rows,
               configurations=len(groups), caught=caught, wrong=wrong)
    sys.exit(1 if wrong or failed else 0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default=None, help="run entries whose label starts with this")
    ap.add_argument("--plants", action="store_true",
                    help="instead: run every strategy's planted bugs (each must FAIL)")
    ap.add_argument("--out", default=None, help="write the summary's rows to this JSON file")
    args = ap.parse_args()
    start = time.time()
    if args.plants:
        run_plants(args.only, args.out)
    entries = [e for e in TOUR if os.path.exists(os.path.join(HERE, e[1]))
               and (args.only is None or e[0].startswith(args.only))]
    rows, failed = [], 0
    for label, script, nproc, extra in entries:
        print(f"[{len(rows) + 1}/{len(entries)}] torchrun --nproc_per_node={nproc} {script} "
              f"--mode correctness {' '.join(extra)}", flush=True)
        rc, results, last, secs, p = run_entry(script, nproc, extra)
        ok = rc == 0 and results and all(r["ok"] for r in results)
        failed += not ok
        if not ok:
            print(p.stdout[-3000:] + p.stderr[-3000:])
        r = results[0] if results else {}
        rows.append((label, nproc, r.get("dtype", "?"),
                     f"{r.get('grads_compared', '?')}+{r.get('params_compared', '?')}"
                     f"/{2 * r['tensors'] if r else '?'}",
                     f"{r['max_rel_err']:.1e}" if r else "-",
                     f"{r['worst_ratio']:.2f}" if r else "-", f"{secs:.0f}s",
                     "PASS" if ok else "FAIL"))
    hdr = ("strategy", "W", "dtype", "grads+params", "max rel err", "worst err/tol", "time",
           "result")
    widths = [max(len(str(x)) for x in col) for col in zip(hdr, *rows)]
    print()
    for row in [hdr] + rows:
        print("  ".join(str(x).ljust(w) for x, w in zip(row, widths)))
    print(f"\n{len(rows) - failed} passed, {failed} failed")
    write_rows(args.out, ("strategy", "world", "dtype", "compared", "max_rel_err", "worst_ratio",
                          "time", "result"), rows, passed=len(rows) - failed, failed=failed,
               seconds=round(time.time() - start))   # (the whole tour, start-ups included)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
