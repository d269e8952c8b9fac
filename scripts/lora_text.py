"""lora_text.py: LoRA against full fine-tuning on real text, and what each holds and sends per
rank (docs/lora.md's figures).

    python scripts/lora_text.py [--steps 80] [--out results/lora-text-cpu.json]   (~20 min, 2 cores)

scripts/text_demo.py's corpus, tokenizer and 6-layer Llama; the model is first pre-trained on
pretrain.jsonl (training.md's step 1: dp 2, 300 steps) and exported; then compose4d.py --mode
train fine-tunes that directory on finetune.jsonl (modules the pre-training never saw, 10% held
out) three ways at the same budget (--steps x 16 sequences x 128 tokens, float32, cosine with 5
warm-up steps): full fine-tuning at dp 2 (--lr 1e-3, training.md's), LoRA r 8 at dp 2 and at tp
2 (--lora 8, alpha 16, every projection, --lr 3e-3). The held-out loss every --eval-every steps.
LoRA at dp 2 and at tp 2 is one computation on two layouts: their losses agree to float32's
rounding.
Then compose4d.py --mode benchmark on the same model (its initial weights: the bytes depend on
the shapes only), with and without --lora 8, at dp 2 (ZeRO-1 and ZeRO-3) and tp 2: the model states each rank holds (measured by the live-tensor
tracker, beside the formula the benchmark checks) and the bytes each collective moves per step.
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FINETUNES = {   # name -> (layout, its flags)
    "full dp2": ("dp 2 (ZeRO-1)", ["--dp", "2", "--lr", "1e-3"]),
    "lora dp2": ("dp 2 (ZeRO-1)", ["--dp", "2", "--lora", "8", "--lr", "3e-3"]),
    "lora tp2": ("tp 2", ["--tp", "2", "--lora", "8", "--lr", "3e-3"]),
}
BENCHES = {    # name -> flags (full fine-tuning, then the same with --lora 8)
    "dp 2, ZeRO-1": ["--dp", "2", "--zero", "1"],
    "dp 2, ZeRO-3": ["--dp", "2", "--zero", "3"],
    "tp 2": ["--tp", "2"],
}


def torchrun(args, what, timeout=3600):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(HERE, "compose4d.py"), *args]
    r = subprocess.run(cmd, cwd=HERE, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise SystemExit(f"{what}: {' '.join(cmd)} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--pretrain-steps", type=int, default=300)
    p.add_argument("--memory-only", default=None, metavar="FILE",
                   help="keep FILE's fine-tuning runs and measure the memory and comm rows again")
    p.add_argument("--out", default=None, help="the results file (default: a temporary "
                   "directory's; results/lora-text-cpu.json updates the tracked figures)")
    a = p.parse_args()
    tmp = tempfile.mkdtemp()
    a.out = a.out or os.path.join(tmp, "lora-text-cpu.json")
    subprocess.run([sys.executable, os.path.join(HERE, "scripts", "text_demo.py"), tmp],
                   check=True, cwd=HERE, capture_output=True)
    pre = os.path.join(tmp, "llama-pre")
    here = "python scripts/lora_text.py " + " ".join(sys.argv[1:])
    if a.memory_only:   # (its fine-tuning runs, and the command that made them)
        kept = json.load(open(a.memory_only))
        runs, command = kept["runs"], kept["command"]
    else:
        runs, command = fine_tunes(a, tmp, pre), here
    memory = []
    for name, flags in BENCHES.items():   # (the shapes are what count: the initial weights)
        for lora in ([], ["--lora", "8"]):
            out = os.path.join(tmp, "bench")
            torchrun(["--mode", "benchmark", "--model", os.path.join(tmp, "llama-init"),
                      "--dtype", "float32", "--batch", "4", "--length", "128", "--bench-iters",
                      "2", "--warmup", "1", *flags, *lora, "--out", out], f"benchmark {name}")
            d = json.load(open(os.path.join(out, "benchmark.json")))
            m = d["ours"]["memory"][0]
            memory.append(dict(layout=name, lora=bool(lora), params=d["params"],
                               measured={k: m[k] for k in ("params", "grads", "optimizer",
                                                           "model_states")},
                               formula=d["memory_formula"],
                               comm={k: v["bytes"] for k, v in d["ours"]["comm"].items()},
                               groups=d["group_sizes"], comm_ok=d["comm_ok"]))
            print(name, "lora" if lora else "full", m["model_states"], flush=True)
    import torch
    result = dict(command=command, memory_command=here,
                  machine=f"{platform.machine()} CPU, {os.cpu_count()} cores, gloo, torch "
                          f"{torch.__version__}",
                  world=2, dtype="float32",
                  data="scripts/text_demo.py: finetune.jsonl, 10% of its modules held out",
                  model=f"text_demo's Llama (6 layers, hidden 256, ~6M parameters) pre-trained "
                        f"{a.pretrain_steps} steps on pretrain.jsonl at dp 2",
                  budget=f"{a.steps} steps x 16 sequences x 128 tokens",
                  lora="r 8, alpha 16, every attention and MLP projection",
                  runs=runs, memory=memory)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {a.out}")


def fine_tunes(a, tmp, pre) -> list:
    """Pre-train, export, then the three fine-tunes: their held-out losses."""
    torchrun(["--mode", "train", "--model", os.path.join(tmp, "llama-init"),
              "--data", os.path.join(tmp, "pretrain.jsonl"), "--val-fraction", "0.05",
              "--dp", "2", "--dtype", "float32", "--batch", "16", "--length", "128",
              "--steps", str(a.pretrain_steps), "--lr", "3e-3", "--lr-schedule", "cosine",
              "--lr-warmup", "20", "--export-hf", pre], "pre-training")
    print("pre-trained", flush=True)
    common = ["--mode", "train", "--model", pre, "--data", os.path.join(tmp, "finetune.jsonl"),
              "--val-fraction", "0.1", "--dtype", "float32", "--batch", "16", "--length", "128",
              "--steps", str(a.steps), "--lr-schedule", "cosine", "--lr-warmup", "5",
              "--eval-every", str(a.eval_every), "--log-every", "20"]
    runs = []
    for name, (layout, flags) in FINETUNES.items():
        out = os.path.join(tmp, "out-" + name.replace(" ", "-"))
        torchrun([*common, *flags, "--out", out], name)
        rows = [json.loads(line) for line in open(os.path.join(out, "train.jsonl"))]
        evals = [dict(step=x["step"] + 1, eval_loss=round(x["eval_loss"], 5))
                 for x in rows if "eval_loss" in x]
        train = [x["loss"] for x in rows if "loss" in x]
        runs.append(dict(name=name, layout=layout, flags=" ".join(flags), evals=evals,
                         last_train_loss=round(train[-1], 5)))
        print(name, evals, flush=True)
    return runs


def table(d) -> str:
    """docs/lora.md's fine-tuning table (scripts/docs.py renders it)."""
    steps = [e["step"] for e in d["runs"][0]["evals"]]
    out = ["| fine-tuning | layout | " + " | ".join(f"held-out loss at step {s}" for s in steps)
           + " | last train loss |", "|---" * (len(steps) + 3) + "|"]
    for r in d["runs"]:
        out.append(f"| {r['name'].split()[0]} (`{r['flags']}`) | {r['layout']} | "
                   + " | ".join(f"{e['eval_loss']:.3f}" for e in r["evals"])
                   + f" | {r['last_train_loss']:.3f} |")
    return "\n".join(out) + "\n"


def memory_table(d) -> str:
    """docs/lora.md's model-state and communication table: per rank, full fine-tuning vs LoRA."""
    kib = lambda x: f"{x / 2**10:,.0f} KiB"   # noqa: E731
    out = ["| layout | fine-tuning | parameters | gradients | optimizer | model states "
           "(formula) | all-reduce | reduce-scatter | all-gather |", "|---" * 9 + "|"]
    for r in d["memory"]:
        m, f = r["measured"], r["formula"]
        by = {op: sum(v for k, v in r["comm"].items() if k.split("|")[0] == op   # (a group of
                      and r["groups"].get(k.split("|")[1], 2) > 1)          # one sends nothing)
              for op in ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor")}
        out.append(f"| {r['layout']} | {'LoRA r 8' if r['lora'] else 'full'} | "
                   f"{kib(m['params'])} | {kib(m['grads'])} | {kib(m['optimizer'])} | "
                   f"{kib(m['model_states'])} ({kib(f['model_states'])}) | "
                   + " | ".join(kib(by[op]) if by[op] >= 2**10 else f"{by[op]:,.0f} B"
                                for op in by) + " |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    main()
