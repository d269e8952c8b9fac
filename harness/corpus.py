"""corpus.py: real text for the train mode (`--data PATH`): read, tokenize once into an on-disk
cache, split into train and held-out documents, pack, and sample as a pure function of
(seed, index).

Input (`TextCorpus.open(path, tokenizer, vocab_size, seed, ...)`)
    a text file      (.txt, or any name but .jsonl/.npy/.bin) documents are separated by one or
                     more blank lines
    a .jsonl file    one document per line, its "text" field
    a directory      every .txt and .jsonl file under it (recursive, sorted by relative path;
                     hidden files and directories, such as the cache, are skipped)
    .npy / .bin      pre-tokenized ids, 1-D, uint16 or uint32 (.bin: raw, uint16 unless
                     token_dtype="uint32", as nanoGPT writes it); documents are the runs ending
                     in the EOS id (`eos_id`, else the tokenizer's), a last run without one too
Text is tokenized with the tokenizer directory's AutoTokenizer (no special tokens added), and
each document is followed by EOS: a split's stream is doc0 EOS doc1 EOS ...

Held-out split: whole documents, so no document's tokens sit on both sides. Document i goes to
"val" when the i-th uniform draw of default_rng([seed, VAL]) falls below val_fraction; with
val_fraction > 0 and two or more documents, the lowest draw is moved to val (the highest to
train) if one side would be empty.

Packing and sampling: a split's stream is cut into windows of length + 1 tokens that overlap by
one (window j = stream[j L : j L + L + 1]); n = (len - 1) // L windows. Train sample i is window
perm_e[i mod n], e = i // n the epoch, perm_e = default_rng([seed, e, PERM]).permutation(n): a
pure function of (seed, i). Every world size, layout and restart therefore sees the same
sample i, a checkpoint's data position is just the number of samples consumed, and each epoch
visits every window once. Held-out sample i is window i mod n, in order (no shuffle).

Memory: the tokens stay on disk (a memory-mapped .npy in the cache, or the pre-tokenized file
itself); a split is a list of runs of consecutive documents in that file, and a sample copies
only its own window. The ranks of one machine share the pages.

Cache: tokenizing happens once per (input files' relative paths, sizes and mtimes, tokenizer
files, EOS) into a cache directory: by default `.NAME.tokens/` beside a file, `.tokens/` inside
a directory, or ~/.cache/parallelisms/<hash of the path>/ when that is not writable. An entry
is KEY.tokens.npy (uint16 when the vocabulary fits, else uint32), KEY.docs.npy (document end
offsets) and KEY.json (written last: its presence marks the entry complete). Each file is
written to a temporary name and os.replace'd, and the build holds a lock (flock), so several
ranks may open the corpus at once: one tokenizes, the others wait and then read its cache.
Pre-tokenized files get an entry too (KEY.docs.npy and KEY.json: the EOS scan, the largest id
and the content digest), so a second open reads nothing but the entry. A tqdm bar on stderr
shows the build when progress=True and stderr is a terminal.

`fingerprint` (recorded in checkpoints) is a digest of the token stream and document
boundaries (so of the corpus as the tokenizer sees it: a touched or copied corpus keeps it, an
edited one or another tokenizer's ids change it), the EOS id, the seed and val_fraction.

Bad input raises ConfigError with one line starting `--data PATH:`.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile

import numpy as np
import torch

from .data import Batch, eos_positions
from .models import ConfigError

VAL, PERM = 0x7A1, 0x9E6          # the seeded streams' tags: held-out draws, epoch permutations
SPLIT_RULE = 1                    # in the fingerprint: bump when the split or sampling rule changes
CACHE_VERSION = 2                 # in the cache key: bump when the reading rules or layout change
TEXT_EXT, JSONL_EXT, TOKEN_EXT = ".txt", ".jsonl", (".npy", ".bin")
TOKENIZER_FILES = ("tokenizer", "vocab", "merges", "special_tokens", "added_tokens", "spiece",
                   "sentencepiece")   # name prefixes of the files that define a tokenizer
TOKENIZE_BATCH = 512              # documents per tokenizer call (a fast tokenizer threads a batch)
CHUNK = 1 << 24                   # tokens per step of a pass over pre-tokenized data


# -- reading documents ----------------------------------------------------------------------
def _input_files(path: str) -> list[str]:
    """The files to read, as absolute paths, in order."""
    if not os.path.exists(path):
        raise ConfigError(f"--data {path}: no such file or directory")
    if not os.path.isdir(path):
        return [os.path.abspath(path)]
    found = []
    for root, dirs, files in os.walk(os.path.abspath(path)):
        dirs[:] = [d for d in dirs if not d.startswith(".")]     # our own .tokens/ cache
        found += [os.path.join(root, f) for f in files
                  if f.endswith((TEXT_EXT, JSONL_EXT)) and not f.startswith(".")]
    if not found:
        raise ConfigError(f"--data {path}: the directory has no .txt or .jsonl files")
    return sorted(found, key=lambda f: os.path.relpath(f, os.path.abspath(path)))


def _documents(files: list[str], root: str, path: str):
    """Yield (text, bytes read so far) for each non-blank document, in file order. Files are
    read as bytes (so the count drives a progress bar) and decoded as UTF-8, bad bytes
    replaced."""
    done = 0
    for fn in files:
        with open(fn, "rb") as f:
            if fn.endswith(JSONL_EXT):
                for k, raw in enumerate(f, 1):
                    done += len(raw)
                    if not raw.strip():
                        continue
                    try:
                        text = json.loads(raw).get("text")
                    except (ValueError, AttributeError):      # not JSON, or not an object
                        text = None
                    if not isinstance(text, str):
                        raise ConfigError(f"--data {path}: {os.path.relpath(fn, root)} line {k} "
                                          f"has no string \"text\" field")
                    if text.strip():
                        yield text, done
            else:
                doc = []
                for raw in f:
                    done += len(raw)
                    line = raw.decode("utf-8", errors="replace")
                    if line.strip():
                        doc.append(line)
                    elif doc:
                        yield _joined(doc), done
                        doc = []
                if doc:
                    yield _joined(doc), done


def _joined(lines: list[str]) -> str:
    """A document's lines as one string: line breaks inside kept, the last one dropped."""
    return "".join(lines).replace("\r\n", "\n").strip("\n")


# -- the tokenizer ----------------------------------------------------------------------------
def _load_tokenizer(tokenizer: str, path: str, vocab_size: int):
    from transformers import AutoTokenizer
    if not os.path.isdir(tokenizer) and (os.path.isabs(tokenizer) or tokenizer.startswith(".")):
        # (a local path, not a hub name: say so rather than let the loader try the network)
        raise ConfigError(f"--data {path}: cannot load the tokenizer {tokenizer} "
                          f"(no such directory)")
    try:
        tok = AutoTokenizer.from_pretrained(tokenizer)
    except Exception as e:       # noqa: BLE001 (any loader failure is a bad input)
        first = (str(e).strip().splitlines() or [""])[0][:160]
        raise ConfigError(f"--data {path}: cannot load the tokenizer {tokenizer} "
                          f"({type(e).__name__}: {first})") from None
    if len(tok) > vocab_size:       # its ids would index past the embedding table
        raise ConfigError(f"--data {path}: the tokenizer has {len(tok)} tokens, more than "
                          f"the model's vocabulary ({vocab_size})")
    return tok


def _tokenizer_digest(tokenizer: str) -> str:
    """sha256 of the files that define the tokenizer (not the model's weights beside them)."""
    h = hashlib.sha256()
    if os.path.isdir(tokenizer):
        for fn in sorted(os.listdir(tokenizer)):
            if fn.startswith(TOKENIZER_FILES):
                with open(os.path.join(tokenizer, fn), "rb") as f:
                    h.update(fn.encode() + b"\0" + f.read())
    else:
        h.update(tokenizer.encode())
    return h.hexdigest()


# -- the cache --------------------------------------------------------------------------------
def _cache_dirs(path: str, cache_dir: str | None) -> list[str]:
    """Where an entry may be, in order: the given directory; else beside the data, then a
    per-path directory under ~/.cache (the data's own directory may be read-only)."""
    if cache_dir is not None:
        return [cache_dir]
    full = os.path.abspath(path)
    beside = (os.path.join(full, ".tokens") if os.path.isdir(full) else
              os.path.join(os.path.dirname(full), f".{os.path.basename(full)}.tokens"))
    per_path = hashlib.sha256(full.encode()).hexdigest()[:16]
    return [beside, os.path.join(os.path.expanduser("~"), ".cache", "parallelisms", per_path)]


def _writable(d: str) -> bool:
    try:
        os.makedirs(d, exist_ok=True)
    except OSError:
        return False
    return os.access(d, os.W_OK)


@contextlib.contextmanager
def _exclusive(lock_path: str):
    """Hold an exclusive flock on lock_path, so one process builds an entry while the others
    wait for it. Where there is no flock (another OS, some file systems) every process builds,
    and os.replace still keeps each file whole."""
    f = None
    try:
        import fcntl
        f = open(lock_path, "a")
        fcntl.flock(f, fcntl.LOCK_EX)
    except (ImportError, OSError):
        pass
    try:
        yield
    finally:
        if f is not None:
            f.close()             # releases the lock


def _write_atomic(dest: str, write) -> None:
    """write(binary file) to a temporary file beside dest, then os.replace it into place: a
    reader sees the old file or the whole new one, never a part."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(dest), prefix=os.path.basename(dest) + ".",
                               suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.chmod(tmp, 0o644)      # (mkstemp makes it private; other users may share the cache)
        os.replace(tmp, dest)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def _entry(path: str, cache_dir: str | None, key: str, build) -> tuple[str, bool]:
    """(entry path prefix, hit): the first cache directory holding KEY.json, else build(entry)
    in the first writable one, under its lock (a process that waited finds it built)."""
    dirs = _cache_dirs(path, cache_dir)
    for d in dirs:
        if os.path.isfile(os.path.join(d, key + ".json")):
            return os.path.join(d, key), True
    for d in dirs:
        if _writable(d):
            entry = os.path.join(d, key)
            with _exclusive(entry + ".lock"):
                if os.path.isfile(entry + ".json"):
                    return entry, True
                build(entry)
            return entry, False
    raise ConfigError(f"--data {path}: no writable directory for the token cache "
                      f"({', '.join(dirs)}); pass --data-cache DIR")


def _progress(progress: bool, total: int, desc: str, unit: str):
    if not progress:
        return None
    from tqdm import tqdm
    # disable=None: only on a terminal (a log file would fill with carriage returns)
    return tqdm(total=total, desc=desc, unit=unit, unit_scale=True, leave=False, disable=None)


def _tokenize_into(entry: str, files: list[str], root: str, path: str, tok, eos: int,
                   dtype: np.dtype, progress: bool) -> None:
    """Build a text entry: tokens streamed to a raw temporary file (memory stays one batch),
    then written as a .npy; the document ends; the json with the content digest."""
    bar = _progress(progress, sum(os.path.getsize(f) for f in files),
                    f"tokenizing {os.path.basename(path)}", "B")
    digest, ends, n = hashlib.sha256(), [], 0
    fd, raw = tempfile.mkstemp(dir=os.path.dirname(entry), suffix=".raw.tmp")
    try:
        with os.fdopen(fd, "wb") as out:
            docs = _documents(files, root, path)
            while True:
                chunk = [d for _, d in zip(range(TOKENIZE_BATCH), docs)]
                if not chunk:
                    break
                ids = tok([text for text, _ in chunk], add_special_tokens=False,
                          verbose=False).input_ids
                for x in ids:
                    n += len(x) + 1
                    ends.append(n)
                flat = np.concatenate([np.asarray(x + [eos], dtype=np.int64) for x in ids])
                out.write(flat.astype(dtype).tobytes())
                digest.update(flat.astype("<u4").tobytes())
                if bar is not None:
                    bar.update(chunk[-1][1] - bar.n)
        if not ends:
            raise ConfigError(f"--data {path}: no documents (an empty corpus)")
        header = dict(descr=np.lib.format.dtype_to_descr(dtype), fortran_order=False,
                      shape=(n,))

        def npy(f):
            np.lib.format.write_array_header_1_0(f, header)
            with open(raw, "rb") as src:
                shutil.copyfileobj(src, f, 1 << 24)
        _write_atomic(entry + ".tokens.npy", npy)
    finally:
        os.remove(raw)
        if bar is not None:
            bar.close()
    ends = np.asarray(ends, dtype=np.int64)
    digest.update(ends.astype("<i8").tobytes())
    _write_atomic(entry + ".docs.npy", lambda f: np.save(f, ends))
    meta = dict(version=CACHE_VERSION, files=len(files), content=digest.hexdigest(),
                max_id=None)
    _write_atomic(entry + ".json", lambda f: f.write(json.dumps(meta).encode()))


def _scan_into(entry: str, tokens: np.ndarray, eos: int, path: str, progress: bool) -> None:
    """Build a pre-tokenized entry: one pass in chunks for the document ends (the positions
    after each EOS), the largest id and the content digest."""
    bar = _progress(progress, len(tokens), f"scanning {os.path.basename(path)}", "tok")
    digest, ends, top = hashlib.sha256(), [], 0
    for a in range(0, len(tokens), CHUNK):
        c = np.asarray(tokens[a:a + CHUNK])
        top = max(top, int(c.max()))
        ends.append(np.flatnonzero(c == eos) + (a + 1))
        digest.update(c.astype("<u4").tobytes())
        if bar is not None:
            bar.update(len(c))
    if bar is not None:
        bar.close()
    ends = np.concatenate(ends).astype(np.int64)
    if len(ends) == 0 or ends[-1] != len(tokens):
        ends = np.append(ends, len(tokens))        # a last document without its EOS
    digest.update(ends.astype("<i8").tobytes())
    _write_atomic(entry + ".docs.npy", lambda f: np.save(f, ends))
    meta = dict(version=CACHE_VERSION, files=1, content=digest.hexdigest(), max_id=top)
    _write_atomic(entry + ".json", lambda f: f.write(json.dumps(meta).encode()))


def _map_tokens(path: str, token_dtype: str | None) -> np.ndarray:
    """The pre-tokenized ids, memory-mapped (1-D uint16 or uint32)."""
    if token_dtype not in (None, "uint16", "uint32"):
        raise ConfigError(f"--data {path}: the token dtype must be uint16 or uint32 "
                          f"(got {token_dtype})")
    if path.endswith(".npy"):               # the header carries the dtype (token_dtype unused)
        try:
            tokens = np.load(path, mmap_mode="r")
        except (ValueError, OSError) as e:
            raise ConfigError(f"--data {path}: not a readable .npy array ({e})") from None
        if tokens.ndim != 1 or tokens.dtype not in (np.dtype("uint16"), np.dtype("uint32")):
            raise ConfigError(f"--data {path}: expected a 1-D uint16 or uint32 array, got "
                              f"{tokens.ndim}-D {tokens.dtype}")
        return tokens
    dtype, size = np.dtype(token_dtype or "uint16"), os.path.getsize(path)
    if size % dtype.itemsize:
        raise ConfigError(f"--data {path}: {size} bytes is not a whole number of {dtype} ids "
                          f"(another --data-dtype?)")
    return np.memmap(path, dtype=dtype, mode="r") if size else np.zeros(0, dtype)


# -- the corpus -------------------------------------------------------------------------------
class TextCorpus:
    """A tokenized corpus split into train and held-out documents; see the module docstring.
    Made by `TextCorpus.open`."""

    def __init__(self, path: str, tokens: np.ndarray, doc_ends: np.ndarray, eos_id: int,
                 seed: int, val_fraction: float, content: str, n_files: int, hit: bool,
                 cache: str):
        self.path, self.eos_id, self.seed, self.val_fraction = path, int(eos_id), seed, val_fraction
        self._tokens, self._files, self._hit, self._cache = tokens, n_files, hit, cache
        self._perms: dict = {}
        n = len(doc_ends)
        starts = np.concatenate([[0], doc_ends[:-1]])
        # document i's draw is the i-th of one seeded stream: a function of (seed, i) only
        draws = np.random.default_rng([seed, VAL]).random(n)
        val = draws < val_fraction
        if val_fraction > 0 and n >= 2:             # at least one document on each side
            if not val.any():
                val[int(np.argmin(draws))] = True
            if val.all():
                val[int(np.argmax(draws))] = False
        # a split's stream is its runs of consecutive documents, end to end: per split, the
        # runs' first token in `tokens`, and the runs' offsets in the split's stream
        cut = np.flatnonzero(val[1:] != val[:-1]) + 1
        first, last = np.concatenate([[0], cut]), np.concatenate([cut, [n]]) - 1
        self._runs = {}
        for split, side in (("train", False), ("val", True)):
            keep = val[first] == side
            lo, hi = starts[first[keep]], doc_ends[last[keep]]
            self._runs[split] = (lo, np.concatenate([[0], np.cumsum(hi - lo)]))
        self.n_docs = {"train": int((~val).sum()), "val": int(val.sum())}
        self.n_tokens = {s: int(self._runs[s][1][-1]) for s in ("train", "val")}
        self.fingerprint = hashlib.sha256(
            f"{content}|eos={self.eos_id}|seed={seed}|val={val_fraction!r}|"
            f"rule={SPLIT_RULE}".encode()).hexdigest()

    # -- construction --
    @classmethod
    def open(cls, path: str, tokenizer: str | None, vocab_size: int, seed: int,
             val_fraction: float = 0.0, cache_dir: str | None = None, progress: bool = True,
             eos_id: int | None = None, token_dtype: str | None = None) -> "TextCorpus":
        if not 0.0 <= val_fraction < 1.0:
            raise ConfigError(f"--data {path}: --val-fraction must be in [0, 1) "
                              f"(got {val_fraction})")
        if os.path.isfile(path) and path.endswith(TOKEN_EXT):
            return cls._open_tokens(path, tokenizer, vocab_size, seed, val_fraction, cache_dir,
                                    progress, eos_id, token_dtype)
        return cls._open_text(path, tokenizer, vocab_size, seed, val_fraction, cache_dir,
                              progress, eos_id)

    @classmethod
    def _open_text(cls, path, tokenizer, vocab_size, seed, val_fraction, cache_dir, progress,
                   eos_id):
        files = _input_files(path)
        root = os.path.abspath(path) if os.path.isdir(path) else os.path.dirname(files[0])
        if tokenizer is None:
            raise ConfigError(f"--data {path}: text needs a tokenizer (the model directory has "
                              f"none; pass --tokenizer DIR)")
        tok = _load_tokenizer(tokenizer, path, vocab_size)
        eos = tok.eos_token_id if tok.eos_token_id is not None else eos_id
        if eos is None:
            raise ConfigError(f"--data {path}: the tokenizer {tokenizer} has no EOS token "
                              f"(documents are joined with EOS)")
        if eos >= vocab_size:
            raise ConfigError(f"--data {path}: the EOS id {eos} is outside the model's "
                              f"vocabulary ({vocab_size})")
        dtype = np.dtype("<u2") if max(len(tok) - 1, eos) < 1 << 16 else np.dtype("<u4")
        key = hashlib.sha256(json.dumps(dict(
            version=CACHE_VERSION, kind="text", tokenizer=_tokenizer_digest(tokenizer), eos=eos,
            files=[(os.path.relpath(f, root), os.path.getsize(f), os.stat(f).st_mtime_ns)
                   for f in files])).encode()).hexdigest()[:32]
        entry, hit = _entry(path, cache_dir, key, lambda e: _tokenize_into(
            e, files, root, path, tok, eos, dtype, progress))
        meta, ends = cls._read_entry(path, entry)
        try:
            tokens = np.load(entry + ".tokens.npy", mmap_mode="r")
        except (ValueError, OSError) as e:
            raise ConfigError(f"--data {path}: the token cache {entry}.* is damaged ({e}); "
                              f"delete it") from None
        return cls(path, tokens, ends, eos, seed, val_fraction, meta["content"], len(files),
                   hit, os.path.dirname(entry))

    @classmethod
    def _open_tokens(cls, path, tokenizer, vocab_size, seed, val_fraction, cache_dir, progress,
                     eos_id, token_dtype):
        if eos_id is None and tokenizer is not None:
            eos_id = _load_tokenizer(tokenizer, path, vocab_size).eos_token_id
        if eos_id is None:
            raise ConfigError(f"--data {path}: pre-tokenized data needs an EOS id to find its "
                              f"documents (none in the model's config or a tokenizer)")
        tokens = _map_tokens(path, token_dtype)
        if len(tokens) == 0:
            raise ConfigError(f"--data {path}: no documents (an empty corpus)")
        st = os.stat(path)
        key = hashlib.sha256(json.dumps(dict(
            version=CACHE_VERSION, kind="tokens", name=os.path.basename(path), size=st.st_size,
            mtime=st.st_mtime_ns, dtype=tokens.dtype.str, eos=int(eos_id))).encode()
        ).hexdigest()[:32]
        entry, hit = _entry(path, cache_dir, key, lambda e: _scan_into(
            e, tokens, int(eos_id), path, progress))
        meta, ends = cls._read_entry(path, entry)
        if meta["max_id"] >= vocab_size:
            raise ConfigError(f"--data {path}: token id {meta['max_id']} is outside the model's "
                              f"vocabulary ({vocab_size} ids)")
        return cls(path, tokens, ends, eos_id, seed, val_fraction, meta["content"], 1, hit,
                   os.path.dirname(entry))

    @staticmethod
    def _read_entry(path: str, entry: str) -> tuple[dict, np.ndarray]:
        try:
            with open(entry + ".json") as f:
                meta = json.load(f)
            return meta, np.load(entry + ".docs.npy")
        except (ValueError, OSError) as e:
            raise ConfigError(f"--data {path}: the token cache {entry}.* is damaged ({e}); "
                              f"delete it") from None

    # -- checks and description --
    def check_length(self, length: int) -> None:
        """Each split in use holds at least one window of length + 1 tokens (val only when
        there is a held-out split)."""
        for split in ("train", "val") if self.val_fraction > 0 else ("train",):
            self._windows(split, length)

    def describe(self) -> str:
        return (f"{self.path}: {self._files} file(s), {self.n_docs['train']} train / "
                f"{self.n_docs['val']} held-out documents, {self.n_tokens['train']:,} / "
                f"{self.n_tokens['val']:,} tokens (EOS included); "
                f"{'cache hit' if self._hit else 'cache built'} ({self._cache})")

    # -- reading a split --
    def _read(self, split: str, a: int, b: int) -> np.ndarray:
        """Tokens [a, b) of the split's stream, gathered from its runs."""
        lo, offsets = self._runs[split]
        k = int(np.searchsorted(offsets, a, side="right")) - 1
        parts = []
        while a < b:
            take = min(b, int(offsets[k + 1])) - a
            s = int(lo[k]) + a - int(offsets[k])
            parts.append(self._tokens[s:s + take])
            a, k = a + take, k + 1
        return np.concatenate(parts) if parts else np.zeros(0, self._tokens.dtype)

    def stream(self, split: str) -> np.ndarray:
        """The split's whole stream (doc EOS doc EOS ...), in memory: for tests and small
        corpora."""
        return np.array(self._read(split, 0, self.n_tokens[split]))

    # -- sampling --
    def n_samples(self, split: str, length: int) -> int:
        return max(0, (self.n_tokens[split] - 1) // length)

    def _windows(self, split: str, length: int) -> int:
        if split not in self._runs:
            raise ValueError(f"split must be 'train' or 'val', not {split!r}")
        n = self.n_samples(split, length)
        if n == 0:
            raise ConfigError(f"--data {self.path}: the {split} split holds "
                              f"{self.n_tokens[split]} tokens, fewer than --length + 1 = "
                              f"{length + 1}")
        return n

    def _perm(self, epoch: int, n: int) -> np.ndarray:
        if (epoch, n) not in self._perms:
            if len(self._perms) >= 2:              # a batch straddles at most two epochs
                self._perms.pop(next(iter(self._perms)))
            self._perms[epoch, n] = np.random.default_rng([self.seed, epoch, PERM]).permutation(n)
        return self._perms[epoch, n]

    def sample(self, split: str, start: int, count: int, length: int) -> np.ndarray:
        """Samples start..start+count-1 of `split`, each length + 1 tokens, as int64."""
        n = self._windows(split, length)
        i = np.arange(start, start + count)
        if split == "val":
            w = i % n
        else:
            epoch, j = np.divmod(i, n)
            w = np.empty(count, dtype=np.int64)
            for e in np.unique(epoch):
                w[epoch == e] = self._perm(int(e), n)[j[epoch == e]]
        out = np.empty((count, length + 1), dtype=np.int64)
        for r, k in enumerate(w):
            out[r] = self._read(split, int(k) * length, int(k) * length + length + 1)
        return out

    def batch(self, split: str, step: int, batch: int, length: int, device,
              offset: int | None = None, doc_mask: bool = False) -> Batch:
        """Samples [step*batch, (step+1)*batch), or [offset, offset+batch): like
        harness.data.make_batch, inputs x[:, :-1] and labels x[:, 1:] (every position has a
        target; across a document boundary the target is EOS, then the next document).
        doc_mask: the documents' positions, restarting after each EOS (--doc-mask)."""
        start = step * batch if offset is None else offset
        x = torch.from_numpy(self.sample(split, start, batch, length))
        docs = eos_positions(x[:, :-1], self.eos_id) if doc_mask else None
        return Batch.on_device(x[:, :-1], x[:, 1:], step, device, docs)
