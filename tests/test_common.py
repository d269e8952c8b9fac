"""Unit tests of the harness (no torchrun): data, loss, comparison, meter, tracker, models."""
import math

import numpy as np
import pytest
import torch
import torch.distributed as dist

import common


@pytest.fixture(scope="module")
def lang():
    return common.MarkovLanguage(vocab=64, seed=3, branching=4)


def test_sample_is_a_pure_function_of_seed_and_index(lang):
    a = lang.sample(0, 12, 32)
    assert np.array_equal(a[5], lang.sample(5, 1, 32)[0])         # independent of batching
    assert np.array_equal(a[7:10], lang.sample(7, 3, 32))
    assert np.array_equal(a, common.MarkovLanguage(64, 3, 4).sample(0, 12, 32))  # rebuilt
    assert not np.array_equal(a, common.MarkovLanguage(64, 4, 4).sample(0, 12, 32))


def test_batches_are_world_size_invariant(lang):
    b = common.make_batch(lang, step=2, batch=6, length=16, device="cpu")
    assert torch.equal(b.input_ids[:, 1:], b.labels[:, :-1])      # labels are shifted inputs
    assert torch.equal(b.input_ids, torch.from_numpy(lang.sample(12, 6, 16)[:, :-1]))
    for world in (1, 2, 3, 6):
        shards = [b.shard(r, world) for r in range(world)]
        assert torch.equal(torch.cat([s.input_ids for s in shards]), b.input_ids)
        for s in shards:                                           # micro-batches too
            assert torch.equal(torch.cat([m.labels for m in s.split(len(s.labels))]), s.labels)
    assert b.n_tokens == 6 * 16


def test_language_follows_its_chain_and_entropy_rate(lang):
    x = lang.sample(0, 400, 64)
    allowed = {(i, j) for i in range(lang.vocab) for j in lang.succ[i]}
    assert all((a, b) in allowed for a, b in zip(x[:, :-1].ravel(), x[:, 1:].ravel()))
    # pi is stationary for P
    nxt = np.zeros(lang.vocab)
    np.add.at(nxt, lang.succ, lang.pi[:, None] * lang.prob)
    assert np.abs(nxt - lang.pi).max() < 1e-10
    # the empirical cross-entropy of the true model estimates the entropy rate
    j = (x[:, 1:, None] == lang.succ[x[:, :-1]]).argmax(-1)
    nll = -np.log(lang.prob[x[:, :-1], j])
    se = nll.std() / math.sqrt(nll.size) * 4   # samples within a sequence correlate a little
    assert abs(nll.mean() - lang.entropy_rate) < 4 * se, (nll.mean(), lang.entropy_rate)
    assert 0.5 < lang.entropy_rate < math.log(4)


def test_loss_is_a_token_mean_with_ignore_index():
    logits = torch.randn(2, 5, 7, dtype=torch.float64)
    labels = torch.randint(0, 7, (2, 5))
    labels[0, 1] = common.IGNORE_INDEX
    total = common.lm_loss_sum(logits, labels)
    keep = labels != common.IGNORE_INDEX
    ref = torch.nn.functional.cross_entropy(logits[keep], labels[keep], reduction="mean")
    assert torch.allclose(total / keep.sum(), ref, rtol=1e-12)


def test_comparison_catches_a_planted_error():
    ref = {"a": torch.randn(4, 4, dtype=torch.float64), "b": torch.randn(3, dtype=torch.float64)}
    c = common.Comparison(["a", "b"], {"a": (4, 4), "b": (3,)})
    c.add("grad", {k: v.clone() for k, v in ref.items()}, ref)
    assert c.max_err() == 0.0
    bad = {k: v.clone() for k, v in ref.items()}
    bad["b"][1] += 1e-6 * ref["b"].abs().max()
    c.add("grad", bad, ref)
    assert 0.9e-6 < c.rows["b"]["grad"][1] < 1.1e-6 and c.rows["a"]["grad"][1] == 0.0
    c.add("param", {"a": ref["a"]}, ref)                          # a missing tensor is noticed
    assert c.missing == {"param:b"}


def test_rmsnorm_is_float64_in_float64_runs():
    args = common.resolve_defaults(common.base_parser("t").parse_args([]), "correctness", "cpu")
    m = common.build_model(args, common.load_config("tiny"), "cpu")
    norm = m.model.norm
    x = torch.randn(3, 64, dtype=torch.float64)
    exact = norm.weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    assert (norm(x) - exact).abs().max() < 1e-14   # HF's own cast to float32 gives ~1e-7


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_comm_meter_counts_calls_and_bytes(group):
    meter = common.CommMeter()
    original = dist.all_reduce
    t = torch.zeros(10, dtype=torch.float32)
    with meter.measuring():
        dist.all_reduce(t)
        dist.all_reduce(t, async_op=True).wait()
        dist.all_gather_into_tensor(torch.zeros(10), t)
        dist.reduce_scatter_tensor(output=torch.zeros(10), input=t)   # keywords work too
        dist.all_to_all_single(torch.zeros(10), t, group=None)
        with meter.paused():
            dist.all_reduce(t)
    dist.all_reduce(t)  # outside: not counted, and the real function is restored
    assert dist.all_reduce is original
    assert meter.snapshot() == {("all_gather_into_tensor", "world"): (1, 40),
                                ("all_reduce", "world"): (2, 80),
                                ("all_to_all_single", "world"): (1, 40),
                                ("reduce_scatter_tensor", "world"): (1, 40)}


def test_memory_tracker_sees_allocations_and_frees():
    keep = torch.zeros(1000)
    tr = common.MemoryTracker([keep])
    with tr:
        with common.phase("forward"):
            a = torch.ones(2000)          # 8000 B, an activation
        b = torch.ones(500) * 2           # 2000 B (ones + the product) outside forward
        del a
        c = torch.ones(100)
    assert tr.act_peak == 8000
    assert tr.peak == 4000 + 8000 + 2000 + 2000
    assert tr.cur == 4000 + 2000 + 400   # keep, b, c (the temporary ones(500) was freed)
    del b, c


def test_load_config_and_checkpoint_dir(tmp_path):
    assert common.load_config("tiny").num_key_value_heads < common.load_config("tiny").num_attention_heads
    with pytest.raises(common.ConfigError, match="not a preset"):
        common.load_config(str(tmp_path / "missing"))
    with pytest.raises(common.ConfigError, match="no config.json"):
        common.load_config(str(tmp_path))
    args = common.resolve_defaults(common.base_parser("t").parse_args([]), "correctness", "cpu")
    cfg = common.load_config("tiny")
    model = common.build_model(args, cfg, "cpu").float()
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)     # weights a seeded init would not give
    model.save_pretrained(tmp_path / "ckpt")
    # a config.json alone: same architecture, seeded init
    args.model = str(tmp_path / "ckpt" / "config.json")
    seeded = common.build_model(args, common.load_config(args.model), "cpu")
    assert seeded.config.hidden_size == 64 and not common.has_weights(args.model)
    # the directory with weights: the real weights load
    args.model = str(tmp_path / "ckpt")
    assert common.has_weights(args.model)
    loaded = common.build_model(args, common.load_config(args.model), "cpu")
    for (n, p), q in zip(loaded.named_parameters(), model.parameters()):
        assert torch.equal(p.float(), q), n
    assert loaded.dtype == torch.float64


def test_presets_have_expected_sizes():
    from transformers import AutoModelForCausalLM
    sizes = {}
    for name in ("tiny", "small", "llama3.2-1b", "llama3-8b"):
        with torch.device("meta"):
            m = AutoModelForCausalLM.from_config(common.load_config(name))
        sizes[name] = common.param_count(m)
    assert sizes["tiny"] == 180_800
    assert 10e6 <= sizes["small"] <= 30e6
    assert 1.2e9 <= sizes["llama3.2-1b"] <= 1.3e9      # 1.24B with tied embeddings
    assert 7.9e9 <= sizes["llama3-8b"] <= 8.1e9        # 8.03B
