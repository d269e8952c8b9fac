"""gpu_muon.py: muon.py on one GPU: torch.optim.Muon's update bit for bit, and the optimizer
step's cost beside AdamW's.

    python scripts/gpu_muon.py OUT.json [--model llama3.2-1b] [--repeats 5]

1. On the device, bf16 parameters without masters (tall, wide, square): muon.MuonAdamW with
   torch's bf16 Newton-Schulz against torch.optim.Muon, 3 steps: equal bit for bit (the CPU test
   tests/test_muon.py proves the same on this machine's torch).
2. --model's parameters (built from its config, random, bf16, on the device; no forward): the
   optimizer step alone, timed with CUDA events (median of --repeats after a warm-up), for
   AdamW over fp32 masters (harness.make_adamw, fused) and for muon.build's MasterMuon (Muon on
   the hidden matrices with bf16 Newton-Schulz, AdamW on the rest); the Newton-Schulz FLOPs per
   step (muon.ns_flops) and the rate they ran at.
"""
import argparse
import json
import os
import statistics
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def bitwise(device) -> dict:
    import muon
    g = torch.Generator().manual_seed(0)
    shapes = [(768, 256), (256, 768), (512, 512)]
    base = [torch.randn(s, generator=g) for s in shapes]
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(3)]
    kw = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True)
    out = []
    for make in (lambda ps: muon.MuonAdamW([dict(params=ps, muon=True)],
                                           ns_dtype=torch.bfloat16, **kw),
                 lambda ps: torch.optim.Muon(ps, **kw)):
        ps = [torch.nn.Parameter(b.to(device, torch.bfloat16)) for b in base]
        opt = make(ps)
        for step in grads:
            for p, gr in zip(ps, step):
                p.grad = gr.to(device, torch.bfloat16)
            opt.step()
        out.append([p.detach() for p in ps])
    diffs = [(a.float() - b.float()).abs().max().item() for a, b in zip(*out)]
    return dict(equal=all(torch.equal(a, b) for a, b in zip(*out)), max_abs_diff=max(diffs))


def step_times(model_name, device, repeats) -> dict:
    import argparse as ap
    from transformers import AutoModelForCausalLM
    import muon
    from harness import make_adamw
    from harness.models import hidden_matrix, load_config
    from harness.precision import muon_kwargs
    cfg = load_config(model_name)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16)
    args = ap.Namespace(lr=1e-3, weight_decay=0.1, muon_lr=0.02, muon_ns_dtype="auto",
                        muon_mode="auto")
    mats = [p.shape for n, p in model.named_parameters() if hidden_matrix(n, p.shape)]
    flops = sum(muon.ns_flops(s) for s in mats)
    res = dict(model=model_name, params=sum(p.numel() for p in model.parameters()),
               matrices=len(mats), ns_flops=flops)
    for name, make in (("adamw", lambda: make_adamw(model.parameters(), args)),
                       ("muon", lambda: muon.build(model, args.lr, args.muon_lr,
                                                   **muon_kwargs(args, torch.bfloat16)))):
        opt = make()
        for p in model.parameters():
            p.grad = torch.randn_like(p) * 1e-3
        times = []
        for i in range(repeats + 1):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            opt.step()
            b.record()
            torch.cuda.synchronize()
            if i:
                times.append(a.elapsed_time(b))
        res[f"{name}_step_ms"] = statistics.median(times)
        del opt
        torch.cuda.empty_cache()
    res["ns_tflops_per_s"] = flops / (res["muon_step_ms"] * 1e-3) / 1e12
    return res


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--model", default="llama3.2-1b")
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    res = dict(device=torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
               torch=torch.__version__, bitwise=bitwise(device))
    print("bitwise:", res["bitwise"], flush=True)
    if device == "cuda":
        res["step"] = step_times(a.model, device, a.repeats)
        print("step:", res["step"], flush=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    sys.exit(0 if res["bitwise"]["equal"] else 1)


if __name__ == "__main__":
    main()
