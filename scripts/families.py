"""families.py: every strategy on one small random model per HF decoder family, float64.

    python scripts/families.py                       # the whole table, W=2 (compose4d W=4)
    python scripts/families.py --out results/families-cpu.json

Each cell is one `torchrun ... --mode correctness` (PASS / FAIL) or the one-line refusal a
strategy gives for a model it does not support (exit 2, before any collective). A cell that
ends any other way (a traceback, a hang) is reported as CRASH: the table's promise is that no
cell does. The families are harness.models' tiny-* presets; what each adds is in the preset's
comment there and in docs/strategies.md ("Model families").
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAMILIES = ["tiny", "tiny-mistral", "tiny-qwen2", "tiny-qwen3", "tiny-olmo2", "tiny-gemma2",
            "tiny-phi3", "tiny-gemma3", "tiny-olmo3", "tiny-cohere", "tiny-granite", "tiny-neox",
            "tiny-gpt2", "tiny-opt", "tiny-starcoder2", "tiny-glm", "tiny-phi", "tiny-nemotron",
            "tiny-stablelm"]
# strategy -> (script, extra arguments, world size)
STRATEGIES = {
    "ddp": ("ddp.py", [], 2),
    "zero3": ("zero.py", ["--stage", "3"], 2),
    "fsdp": ("fsdp.py", [], 2),
    "tp": ("tp.py", [], 2),
    "sp megatron": ("sp.py", ["--variant", "megatron"], 2),
    "sp ulysses": ("sp.py", ["--variant", "ulysses"], 2),
    "pp": ("pp.py", [], 2),
    "cp": ("cp_ring.py", [], 2),
    "compose4d": ("compose4d.py", ["--tp", "2", "--pp", "2"], 4),
}
COMMON = ["--mode", "correctness", "--dtype", "float64", "--batch", "4", "--length", "16",
          "--timeout", "120"]


def run_cell(strategy: str, family: str) -> dict:
    script, extra, world = STRATEGIES[strategy]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={world}", os.path.join(ROOT, script), "--model", family,
           *COMMON, *extra]
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)
    lines = [l for l in p.stdout.splitlines() if l.startswith(("PASS", "FAIL"))]
    errors = [l for l in (p.stdout + p.stderr).splitlines() if l.startswith("error:")]
    if errors and (p.returncode == 2 or "exitcode  : 2" in p.stderr):   # (torchrun exits 1)
        verdict, line = "refused", errors[0]
    elif lines:
        verdict, line = lines[-1].split()[0], lines[-1]
    else:
        verdict, line = "CRASH", (p.stderr.strip().splitlines() or [""])[-1]
    return dict(strategy=strategy, family=family, world=world, verdict=verdict,
                line=line[:300], seconds=round(time.time() - t0, 1), rc=p.returncode)


def table(rows: list[dict]) -> str:
    strategies = list(dict.fromkeys(r["strategy"] for r in rows))
    families = list(dict.fromkeys(r["family"] for r in rows))
    cell = {(r["family"], r["strategy"]): r["verdict"] for r in rows}
    out = ["| family | " + " | ".join(strategies) + " |", "|---" * (len(strategies) + 1) + "|"]
    for f in families:
        out.append(f"| {f} | " + " | ".join(cell.get((f, s), "") for s in strategies) + " |")
    return "\n".join(out)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--out", default=None, help="write the rows as JSON")
    p.add_argument("--update", action="store_true",
                   help="keep --out's rows for the cells not run now (a few families rerun)")
    a = p.parse_args()
    rows = []
    for s in a.strategies.split(","):
        for f in a.families.split(","):
            r = run_cell(s, f)
            rows.append(r)
            print(f"{s:12} {f:13} {r['verdict']:8} {r['seconds']:6.1f}s  {r['line'][:150]}",
                  flush=True)
    if a.update and a.out and os.path.exists(a.out):
        with open(a.out) as fh:
            old = {(r["strategy"], r["family"]): r for r in json.load(fh)["rows"]}
        old.update({(r["strategy"], r["family"]): r for r in rows})
        rows = [old[s, f] for s in STRATEGIES for f in FAMILIES if (s, f) in old]
    print(table(rows))
    if a.out:
        import torch
        import transformers
        with open(a.out, "w") as fh:
            json.dump(dict(command="python scripts/families.py --out " + a.out,
                           machine=f"CPU, gloo, torch {torch.__version__}, transformers "
                                   f"{transformers.__version__}", dtype="float64", rows=rows),
                      fh, indent=1)
    sys.exit(0 if all(r["verdict"] in ("PASS", "refused") for r in rows) else 1)


if __name__ == "__main__":
    main()
