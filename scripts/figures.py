"""figures.py: the README's pictures, each from a command anyone can rerun.

    python scripts/figures.py --out docs --results results/strategies-cpu.json   # all four, tracked
    python scripts/figures.py                   # all four into a temporary directory
    python scripts/figures.py --only schedules,zigzag     # the two that need no processes

    schedules  docs/pp-schedules.png    every pipeline schedule of pp.py on one time axis:
                                        pp_schedule.simulate()'s unit-cost timelines (F=1,
                                        B=2, I=W=1) at P=4, M=8, the bubble of each beside
                                        its formula
    zigzag     docs/cp-zigzag.png       cp_ring.py's layouts of a causal sequence over W=4
                                        ranks: who owns which query rows, and the attention
                                        work (query-key pairs under the causal mask) per rank
    comm       docs/comm-bars.png       bytes on the wire per rank and optimizer step, by
                                        collective, for each strategy: measured by each
                                        strategy's `--mode benchmark` at W=2 (the same rows
                                        its tests check against the formulas)
    memory     docs/memory-breakdown.png  parameters, gradients, optimizer state and
                                        activations of rank 0 after the same benchmarks (the
                                        live-tensor tracker), beside the single device

comm and memory launch one `torchrun --nproc_per_node=2 <strategy>.py --mode benchmark` per
strategy (the `small` preset, float32, batch 8 x 128 tokens; about 5 minutes on a 2-core CPU)
and write what they plot to results/strategies-cpu.json. The pictures need matplotlib; without
it the data is still computed and written.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, HERE)

# (label, script, extra arguments): every strategy at W=2 on one model
STRATEGIES = [
    ("ddp", "ddp.py", []),
    ("zero-1", "zero.py", ["--stage", "1"]),
    ("zero-2", "zero.py", ["--stage", "2"]),
    ("zero-3", "zero.py", ["--stage", "3"]),
    ("fsdp", "fsdp.py", []),
    ("tp", "tp.py", []),
    ("sp megatron", "sp.py", ["--variant", "megatron"]),
    ("sp ulysses", "sp.py", ["--variant", "ulysses"]),
    ("cp zigzag", "cp_ring.py", ["--variant", "zigzag"]),
    ("pp 1f1b", "pp.py", ["--schedule", "1f1b", "--microbatches", "4"]),
]
BENCH = ["--mode", "benchmark", "--model", "small", "--dtype", "float32", "--batch", "8",
         "--length", "128", "--warmup", "1", "--bench-iters", "2"]
PIPELINES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb", 1), ("dualpipev", 1)]
COLORS = {"F": "tab:blue", "B": "tab:orange", "I": "tab:orange", "W": "tab:green"}


def _plt():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except ImportError:
        return None


# -- pipeline schedules (pure) -----------------------------------------------------------------
def schedule_data(P=4, M=8) -> dict:
    import pp_schedule      # pure Python: no torch needed for this picture
    out = {}
    for name, V in PIPELINES:
        tl, T, bubble, peak = pp_schedule.simulate(name, P, M, V)
        out[name] = dict(V=V, timeline=tl, makespan=T, bubble=bubble, peak=peak,
                         formula=pp_schedule.bubble_formula(name, P, M, V))
    return out


def plot_schedules(path, P=4, M=8):
    data = schedule_data(P, M)
    plt = _plt()
    if plt is None:
        return data
    fig, axes = plt.subplots(len(data), 1, figsize=(11, 1.1 * P * len(data) / 2 + 1),
                             sharex=True)
    for ax, (name, d) in zip(axes, data.items()):
        for r, tl in enumerate(d["timeline"]):
            for kind, c, m, s, e in tl:
                # the later chunks of a rank lighter (interleaved, DualPipeV's way up)
                second = c >= P
                ax.barh(r, e - s, left=s, color=COLORS[kind], alpha=0.55 if second else 1.0,
                        edgecolor="black", linewidth=0.3)
                ax.text((s + e) / 2, r, f"{m}", ha="center", va="center", fontsize=6)
        ax.set_yticks(range(P), [f"rank {r}" for r in range(P)], fontsize=7)
        ax.invert_yaxis()
        label = f"{name}" + (f" V={d['V']}" if d["V"] > 1 else "")
        formula = ("DeepSeek's formula, F&B pairs started together" if name == "dualpipev"
                   else "formula")
        ax.set_title(f"{label}: bubble {d['bubble']:.3f} ({formula} {d['formula']:.3f}), "
                     f"peak in flight {d['peak']}", fontsize=8, loc="left")
    axes[-1].set_xlabel(f"time (unit costs F=1, B=2, I=W=1), P={P}, M={M}; blue F, orange B/I, "
                        f"green W; light: a rank's later chunk; numbers: micro-batch")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return data


# -- context parallel layouts (pure) -----------------------------------------------------------
def zigzag_data(W=4, S=32) -> dict:
    """Per layout: owner[q] (the rank holding query position q) and work[r] (query-key pairs
    with k <= q on rank r's query rows: what its attention computes under the causal mask)."""
    import cp_ring
    out = {}
    for variant in ("ring", "zigzag"):
        owner = [0] * S
        for r, chunks in enumerate(cp_ring.layout(variant, W, S)):
            for a, b in chunks:
                for q in range(a, b):
                    owner[q] = r
        work = [sum(q + 1 for q in range(S) if owner[q] == r) for r in range(W)]
        out["contiguous" if variant == "ring" else "zigzag"] = dict(owner=owner, work=work)
    return out


def plot_zigzag(path, W=4, S=32):
    data = zigzag_data(W, S)
    plt = _plt()
    if plt is None:
        return data
    import numpy as np
    cmap = plt.get_cmap("tab10")
    fig, axes = plt.subplots(1, 3, figsize=(12, 4), gridspec_kw=dict(width_ratios=[1, 1, 1.1]))
    for ax, (name, d) in zip(axes[:2], data.items()):
        img = np.ones((S, S, 3))
        for q in range(S):
            for k in range(q + 1):
                img[q, k] = cmap(d["owner"][q])[:3]
        ax.imshow(img, interpolation="nearest")
        ax.set_title(f"{name}: query rows by rank (causal mask)", fontsize=9)
        ax.set_xlabel("key position")
        ax.set_ylabel("query position")
    ax = axes[2]
    x = np.arange(W)
    for i, (name, d) in enumerate(data.items()):
        ax.bar(x + (i - 0.5) * 0.4, d["work"], 0.4, label=name,
               color=[cmap(r) for r in range(W)], alpha=0.5 if i == 0 else 1.0,
               edgecolor="black", hatch="//" if i == 0 else None)
    ax.set_xticks(x, [f"rank {r}" for r in range(W)])
    ax.set_ylabel("query-key pairs computed")
    ax.set_title(f"attention work per rank, W={W}, S={S}", fontsize=9)
    ax.legend(["contiguous (hatched)", "zig-zag"], fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return data


# -- measured: communication and memory per strategy -------------------------------------------
def wire_bytes(comm: dict, group_sizes: dict, world: int) -> dict:
    """{op: bytes a rank sends per step} from a benchmark.json's comm rows (rank 0's): a
    collective's logical bytes x the ring factor of the op on its group
    (harness.meter.RING_FACTOR), a point-to-point send's bytes (its receive is the peer's send,
    not counted twice)."""
    from harness.meter import RING_FACTOR
    out = {}
    for key, row in comm.items():
        op, group = key.split("|")
        if op == "irecv":
            continue
        n = group_sizes.get(group, world)
        out[op] = out.get(op, 0.0) + row["bytes"] * RING_FACTOR.get(op, lambda w: 1.0)(n)
    return out


def run_benchmarks(strategies, world=2, extra=(), log=print) -> list[dict]:
    rows = []
    for label, script, args in strategies:
        with tempfile.TemporaryDirectory() as out:
            cmd = ["torchrun", "--standalone", f"--nproc_per_node={world}", script, *BENCH,
                   *extra, *args, "--out", out]
            log(f"  {label}: {' '.join(cmd[3:])}")
            p = subprocess.run(cmd, cwd=HERE, capture_output=True, text=True)
            path = os.path.join(out, "benchmark.json")
            if p.returncode != 0 or not os.path.exists(path):
                raise SystemExit(f"{label} failed (exit {p.returncode}):\n{p.stdout[-2000:]}"
                                 f"{p.stderr[-2000:]}")
            with open(path) as f:
                b = json.load(f)
        mem = b["ours"]["memory"][0]
        rows.append(dict(
            label=label, script=script, args=args, world=b["world"], dtype=b["dtype"],
            model=b["model"], batch=b["batch"], length=b["length"], comm_ok=b["comm_ok"],
            wire=wire_bytes(b["ours"]["comm"], b.get("group_sizes", {}), b["world"]),
            memory={k: mem[k] for k in ("params", "grads", "optimizer", "activations", "peak")},
            reference_memory={k: b["reference"]["memory"][0][k] for k in
                              ("params", "grads", "optimizer", "activations", "peak")}
            if b.get("reference") else None))
    return rows


def plot_comm(rows, path):
    plt = _plt()
    if plt is None:
        return
    ops = sorted({op for r in rows for op in r["wire"]})
    cmap = plt.get_cmap("tab10")
    fig, ax = plt.subplots(figsize=(10, 4.5))
    bottom = [0.0] * len(rows)
    for i, op in enumerate(ops):
        vals = [r["wire"].get(op, 0.0) / 2**20 for r in rows]
        ax.bar([r["label"] for r in rows], vals, bottom=bottom, label=op, color=cmap(i))
        bottom = [b + v for b, v in zip(bottom, vals)]
    for x, b in enumerate(bottom):
        ax.text(x, b, f"{b:.1f}", ha="center", va="bottom", fontsize=7)
    r0 = rows[0]
    ax.set_ylabel("MiB sent per rank per optimizer step")
    ax.set_title(f"communication per strategy: {r0['model']}, {r0['dtype']}, W={r0['world']}, "
                 f"batch {r0['batch']} x {r0['length']} (measured, rank 0)", fontsize=9)
    ax.legend(fontsize=7)
    plt.setp(ax.get_xticklabels(), rotation=30, ha="right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_memory(rows, path):
    plt = _plt()
    if plt is None:
        return
    parts = ("params", "grads", "optimizer", "activations")
    bars = ([("single device", rows[0]["reference_memory"])] if rows[0]["reference_memory"]
            else []) + [(r["label"], r["memory"]) for r in rows]
    cmap = plt.get_cmap("tab10")
    fig, ax = plt.subplots(figsize=(10, 4.5))
    bottom = [0.0] * len(bars)
    for i, part in enumerate(parts):
        vals = [m[part] / 2**20 for _, m in bars]
        ax.bar([b for b, _ in bars], vals, bottom=bottom, label=part, color=cmap(i))
        bottom = [b + v for b, v in zip(bottom, vals)]
    for x, (_, m) in enumerate(bars):
        ax.text(x, bottom[x], f"peak {m['peak'] / 2**20:.0f}", ha="center", va="bottom",
                fontsize=7)
    r0 = rows[0]
    ax.set_ylabel("MiB on rank 0")
    ax.set_title(f"memory per strategy: {r0['model']}, {r0['dtype']}, W={r0['world']}, "
                 f"batch {r0['batch']} x {r0['length']} (live-tensor tracker, CPU)", fontsize=9)
    ax.legend(fontsize=7)
    plt.setp(ax.get_xticklabels(), rotation=30, ha="right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python scripts/figures.py", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="schedules,zigzag,comm,memory",
                    help="comma-separated subset of schedules, zigzag, comm, memory")
    ap.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "figures"),
                    help="pictures go here (default: a temporary directory; docs updates the "
                         "README's)")
    ap.add_argument("--results", default=os.path.join(tempfile.gettempdir(), "figures",
                                                      "strategies-cpu.json"),
                    help="where comm/memory write their data (results/strategies-cpu.json: "
                         "the tracked figures)")
    ap.add_argument("--strategies", default=None,
                    help="comma-separated labels of STRATEGIES to benchmark (default: all)")
    ap.add_argument("--bench-args", default="",
                    help="extra arguments for every benchmark (e.g. '--model tiny')")
    ap.add_argument("--replot", action="store_true",
                    help="comm/memory: draw from --results instead of running the benchmarks")
    a = ap.parse_args(argv)
    want = set(a.only.split(","))
    bad = want - {"schedules", "zigzag", "comm", "memory"}
    if bad:
        ap.error(f"unknown figure(s): {', '.join(sorted(bad))}")
    os.makedirs(a.out, exist_ok=True)
    summary = {}
    if "schedules" in want:
        d = plot_schedules(os.path.join(a.out, "pp-schedules.png"))
        summary["schedules"] = {n: dict(bubble=v["bubble"], formula=v["formula"], peak=v["peak"])
                                for n, v in d.items()}
        for n, v in d.items():
            print(f"schedule {n:<12} bubble {v['bubble']:.3f} (formula {v['formula']:.3f}), "
                  f"peak in flight {v['peak']}")
    if "zigzag" in want:
        d = plot_zigzag(os.path.join(a.out, "cp-zigzag.png"))
        summary["zigzag"] = {n: v["work"] for n, v in d.items()}
        for n, v in d.items():
            print(f"cp {n:<11} work per rank {v['work']} (max/min {max(v['work']) / min(v['work']):.2f})")
    if want & {"comm", "memory"}:
        picked = STRATEGIES
        if a.strategies:
            names = a.strategies.split(",")
            unknown = set(names) - {s[0] for s in STRATEGIES}
            if unknown:
                ap.error(f"unknown strategy label(s): {', '.join(sorted(unknown))}")
            picked = [s for s in STRATEGIES if s[0] in names]
        if a.replot:
            with open(a.results) as f:
                rows = json.load(f)["rows"]
        else:
            print(f"benchmarking {len(picked)} strategies at W=2:")
            rows = run_benchmarks(picked, extra=a.bench_args.split())
        if "comm" in want:
            plot_comm(rows, os.path.join(a.out, "comm-bars.png"))
        if "memory" in want:
            plot_memory(rows, os.path.join(a.out, "memory-breakdown.png"))
        if not a.replot:
            os.makedirs(os.path.dirname(a.results), exist_ok=True)
            with open(a.results, "w") as f:
                json.dump(dict(machine="CPU (gloo)", rows=rows), f, indent=1)
        for r in rows:
            m = r["memory"]
            print(f"{r['label']:<12} wire/rank {sum(r['wire'].values()) / 2**20:8.2f} MiB  "
                  f"params {m['params'] / 2**20:6.1f}  grads {m['grads'] / 2**20:6.1f}  "
                  f"optimizer {m['optimizer'] / 2**20:6.1f}  activations "
                  f"{m['activations'] / 2**20:6.1f} MiB  (comm {'ok' if r['comm_ok'] else 'MISMATCH'})")
    return summary


if __name__ == "__main__":
    main()
