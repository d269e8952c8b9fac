"""gpu_perf.py: single-GPU speed of the reference step on a Llama shape, with MFU and the top
kernels, then compose4d at W=1 through its benchmark mode (which also times the reference).

    python scripts/gpu_perf.py OUT [--model llama3.2-1b] [--lengths 2048,4096] [--tokens 16384]

The reference is the harness's: the HF model (SDPA attention) in bf16 with fp32 master weights
(harness.precision.MasterAdamW), one step = forward, backward, AdamW. Steps are timed with CUDA
events (3 warm-up, 5 timed, median). MFU = model FLOPs (harness.flops.model_flops: 6 Psi_matmul
T + 12 L h S T) / step time / the GPU's dense bf16 peak (harness.flops.PEAK_FLOPS).
Writes OUT/perf.json and one compose4d log per length.
"""
import argparse
import json
import os
import subprocess
import sys
import types

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from harness.data import MarkovLanguage, make_batch  # noqa: E402
from harness.flops import PEAK_FLOPS, model_flops  # noqa: E402
from harness.models import build_model, load_config  # noqa: E402
from harness.strategy import Reference  # noqa: E402


def reference_run(model_name, length, batch, out):
    args = types.SimpleNamespace(model=model_name, dtype="bfloat16", attn="sdpa", seed=0,
                                 lr=3e-4, weight_decay=0.1, clip=0.0)
    cfg = load_config(model_name)
    model = build_model(args, cfg, torch.device("cuda"))
    ref = Reference(model, args, None)
    lang = MarkovLanguage(cfg.vocab_size, 0, 4)
    b = make_batch(lang, 0, batch, length, torch.device("cuda"))
    for _ in range(3):
        ref.step(b)
    times = []
    for _ in range(5):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        s.record()
        ref.step(b)
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    step = sorted(times)[2]
    name = torch.cuda.get_device_name()
    peak = next(v for k, v in PEAK_FLOPS.items() if k in name)
    flops = model_flops(cfg, batch * length, length)
    res = dict(model=model_name, length=length, batch=batch, step_s=step,
               tokens_per_s=batch * length / step, model_flops=flops,
               mfu=flops / step / peak, peak_flops=peak, device=name,
               max_memory_gib=torch.cuda.max_memory_allocated() / 2**30)
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        ref.step(b)
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=15,
                                      max_name_column_width=70)
    with open(os.path.join(out, f"profile-{length}.txt"), "w") as f:
        f.write(table)
    tot = sum(e.self_device_time_total for e in prof.key_averages())
    res["top_kernels"] = [(e.key[:90], e.self_device_time_total / tot)
                          for e in sorted(prof.key_averages(),
                                          key=lambda e: -e.self_device_time_total)[:12]]
    print(f"reference {model_name} S={length} B={batch} bf16: step {step * 1e3:.1f} ms, "
          f"{res['tokens_per_s']:.0f} tokens/s, MFU {res['mfu']:.1%} of {peak / 1e12:.0f} "
          f"TFLOP/s ({name}), peak memory {res['max_memory_gib']:.1f} GiB", flush=True)
    for k, share in res["top_kernels"]:
        print(f"    {share:6.1%}  {k}")
    del ref, model
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return res


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--model", default="llama3.2-1b")
    p.add_argument("--lengths", default="2048,4096")
    p.add_argument("--tokens", type=int, default=16384, help="tokens per step")
    p.add_argument("--skip-compose", action="store_true")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    results = []
    for L in map(int, a.lengths.split(",")):
        r = reference_run(a.model, L, a.tokens // L, a.out)
        if not a.skip_compose:
            log = os.path.join(a.out, f"compose4d-{L}.log")
            cmd = [sys.executable, "compose4d.py", "--device", "cuda", "--mode", "benchmark",
                   "--model", a.model, "--dtype", "bfloat16", "--batch", str(a.tokens // L),
                   "--length", str(L), "--warmup", "2", "--bench-iters", "5"]
            with open(log, "w") as f:
                r["compose4d_rc"] = subprocess.run(cmd, cwd=ROOT, stdout=f,
                                                   stderr=subprocess.STDOUT).returncode
            with open(log) as f:
                r["compose4d_log_tail"] = [ln.rstrip() for ln in f][-40:]
            print("\n".join(ln for ln in r["compose4d_log_tail"]
                            if "ours" in ln or "ref)" in ln or "MFU" in ln or "PASS" in ln
                            or "FAIL" in ln or "Error" in ln), flush=True)
        results.append(r)
        with open(os.path.join(a.out, "perf.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
