"""optimizer_step.py: the optimizer step's time, ours (fp32-master AdamW on bf16 parameters,
harness.precision.make_adamw) against torch.optim.AdamW(foreach=True) on fp32 parameters.

    python scripts/optimizer_step.py --layers 2 --rounds 9 --out results/optimizer-cpu.json

Parameters shaped as Llama 3.2 1B's decoder layers (q, k, v, o, gate, up, down, two norms; the
embedding is left out so that a CPU machine holds every variant at once: --layers 16 is the
whole 1.2B model's layers). Every variant keeps its parameters, gradients and states alive, and
each round steps each variant once, the order reversed every other round (interleaved: the
machine's drift falls on all of them); the medians and the [min, max] per variant, and the
ratio of ours to the foreach baseline.

Variants:
  fp32-foreach      torch.optim.AdamW(foreach=True), fp32 parameters (the baseline)
  fp32-fused        torch.optim.AdamW(fused=True), fp32 parameters (what make_adamw gives
                    float32 runs)
  bf16-masters      make_adamw on bf16 parameters: fp32 masters on the fused kernel, the
                    gradients upcast per tensor, the bf16 copy-back in one foreach pass (ours)
  bf16-masters-loop the same masters on the loop implementation (foreach=False, fused=False):
                    what make_adamw did before
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from harness import load_config  # noqa: E402
from harness.precision import MasterAdamW, make_adamw  # noqa: E402

KW = dict(lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)


def layer_shapes(cfg, layers: int) -> list[tuple]:
    H, I = cfg.hidden_size, cfg.intermediate_size
    d = getattr(cfg, "head_dim", None) or H // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    return [s for _ in range(layers)
            for s in [(q, H), (kv, H), (kv, H), (H, q), (I, H), (I, H), (H, I), (H,), (H,)]]


def build(kind: str, shapes, device):
    dtype = torch.bfloat16 if kind.startswith("bf16") else torch.float32
    ps = [torch.randn(s, device=device).to(dtype) for s in shapes]
    if kind == "fp32-foreach":
        opt = torch.optim.AdamW(ps, foreach=True, **KW)
    elif kind == "fp32-fused":
        opt = torch.optim.AdamW(ps, fused=True, **KW)
    elif kind == "bf16-masters":
        opt = make_adamw(ps, SimpleNamespace(lr=KW["lr"], weight_decay=KW["weight_decay"]))
    else:
        opt = MasterAdamW(ps, foreach=False, fused=False, **KW)
    for p in ps:
        p.grad = torch.randn_like(p)
    opt.step()   # the states exist from here on
    return opt


def timed(opt, device) -> float:
    if device.type == "cuda":
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        opt.step()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / 1e3
    t = time.perf_counter()
    opt.step()
    return time.perf_counter() - t


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama3.2-1b")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    device = torch.device(a.device)
    shapes = layer_shapes(load_config(a.model), a.layers)
    n = sum(torch.Size(s).numel() for s in shapes)
    kinds = ["fp32-foreach", "fp32-fused", "bf16-masters", "bf16-masters-loop"]
    opts = {k: build(k, shapes, device) for k in kinds}
    times = {k: [] for k in kinds}
    for r in range(a.rounds):
        for k in (kinds if r % 2 == 0 else kinds[::-1]):
            times[k].append(timed(opts[k], device))
    med = {k: statistics.median(v) for k, v in times.items()}
    rows = [dict(variant=k, median_ms=1e3 * med[k], min_ms=1e3 * min(times[k]),
                 max_ms=1e3 * max(times[k]), ratio_to_fp32_foreach=med[k] / med["fp32-foreach"])
            for k in kinds]
    dev = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        f"CPU, {torch.get_num_threads()} threads"
    print(f"optimizer step, {n / 1e6:.0f}M parameters ({a.layers} layers of {a.model}), {dev}, "
          f"{a.rounds} interleaved rounds:")
    for row in rows:
        print(f"  {row['variant']:18s} {row['median_ms']:8.1f} ms  [{row['min_ms']:.1f}, "
              f"{row['max_ms']:.1f}]  x{row['ratio_to_fp32_foreach']:.2f} of fp32-foreach")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(command="python scripts/optimizer_step.py " + " ".join(sys.argv[1:]),
                           device=dev, torch=torch.__version__, params=n, layers=a.layers,
                           model=a.model, rounds=a.rounds, rows=rows), f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
