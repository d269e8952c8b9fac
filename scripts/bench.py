"""bench.py: every strategy against PyTorch's own implementation and the single-device reference,
timed interleaved, into results/bench-cpu.json (`make bench`).

    python scripts/bench.py --out results/bench-cpu.json   # every row, W=2 and 4, 8 rounds each
    make bench                                     # the README's: W=2 at 6 rounds, W=4 at 4 (~35 min on 2 cores)
    python scripts/bench.py --world 2 --only ddp,zero-1 --pairs 4 --out /tmp/b.json
    python scripts/bench.py --world 4 --only zero-1 --merge     # redo rows, keep the others
    python scripts/bench.py --table results/bench-cpu.json      # every row
    python scripts/bench.py --table results/bench-cpu.json --wide   # the README's table

One `torchrun --nproc_per_node=W <strategy>.py --mode benchmark --compare-native --paired N` per
(strategy, W): ours, each of its baselines and the single-device reference are built side by side
and step in turn, one step each, N rounds, the order reversed every other round (A B, B A, ...;
harness/benchmark.py: paired_ratios), so each round's ratio ours/theirs shares the machine's
state of that moment. Written per (strategy, baseline, W):

    {"strategy", "baseline", "world", "dtype", "ratio_median", "ratio_p10", "ratio_p90",
     "ours_ms", "theirs_ms", "overlap_share", "pairs", "model", "machine"}

ours_ms and theirs_ms are the median step times of the same rounds (max over ranks).

overlap_share is ours, from the median of 3 profiled steps per rank (harness/overlap.py); null when the step has no
communication. The baselines (each strategy's `native`): ddp.py torch DDP; zero.py stages 1, 2
ZeroRedundancyOptimizer over torch DDP, stage 3 FSDP2; fsdp.py FSDP2 (`fully_shard`) and our DDP;
tp.py DTensor TP; sp.py our TP (no DTensor SP baseline); sp.py --async-tp the same regions
synchronous (rig.sp.SyncMegatronSP); ddp.py --ce-chunk the same DDP with the loss on the full logits
(rig.ddp.FullLogitsDDP); pp.py torch.distributed.pipelining's
class for each schedule (ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B,
ScheduleInterleavedZeroBubble, ScheduleDualPipeV); cp_ring.py only the reference (torch's
context_parallel has no CPU sharding rule for SDPA in torch 2.13). A configuration a strategy
refuses at a world size (its one `error:` line) is written as {"strategy", "world", "skipped"}.
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (label, script, extra arguments). tp and sp run the small preset with 8 heads / 4 kv heads
# (configs/small-gqa8.json): the small preset's 6 heads do not split over 4 ranks.
GQA8 = ["--model", "configs/small-gqa8.json"]
PP = ["--microbatches", "8"]
ROWS = [
    ("ddp", "ddp.py", []),
    ("zero-1", "zero.py", ["--stage", "1"]),
    ("zero-2", "zero.py", ["--stage", "2"]),
    ("zero-3", "zero.py", ["--stage", "3"]),
    ("fsdp", "fsdp.py", []),
    ("tp", "tp.py", GQA8),
    ("sp megatron", "sp.py", ["--variant", "megatron", *GQA8]),
    ("sp ulysses", "sp.py", ["--variant", "ulysses", *GQA8]),
    ("sp async-tp", "sp.py", ["--variant", "megatron", "--async-tp", *GQA8]),
    ("ddp ce-chunk", "ddp.py", ["--ce-chunk", "256"]),
    ("cp zigzag", "cp_ring.py", ["--variant", "zigzag"]),
    ("pp gpipe", "pp.py", ["--schedule", "gpipe", *PP]),
    ("pp 1f1b", "pp.py", ["--schedule", "1f1b", *PP]),
    ("pp interleaved", "pp.py", ["--schedule", "interleaved", *PP]),
    ("pp zb", "pp.py", ["--schedule", "zb", *PP]),
    ("pp dualpipev", "pp.py", ["--schedule", "dualpipev", *PP]),
]
BENCH = ["--mode", "benchmark", "--compare-native", "--dtype", "float32", "--batch", "8",
         "--length", "128", "--warmup", "2", "--bench-iters", "2"]


def machine() -> str:
    return f"{platform.machine()} CPU, {os.cpu_count()} cores, gloo"


def cpu_machine() -> str:
    """The `machine` of the measurement scripts' results files: 'CPU (N cores, processor), gloo'."""
    return f"CPU ({os.cpu_count()} cores, {platform.processor() or platform.machine()}), gloo"


def torchrun_json(world: int, argv: list[str], result: str = "benchmark.json",
                  prefix: str = "run-") -> tuple[dict, str]:
    """`torchrun --nproc_per_node=world argv --out DIR` in the repository: (DIR/result parsed,
    the command without --out). A failed run ends the script with its output."""
    out = tempfile.mkdtemp(prefix=prefix)
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        f"--nproc_per_node={world}", *argv, "--out", out], capture_output=True,
                       text=True, cwd=HERE)
    path = os.path.join(out, result)
    if r.returncode != 0 or not os.path.exists(path):
        raise SystemExit(f"{' '.join(argv)} failed (exit {r.returncode}):\n{r.stdout[-3000:]}")
    with open(path) as f:
        return json.load(f), f"torchrun --nproc_per_node={world} " + " ".join(argv)


def write_results(name: str, res: dict, out: str | None = None) -> str:
    """Indented JSON at `out` (results/NAME updates the tracked figures), by default the temporary
    directory's NAME; returns its path (printed)."""
    path = out or os.path.join(tempfile.gettempdir(), name)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    print(f"wrote {path}")
    return path


def run_one(label, script, extra, world, pairs, model, verbose=False) -> list[dict]:
    """The rows of one launch; a launch the strategy refuses (exit 2: the configuration does not
    fit this world size) or that fails gives one row with `skipped`, the reason, instead."""
    model_args = [] if "--model" in extra else ["--model", model]
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={world}", os.path.join(HERE, script), *BENCH, *model_args,
               "--paired", str(pairs), "--out", out, *extra]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        p = subprocess.run(cmd, capture_output=True, text=True, cwd=HERE, env=env)
        if verbose or p.returncode:
            print(p.stdout[-4000:], p.stderr[-2000:] if p.returncode else "", flush=True)
        path = os.path.join(out, "benchmark.json")
        if p.returncode or not os.path.exists(path):
            lines = [l for l in (p.stderr + p.stdout).splitlines() if l.startswith("error:")]
            why = lines[0] if lines else f"failed (exit {p.returncode})"   # error: a refusal
            return [dict(strategy=label, baseline=None, world=world, dtype="float32",
                         skipped=why, model=model_args[1] if model_args else extra[-1],
                         machine=machine())]
        with open(path) as f:
            b = json.load(f)
    rows = []
    for base, r in b["paired"].items():
        rows.append(dict(strategy=label, baseline=base, world=world, dtype=b["dtype"],
                         ratio_median=round(r["median"], 4), ratio_p10=round(r["p10"], 4),
                         ratio_p90=round(r["p90"], 4), ours_ms=round(r["ours_ms"], 2),
                         theirs_ms=round(r["theirs_ms"], 2),
                         overlap_share=(None if b["overlap_share"] is None
                                        else round(b["overlap_share"], 4)),
                         pairs=r["n"], model=b["model"], machine=machine()))
    return rows


def table(rows) -> str:
    lines = ["| strategy | baseline | W | ours/theirs median (p10-p90) | overlap share (ours) "
             "| model |", "|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("skipped"):
            lines.append(f"| {r['strategy']} | - | {r['world']} | not run: {r['skipped']} | - "
                         f"| {r.get('model', '-')} |")
            continue
        ov = "-" if r["overlap_share"] is None else f"{r['overlap_share']:.0%}"
        lines.append(f"| {r['strategy']} | {r['baseline']} | {r['world']} | "
                     f"{r['ratio_median']:.2f} ({r['ratio_p10']:.2f}-{r['ratio_p90']:.2f}) | "
                     f"{ov} | {r['model']} |")
    return "\n".join(lines)


def wide_table(rows) -> str:
    """The README's form: one line per (strategy, baseline), one column per world size, the
    median ratio with its p10-p90 spread, and ours' overlap share per world size."""
    worlds = sorted({r["world"] for r in rows})
    lines, seen = [], {}
    for r in rows:
        key = (r["strategy"], r.get("baseline") or "-")
        seen.setdefault(key, {})[r["world"]] = r
    head = ["strategy", "baseline"] + [f"W={w} ours/theirs" for w in worlds] + \
        [f"overlap W={w}" for w in worlds]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (strategy, base), by_world in seen.items():
        cells, overlap = [], []
        for w in worlds:
            r = by_world.get(w)
            if r is None:
                cells.append("-")
            elif r.get("skipped"):
                cells.append(f"not run: {r['skipped']}")
            else:
                cells.append(f"{r['ratio_median']:.2f} ({r['ratio_p10']:.2f}-{r['ratio_p90']:.2f})")
            ov = None if r is None else r.get("overlap_share")
            overlap.append("-" if ov is None else f"{ov:.0%}")
        lines.append("| " + " | ".join([strategy, base, *cells, *overlap]) + " |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", default="2,4", help="world sizes, comma-separated")
    p.add_argument("--only", default=None, help="labels to run, comma-separated (default all)")
    p.add_argument("--pairs", type=int, default=8, help="interleaved rounds per run")
    p.add_argument("--model", default="small")
    p.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "bench-cpu.json"),
                   help="the results file (default: the temporary directory's; "
                        "results/bench-cpu.json updates the tracked table, as `make bench` does)")
    p.add_argument("--merge", action="store_true",
                   help="keep --out's other rows: replace only the (strategy, W) runs made now")
    p.add_argument("--table", metavar="JSON", default=None,
                   help="print the markdown table of a written file and exit (runs nothing)")
    p.add_argument("--wide", action="store_true",
                   help="with --table: one line per pair, a column per world size (the README's)")
    p.add_argument("--verbose", action="store_true")
    a = p.parse_args()
    if a.table:
        with open(a.table) as f:
            rows = json.load(f)
        print(wide_table(rows) if a.wide else table(rows))
        return
    only = None if a.only is None else set(a.only.split(","))
    unknown = (only or set()) - {label for label, _, _ in ROWS}
    if unknown:
        print(f"error: unknown --only labels {sorted(unknown)}; known: "
              f"{', '.join(label for label, _, _ in ROWS)}", file=sys.stderr)
        sys.exit(2)
    order = {label: i for i, (label, _, _) in enumerate(ROWS)}
    old = []
    if a.merge and os.path.exists(a.out):
        with open(a.out) as f:
            old = json.load(f)

    def save(rows):
        """The table so far (after every launch: an interrupted run keeps what it measured);
        with --merge, the old rows of every (strategy, W) not run again."""
        done = {(r["strategy"], r["world"]) for r in rows}
        out = sorted([r for r in old if (r["strategy"], r["world"]) not in done] + rows,
                     key=lambda r: (r["world"], order.get(r["strategy"], len(order))))
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
        return out

    rows = []   # this invocation's runs (save() adds --merge's older rows to the file)
    for world in [int(w) for w in a.world.split(",")]:
        for label, script, extra in ROWS:
            if only is None or label in only:
                got = run_one(label, script, extra, world, a.pairs, a.model, a.verbose)
                for r in got:
                    if r.get("skipped"):
                        print(f"{label:<12} W={world} not run: {r['skipped']}", flush=True)
                        continue
                    print(f"{label:<12} W={world} vs {r['baseline']:<16} median "
                          f"{r['ratio_median']:.3f} (p10 {r['ratio_p10']:.3f}, p90 "
                          f"{r['ratio_p90']:.3f})  overlap {r['overlap_share']}", flush=True)
                rows += got
                save(rows)
    print(table(save(rows)))
    print(f"wrote {a.out}")
    if any(r.get("skipped", "").startswith("failed") for r in rows):   # this run's, not merged
        sys.exit(1)


if __name__ == "__main__":
    main()
