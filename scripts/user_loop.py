"""user_loop.py: a user's own loop with PyTorch's utilities on fsdp.fully_shard and on FSDP2, on
tp.parallelize and on PyTorch's DTensor TP.

    python scripts/user_loop.py --out results/user-loop-cpu.json

The loop (tests/user_loop_check.py): torch.compile, torch.nn.utils.clip_grad_norm_, AdamW, a
torch.distributed.checkpoint save of get_state_dict(model, opt) at W=2 after step 2, loaded at
W=1 (unsharded) and W=4 into fresh models, steps 3-4. Per implementation: the largest relative
difference of its losses from one device's, of each loaded run's from the saving run's, the
largest absolute difference of a loaded tensor (model and AdamW state) from the saved one; and
for ours the planted bug `shard-unlabelled` / `tp-unlabelled` (plain tensors: torch's clip
takes each rank's norm). DTensor TP loads at W=1 only (its plan cannot split tiny's 2 kv heads
4 ways; tp.py puts each on 2 ranks). tests/test_torch_utils.py asserts the same numbers."""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECK = os.path.join(ROOT, "tests", "user_loop_check.py")


def phase(tmp, impl, name, W, *extra) -> dict:
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                    f"--nproc_per_node={W}", CHECK, "--impl", impl, "--phase", name, "--dir",
                    tmp, *extra], check=True, capture_output=True,
                   env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"))
    with open(os.path.join(tmp, f"{impl}-{name}-W{W}.json")) as f:
        return json.load(f)


def rel(got: dict, want: dict) -> float:
    return max(abs(got[k] - want[k]) / abs(want[k]) for k in got)


IMPLS = ("ours", "torch", "ours-tp", "torch-tp")


def line(row: dict) -> str:
    """One implementation's figures, readable."""
    out = f"{row['impl']:<9} vs one device {row['vs_one_device']:.1e}"
    if "planted_vs_one_device" in row:
        out += f"  planted {row['planted_vs_one_device']:.1e}"
    out += f"  saved at W=2 in {row['save_s']:.3f} s"
    for W in (1, 4):
        if f"load_W{W}_max_abs_diff" in row:
            out += (f"  loaded at W={W} in {row[f'load_W{W}_s']:.3f} s: max |diff| "
                    f"{row[f'load_W{W}_max_abs_diff']:.1f}, steps 3-4 vs the saving run "
                    f"{row[f'load_W{W}_vs_saving_run']:.1e}")
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None)
    p.add_argument("--impl", default=",".join(IMPLS), help="a comma-separated subset of "
                   + ", ".join(IMPLS))
    a = p.parse_args()
    import torch
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        plants = {"ours": "shard-unlabelled", "ours-tp": "tp-unlabelled"}
        for impl in a.impl.split(","):
            extra = ["--plant-bug", plants[impl]] if impl in plants else []
            saved = phase(tmp, impl, "save", 2, *extra)
            row = dict(impl=impl, vs_one_device=rel(saved["losses"], saved["reference"]),
                       save_s=saved["save_s"])
            if "planted" in saved:
                row["planted_vs_one_device"] = rel(saved["planted"], saved["reference"])
            for W in ((1,) if impl == "torch-tp" else (1, 4)):
                got = phase(tmp, impl, "load", W)
                row[f"load_W{W}_max_abs_diff"] = got["max_abs_diff"]
                row[f"load_W{W}_vs_saving_run"] = rel(got["losses"], saved["losses"])
                row[f"load_W{W}_s"] = got["load_s"]
            rows.append(row)
            print(line(row), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(command="python scripts/user_loop.py --out " + a.out,
                           machine=f"{platform.machine()} CPU, {os.cpu_count()} cores, gloo, "
                                   f"torch {torch.__version__}",
                           dtype="float32", model="tiny (HF Llama)", rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
