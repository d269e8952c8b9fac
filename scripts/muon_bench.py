"""muon_bench.py: Muon under sharding measured (docs/muon.md's figures).

    python scripts/muon_bench.py [--model small] [--rounds 2] [--out results/muon-cpu.json]

Under torchrun, on this machine: each layout's step time with AdamW and with Muon in each of
its modes (rounds interleaved: every configuration once per round, the order reversed every
other round; the median kept), the communication per step the meter counted (each row checked
against muon.py's formulas by the benchmark itself), the optimizer-state bytes, rank 0's
Newton-Schulz FLOPs per step (muon.ns_flops over the matrices it orthogonalises), the learning
curves of AdamW and Muon on the synthetic language at the same step budget, and the blockwise
mode's error against one device (the muon-blockwise plant).
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, HERE)


def torchrun(script, world, args, out):
    """One launch; its last PASS/FAIL line."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={world}", os.path.join(HERE, script), *args, "--out", out]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=HERE, timeout=1800)
    last = [ln for ln in r.stdout.splitlines() if ln.startswith(("PASS", "FAIL"))]
    if r.returncode != 0 and not last:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return last[-1] if last else ""


def ns_flops_rank0(model, script, world, optimizer, mode, tp=1):
    """rank 0's Newton-Schulz FLOPs per step, from the layout (no process group needed); tp:
    compose4d's, whose owners are dp ranks (each tp rank of an owner runs its matrices whole)."""
    if optimizer != "muon":
        return 0
    import torch
    from transformers import AutoModelForCausalLM
    import muon
    from harness.models import hidden_matrix, load_config
    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(load_config(model))
    mats = [p.shape for n, p in m.named_parameters() if hidden_matrix(n, p.shape)]
    flops = [muon.ns_flops(s) for s in mats]
    if script in ("ddp.py", "tp.py"):          # replicated / tp-gather: every matrix, every rank
        return sum(flops)
    if mode == "owner":                        # OwnerPlan's balance: largest first, least loaded
        load = [0] * (world // tp)
        for f in sorted(flops, reverse=True):
            load[load.index(min(load))] += f
        return load[0]
    # gather: the matrices rank 0's shard of each layer's flat unit touches (zero_state's units:
    # each decoder layer one unit, its parameters in order, padded to a multiple of W)
    from zero_units import pad_to
    total, layers = 0, {}
    for n, p in m.named_parameters():
        if n.startswith("model.layers."):
            layers.setdefault(n.split(".")[2], []).append((n, p.shape, p.numel()))
    for params in layers.values():
        s = pad_to(sum(k for _, _, k in params), world) // world
        off = 0
        for n, shape, k in params:
            if off < s and hidden_matrix(n, shape):
                total += muon.ns_flops(shape)
            off += k
    return total


def table(d) -> str:
    """docs/muon.md's table (scripts/docs.py renders it from results/muon-cpu.json)."""
    base = {(r["strategy"], r["world"]): r for r in d["rows"] if r["optimizer"] == "adamw"}
    out = ["| layout | W | optimizer | step (ms): median [rounds' range] | vs AdamW | Muon's "
           "extra traffic per step (rank 0, metered) | Newton-Schulz on rank 0 (GFLOP) | "
           "optimizer state, rank 0 |", "|---|---|---|---|---|---|---|---|"]
    for r in d["rows"]:
        a = base[r["strategy"], r["world"]]
        extra = []
        for op, c in r["comm"].items():
            was = a["comm"].get(op, {"calls": 0, "bytes": 0})
            if c["bytes"] != was["bytes"]:
                extra.append(f"{op.split('|')[0]} {c['calls'] - was['calls']:+.0f} calls, "
                             f"{c['bytes'] - was['bytes']:+,.0f} B")
        name = "AdamW" if r["optimizer"] == "adamw" else f"Muon, {r['mode']}"
        spread = f"[{min(r['steps_ms']):,.0f}-{max(r['steps_ms']):,.0f}]"
        out.append(f"| {r['strategy']} | {r['world']} | {name} | {r['step_ms']:,.1f} {spread} | "
                   f"{r['step_ms'] / a['step_ms']:.2f} | {'; '.join(extra) or '-'} | "
                   f"{r['ns_flops_rank0'] / 1e9:.2f} | {r['optimizer_bytes'] / 2**20:.2f} MiB |")
    return "\n".join(out) + "\n"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="small")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--learning-steps", type=int, default=200)
    p.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "muon-cpu.json"),
                   help="the results file (default: the temporary directory's; "
                        "results/muon-cpu.json updates the tracked figures)")
    a = p.parse_args()
    common = ["--model", a.model, "--mode", "benchmark", "--dtype", "float32", "--warmup", "2",
              "--bench-iters", "5", "--batch", "8", "--length", "128"]
    configs = []
    for world in (2, 4):
        configs += [("zero.py", world, "adamw", "-", ["--stage", "1"]),
                    ("zero.py", world, "muon", "owner", ["--stage", "1"]),
                    ("zero.py", world, "muon", "gather", ["--stage", "1"])]
        configs += [("fsdp.py", world, "adamw", "-", []), ("fsdp.py", world, "muon", "owner", [])]
    # (the small model's 6 heads: tp 2 at most)
    configs += [("tp.py", 2, "adamw", "-", []), ("tp.py", 2, "muon", "tp-gather", []),
                ("ddp.py", 2, "adamw", "-", []), ("ddp.py", 2, "muon", "replicated", []),
                ("compose4d.py", 4, "adamw", "-", ["--dp", "2", "--tp", "2"]),
                ("compose4d.py", 4, "muon", "owner", ["--dp", "2", "--tp", "2"])]
    times = {c[:4]: [] for c in configs}
    tp_of = {c[:4]: int(c[4][c[4].index("--tp") + 1]) if "--tp" in c[4] else 1 for c in configs}
    found = {}
    tmp = tempfile.mkdtemp()
    for rnd in range(a.rounds):
        order = configs if rnd % 2 == 0 else configs[::-1]
        for script, world, opt, mode, extra in order:
            out = os.path.join(tmp, f"{script}-{world}-{opt}-{mode}-{rnd}")
            args = [*common, *extra, "--optimizer", opt]
            if mode in ("owner", "gather") and script == "zero.py":
                args += ["--muon-mode", mode]
            line = torchrun(script, world, args, out)
            if not line.startswith("PASS"):
                raise SystemExit(f"{script} W={world} {opt} {mode}: {line}")
            b = json.load(open(os.path.join(out, "benchmark.json")))
            times[script, world, opt, mode].append(b["ours"]["step_s"])
            found[script, world, opt, mode] = b
    rows = []
    for (script, world, opt, mode), ts in times.items():
        b = found[script, world, opt, mode]
        mem = b["ours"]["memory"][0]
        tp = tp_of[script, world, opt, mode]
        name = script[:-3] + (f" (dp {world // tp} x tp {tp})" if tp > 1 else "")
        rows.append(dict(strategy=name, world=world, optimizer=opt, mode=mode,
                         step_ms=round(1e3 * statistics.median(ts), 1),
                         steps_ms=[round(1e3 * t, 1) for t in ts],
                         comm={k: v for k, v in b["ours"]["comm"].items()},
                         optimizer_bytes=mem["optimizer"],
                         ns_flops_rank0=ns_flops_rank0(a.model, script, world, opt, mode, tp)))
    learning = []
    for opt in ("adamw", "muon"):
        out = os.path.join(tmp, f"learn-{opt}")
        line = torchrun("zero.py", 2, ["--mode", "learning", "--optimizer", opt,
                                       "--steps", str(a.learning_steps)], out)
        learning.append(dict(optimizer=opt, line=line, **{
            k: v for k, v in json.load(open(os.path.join(out, "learning.json"))).items()
            if k in ("first", "last", "floor", "ok")}))
    blockwise = []
    for dtype in ("float64", "bfloat16"):
        out = os.path.join(tmp, f"blockwise-{dtype}")
        line = torchrun("tp.py", 2, ["--mode", "correctness", "--optimizer", "muon",
                                     "--plant-bug", "muon-blockwise", "--dtype", dtype], out)
        res = json.load(open(os.path.join(out, "correctness.json")))[0]
        blockwise.append(dict(dtype=dtype, line=line, ok=res["ok"],
                              worst_ratio=res["worst_ratio"],
                              max_param_err=res.get("max_param_err"),
                              max_param_noise=res.get("max_param_noise")))
    import torch
    result = dict(command="python scripts/muon_bench.py " + " ".join(sys.argv[1:]),
                  machine=f"{platform.machine()} CPU, {os.cpu_count()} cores, gloo, torch "
                          f"{torch.__version__}",
                  model=a.model, dtype="float32", rounds=a.rounds, rows=rows,
                  learning=learning, blockwise=blockwise)
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    for r in rows:
        print(f"{r['strategy']:5s} W={r['world']} {r['optimizer']:5s} {r['mode']:10s} "
              f"{r['step_ms']:8.1f} ms  optimizer {r['optimizer_bytes']:>10,} B  "
              f"NS {r['ns_flops_rank0']}")
    for x in learning + blockwise:
        print(x["line"][:160])


if __name__ == "__main__":
    main()
