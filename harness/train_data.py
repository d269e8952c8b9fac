"""train_data.py: what compose4d's train mode needs around the corpus (harness/corpus.py):
the arguments' constraints (checked on every rank before the process group exists), the
tokenizer directory, the data source a step draws from, the held-out evaluation and greedy
samples.

Data position: sample i of the train split is a pure function of (seed, i) (corpus.py), and a
checkpoint records how many samples the run consumed (`samples`) beside the corpus's
fingerprint and the sequence length, so a resumed run, on any layout, draws exactly the samples
the uninterrupted run would have. A checkpoint from other data or another --length is refused.
"""
from __future__ import annotations

import json
import math
import os

import torch

from .data import make_batch
from .models import ConfigError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def tokenizer_dir(args) -> str | None:
    """--tokenizer, else --model when it is a directory with tokenizer files."""
    if args.tokenizer:
        return args.tokenizer
    if os.path.isdir(args.model) and any(
            os.path.isfile(os.path.join(args.model, f)) for f in TOKENIZER_FILES):
        return args.model
    return None


def open_corpus(args, config, progress: bool = False):
    """The --data corpus (harness/corpus.TextCorpus), or None for the synthetic language."""
    if not args.data:
        return None
    from .corpus import TextCorpus
    return TextCorpus.open(args.data, tokenizer_dir(args), config.vocab_size, args.seed,
                           val_fraction=args.val_fraction, cache_dir=args.data_cache,
                           progress=progress, eos_id=getattr(config, "eos_token_id", None)
                           if isinstance(getattr(config, "eos_token_id", None), int) else None,
                           token_dtype=args.data_dtype)


def _checkpoint_meta(root: str | None) -> dict | None:
    if not root or not os.path.isfile(os.path.join(root, "latest")):
        return None
    with open(os.path.join(root, "latest")) as f:
        d = os.path.join(root, f.read().strip())
    try:
        with open(os.path.join(d, "meta.json")) as f:
            return json.load(f)
    except OSError:
        return None


def constraints(args, config) -> list[str]:
    """The data, evaluation and sample arguments (one line each; the corpus is opened, and
    tokenized into its cache, here: before any collective)."""
    used = [n for n, v in (("--data", args.data), ("--eval-every", args.eval_every),
                           ("--prompt", args.prompt)) if v]
    if used and args.mode != "train":
        return [f"{used[0]} is read by --mode train (the other modes use the synthetic language)"]
    if args.eval_every < 0 or args.eval_batches < 1 or args.gen_tokens < 1:
        return ["--eval-every must be >= 0, --eval-batches and --gen-tokens >= 1"]
    if args.eval_every and not args.data:
        return ["--eval-every evaluates on held-out text: give --data and --val-fraction"]
    if args.eval_every and args.val_fraction <= 0:
        return [f"--eval-every needs held-out documents: --val-fraction > 0 "
                f"(got {args.val_fraction})"]
    if args.prompt and tokenizer_dir(args) is None:
        return ["--prompt needs a tokenizer: --model has none; pass --tokenizer DIR"]
    try:
        corpus = open_corpus(args, config, progress=int(os.environ.get("RANK", "0")) == 0)
        if corpus is not None:
            corpus.check_length(args.length)
    except ConfigError as e:
        return [str(e)]
    meta = _checkpoint_meta(args.resume)
    if meta is not None:
        fp = corpus.fingerprint if corpus is not None else "synthetic"
        if meta.get("data", "synthetic") != fp:
            return [f"--resume {args.resume}: the checkpoint was trained on other data "
                    f"({meta.get('data', 'synthetic')[:12]}, this run's is {fp[:12]})"]
        if meta.get("length", args.length) != args.length:
            return [f"--resume {args.resume}: the checkpoint was trained at --length "
                    f"{meta['length']}, not {args.length} (its samples would differ)"]
        if meta.get("doc_mask", False) != getattr(args, "doc_mask", False):
            was = "with" if meta.get("doc_mask", False) else "without"
            return [f"--resume {args.resume}: the checkpoint was trained {was} --doc-mask (the "
                    f"documents' masks are part of the objective: give the same flag)"]
    return []


class DataSource:
    """The train mode's batches: the corpus's train split, or the synthetic language."""

    def __init__(self, corpus, lang, args, device):
        self.corpus, self.lang, self.args, self.device = corpus, lang, args, device
        self.fingerprint = corpus.fingerprint if corpus is not None else "synthetic"

    def train(self, step: int, batch: int, offset: int):
        docs = getattr(self.args, "doc_mask", False)   # packed documents (--doc-mask)
        if self.corpus is None:
            return make_batch(self.lang, step, batch, self.args.length, self.device,
                              offset=offset, doc_mask=docs)
        return self.corpus.batch("train", step, batch, self.args.length, self.device,
                                 offset=offset, doc_mask=docs)

    def val(self, k: int):
        return self.corpus.batch("val", k, self.args.batch, self.args.length, self.device,
                                 doc_mask=getattr(self.args, "doc_mask", False))


def evaluate(strat, data: DataSource) -> tuple[float, float]:
    """(held-out mean CE, perplexity) over --eval-batches global batches of the val split
    (the same sequences at every evaluation)."""
    total = n = 0
    for k in range(data.args.eval_batches):
        b = data.val(k)
        total += strat.eval_sum(b)
        n += b.n_tokens
    loss = total / n
    return loss, math.exp(min(loss, 700.0))


def greedy(model, tok_dir: str, prompt: str, n: int) -> str:
    """The greedy continuation (no sampling) of `prompt` by an HF model, decoded."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tok_dir)
    ids = torch.tensor([tok(prompt, add_special_tokens=False).input_ids],
                       device=next(model.parameters()).device)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                             do_sample=False, pad_token_id=tok.eos_token_id)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=False)
