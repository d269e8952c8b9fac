"""fsdp_designs.py: the two ways to shard parameters, measured side by side on one model.

    python scripts/fsdp_designs.py --out results/fsdp-designs-cpu.json     (~2 minutes, 2 cores)

zero.py --stage 3 keeps each unit's parameters as views into one flat buffer padded to a
multiple of W (DeepSpeed's and FSDP1's layout); fsdp.py cuts every parameter along dim 0 as
FSDP2 does and pads only the communication buffers; PyTorch's FSDP2 runs beside each (their
--compare-native). One `torchrun ... --mode benchmark --compare-native` per (design, W), W = 2
and the uneven 3; from each benchmark.json: collective calls and bytes per step, the padding,
the bytes copied into and out of the communication buffers (the meter's "copy" rows: none for
the flat layout, whose collectives read and write the parameters' own storage), rank 0's model
states and peak, and the step time (ours and FSDP2's, the same process, one after the other).
docs/strategies.md renders the table (scripts/docs.py: table fsdp-designs).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DESIGNS = [("flat (zero.py --stage 3)", "zero.py", ["--stage", "3"]),
           ("per-parameter (fsdp.py)", "fsdp.py", [])]
COMMON = ["--mode", "benchmark", "--model", "tiny", "--dtype", "float32", "--batch", "6",
          "--warmup", "1", "--bench-iters", "3", "--compare-native"]


def measure(script: str, extra: list[str], world: int) -> dict:
    with tempfile.TemporaryDirectory() as out:
        cmd = ["torchrun", "--standalone", f"--nproc_per_node={world}", script, *COMMON, *extra,
               "--out", out]
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
        if p.returncode != 0:
            sys.exit(f"{' '.join(cmd)} failed:\n{p.stdout[-2000:]}{p.stderr[-2000:]}")
        b = json.load(open(os.path.join(out, "benchmark.json")))
    comm = b["ours"]["comm"]
    g = {k.split("|")[0]: v for k, v in comm.items()}
    mem = b["ours"]["memory"][0]
    theirs = b["native"]["torch-fsdp2"]
    return dict(world=world, params=b["params"],
                all_gather=g["all_gather_into_tensor"], reduce_scatter=g["reduce_scatter_tensor"],
                padding=g["reduce_scatter_tensor"]["bytes"] // 4 - b["params"],
                copied=sum(v["bytes"] for k, v in g.items() if "copy" in k),
                model_states=mem["model_states"], peak=mem["peak"],
                step_ms=1e3 * b["ours"]["step_s"], fsdp2_step_ms=1e3 * theirs["step_s"],
                fsdp2_peak=theirs["memory"][0]["peak"])


def table(rows: list[dict]) -> str:
    """The docs' table: one row per (design, W)."""
    out = ["| design | W | all-gathers | reduce-scatters | padding | copied in/out | "
           "model states | peak | step ms (FSDP2's) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ag, rs = r["all_gather"], r["reduce_scatter"]
        out.append(f"| {r['design']} | {r['world']} | {ag['calls']:.0f} x, "
                   f"{ag['bytes'] / 2**20:.2f} MiB | {rs['calls']:.0f} x, "
                   f"{rs['bytes'] / 2**20:.2f} MiB | {r['padding']:,.0f} elements | "
                   f"{r['copied'] / 2**20:.2f} MiB | "
                   f"{r['model_states'] / 2**10:.0f} KiB | {r['peak'] / 2**20:.2f} MiB | "
                   f"{r['step_ms']:.0f} ({r['fsdp2_step_ms']:.0f}) |")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rows = [dict(design=name, **measure(script, extra, w))
            for w in (2, 3) for name, script, extra in DESIGNS]
    print(table(rows))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(command="python scripts/fsdp_designs.py --out " + a.out,
                           machine=f"CPU ({platform.machine()}), {os.cpu_count()} cores, gloo",
                           dtype="float32", model="tiny", batch=6, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
