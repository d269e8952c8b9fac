"""load_memory.py: each rank's peak memory while compose4d builds a real-sized model, reading
only its shard (--load shards) or building the whole model and slicing it (--load full).

    python scripts/load_memory.py                # writes /tmp/llama-135m-shape once, W = 1, 2, 4
    python scripts/load_memory.py --dtype float64 --out results/load-memory-float64-cpu.json
    python scripts/load_memory.py --worlds 1 2 --dtype float64

The checkpoint has SmolLM-135M's shape (30 layers, hidden 576, 9 heads / 3 kv heads, SwiGLU
1536, vocabulary 49152, tied embeddings; 134.5M parameters) with random weights in float32
safetensors. Each world size runs `compose4d.py --mode train --steps 0 --pp W` (9 heads: tensor
parallel sizes 2 and 4 do not divide them), which prints, per rank, the bytes of parameters it
holds and the growth of its peak resident set (Linux VmHWM, reset before the build) while the
strategy is built: the model, its ZeRO-1 flat buffers (parameters and gradients of the stage)
and, with --load full, the whole model first. Writes --out (results/load-memory-<dtype>-cpu.json:
the tracked ones; default: the temporary directory's).
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import platform
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
             num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
             tie_word_embeddings=True, rms_norm_eps=1e-5)
LINE = re.compile(r"load rank (\d+): (read its shard|built all) .*holds ([\d.]+) MiB of the "
                  r"([\d.]+) MiB model .*\+([\d.]+) MiB during the load, \+([\d.]+) MiB")


def write_checkpoint(path: str):
    if os.path.isfile(os.path.join(path, "model.safetensors")):
        return
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SHAPE)).float().save_pretrained(path)


def measure(path: str, world: int, load: str, dtype: str) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={world}", os.path.join(ROOT, "compose4d.py"), "--mode", "train",
           "--model", path, "--pp", str(world), "--steps", "0", "--batch", str(world),
           "--length", "16", "--dtype", dtype, "--load", load]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    rows = [dict(rank=int(m[1]), how=m[2], held_mib=float(m[3]), model_mib=float(m[4]),
                 load_growth_mib=float(m[5]), build_growth_mib=float(m[6])) for m in LINE.finditer(out.stdout)]
    if out.returncode != 0 or len(rows) != world:
        raise SystemExit(f"W={world} --load {load} failed:\n{out.stdout[-3000:]}"
                         f"\n{out.stderr[-3000:]}")
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--checkpoint", default="/tmp/llama-135m-shape")
    p.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--dtype", default="float32")
    p.add_argument("--out", default=None, help="the results file (default: the temporary "
                   "directory's load-memory-DTYPE-cpu.json; results/load-memory-DTYPE-cpu.json "
                   "updates the tracked figures)")
    a = p.parse_args()
    write_checkpoint(a.checkpoint)
    table = []
    for w in a.worlds:
        for load in ("shards", "full"):
            rows = measure(a.checkpoint, w, load, a.dtype)
            table.append(dict(world=w, load=load, dtype=a.dtype, ranks=rows))
            print(f"W={w} pp={w} --load {load:<6} model {rows[0]['model_mib']:.0f} MiB; per rank "
                  f"(holds / peak growth during the load / during the whole build) " + ", ".join(
                      f"{r['held_mib']:.0f}/{r['load_growth_mib']:.0f}/{r['build_growth_mib']:.0f}"
                      for r in rows) + " MiB", flush=True)
    out = a.out or os.path.join(tempfile.gettempdir(), f"load-memory-{a.dtype}-cpu.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(dict(machine=f"{platform.machine()} CPU ({os.cpu_count()} cores), gloo",
                       checkpoint_shape=SHAPE, rows=table), f, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
