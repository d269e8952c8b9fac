"""gpu_w1.py: every strategy script at world size 1 on CUDA, in one command that writes its logs.

    python scripts/gpu_w1.py OUT [--only ddp,zero] [--timeout 240]

On a one-GPU machine NCCL runs a group of one, so this proves the device paths (tensors on the
GPU, bf16 numerics, CUDA timing, checkpoints) rather than the multi-rank semantics, which the CPU
tests prove. Each script runs once (`--runs`, imports paid once) over:

    correctness   float64 (the reference's own dtype) and bfloat16 (judged error-vs-error)
    learning      bfloat16, 100 steps
    benchmark     bfloat16

then compose4d's train mode: save, resume from the checkpoint, export to HF and reload.
OUT gets one log per script and `summary.json` ({label: {"rc", "seconds", "last"}}); the exit
code is 0 only when every run passed.
"""
import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODES = [["--mode", "correctness"],
         ["--mode", "correctness", "--dtype", "bfloat16"],
         ["--mode", "learning", "--dtype", "bfloat16", "--steps", "100", "--log-every", "50"],
         ["--mode", "benchmark", "--dtype", "bfloat16"]]

GQA = ["--model", "configs/tiny-gqa8.json"]
SCRIPTS = [  # (label, script, extra arguments)
    ("ddp", "ddp.py", []),
    ("zero1", "zero.py", ["--stage", "1"]),
    ("zero2", "zero.py", ["--stage", "2"]),
    ("zero3", "zero.py", ["--stage", "3"]),
    ("fsdp", "fsdp.py", []),
    ("tp", "tp.py", GQA),
    ("sp-megatron", "sp.py", GQA),
    ("sp-ulysses", "sp.py", GQA + ["--variant", "ulysses"]),
    ("cp-zigzag", "cp_ring.py", []),
    ("pp-1f1b", "pp.py", ["--schedule", "1f1b"]),
    ("pp-zb", "pp.py", ["--schedule", "zb"]),
    ("ep", "ep_moe.py", []),
    ("compose4d", "compose4d.py", ["--grad-accum", "2"]),
]


def run(label, cmd, out, timeout):
    t0 = time.time()
    with open(os.path.join(out, f"{label}.log"), "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        try:
            rc = subprocess.run(cmd, cwd=HERE, stdout=log, stderr=subprocess.STDOUT,
                                timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    with open(os.path.join(out, f"{label}.log")) as f:
        lines = [ln.rstrip() for ln in f if ln.strip()]
    verdicts = [ln for ln in lines if ln.startswith(("PASS", "FAIL", "error", "Traceback"))
                or "Error" in ln]
    res = dict(rc=rc, seconds=round(time.time() - t0, 1), verdicts=verdicts[-12:],
               last=lines[-3:])
    print(f"{label:<14} rc={rc:<4} {res['seconds']:>6.1f}s  "
          + (verdicts[-1] if verdicts else lines[-1] if lines else ""), flush=True)
    return res


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--only", default=None)
    p.add_argument("--timeout", type=float, default=240.0)
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    only = a.only.split(",") if a.only else None
    py = [sys.executable]
    summary = {}
    for label, script, extra in SCRIPTS:
        if only and not any(label.startswith(o) for o in only):
            continue
        runs = [m + extra + ["--device", "cuda", "--out", os.path.join(a.out, label, str(i))]
                for i, m in enumerate(MODES)]
        path = os.path.join(a.out, f"{label}.runs.json")
        with open(path, "w") as f:
            json.dump(runs, f)
        summary[label] = run(label, py + [script, "--runs", path], a.out, a.timeout)
    if not only or "train" in only:
        ck, hf = os.path.join(a.out, "ckpt"), os.path.join(a.out, "hf")
        base = py + ["compose4d.py", "--device", "cuda", "--mode", "train", "--dtype",
                     "bfloat16", "--model", "configs/tiny-tied.json", "--save", ck]
        summary["train-save"] = run("train-save", base + ["--steps", "20", "--save-every",
                                                          "10"], a.out, a.timeout)
        summary["train-resume"] = run("train-resume", base + [
            "--steps", "30", "--resume", ck, "--export-hf", hf], a.out, a.timeout)
        summary["hf-reload"] = run("hf-reload", py + ["-c", (
            "import sys, torch; from transformers import AutoModelForCausalLM as M; "
            f"m = M.from_pretrained({hf!r}).cuda(); "
            "x = torch.randint(0, m.config.vocab_size, (1, 16), device='cuda'); "
            "print('PASS hf export reloads on cuda:', tuple(m(input_ids=x).logits.shape))")],
            a.out, a.timeout)
    with open(os.path.join(a.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    bad = [k for k, v in summary.items() if v["rc"] != 0]
    print(f"{len(summary) - len(bad)}/{len(summary)} passed" + (f"; failed: {bad}" if bad else ""))
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
