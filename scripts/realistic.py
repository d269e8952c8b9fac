"""realistic.py: every strategy's correctness on a checkpoint that behaves like a trained one,
each error beside the noise it was judged against (the README's numerics table).

    python scripts/realistic.py                 # W=2 and 3, float64 and float32 (~10 min, CPU)
    python scripts/realistic.py --world 2 --only tp,cp-zigzag --model DIR
    python scripts/realistic.py --world 2 --out results/realistic-cpu.json   # the docs' table

Builds scripts/make_checkpoint.py's checkpoints into --ckpt (once), then runs
`torchrun --nproc_per_node=W <script> --mode correctness --dtype float64,float32` per strategy
and prints a markdown table. tests/test_realistic.py runs the same RUNS.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

DATA = ["--batch", "6", "--length", "48"]
RUNS = {   # label -> (script, extra args); ep-moe runs on the Mixtral checkpoint
    "ddp": ("ddp.py", []),
    "zero2": ("zero.py", ["--stage", "2"]),
    "zero3": ("zero.py", ["--stage", "3"]),
    "fsdp": ("fsdp.py", []),
    "tp": ("tp.py", []),
    "sp-megatron": ("sp.py", []),
    "sp-ulysses": ("sp.py", ["--variant", "ulysses"]),
    "cp-zigzag": ("cp_ring.py", []),
    "pp-1f1b": ("pp.py", ["--schedule", "1f1b", "--microbatches", "3"]),
    "ep-moe": ("ep_moe.py", []),
    "4d": ("compose4d.py", None),    # layout per world size: LAYOUT_4D
}
LAYOUT_4D = {2: ["--tp", "2", "--sp"], 3: ["--pp", "3", "--grad-accum", "3"]}


def command(label: str, world: int, model: str, dtypes: str = "float64,float32") -> list[str]:
    script, extra = RUNS[label]
    extra = LAYOUT_4D[world] if extra is None else extra
    return [os.path.join(ROOT, script), "--mode", "correctness", "--model", model,
            "--dtype", dtypes, *DATA, *extra]


def checkpoints(root: str) -> dict:
    return {kind: checkpoint(root, kind) for kind in ("llama", "moe")}


def checkpoint(root: str, kind: str) -> str:
    """make_checkpoint's `kind` (llama, moe, qwen3) under root, built the first time."""
    import make_checkpoint
    path = os.path.join(root, kind)
    if not os.path.isfile(os.path.join(path, "config.json")):
        make_checkpoint.build(path, moe=kind == "moe", family="qwen3" if kind == "qwen3"
                              else "llama")
    return path


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ckpt", default=os.path.join(tempfile.gettempdir(), "realistic-ckpt"))
    ap.add_argument("--world", default="2,3")
    ap.add_argument("--only", default=None, help="comma-separated labels of RUNS")
    ap.add_argument("--out", help="write the rows as JSON here (results/realistic-cpu.json, "
                    "which docs/correctness.md's table renders)")
    a = ap.parse_args()
    ck = checkpoints(a.ckpt)
    labels = a.only.split(",") if a.only else list(RUNS)
    rows = []
    for world in map(int, a.world.split(",")):
        for label in labels:
            model = ck["moe" if label == "ep-moe" else "llama"]
            with tempfile.TemporaryDirectory() as out:
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                       f"--nproc_per_node={world}", *command(label, world, model), "--out", out]
                t0 = time.time()
                p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                                   env=dict(os.environ, OMP_NUM_THREADS="1"))
                path = os.path.join(out, "correctness.json")
                res = json.load(open(path)) if os.path.exists(path) else []
            print(f"{label} W={world}: rc {p.returncode}, {time.time() - t0:.0f} s", flush=True)
            if not res:
                print(p.stdout[-2000:] + p.stderr[-2000:])
            for r in res:
                loss = r["scalars"]["loss"]
                rows.append((label, world, r["dtype"],
                             f"{r['max_grad_err']:.1e}", f"{r['max_grad_noise']:.1e}",
                             f"{r['max_param_err']:.1e}", f"{r['max_param_noise']:.1e}",
                             f"{loss['err']:.1e}", f"{loss['noise']:.1e}",
                             f"{r['worst_ratio']:.2f}", "PASS" if r["ok"] else "FAIL"))
    hdr = ("strategy", "W", "dtype", "grad err", "grad noise", "param err", "param noise",
           "loss err", "loss noise", "worst err/tol", "verdict")
    print("\n| " + " | ".join(hdr) + " |\n|" + "---|" * len(hdr))
    for r in rows:
        print("| " + " | ".join(map(str, r)) + " |")
    if a.out:
        import platform
        keys = ("strategy", "world", "dtype", "grad_err", "grad_noise", "param_err", "param_noise",
                "loss_err", "loss_noise", "worst_ratio", "verdict")
        out_rows = [dict(zip(keys, [r[0], r[1], r[2], *map(float, r[3:10]), r[10]]))
                    for r in rows]
        with open(a.out, "w") as f:
            json.dump(dict(
                command="python scripts/realistic.py " + " ".join(sys.argv[1:]),
                machine=f"{platform.machine()} CPU ({platform.processor() or 'unknown'}), "
                        f"{os.cpu_count()} cores, gloo, one thread per rank",
                world=int(a.world) if a.world.isdigit() else a.world, dtypes="float64,float32",
                data="batch 6, length 48, 2 steps; scripts/make_checkpoint.py's checkpoints "
                     "(llama; moe for ep-moe)",
                what="per strategy and dtype: the largest error over tensors and steps and the "
                     "largest noise it was judged against, for gradients, parameters and the "
                     "loss; worst_ratio: the largest err/tol of any row",
                worst_ratio=max(r["worst_ratio"] for r in out_rows), rows=out_rows), f, indent=1)
            f.write("\n")
    sys.exit(0 if rows and all(r[-1] == "PASS" for r in rows) else 1)


if __name__ == "__main__":
    main()
