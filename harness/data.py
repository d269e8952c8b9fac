"""data.py: a sparse random Markov chain over the vocabulary, with an exactly known loss floor.
Sequences start from the stationary distribution pi, so every position's next-token entropy is
the chain's entropy rate
    H = sum_i pi_i * H(P_i)     (nats),
the floor that a perfect model's cross-entropy reaches. Sample i is a pure function of (seed, i):
the same whatever the world size, rank or layout. Correctness runs also ignore a padded tail and
a masked span per sample (`ignore_spans`), so token counts differ per rank, micro-batch and chunk.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from .loss import IGNORE_INDEX


class MarkovLanguage:
    def __init__(self, vocab: int, seed: int, branching: int = 4):
        rng = np.random.default_rng([seed, 0x5EED])
        self.vocab, self.seed = vocab, seed
        self.succ = np.stack([rng.choice(vocab, branching, replace=False) for _ in range(vocab)])
        self.prob = rng.dirichlet(np.ones(branching), size=vocab)            # (V, k)
        self.cum = np.cumsum(self.prob, axis=1)
        self.cum[:, -1] = 1.0
        self.pi = self._stationary()
        row_entropy = -(self.prob * np.log(self.prob)).sum(axis=1)
        self.entropy_rate = float((self.pi * row_entropy).sum())

    def _stationary(self, iters: int = 10000, tol: float = 1e-13) -> np.ndarray:
        pi = np.full(self.vocab, 1.0 / self.vocab)
        for _ in range(iters):  # lazy chain (I+P)/2: same pi, and no oscillation if periodic
            nxt = np.zeros_like(pi)
            np.add.at(nxt, self.succ, pi[:, None] * self.prob)
            nxt = 0.5 * (pi + nxt)
            if np.abs(nxt - pi).sum() < tol:
                return nxt / nxt.sum()
            pi = nxt
        return pi / pi.sum()

    def sample(self, start: int, count: int, length: int) -> np.ndarray:
        """Samples start..start+count-1, each length+1 tokens, as an int64 array."""
        u = np.stack([np.random.default_rng([self.seed, i]).random(length + 1)
                      for i in range(start, start + count)])
        x = np.empty((count, length + 1), dtype=np.int64)
        x[:, 0] = np.searchsorted(np.cumsum(self.pi), u[:, 0]).clip(max=self.vocab - 1)
        for t in range(1, length + 1):
            cur = x[:, t - 1]
            j = (u[:, t, None] > self.cum[cur]).sum(axis=1)
            x[:, t] = self.succ[cur, j]
        return x


def targets(labels: torch.Tensor) -> int:
    """How many labels count (are not IGNORE_INDEX): a host read when labels are on a GPU."""
    return int((labels != IGNORE_INDEX).sum())


@dataclass
class Batch:
    """A global batch. labels are already shifted (labels[:, t] is the token after
    input_ids[:, t]), so every position has a target and a sequence split loses no token."""
    input_ids: torch.Tensor   # (B, S)
    labels: torch.Tensor      # (B, S), IGNORE_INDEX where there is no target
    index: int                # step index s: samples [s*B, (s+1)*B)
    # where the rows and columns sit in the step's global batch (None: rows 0..B-1, columns
    # 0..S-1): a rank's share keeps them, so dropout.py can key its masks by them
    sample_ids: torch.Tensor | None = None   # (B,)
    positions: torch.Tensor | None = None    # (S,)
    # packed documents (--doc-mask): each token's position in its own document, restarting at
    # 0 at each boundary (None: one document per row). Passed to HF's forward as position_ids,
    # it restarts the rotary positions and makes HF's mask block-diagonal: causal within a
    # document only (transformers' find_packed_sequence_indices)
    doc_positions: torch.Tensor | None = None   # (B, S)

    def row_ids(self) -> torch.Tensor:
        return (torch.arange(self.input_ids.shape[0], device=self.input_ids.device)
                if self.sample_ids is None
                else self.sample_ids)

    def column_positions(self) -> torch.Tensor:
        return (torch.arange(self.input_ids.shape[1], device=self.input_ids.device)
                if self.positions is None
                else self.positions)

    def take(self, rows) -> "Batch":
        """The rows `rows` (a slice, a list or an index tensor), their ids kept."""
        return Batch(self.input_ids[rows], self.labels[rows], self.index,
                     self.row_ids()[rows], self.positions,
                     None if self.doc_positions is None else self.doc_positions[rows])

    def cols(self, idx: torch.Tensor) -> "Batch":
        """The columns `idx` of every row (a context-parallel rank's tokens), positions kept."""
        return Batch(self.input_ids[:, idx], self.labels[:, idx], self.index, self.sample_ids,
                     self.column_positions().to(idx.device)[idx],
                     None if self.doc_positions is None else self.doc_positions[:, idx])

    @functools.cached_property
    def n_tokens(self) -> int:
        """Targets that count (a host int). A batch made by `on_device` counted them on the
        host before the copy; counting device labels here is a host read."""
        return targets(self.labels)

    @classmethod
    def on_device(cls, inputs, labels, index: int, device, doc_positions=None) -> "Batch":
        """The batch of host tensors `inputs`, `labels` on `device`, its target count taken on
        the host first: a step that reads `n_tokens` then makes no host read for it."""
        b = cls(inputs.to(device).contiguous(), labels.to(device).contiguous(), index,
                doc_positions=None if doc_positions is None else doc_positions.to(device))
        b.__dict__["n_tokens"] = targets(labels)   # (the cached property, from host labels)
        return b

    def rows(self, start: int, stop: int) -> "Batch":
        return self.take(slice(start, stop))

    def shard(self, rank: int, world: int) -> "Batch":
        """This rank's contiguous share of the sequences (world must divide the batch)."""
        n = self.input_ids.shape[0] // world
        return self.rows(rank * n, (rank + 1) * n)

    def split(self, k: int) -> list["Batch"]:
        n = self.input_ids.shape[0] // k
        return [self.rows(i * n, (i + 1) * n) for i in range(k)]


PAD_ID = 0   # the input token at padded positions (their labels are IGNORE_INDEX) when the
             # model names none


def pad_id(config) -> int | None:
    """The model's pad token (config.pad_token_id, whose embedding row HF's nn.Embedding keeps
    at zero gradient through padding_idx), or None where it names none in its vocabulary."""
    p = getattr(config, "pad_token_id", None)
    return p if isinstance(p, int) and 0 <= p < config.vocab_size else None


def ignore_spans(seed: int, start: int, count: int, length: int) -> np.ndarray:
    """(count, length) bool: which targets of samples start..start+count-1 are ignored, a pure
    function of (seed, sample index) like the tokens. Each sample gets a padded tail of 0..L/4
    positions (inputs PAD_ID, labels ignored) and an ignored span of 0..L/8 labels somewhere
    before it (a masked prompt), so token counts differ per sample, per rank, per micro-batch
    and per sequence chunk, and a "mean of per-shard means" cannot agree with the global mean."""
    out = np.zeros((count, length), dtype=bool)
    for r, i in enumerate(range(start, start + count)):
        rng = np.random.default_rng([seed, i, 0x1D])
        tail = int(rng.integers(0, length // 4 + 1))
        span = int(rng.integers(0, length // 8 + 1))
        a = int(rng.integers(0, max(1, length - tail - span)))
        out[r, a:a + span] = True
        if tail:
            out[r, length - tail - 1:] = True     # the last real token predicts padding too
    return out


# Packed documents: each row is cut into documents whose lengths follow a long tail, as real
# SFT and pretraining data do: Pareto(alpha = 1.2) floored to whole tokens, at least DOC_MIN
# (median 6-7 tokens, a tail to the row's end, which cuts the last document), a pure function of
# (seed, sample).
DOC_ALPHA, DOC_MIN = 1.2, 4


def doc_lengths(seed: int, sample: int, length: int, minimum: int = DOC_MIN) -> list[int]:
    """The documents' lengths of sample `sample`'s row of `length` tokens (they sum to it);
    `minimum`, the Pareto's scale (cp_balance.py's study scales it with the sequence)."""
    rng = np.random.default_rng([seed, sample, 0xD0C])
    out, left = [], length
    while left > 0:
        n = int(minimum * (1.0 - rng.random()) ** (-1.0 / DOC_ALPHA))
        out.append(min(max(n, minimum), left))
        left -= out[-1]
    return out


def doc_positions(seed: int, start: int, count: int, length: int,
                  minimum: int = DOC_MIN) -> torch.Tensor:
    """(count, length) int64: each token's position in its document, for samples
    start..start+count-1 (0 at each document's first token)."""
    rows = [torch.cat([torch.arange(n) for n in doc_lengths(seed, i, length, minimum)])
            for i in range(start, start + count)]
    return torch.stack(rows)


def document_mask(doc_positions: torch.Tensor, rows=None, cols=None) -> torch.Tensor:
    """(B, S) positions within packed documents (0 at each document's first token) -> (B,
    len(rows), len(cols)) bool: query i may attend to key j when j <= i in the same document;
    `rows`, `cols` the query and key columns (index tensors; default all S). The one rule
    behind every strategy that masks the documents itself (sp.py's Ulysses, cp_ring.py's
    blocks); HF's forward builds the same from the position ids."""
    doc = (doc_positions == 0).cumsum(-1)                     # (B, S) each token's document
    all_ = torch.arange(doc.shape[1], device=doc.device)
    q = all_ if rows is None else rows
    k = all_ if cols is None else cols
    return (doc[:, q, None] == doc[:, None, k]) & (k[None, None, :] <= q[None, :, None])


def eos_positions(inputs: torch.Tensor, eos: int) -> torch.Tensor:
    """(B, S) int64: each token's position in its document when documents end with `eos`
    (a corpus's stream doc0 EOS doc1 EOS ...): 0 after each EOS and at the window's start (a
    document cut by the window starts there), the EOS the last position of its document."""
    t = torch.arange(inputs.shape[1]).expand_as(inputs)
    after = torch.where(inputs == eos, t + 1, 0)     # a document starts after each EOS
    start = torch.cummax(torch.nn.functional.pad(after[:, :-1], (1, 0)), dim=1).values
    return t - start


def make_batch(lang: MarkovLanguage, step: int, batch: int, length: int, device,
               offset: int | None = None, ignore: bool = False,
               pad_id: int | None = None, doc_mask: bool = False) -> Batch:
    """Samples [step*batch, (step+1)*batch), or [offset, offset+batch) when the global batch
    has not been the same every step (compose4d's elastic restarts). ignore=True (correctness
    mode) pads and masks targets as `ignore_spans` says. `pad_id`, the model's pad token
    (data.pad_id): the padded tail's inputs, and the first input of each ignored span (packed
    documents separated by a pad token), where later tokens attend to it: its embedding row's
    gradient (zero in HF's nn.Embedding(padding_idx=...)) is then part of every verdict. A
    tail alone would not do: nothing attends to it and its labels are ignored. doc_mask: the
    rows are packed documents (doc_lengths), each attending within itself only."""
    start = step * batch if offset is None else offset
    x = torch.from_numpy(lang.sample(start, batch, length))
    inputs, labels = x[:, :-1].clone(), x[:, 1:].clone()
    if ignore:
        m = torch.from_numpy(ignore_spans(lang.seed, start, batch, length))
        labels[m] = IGNORE_INDEX
        # padded tail: the inputs after the last real token are the pad token too
        to_end = torch.flip(torch.cummin(torch.flip(m.int(), [1]), 1).values.bool(), [1])
        pad = torch.zeros_like(m)
        pad[:, 1:] = m[:, :-1] & m[:, -1:]
        pad &= to_end
        inputs[pad] = PAD_ID if pad_id is None else pad_id
        if pad_id is not None:   # each ignored span's first input (the tail's is the last
            starts = m & ~torch.nn.functional.pad(m, (1, 0))[:, :-1]   # real token: kept)
            inputs[starts & ~to_end] = pad_id
    docs = doc_positions(lang.seed, start, batch, length) if doc_mask else None
    return Batch.on_device(inputs, labels, step, device, docs)
