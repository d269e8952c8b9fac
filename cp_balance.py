"""cp_balance.py: which tokens each context-parallel rank holds when the rows are packed documents.

The idea
    Causal attention's work is uneven along a sequence: the query at position p attends to p + 1
    keys. Context parallelism cuts the sequence over C ranks; zig-zag (cp_ring.layout) cuts it
    into 2C chunks and gives rank r chunks r and 2C-1-r, an early one and a late one, so every
    rank gets the same number of (query, key) pairs over one document. Packed documents break
    that: under a document mask the query at position p of its *document* attends to p + 1 keys,
        work(token) = (its position in its document) + 1,   work(rank) = sum over its tokens,
    so the work follows the documents, not the position in the row, and a rank whose chunks fall
    in short documents idles while another computes (the ring waits for the slowest rank). The
    pairs are the ideal work of a kernel that skips every masked block.
    The balancer here (greedy by measured work, LPT with equal counts): cut the row into
    K = 2 C m chunks (m = 4), sum each chunk's work over the batch's rows, and give the chunks,
    largest first, each to the least-loaded rank that still has room for K / C of them, so every
    rank still holds S / C tokens (the ring's shapes stay equal). One assignment per batch (its
    rows share the layout). Applying it permutes the rows into rank order (`permutation`)
    before the model; the labels and the gradients must follow the same permutation, so that
    the loss is the unpermuted batch's: each rank gathers its columns of the inputs and of the
    labels with the same positions (`apply`; cp_ring's --cp-balance greedy).
    torchtitan's context-parallel package ships a processing-time round-robin balancer for
    document masks beside its head-tail one (zig-zag); this is its greedy cousin.

Public API
    token_work(doc_pos)             (B, S) doc positions -> (S,) pairs per column, summed over rows
    zigzag(C, S)                    [[(start, end), ...] per rank], cp_ring's zig-zag layout
    balanced(doc_pos, C, m=4)       the greedy assignment for this batch's documents
    rank_work(work, chunks)         (C,) pairs per rank; imbalance(...) max / mean
    permutation(chunks)             the row's positions in rank order (and its inverse: argsort)
    apply(cp, chunks)               cp_ring's context takes the layout (then set_documents)

Run:  python scripts/cp_balance_study.py   (zig-zag's and the balancer's max/mean work, C = 2, 4, 8)
"""
import torch

import cp_ring


def token_work(doc_pos: torch.Tensor) -> torch.Tensor:
    """(B, S) positions within each document -> (S,) the (query, key) pairs each column's
    queries attend to under the document mask, summed over the rows (int64)."""
    return (doc_pos.long() + 1).sum(0)


def zigzag(C: int, S: int) -> list[list[tuple[int, int]]]:
    """Rank r: chunks r and 2C-1-r of 2C (cp_ring.layout's zig-zag)."""
    return cp_ring.layout("zigzag", C, S)


def balanced(doc_pos: torch.Tensor, C: int, m: int = 4) -> list[list[tuple[int, int]]]:
    """Greedy by work: K = 2 C m chunks, largest first to the least-loaded rank with room for
    K / C chunks; each rank's chunks in ascending order."""
    S = doc_pos.shape[1]
    K = 2 * C * m
    if S % K:
        raise ValueError(f"cp_balance: sequence length {S} is not divisible by 2 C m = {K}")
    c = S // K
    work = token_work(doc_pos).view(K, c).sum(1)                   # (K,) pairs per chunk
    load, held = [0] * C, [[] for _ in range(C)]
    for k in torch.argsort(work, descending=True, stable=True).tolist():
        r = min((r for r in range(C) if len(held[r]) < K // C), key=lambda r: load[r])
        held[r].append(k)
        load[r] += int(work[k])
    return [[(k * c, (k + 1) * c) for k in sorted(ks)] for ks in held]


def rank_work(work: torch.Tensor, chunks) -> torch.Tensor:
    """(C,) the pairs each rank's chunks hold, from token_work's (S,)."""
    return torch.stack([sum(work[a:b].sum() for a, b in rank) for rank in chunks])


def imbalance(work: torch.Tensor, chunks) -> float:
    """max / mean of the ranks' work: 1 is perfect; the ring's step waits for the max."""
    w = rank_work(work, chunks).double()
    return float(w.max() / w.mean())


def apply(cp, chunks):
    """Give cp_ring's context (cp_ring.CPContext) this batch's layout: every rank's chunks
    (its blocks' global ranges) and this rank's positions, the columns of the batch it feeds
    and whose labels it scores (one gather for both: the loss is the batch's, unpermuted)."""
    if len({b - a for rank in chunks for a, b in rank}) != 1:   # (cp_ring lays chunks out as
        raise ValueError("cp_balance: the ring's chunks must be of one length")   # equal blocks)
    cp.chunks = chunks
    cp.positions = cp_ring.positions(chunks[cp.rank])


def permutation(chunks) -> torch.Tensor:
    """(S,) the row's positions in rank order: x[:, perm] puts rank 0's tokens first, then
    rank 1's, ... (each rank then takes a contiguous S / C); argsort(perm) undoes it."""
    return cp_ring.positions([c for rank in chunks for c in rank])
