"""cp_balance.py: context parallelism's work per rank under a document mask. The work formula on
a known row, zig-zag exactly balanced on one document and not on packed ones, the greedy
balancer's assignment (equal token counts, the chunks tiling the row, closer to 1 than zig-zag),
the permutation and its inverse, and results/cp-balance-cpu.json recomputed from its command."""
import json
import os

import torch

import cp_balance
from conftest import ROOT
from harness.data import doc_positions


def test_a_tokens_work_is_its_position_in_its_document_plus_one():
    docs = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2], [0, 1, 2, 3, 4, 5, 6, 7]])
    assert cp_balance.token_work(docs).tolist() == [2, 4, 6, 5, 7, 7, 9, 11]
    # one rank holding columns 0-3, another 4-7: 17 and 34 pairs
    assert cp_balance.rank_work(cp_balance.token_work(docs), [[(0, 4)], [(4, 8)]]).tolist() \
        == [17, 34]


def test_zigzag_balances_one_document_exactly_and_packed_ones_not():
    S = 512
    one = torch.arange(S).expand(4, S)
    packed = doc_positions(0, 0, 4, S, minimum=S // 32)
    for C in (2, 4, 8):
        z = cp_balance.zigzag(C, S)
        assert cp_balance.imbalance(cp_balance.token_work(one), z) == 1.0
        assert cp_balance.imbalance(cp_balance.token_work(packed), z) > 1.05


def test_the_balancer_keeps_equal_shares_and_beats_zigzag():
    S = 1024
    for C in (2, 4, 8):
        for k in range(4):
            docs = doc_positions(3, 8 * k, 8, S, minimum=S // 32)
            chunks = cp_balance.balanced(docs, C)
            covered = sorted(c for rank in chunks for c in rank)
            assert all(sum(b - a for a, b in rank) == S // C for rank in chunks)
            assert covered[0][0] == 0 and covered[-1][1] == S and all(
                a[1] == b[0] for a, b in zip(covered, covered[1:]))     # a tiling of the row
            work = cp_balance.token_work(docs)
            assert cp_balance.imbalance(work, chunks) <= cp_balance.imbalance(
                work, cp_balance.zigzag(C, S)) and cp_balance.imbalance(work, chunks) < 1.1


def test_the_permutation_puts_each_ranks_tokens_together_and_inverts():
    S, C = 64, 2
    docs = doc_positions(1, 0, 2, S, minimum=4)
    chunks = cp_balance.balanced(docs, C)
    perm = cp_balance.permutation(chunks)
    x = torch.arange(S)[None].expand(2, S)
    mine = x[:, perm].chunk(C, dim=1)
    for r, rank in enumerate(chunks):
        assert mine[r][0].tolist() == [t for a, b in rank for t in range(a, b)]
    assert torch.equal(x[:, perm][:, torch.argsort(perm)], x)


def test_the_results_file_is_its_commands_output():
    import importlib.util
    spec = importlib.util.spec_from_file_location("cp_balance_study",
                                                  os.path.join(ROOT, "scripts", "cp_balance_study.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    saved = json.load(open(os.path.join(ROOT, "results", "cp-balance-cpu.json")))["rows"]
    assert mod.rows() == saved
