"""text_demo.py: real English text, a tokenizer and a small Llama to train on it, with nothing
downloaded: the corpus is the docstrings of Python's own standard library (present wherever
Python is), the tokenizer a byte-level BPE trained on it (tokenizers), the model a Llama
directory with random weights that the README's first command pre-trains.

    python scripts/text_demo.py /tmp/demo          # writes the files below (about 10 s)

    /tmp/demo/pretrain.jsonl   docstrings of the modules whose name hashes to the first 80%
    /tmp/demo/finetune.jsonl   the other modules' docstrings (a different distribution of topics)
    /tmp/demo/tokenizer/       BPE, 4096 tokens, EOS </s>, trained on pretrain.jsonl
    /tmp/demo/llama-init/      config.json + model.safetensors (+ the tokenizer): 6 layers,
                               hidden 256, 8 heads / 4 kv heads, SwiGLU 704, untied, ~6M params

Each JSON line is one document {"text": ...}: a module's docstring, or a public class's or
function's ("module.name: docstring"). The split is by module, so fine-tuning meets modules the
pre-training never saw.

For the scripts that train on it (muon_text.py, doc_mask_text.py): make(dir) writes the files,
pretrain_args(dir, steps, eval_every) gives training.md's pre-training settings, and
train(args, nproc, out) runs compose4d.py --mode train and returns its logged held-out losses
and first and last training losses.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib
import inspect
import json
import os
import pkgutil
import sys
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tests"))

SKIP = ("test", "idlelib", "tkinter", "turtle", "antigravity", "this", "__", "lib2to3",
        "ensurepip", "venv", "pydoc_data", "distutils")


def stdlib_documents() -> dict[str, list[str]]:
    """module name -> its documents (module docstring, then each public object's)."""
    out = {}
    names = sorted(m.name for m in pkgutil.iter_modules() if m.module_finder is not None
                   and "site-packages" not in str(getattr(m.module_finder, "path", "")))
    names = [n for n in names if n in sys.stdlib_module_names and not n.startswith(SKIP)]
    for name in names:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                mod = importlib.import_module(name)
        except Exception:            # noqa: BLE001 (platform modules that do not import)
            continue
        docs = []
        if inspect.getdoc(mod):
            docs.append(inspect.getdoc(mod))
        for attr, obj in sorted(vars(mod).items()):
            if attr.startswith("_") or getattr(obj, "__module__", None) != name:
                continue
            if inspect.isclass(obj) or inspect.isfunction(obj):
                d = inspect.getdoc(obj)
                if d and len(d) > 40:
                    docs.append(f"{name}.{attr}: {d}")
        if docs:
            out[name] = docs
    return out


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make(directory: str):
    """This script's files in `directory` (a process of its own: its imports stay there)."""
    import subprocess
    subprocess.run([sys.executable, os.path.abspath(__file__), directory], check=True, cwd=ROOT,
                   capture_output=True)


def pretrain_args(directory: str, steps: int, eval_every: int) -> list[str]:
    """compose4d.py --mode train with training.md's pre-training settings on make()'s files:
    float32, batch 16 x 128 tokens, AdamW at 3e-3 with 20 warm-up steps then cosine, 5% of the
    modules held out, the held-out loss every `eval_every` steps."""
    return ["--mode", "train", "--model", os.path.join(directory, "llama-init"),
            "--data", os.path.join(directory, "pretrain.jsonl"), "--val-fraction", "0.05",
            "--dtype", "float32", "--batch", "16", "--length", "128", "--steps", str(steps),
            "--lr", "3e-3", "--lr-schedule", "cosine", "--lr-warmup", "20",
            "--eval-every", str(eval_every), "--log-every", "50"]


def train(args: list[str], nproc: int, out: str) -> dict:
    """torchrun compose4d.py `args` --out `out`: {"evals": [{"step", "eval_loss"}] (step 0:
    before training), "first_train_loss", "last_train_loss", "seconds"}; a failure ends the
    calling script with torchrun's last lines."""
    import subprocess
    import time
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", os.path.join(ROOT, "compose4d.py"), *args, "--out", out]
    t0 = time.time()
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    rows = [json.loads(line) for line in open(os.path.join(out, "train.jsonl"))]
    train_losses = [x["loss"] for x in rows if "loss" in x]
    return dict(evals=[dict(step=x["step"] + 1, eval_loss=round(x["eval_loss"], 4))
                       for x in rows if "eval_loss" in x],
                first_train_loss=round(train_losses[0], 4),
                last_train_loss=round(train_losses[-1], 4), seconds=round(time.time() - t0, 1))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--vocab", type=int, default=4096)
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    mods = stdlib_documents()
    parts = {"pretrain": [], "finetune": []}
    for name, docs in mods.items():
        h = int(hashlib.sha256(name.encode()).hexdigest(), 16) % 100
        parts["pretrain" if h < 80 else "finetune"] += docs
    for k, docs in parts.items():
        with open(os.path.join(a.out, f"{k}.jsonl"), "w") as f:
            for d in docs:
                f.write(json.dumps({"text": d}) + "\n")
        print(f"{k}.jsonl: {len(docs)} documents, {sum(map(len, docs)):,} characters")
    import textdata
    tok = textdata.train_tokenizer(os.path.join(a.out, "tokenizer"), parts["pretrain"],
                                   vocab_size=a.vocab)
    textdata.llama_dir(os.path.join(a.out, "llama-init"), tok, hidden=256, layers=6, heads=8,
                       kv_heads=4, intermediate=704)
    print(f"wrote {a.out}/tokenizer and {a.out}/llama-init")


if __name__ == "__main__":
    main()
