"""corpus.py: real text for the train mode (`--data PATH`): read, tokenize (cached), split
into train and held-out documents, pack, and sample as a pure function of (seed, index).

Input (`TextCorpus.open(path, tokenizer, vocab_size, seed, ...)`)
    a text file      documents are separated by one or more blank lines
    a .jsonl file    one document per line, its "text" field
    a directory      every .txt and .jsonl file under it (recursive, sorted by relative path)
    .npy / .bin      pre-tokenized ids, 1-D, uint16 or uint32 (.bin: raw, uint16 unless
                     token_dtype="uint32", as nanoGPT writes it); documents are the runs between
                     EOS ids
Text is tokenized with the tokenizer directory's AutoTokenizer (no special tokens added), and
each document is followed by EOS: a split's stream is doc0 EOS doc1 EOS ...

Held-out split: whole documents. Document i goes to val when the i-th uniform draw of
default_rng([seed, VAL]) falls below val_fraction (at least one document each way when
val_fraction > 0 and there are two or more), so a document's tokens never sit on both sides.

Packing and sampling: a split's stream is cut into windows of length + 1 tokens that overlap by
one (window j = stream[j L : j L + L + 1]); n = (len - 1) // L windows. Train sample i is window
perm_e[i mod n], e = i // n the epoch, perm_e drawn from default_rng([seed, e, PERM]): a pure
function of (seed, i). Every world size, layout and restart therefore sees the same sample i,
and a checkpoint's data position is just the number of samples consumed. Each epoch visits every
window once. Held-out sample i is window i mod n in order.

Cache: the token stream and the document offsets are written once per (input files' paths,
sizes and mtimes, tokenizer files, reading rules) to a cache directory (default beside the data:
`.<name>.tokens/` next to a file, `.tokens/` inside a directory; ~/.cache/parallelisms when that
is not writable), atomically (tmp + os.replace), so several ranks may open the same corpus at
once. A tqdm bar shows tokenization when progress=True and stderr is a terminal.

Bad input raises ConfigError with one line starting `--data PATH:`.
"""
from __future__ import annotations

import hashlib
import json
import os

import numpy as np
import torch

from .data import Batch
from .models import ConfigError

VAL, PERM = 0x7A1, 0x9E6
TEXT_EXT, JSONL_EXT, TOKEN_EXT = (".txt", ".text", ".md"), (".jsonl",), (".npy", ".bin")
CACHE_VERSION = 1


# -- reading documents ----------------------------------------------------------------------
def _input_files(path: str) -> list[str]:
    if os.path.isdir(path):
        out = []
        for root, dirs, files in os.walk(path):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            out += [os.path.join(root, f) for f in files
                    if f.endswith(TEXT_EXT + JSONL_EXT) and not f.startswith(".")]
        if not out:
            raise ConfigError(f"--data {path}: the directory has no .txt or .jsonl files")
        return sorted(out, key=lambda f: os.path.relpath(f, path))
    if not os.path.exists(path):
        raise ConfigError(f"--data {path}: no such file or directory")
    return [path]


def _documents(files: list[str], root: str):
    """Yield each non-blank document's text, in file order."""
    for fn in files:
        if fn.endswith(JSONL_EXT):
            with open(fn, encoding="utf-8") as f:
                for k, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        text = json.loads(line).get("text")
                    except (ValueError, AttributeError):
                        text = None
                    if not isinstance(text, str):
                        raise ConfigError(f"--data {root}: {os.path.relpath(fn, root) or fn} "
                                          f"line {k} has no string \"text\" field")
                    if text.strip():
                        yield text
        else:
            with open(fn, encoding="utf-8", errors="replace") as f:
                doc = []
                for line in f:
                    if line.strip():
                        doc.append(line)
                    elif doc:
                        yield "".join(doc).strip("\n")
                        doc = []
                if doc:
                    yield "".join(doc).strip("\n")


def _load_tokenizer(tokenizer: str | None, path: str):
    if tokenizer is None:
        raise ConfigError(f"--data {path}: text needs a tokenizer (the model directory has "
                          f"none; pass --tokenizer DIR)")
    from transformers import AutoTokenizer
    try:
        tok = AutoTokenizer.from_pretrained(tokenizer)
    except Exception as e:       # noqa: BLE001 (any loader failure is a bad input)
        raise ConfigError(f"--data {path}: cannot load the tokenizer {tokenizer} "
                          f"({type(e).__name__}: {str(e).splitlines()[0][:120]})")
    if tok.eos_token_id is None:
        raise ConfigError(f"--data {path}: the tokenizer {tokenizer} has no EOS token "
                          f"(documents are joined with EOS)")
    return tok


def _tokenizer_digest(tokenizer: str) -> str:
    h = hashlib.sha256()
    if os.path.isdir(tokenizer):
        for fn in sorted(os.listdir(tokenizer)):
            if fn.startswith(("tokenizer", "vocab", "merges", "special_tokens")):
                with open(os.path.join(tokenizer, fn), "rb") as f:
                    h.update(fn.encode() + f.read())
    else:
        h.update(tokenizer.encode())
    return h.hexdigest()


# -- the corpus -------------------------------------------------------------------------------
class TextCorpus:
    def __init__(self, path, tokens: np.ndarray, doc_ends: np.ndarray, eos_id: int, seed: int,
                 val_fraction: float, fingerprint: str, cache: str):
        self.path, self.eos_id, self.seed = path, eos_id, seed
        self.val_fraction, self.cache = val_fraction, cache
        starts = np.concatenate([[0], doc_ends[:-1]])
        n_docs = len(doc_ends)
        # document i's draw is the i-th of one seeded stream: a function of (seed, i) only
        draws = np.random.default_rng([seed, VAL]).random(n_docs)
        val = draws < val_fraction
        if val_fraction > 0 and n_docs >= 2:        # at least one document on each side
            if not val.any():
                val[int(np.argmin(draws))] = True
            if val.all():
                val[int(np.argmax(draws))] = False
        self.streams = {}
        for split, mask in (("train", ~val), ("val", val)):
            parts = [tokens[a:b] for a, b, m in zip(starts, doc_ends, mask) if m]
            self.streams[split] = (np.concatenate(parts).astype(np.int64) if parts
                                   else np.zeros(0, dtype=np.int64))
        self.n_docs = {"train": int((~val).sum()), "val": int(val.sum())}
        self.n_tokens = {k: int(len(v)) for k, v in self.streams.items()}
        self.fingerprint = hashlib.sha256(
            f"{fingerprint}|{seed}|{val_fraction!r}".encode()).hexdigest()

    # -- construction --
    @classmethod
    def open(cls, path: str, tokenizer: str | None, vocab_size: int, seed: int,
             val_fraction: float = 0.0, cache_dir: str | None = None, progress: bool = True,
             eos_id: int | None = None, token_dtype: str | None = None) -> "TextCorpus":
        if not 0.0 <= val_fraction < 1.0:
            raise ConfigError(f"--data {path}: --val-fraction must be in [0, 1) "
                              f"(got {val_fraction})")
        if path.endswith(TOKEN_EXT) and os.path.isfile(path):
            return cls._pretokenized(path, tokenizer, vocab_size, seed, val_fraction, eos_id,
                                     token_dtype)
        files = _input_files(path)
        root = path if os.path.isdir(path) else os.path.dirname(path)
        tok = _load_tokenizer(tokenizer, path)
        if len(tok) > vocab_size:
            raise ConfigError(f"--data {path}: the tokenizer has {len(tok)} tokens, more than "
                              f"the model's vocabulary ({vocab_size})")
        key = hashlib.sha256(json.dumps(dict(
            v=CACHE_VERSION, tok=_tokenizer_digest(tokenizer),
            files=[(os.path.relpath(f, root) if root else f, os.path.getsize(f),
                    os.stat(f).st_mtime_ns) for f in files])).encode()).hexdigest()
        cache = cls._cache_dir(path, cache_dir)
        npz = os.path.join(cache, f"{key[:24]}.npz")
        hit = os.path.isfile(npz)
        if hit:
            with np.load(npz) as z:
                tokens, doc_ends = z["tokens"], z["doc_ends"]
        else:
            tokens, doc_ends = cls._tokenize(files, root or path, path, tok, progress)
            tmp = f"{npz}.{os.getpid()}.tmp.npz"
            np.savez(tmp, tokens=tokens, doc_ends=doc_ends)
            os.replace(tmp, npz)
        if len(doc_ends) == 0 or len(tokens) == 0:
            raise ConfigError(f"--data {path}: no documents (an empty corpus)")
        c = cls(path, tokens, doc_ends, int(tok.eos_token_id), seed, val_fraction, key, npz)
        c._files, c._hit = len(files), hit
        return c

    @staticmethod
    def _cache_dir(path: str, cache_dir: str | None) -> str:
        if cache_dir is None:
            if os.path.isdir(path):
                cache_dir = os.path.join(path, ".tokens")
            else:
                d, name = os.path.split(os.path.abspath(path))
                cache_dir = os.path.join(d, f".{name}.tokens")
        try:
            os.makedirs(cache_dir, exist_ok=True)
            if not os.access(cache_dir, os.W_OK):
                raise OSError
        except OSError:
            cache_dir = os.path.join(os.path.expanduser("~"), ".cache", "parallelisms")
            os.makedirs(cache_dir, exist_ok=True)
        return cache_dir

    @staticmethod
    def _tokenize(files, root, path, tok, progress):
        """(tokens uint32, doc_ends int64): every document's ids followed by EOS."""
        docs = list(_documents(files, root))
        if not docs:
            raise ConfigError(f"--data {path}: no documents (an empty corpus)")
        bar = None
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=len(docs), desc=f"tokenizing {os.path.basename(path)}",
                       unit="doc", leave=False, disable=None)   # (None: only on a terminal)
        ids, ends, n = [], [], 0
        for i in range(0, len(docs), 256):        # batches: the fast tokenizer's threads
            for x in tok(docs[i:i + 256], add_special_tokens=False).input_ids:
                ids.append(np.asarray(x + [tok.eos_token_id], dtype=np.uint32))
                n += len(x) + 1
                ends.append(n)
            if bar is not None:
                bar.update(min(256, len(docs) - i))
        if bar is not None:
            bar.close()
        return np.concatenate(ids), np.asarray(ends, dtype=np.int64)

    @classmethod
    def _pretokenized(cls, path, tokenizer, vocab_size, seed, val_fraction, eos_id, token_dtype):
        if eos_id is None and tokenizer is not None:
            eos_id = _load_tokenizer(tokenizer, path).eos_token_id
        if eos_id is None:
            raise ConfigError(f"--data {path}: pre-tokenized data needs an EOS id to find its "
                              f"documents (none in the model's config or a tokenizer)")
        if path.endswith(".npy"):
            tokens = np.load(path, mmap_mode="r")
            if tokens.dtype not in (np.uint16, np.uint32) or tokens.ndim != 1:
                raise ConfigError(f"--data {path}: expected a 1-D uint16 or uint32 array, got "
                                  f"{tokens.ndim}-D {tokens.dtype}")
        else:
            tokens = np.memmap(path, dtype=token_dtype or "uint16", mode="r")
        tokens = np.asarray(tokens)
        if len(tokens) == 0:
            raise ConfigError(f"--data {path}: no documents (an empty corpus)")
        top = int(tokens.max())
        if top >= vocab_size:
            raise ConfigError(f"--data {path}: token id {top} is outside the model's "
                              f"vocabulary ({vocab_size})")
        ends = np.flatnonzero(tokens == eos_id) + 1
        if len(ends) == 0 or ends[-1] != len(tokens):
            ends = np.append(ends, len(tokens))      # a last document without its EOS
        st = os.stat(path)
        key = hashlib.sha256(f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}|"
                             f"{token_dtype}|{eos_id}".encode()).hexdigest()
        c = cls(path, tokens, ends, int(eos_id), seed, val_fraction, key, "(pre-tokenized)")
        c._files, c._hit = 1, True
        return c

    # -- checks and description --
    def check_length(self, length: int) -> None:
        """Each split in use holds at least one window of length + 1 tokens."""
        for split in ("train", "val") if self.val_fraction > 0 else ("train",):
            if self.n_samples(split, length) == 0:
                raise ConfigError(f"--data {self.path}: the {split} split holds "
                                  f"{self.n_tokens[split]} tokens, fewer than --length + 1 = "
                                  f"{length + 1}")

    def describe(self) -> str:
        return (f"{self.path}: {self._files} file(s), {self.n_docs['train']} train / "
                f"{self.n_docs['val']} held-out documents, {self.n_tokens['train']:,} / "
                f"{self.n_tokens['val']:,} tokens (EOS included); "
                + ("cache hit" if self._hit else "tokenized") + f" ({self.cache})")

    # -- sampling --
    def n_samples(self, split: str, length: int) -> int:
        return max(0, (self.n_tokens[split] - 1) // length)

    def _window(self, split: str, i: int, length: int) -> int:
        n = self.n_samples(split, length)
        if split == "val":
            return i % n
        e, j = divmod(i, n)
        return int(self._perm(e, n)[j])

    def _perm(self, epoch: int, n: int) -> np.ndarray:
        cached = getattr(self, "_perm_cache", None)
        if cached is None or cached[0] != (epoch, n):
            cached = ((epoch, n), np.random.default_rng([self.seed, epoch, PERM]).permutation(n))
            self._perm_cache = cached
        return cached[1]

    def sample(self, split: str, start: int, count: int, length: int) -> np.ndarray:
        """Samples start..start+count-1 of `split`, each length + 1 tokens, as int64."""
        if self.n_samples(split, length) == 0:
            raise ConfigError(f"--data {self.path}: the {split} split holds "
                              f"{self.n_tokens[split]} tokens, fewer than --length + 1")
        s = self.streams[split]
        rows = [s[w * length:w * length + length + 1]
                for w in (self._window(split, i, length) for i in range(start, start + count))]
        return np.stack(rows).astype(np.int64)

    def batch(self, split: str, step: int, batch: int, length: int, device,
              offset: int | None = None) -> Batch:
        """Samples [step*batch, (step+1)*batch), or [offset, offset+batch): like
        harness.data.make_batch, inputs x[:, :-1] and labels x[:, 1:] (every position has a
        target; across a document boundary the target is EOS, then the next document)."""
        start = step * batch if offset is None else offset
        x = torch.from_numpy(self.sample(split, start, batch, length))
        return Batch(x[:, :-1].contiguous().to(device), x[:, 1:].contiguous().to(device), step)
