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
