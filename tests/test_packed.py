"""Packed documents (--doc-mask, harness/data.py): each row cut into documents of long-tailed
lengths, each attending within itself, positions restarting at 0. The oracle: a packed row's
per-token losses and gradients are those of its documents run one by one without packing
(float64, HF's eager and SDPA attention). Then every strategy that runs HF's forward (ddp,
zero, zero++ with qwZ, fsdp, tp, sp megatron), pp (its stage loop with HF's own document
masks, document_masks), Ulysses (its own mask over the gathered sequence,
harness.data.document_mask), ring attention (each block pair its documents' mask,
cp_ring.set_documents; on zig-zag's layout and on the greedy balancer's, cp_balance.py) and
compose4d's tp x pp, its MoE (ep x pp, router losses per micro-batch), its cp x pp (the ring's
block masks per micro-batch: pp.Pipeline.documents) and its tp x pp under SP (the masks over
the whole sequence while the stage holds 1/T of it) against the single-device reference with
the same documents, at W=2, an uneven W=3 and W=4; the plants `doc-positions-dropped` (ddp),
`doc-mask-causal-only` (pp) and `ring-docs-not-restored` (compose4d) FAIL
(tests/test_plants.py); a balancer that cannot cut the sequence is refused in one line."""
import numpy as np
import pytest
import torch

import harness
from harness.data import DOC_MIN, doc_lengths, doc_positions, document_mask, eos_positions
from conftest import Runs, assert_config_error, launch


def test_documents_tile_each_row_with_a_long_tail():
    lens = [doc_lengths(0, i, 64) for i in range(200)]
    assert all(sum(l) == 64 for l in lens)
    inner = [n for l in lens for n in l[:-1]]        # (the last is cut by the row's end)
    assert min(inner) >= DOC_MIN and 5 <= np.median(inner) <= 8 and max(inner) > 32, inner
    assert doc_lengths(0, 5, 64) == doc_lengths(0, 5, 64) != doc_lengths(1, 5, 64)
    pos = doc_positions(0, 3, 2, 64)                  # restarts at each boundary
    for row, l in zip(pos, (doc_lengths(0, 3, 64), doc_lengths(0, 4, 64))):
        assert row.tolist() == [t for n in l for t in range(n)]


def test_a_corpus_document_ends_at_its_eos():
    """A corpus window (doc0 EOS doc1 EOS ...): positions restart after each EOS, the EOS the
    last position of its document; a window starting mid-document starts at 0."""
    x = torch.tensor([[5, 6, 2, 7, 8, 9, 2, 3], [2, 1, 1, 2, 2, 4, 4, 4]])
    assert eos_positions(x, eos=2).tolist() == [[0, 1, 2, 0, 1, 2, 3, 0],
                                                [0, 0, 1, 2, 0, 0, 1, 2]]


def test_the_document_mask_is_causal_within_each_document():
    """harness.data.document_mask, the rule Ulysses and the ring apply themselves: documents of
    2 and 3 tokens give a block-diagonal lower triangle; a block of it equals the slice."""
    pos = torch.tensor([[0, 1, 0, 1, 2]])
    want = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0],
                         [0, 0, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(document_mask(pos)[0], want)
    q, k = torch.tensor([3, 4]), torch.tensor([1, 2, 3])
    assert torch.equal(document_mask(pos, q, k)[0], want[3:5, 1:4])


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_a_packed_row_computes_its_documents_one_by_one(attn):
    """The oracle, independent of the strategies: HF's forward with the documents' position ids
    equals running each document alone (per-token CE and the gradients of their sum, float64);
    without them (the plant's mistake) it does not. HF finds the documents only without a KV
    cache (use_cache=False: the harness's models never make one) and without a 2-D mask."""
    from transformers import AutoModelForCausalLM
    from harness.models import Float64Kept   # (HF's norms would compute in float32)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(harness.load_config("tiny"),
                                             attn_implementation=attn).double()
    S = 48
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 256, (1, S + 1), generator=g)
    x, y = ids[:, :-1], ids[:, 1:]
    lens = doc_lengths(0, 7, S)
    assert len(lens) >= 3
    pos = doc_positions(0, 7, 1, S)

    def ce(logits, labels):
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 labels.reshape(-1), reduction="none")
    run = lambda ids, **kw: model(input_ids=ids, use_cache=False, **kw).logits   # noqa: E731
    with Float64Kept():
        packed = ce(run(x, position_ids=pos), y)
    packed.sum().backward()
    g_packed = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    alone, a = [], 0
    with Float64Kept():
        for n in lens:
            alone.append(ce(run(x[:, a:a + n]), y[:, a:a + n]))
            a += n
        leaky = ce(run(x), y)                          # one document: attends across
    alone = torch.cat(alone)
    alone.sum().backward()
    torch.testing.assert_close(packed, alone, rtol=1e-12, atol=1e-12)
    for p, gp in zip(model.parameters(), g_packed):
        torch.testing.assert_close(gp, p.grad, rtol=1e-10, atol=1e-12)
    assert (leaky - alone).abs().max() > 1e-3


def test_ring_attention_skips_a_block_pair_no_query_can_see():
    """cp_ring.set_documents: two documents of 8 tokens over a zig-zag of 2 ranks (chunks of 4):
    rank 0's last chunk (12-16, document 1) against its first (0-4, document 0) has no allowed
    pair and is skipped; the diagonal blocks keep the causal mask within their document."""
    import cp_ring
    cp = cp_ring.CPContext("zigzag", None, 16, world=2, rank=0)
    cp_ring.set_documents(cp, torch.cat([torch.arange(8), torch.arange(8)])[None])
    assert cp.blocks[(12, 16), (0, 4)] == "skip" and cp.blocks[(12, 16), (8, 12)] != "skip"
    diag = cp.blocks[(0, 4), (0, 4)]
    assert torch.equal(diag[0], torch.tril(torch.ones(4, 4, dtype=torch.bool)))
    # against rank 1's chunks 4-8 (document 0) and 8-12 (document 1): only 12-16 sees 8-12,
    # in full; the other three pairs are skipped (two by causality, one by the documents)
    rels = [rel for _, _, rel in cp_ring._pairs(cp, 1)]
    assert len(rels) == 1 and bool(rels[0].all())
    cp_ring.set_documents(cp, None)
    assert cp.blocks == {}


PACKED = ["--mode", "correctness", "--doc-mask", "--dtype", "float64"]
W2 = {s: Runs(s.split()[0], 2, {"packed": PACKED + list(extra)}, tier="slow")
      for s, extra in (("ddp.py", ["--grad-accum", "2"]), ("zero.py", ["--stage", "3"]),
                       ("fsdp.py", []), ("tp.py", []), ("sp.py", ["--variant", "megatron"]),
                       ("sp.py ulysses", ["--variant", "ulysses", "--dropout", "0.1"]),
                       ("pp.py", ["--schedule", "zb"]),
                       ("cp_ring.py", []), ("cp_ring.py allgather", ["--variant", "allgather"]),
                       ("cp_ring.py greedy", ["--cp-balance", "greedy"]),
                       ("zeropp.py", ["--stage", "3", "--zeropp", "qwz"]),
                       ("ep_moe.py", []))}
W3 = Runs("ddp.py", 3, {"packed": PACKED + ["--batch", "6"]}, tier="slow")
W4 = Runs("compose4d.py", 4, {"packed": PACKED + ["--tp", "2", "--pp", "2"],
                              "moe": PACKED + ["--model", "tiny-moe", "--ep", "2", "--pp", "2",
                                               "--aux-coef", "0.02", "--grad-accum", "2"],
                              "cp": PACKED + ["--cp", "2", "--pp", "2", "--grad-accum", "2"],
                              "sp": PACKED + ["--tp", "2", "--sp", "--pp", "2",
                                              "--grad-accum", "2"]},
          tier="slow")


@pytest.mark.slow
@pytest.mark.parametrize("script,world", [(s, 2) for s in W2] + [("ddp.py", 3),
                                                                 ("compose4d.py", 4)])
def test_every_strategy_on_hfs_forward_masks_the_documents(runs, script, world):
    for key in (["packed", "moe", "cp", "sp"] if world == 4 else ["packed"]):
        r = runs(W2[script] if world == 2 else W3 if world == 3 else W4, key)
        assert r.rc == 0 and r.last_line.startswith("PASS"), r
        assert r.json("correctness.json")[0]["ok"], r


@pytest.mark.parametrize("script,args,msg", [
    ("cp_ring.py", ["--cp-balance", "greedy", "--length", "40"],
     "--cp-balance greedy: sequence length 40 is not divisible by 2 x cp x 4 = 16"),
])
def test_a_strategy_with_its_own_attention_refuses_packed_documents(script, args, msg):
    r = launch(script, 2, "--mode", "correctness", "--doc-mask", *args, as_rank0=True)
    assert_config_error(r, msg, torchrun=False)


W8 = Runs("compose4d.py", 8, {"packed": PACKED + ["--tp", "2", "--cp", "2", "--pp", "2",
                                                  "--grad-accum", "2"]}, tier="heavy")


@pytest.mark.heavy
def test_compose4d_masks_documents_at_w8_with_cp(runs):
    """tp 2 x cp 2 x pp 2 (W = 8): the ring's block masks per micro-batch beside TP's split
    heads and the pipeline, against one device with the same documents."""
    r = runs(W8, "packed")
    assert r.rc == 0 and r.last_line.startswith("PASS"), r
    assert r.json("correctness.json")[0]["ok"], r
