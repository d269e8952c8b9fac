"""correctness_memory.py: the correctness mode on a real-sized checkpoint, and each rank's peak.

    python scripts/correctness_memory.py          # tp.py, W=3, float64, batch 3, length 32 (--out
                                                  # results/correctness-memory-cpu.json: tracked)
    python scripts/correctness_memory.py --script sp.py --args "--variant ulysses"

The checkpoint has SmolLM-135M's shape (scripts/load_memory.py writes it once to
/tmp/llama-135m-shape: 30 layers, 9 heads / 3 kv heads, vocabulary 49152, tied; 134.5M
parameters, random weights). The run prints each rank's peak resident set (Linux VmHWM) against
one training replica, 4 x params x 8 bytes in float64 (parameters, gradients, AdamW's two
states); rank 0, which also runs the float64 reference and the noise sources one after another,
must stay under 3 replicas. Writes --out (results/correctness-memory-cpu.json: the tracked
one; about 10 minutes on 2 cores).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import bench  # noqa: E402
import load_memory  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--checkpoint", default="/tmp/llama-135m-shape")
    p.add_argument("--script", default="tp.py")
    p.add_argument("--args", default="", help="more arguments for the script")
    p.add_argument("--world", type=int, default=3)
    p.add_argument("--out", default=os.path.join(tempfile.gettempdir(),
                                                  "correctness-memory-cpu.json"),
                   help="the results file (default: the temporary directory's; "
                        "results/correctness-memory-cpu.json updates the tracked figures)")
    a = p.parse_args()
    load_memory.write_checkpoint(a.checkpoint)
    out = tempfile.mkdtemp(prefix="correctness-memory-")
    argv = [a.script, "--mode", "correctness", "--model", a.checkpoint, "--batch", "3",
            "--length", "32", "--dtype", "float64", "--out", out, *shlex.split(a.args)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={a.world}", *argv]
    t0 = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    wall = time.time() - t0
    path = os.path.join(out, "correctness.json")
    if r.returncode != 0 or not os.path.exists(path):
        raise SystemExit(f"{' '.join(argv)} failed (exit {r.returncode}):\n{r.stdout[-3000:]}\n"
                         f"{r.stderr[-3000:]}")
    res = json.load(open(path))[0]
    G = 2 ** 30
    peak = [b / G for b in res["peak_rss_bytes"]]
    row = dict(machine=bench.cpu_machine(), command=f"torchrun --nproc_per_node={a.world} " + " ".join(argv[:-2]),
               strategy=res["strategy"], world=res["world"], dtype=res["dtype"],
               ok=res["ok"], worst_ratio=res["worst_ratio"], wall_s=round(wall, 1),
               replica_gib=res["replica_bytes"] / G, peak_gib=peak,
               start_gib=[b / G for b in res["start_rss_bytes"]],
               rank0_over_replica=res["peak_rss_bytes"][0] / res["replica_bytes"])
    print(f"{row['command']}: {'PASS' if row['ok'] else 'FAIL'} in {wall:.0f} s; peak per rank "
          + ", ".join(f"{x:.2f}" for x in peak) + f" GiB; one replica {row['replica_gib']:.2f} "
          f"GiB: rank 0 at {row['rank0_over_replica']:.2f}x")
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(row, f, indent=1)
    print(f"wrote {a.out}")
    if row["rank0_over_replica"] >= 3 or not row["ok"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
