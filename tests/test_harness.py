"""Unit tests of the harness (no torchrun): data, loss, comparison, meter, tracker, models."""
import math

import numpy as np
import pytest
import torch
import torch.distributed as dist

import harness


@pytest.fixture(scope="module")
def lang():
    return harness.MarkovLanguage(vocab=64, seed=3, branching=4)


def test_sample_is_a_pure_function_of_seed_and_index(lang):
    a = lang.sample(0, 12, 32)
    assert np.array_equal(a[5], lang.sample(5, 1, 32)[0])         # independent of batching
    assert np.array_equal(a[7:10], lang.sample(7, 3, 32))
    assert np.array_equal(a, harness.MarkovLanguage(64, 3, 4).sample(0, 12, 32))  # rebuilt
    assert not np.array_equal(a, harness.MarkovLanguage(64, 4, 4).sample(0, 12, 32))


def test_batches_are_world_size_invariant(lang):
    b = harness.make_batch(lang, step=2, batch=6, length=16, device="cpu")
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
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 7, dtype=torch.float64, generator=g)
    labels = torch.randint(0, 7, (2, 5), generator=g)
    labels[0, 1] = harness.IGNORE_INDEX
    total = harness.lm_loss_sum(logits, labels)
    keep = labels != harness.IGNORE_INDEX
    ref = torch.nn.functional.cross_entropy(logits[keep], labels[keep], reduction="mean")
    assert torch.allclose(total / keep.sum(), ref, rtol=1e-12)


def test_correctness_data_has_uneven_ignored_labels(lang):
    b = harness.make_batch(lang, step=1, batch=8, length=32, device="cpu", ignore=True)
    plain = harness.make_batch(lang, step=1, batch=8, length=32, device="cpu")
    ignored = b.labels == harness.IGNORE_INDEX
    # only labels become ignored; the kept ones are the plain batch's
    assert torch.equal(b.labels[~ignored], plain.labels[~ignored])
    per_row = (~ignored).sum(1)
    assert 0 < b.n_tokens < 8 * 32 and len(set(per_row.tolist())) > 2   # uneven per sample
    assert (per_row >= 32 - 32 // 4 - 32 // 8 - 1).all()                # never empty
    halves = [(~ignored[:, :16]).sum().item(), (~ignored[:, 16:]).sum().item()]
    assert halves[0] != halves[1]                                         # uneven per chunk
    # padded tails: inputs after the last real token are PAD_ID, their labels ignored
    pad = b.input_ids != plain.input_ids
    assert (b.input_ids[pad] == harness.PAD_ID).all() and ignored[pad].all()
    # a pure function of (seed, sample index), like the tokens
    again = harness.make_batch(lang, step=0, batch=16, length=32, device="cpu", ignore=True)
    assert torch.equal(again.labels[8:], b.labels) and torch.equal(again.input_ids[8:],
                                                                   b.input_ids)


def test_verdict_is_error_against_noise():
    policy = harness.NoisePolicy("float32")
    g = torch.Generator().manual_seed(0)
    ref = {"a": torch.randn(4, 4, dtype=torch.float64, generator=g),
           "b": torch.randn(3, dtype=torch.float64, generator=g)}
    noisy = {k: v * (1 + 1e-6) for k, v in ref.items()}                 # noise 1e-6
    c = harness.Comparison(["a", "b"], {"a": (4, 4), "b": (3,)}, policy)
    c.add("grad", 0, {k: v.clone() for k, v in ref.items()}, ref, [(noisy, 1.0)])
    assert c.max_err() == 0.0 and abs(c.max_noise() - 1e-6) < 1e-9
    assert all(j.ok for _, j in c.all())
    bad = {k: v.clone() for k, v in ref.items()}
    bad["b"][1] += 5e-6 * ref["b"].abs().max()                            # within 8 x noise
    c.add("grad", 1, bad, ref, [(noisy, 1.0)])
    assert c.rows["b"]["grad"].ok and c.rows["b"]["grad"].step == 1
    bad["b"][1] += 5e-6 * ref["b"].abs().max()                            # 10 x noise: FAIL
    c.add("grad", 2, bad, ref, [(noisy, 1.0)])
    assert not c.rows["b"]["grad"].ok and c.rows["a"]["grad"].ok
    assert c.worst()[0] == "grad:b"
    c.add("param", 0, {"a": ref["a"]}, ref, [(noisy, 1.0)])              # a missing tensor
    assert c.missing == {"param:b"}
    # parameters get PARAM_K_FACTOR times the room; a zero noise still leaves the floor
    assert policy.tol(1e-6, "param") == pytest.approx(32e-6 + 4 * 2 ** -23)
    assert policy.tol(0.0) == 4 * 2 ** -23
    # float64 runs: the float32 noise rescaled by eps64 / eps32
    assert harness.NoisePolicy("float64").scale == 2.0 ** -29
    c64 = harness.Comparison(["b"], {"b": (3,)}, harness.NoisePolicy("float64"))
    c64.add_scalar("loss", 0, 1.0 + 1e-12, 1.0, [(1.0 + 1e-7, 2.0 ** -29), (1.0, 1.0)])
    assert not c64.scalars["loss"].ok          # 1e-12 > 8 x 1e-7 x 2^-29 + 4 ulp
    c64.add_scalar("loss2", 0, 1.0 + 1e-12, 1.0, [(1.0 + 1e-7, 2.0 ** -29), (1.0 + 2e-13, 1.0)])
    assert c64.scalars["loss2"].ok             # the largest of the noise sources counts
    c64.add_scalar("nan", 0, float("nan"), 1.0, [(1.0, 1.0)])
    assert not c64.scalars["nan"].ok and c64.worst()[0] == "nan"


def test_gradients_are_compared_before_clipping():
    class S:
        name = "s"
    g = {"w": torch.tensor([3.0, 4.0], dtype=torch.float64)}              # norm 5
    s = S()
    s.grad_norm = torch.tensor(5.0, dtype=torch.float64)
    clipped = {"w": g["w"] * harness.clip_coef(5.0, 0.5)}
    assert torch.allclose(harness.preclip_grads(s, clipped, 0.5)["w"], g["w"], rtol=1e-12)
    # a 2x scale bug: norm 10, clipped to the same 0.5, but not once un-clipped
    s.grad_norm = 10.0
    clipped2 = {"w": 2 * g["w"] * harness.clip_coef(10.0, 0.5)}
    assert torch.allclose(clipped2["w"], clipped["w"], rtol=1e-6)
    assert torch.allclose(harness.preclip_grads(s, clipped2, 0.5)["w"], 2 * g["w"], rtol=1e-12)
    assert harness.preclip_grads(S(), g, 0.0) is g                         # no clipping
    with pytest.raises(RuntimeError, match="grad_norm"):
        harness.preclip_grads(S(), g, 0.5)


def test_rmsnorm_is_float64_in_float64_runs():
    args = harness.resolve_defaults(harness.base_parser("t").parse_args([]), "correctness", "cpu")
    m = harness.build_model(args, harness.load_config("tiny"), "cpu")
    norm = m.model.norm
    x = torch.randn(3, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    exact = norm.weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    assert (norm(x) - exact).abs().max() < 1e-14   # HF's own cast to float32 gives ~1e-7


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_comm_meter_counts_calls_and_bytes(group):
    meter = harness.CommMeter()
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
    tr = harness.MemoryTracker([keep])
    with tr:
        with harness.phase("forward"):
            a = torch.ones(2000)          # 8000 B, an activation
        b = torch.ones(500) * 2           # 2000 B (ones + the product) outside forward
        del a
        c = torch.ones(100)
    assert tr.act_peak == 8000
    assert tr.peak == 4000 + 8000 + 2000 + 2000
    assert tr.cur == 4000 + 2000 + 400   # keep, b, c (the temporary ones(500) was freed)
    del b, c


def test_load_config_and_checkpoint_dir(tmp_path):
    assert harness.load_config("tiny").num_key_value_heads < harness.load_config("tiny").num_attention_heads
    with pytest.raises(harness.ConfigError, match="not a preset"):
        harness.load_config(str(tmp_path / "missing"))
    with pytest.raises(harness.ConfigError, match="no config.json"):
        harness.load_config(str(tmp_path))
    args = harness.resolve_defaults(harness.base_parser("t").parse_args([]), "correctness", "cpu")
    cfg = harness.load_config("tiny")
    model = harness.build_model(args, cfg, "cpu").float()
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)     # weights a seeded init would not give
    model.save_pretrained(tmp_path / "ckpt")
    # a config.json alone: same architecture, seeded init
    args.model = str(tmp_path / "ckpt" / "config.json")
    seeded = harness.build_model(args, harness.load_config(args.model), "cpu")
    assert seeded.config.hidden_size == 64 and not harness.has_weights(args.model)
    # the directory with weights: the real weights load
    args.model = str(tmp_path / "ckpt")
    assert harness.has_weights(args.model)
    loaded = harness.build_model(args, harness.load_config(args.model), "cpu")
    for (n, p), q in zip(loaded.named_parameters(), model.parameters()):
        assert torch.equal(p.float(), q), n
    assert loaded.dtype == torch.float64


def test_presets_have_expected_sizes():
    from transformers import AutoModelForCausalLM
    sizes = {}
    for name in ("tiny", "small", "llama3.2-1b", "llama3-8b"):
        with torch.device("meta"):
            m = AutoModelForCausalLM.from_config(harness.load_config(name))
        sizes[name] = harness.param_count(m)
    assert sizes["tiny"] == 180_800
    assert 10e6 <= sizes["small"] <= 30e6
    assert 1.2e9 <= sizes["llama3.2-1b"] <= 1.3e9      # 1.24B with tied embeddings
    assert 7.9e9 <= sizes["llama3-8b"] <= 8.1e9        # 8.03B


def test_noise_is_at_least_its_roles_median_and_largest_for_later_grads():
    """One tensor's noise sample can be unusually small; the same tensor in the other layers
    has the same conditioning, so a tensor is judged against at least its role's median, and a
    gradient after the first step (the previous update's error) against its role's largest."""
    assert harness.role("model.layers.11.mlp.up_proj.weight") == "model.layers.*.mlp.up_proj.weight"
    names = [f"model.layers.{i}.mlp.up_proj.weight" for i in range(4)] + ["lm_head.weight"]
    ref = {n: torch.ones(8, dtype=torch.float64) for n in names}
    noisy = {n: ref[n] * (1 + e) for n, e in zip(names, (6e-7, 1e-7, 1.4e-6, 1e-8, 1e-8))}
    got = {n: ref[n] * (1 + 1e-6) for n in names}                     # 1e-6 everywhere
    c = harness.Comparison(names, {n: (8,) for n in names}, harness.NoisePolicy("float32"))
    c.add("grad", 0, got, ref, [(noisy, 1.0)])
    c.add("param", 0, got, ref, [(noisy, 1.0)])
    assert c.rows[names[3]]["grad"].ok          # own noise 1e-8, role median 3.5e-7
    assert c.rows[names[3]]["grad"].noise == pytest.approx(3.5e-7)
    assert c.rows[names[3]]["param"].noise == pytest.approx(3.5e-7)
    assert not c.rows["lm_head.weight"]["grad"].ok     # a role of one: its own noise
    c = harness.Comparison(names, {n: (8,) for n in names}, harness.NoisePolicy("float32"))
    c.add("grad", 1, got, ref, [(noisy, 1.0)])  # after the first step: the role's largest
    c.add("param", 1, got, ref, [(noisy, 1.0)])
    assert c.rows[names[3]]["grad"].noise == pytest.approx(1.4e-6)
    assert c.rows[names[3]]["param"].noise == pytest.approx(3.5e-7)
    c = harness.Comparison(names, {n: (8,) for n in names}, harness.NoisePolicy("bfloat16"))
    c.add("grad", 1, got, ref, [(noisy, 1.0)])  # bf16: no pooling (one layer's 0.05 would
    assert c.rows[names[3]]["grad"].noise == pytest.approx(3.5e-7)   # widen every layer's)


def test_plants_mode_picks_the_plants_declared_for_the_run():
    import rig.sp
    p = harness.base_parser("t", rig.sp.SP.modes, rig.sp.SP.plants)
    rig.sp.SP.add_args(p)
    for argv, variant in ((["--variant", "ulysses"], "ulysses"), ([], "megatron")):
        a = p.parse_args(argv + ["--model", "configs/tiny-gqa8.json", "--dtype", "float32",
                                 "--clip", "0.5"])
        picked = [n for n, pl in rig.sp.SP.plants.items() if harness.correctness._declared_for(pl, rig.sp.SP, a)]
        assert picked and all(rig.sp.SP.plants[n].args[1] == variant for n in picked), picked
    assert not any(harness.correctness._declared_for(pl, rig.sp.SP, p.parse_args([]))
                   for pl in rig.sp.SP.plants.values())       # float64 without --clip: none


def _adamw_args(lr):
    import types
    return types.SimpleNamespace(lr=lr, weight_decay=0.0)


def test_bf16_parameters_get_fp32_masters():
    """An update below half a bf16 ulp is lost by AdamW on bf16 parameters and kept by the fp32
    master: after 100 steps of lr 1e-4 on weights of 1.0 (half a bf16 ulp there: 2^-9 above,
    2^-10 below), plain AdamW has not moved them at all, MasterAdamW has moved them by about
    100 x 1e-4 (to bf16 rounding), and its masters follow fp32 AdamW on the same (bf16-rounded)
    gradients exactly."""
    torch.manual_seed(0)
    w0 = torch.ones(64)
    grads = [torch.rand(64) + 0.1 for _ in range(100)]   # one sign: the updates add up
    runs = {}
    for kind in ("plain-bf16", "master", "fp32"):
        p = torch.nn.Parameter(w0.clone().to(torch.float32 if kind == "fp32" else torch.bfloat16))
        opt = (torch.optim.AdamW([p], lr=1e-4, weight_decay=0.0, betas=(0.9, 0.95), eps=1e-8)
               if kind == "plain-bf16" else harness.make_adamw([p], _adamw_args(1e-4)))
        assert isinstance(opt, harness.MasterAdamW) == (kind == "master")
        for g in grads:
            p.grad = g.to(p.dtype)
            opt.step()
            opt.zero_grad()
        runs[kind] = (p.detach().float(), opt)
    assert torch.equal(runs["plain-bf16"][0], w0)                      # every update lost
    moved = (runs["master"][0] - w0).abs()
    assert moved.min() > 0.005 and torch.allclose(runs["master"][0], runs["fp32"][0],
                                                  atol=2**-8)
    # the masters are exactly fp32 AdamW on the bf16-rounded gradients (the same here:
    # torch.randn values rounded to bf16 only in the plain run's and master's .grad)
    ref = torch.nn.Parameter(w0.clone())
    ref_opt = torch.optim.AdamW([ref], lr=1e-4, weight_decay=0.0, betas=(0.9, 0.95), eps=1e-8,
                                fused=True)   # (the kernel make_adamw picks on CPU)
    for g in grads:
        ref.grad = g.to(torch.bfloat16).float()
        ref_opt.step()
    master = runs["master"][1]
    assert torch.equal(master.master_tensors()[0], ref.detach())
    assert master.model_params[0].grad is None                          # zero_grad cleared it


def test_master_adamw_is_a_torch_optimizer_and_counted_in_states():
    """Schedulers and state_dict work on it; the harness counts the masters as optimizer
    memory (4 bytes per bf16 parameter, beside Adam's 8)."""
    lin = torch.nn.Linear(4, 4).to(torch.bfloat16)
    opt = harness.make_adamw(lin.parameters(), _adamw_args(1e-3))
    sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.5, total_iters=2)
    lin(torch.ones(2, 4, dtype=torch.bfloat16)).sum().backward()
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.75e-3)
    sd = opt.state_dict()
    assert len(sd["state"]) == 2 and sd["state"][0]["exp_avg"].dtype == torch.float32

    class S(harness.Strategy):
        def __init__(self):
            self.model, self.optimizer = lin, opt
    states = S().model_states()["optimizer"]
    n = sum(p.numel() for p in lin.parameters())
    assert sum(t.numel() * t.element_size() for t in states if t.dim() > 0) == 12 * n
    # float32 parameters are their own masters: a plain torch AdamW
    assert type(harness.make_adamw(torch.nn.Linear(2, 2).parameters(), _adamw_args(1e-3))) \
        is torch.optim.AdamW


def test_the_optimizer_step_runs_on_the_fused_kernel():
    """make_adamw takes torch's fused AdamW on CPU (masters included), and its updates are
    torch's loop implementation's to rounding; the bf16 parameters are their masters rounded
    (the one foreach copy-back); the timing script runs (a smoke test, not a timed claim)."""
    import os
    import subprocess
    import sys
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        w = [torch.randn(64, 32, dtype=dtype) for _ in range(3)]
        ours = [x.clone() for x in w]
        loop = [x.float().clone() for x in w]
        opt = harness.make_adamw(ours, _adamw_args(1e-2))
        ref = torch.optim.AdamW(loop, lr=1e-2, weight_decay=0.0, betas=(0.9, 0.95), eps=1e-8,
                                foreach=False)
        assert opt.defaults["fused"] and not ref.defaults["fused"]
        for step in range(3):
            g = [torch.randn(64, 32) for _ in w]
            for p, q, x in zip(ours, loop, g):
                p.grad, q.grad = x.to(dtype), x.to(dtype).float()
            opt.step()
            ref.step()
        masters = opt.masters if dtype == torch.bfloat16 else ours
        for m, q in zip(masters, loop):
            torch.testing.assert_close(m, q, rtol=1e-6, atol=1e-7)
        for p, m in zip(ours, masters):
            assert torch.equal(p, m.to(dtype))
    r = subprocess.run([sys.executable, "scripts/optimizer_step.py", "--model", "tiny",
                        "--layers", "1", "--rounds", "2"], capture_output=True, text=True,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == 0 and "bf16-masters" in r.stdout, r.stderr


def test_call_timer_counts_time_and_work_from_outside():
    """harness.timing.CallTimer (cp_ring's block-kernel time and FLOPs): the wrapped function
    returns what it returned, each call adds its work, and time is spent inside it."""
    import time as _time
    from harness.timing import CallTimer
    t = CallTimer(cuda=False)
    f = t.wrap(lambda x: (_time.sleep(0.01), x * 2)[1], work=lambda x: x)
    assert f(3) == 6 and f(4) == 8
    sec, work = t.total()
    assert work == 7 and sec >= 0.02
    t.reset()
    assert t.total() == (0.0, 0)


def test_meter_rejects_a_tensor_off_the_runs_device(group):
    """NCCL takes device tensors only: with the run's device set to CUDA (as launch() does on a
    GPU), a CPU tensor handed to a collective fails at the call, naming it; on the right device
    the call goes through."""
    meter = harness.CommMeter()
    meter.device = torch.device("cuda")           # what launch() sets on a GPU run
    with meter.measuring():
        with pytest.raises(RuntimeError, match=r"all_reduce at test_harness.py:\d+ got a tensor "
                                               r"on cpu in a run on cuda"):
            dist.all_reduce(torch.zeros(2))
    meter.device = torch.device("cpu")
    with meter.measuring():
        dist.all_reduce(torch.zeros(2))
    assert meter.snapshot() == {("all_reduce", "world"): (1, 8)}


def test_permuted_reference_is_the_same_function_in_another_order():
    """float64's measured noise (harness.compare.PermutedReference): the permuted model
    (hidden units, MLP units, kv-head groups with their q heads, batch rows) computes the same
    loss and, mapped back, the same gradients and updated parameters as the reference, to
    float64 rounding; a parameter it cannot permute (a per-head q_norm) makes it decline."""
    from types import SimpleNamespace
    from harness.compare import PermutedReference, reference_in
    import rig.ddp
    args = harness.resolve_defaults(harness.base_parser("t").parse_args(["--batch", "4"]),
                                    "correctness", "cpu")
    cfg = harness.load_config("tiny")
    cfg.num_key_value_heads = 2   # GQA: q heads move with their kv group
    run = SimpleNamespace(args=args, config=cfg, env=SimpleNamespace(device=torch.device("cpu")))
    ref, perm = reference_in(run, rig.ddp.DDP, "float64"), PermutedReference.build(run, rig.ddp.DDP)
    assert perm is not None
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (4, 32), generator=g)
    batch = harness.Batch(ids, torch.roll(ids, -1, 1), 0)
    assert abs(ref.step(batch) - perm.step(batch)) < 1e-14
    for got, want in ((perm.full_grads(), ref.full_grads()), (perm.full_params(),
                                                              ref.full_params())):
        for n, t in want.items():
            assert (got[n] - t).abs().max() <= 1e-12 * t.abs().max(), n
    assert any((perm.full_grads()[n] != t).any() for n, t in ref.full_grads().items())
    match = lambda n: next((d for s, d in PermutedReference.RULES if n.endswith(s)), None)  # noqa
    assert match("model.layers.0.self_attn.q_norm.weight") is None
    assert match("model.layers.0.input_layernorm.weight") == ("h",)


def test_permuted_bf16_noise_source_is_noise():
    """The permuted reference in bfloat16 (a noise source of every bf16 correctness run) is
    the reference's function in another order: two AdamW steps later its parameters, mapped
    back, sit within bf16 rounding and Adam's near-zero-gradient flips of the plain bf16
    reference's (measured 0.03 of a tensor's scale). Its fp32 masters are copied after the
    permutation: built before it (the old order), every weight matrix measured 1.4-1.6."""
    from types import SimpleNamespace
    from harness.compare import NOISE_MAX, PermutedReference, reference_in, rel_err
    import rig.ddp
    args = harness.resolve_defaults(harness.base_parser("t").parse_args(["--batch", "4"]),
                                    "correctness", "cpu")
    cfg = harness.load_config("tiny")
    run = SimpleNamespace(args=args, config=cfg, env=SimpleNamespace(device=torch.device("cpu")))
    ref = reference_in(run, rig.ddp.DDP, "bfloat16")
    perm = PermutedReference.build(run, rig.ddp.DDP, "bfloat16")
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        ids = torch.randint(0, cfg.vocab_size, (4, 32), generator=g)
        batch = harness.Batch(ids, torch.roll(ids, -1, 1), 0)
        ref.step(batch), perm.step(batch)
    got, want = perm.full_params(), ref.full_params()
    worst = max(rel_err(got[n], t) for n, t in want.items())
    assert 0 < worst < NOISE_MAX / 2, worst


def test_a_noise_sample_that_is_not_noise_fails_the_run():
    """compare.NOISE_MAX: a noise source whose distance from the target is a large fraction of
    the tensor itself is broken; the comparison names it (correctness.py then FAILs) instead
    of judging against 8 x garbage, which would accept anything."""
    from harness.compare import Comparison, NoisePolicy
    target = {"w": torch.linspace(-1, 1, 64, dtype=torch.float64)}
    for scale, bad in ((1e-3, False), (1.5, True)):   # 1.5: the old permuted bf16 masters
        cmp = Comparison(["w"], {"w": (64,)}, NoisePolicy("bfloat16"))
        noisy = {"w": target["w"] * (1 + scale)}
        cmp.add("param", 0, {"w": target["w"] * (1 + 1e-3)}, target, [(noisy, 1.0)])
        cmp.add_scalar("loss", 0, 2.0, 2.0, [(2.0 * (1 + scale), 1.0)])
        assert cmp.rows["w"]["param"].ok   # (the tolerance itself accepts it)
        assert bool(cmp.implausible) == bad, cmp.implausible
        assert set(cmp.implausible) == ({"param:w", "loss"} if bad else set())


def test_a_gradient_zero_in_exact_arithmetic_is_not_called_implausible():
    """compare.ZERO_GRAD_ULPS: a tensor whose target gradient is a rounding residue (OPT's key
    bias, which the softmax cancels) has O(1) relative noise by nature, in the gradient and in
    the parameter Adam moves with it: still judged, not called implausible. The same noise on
    a tensor with a real gradient is (the guard above)."""
    from harness.compare import Comparison, NoisePolicy
    g = torch.linspace(-1, 1, 64, dtype=torch.float64)
    for residue, bad in ((1e-19, False), (1e-3, True)):
        target = {"w": g, "b": g * residue}
        cmp = Comparison(["w", "b"], {"w": (64,), "b": (64,)}, NoisePolicy("float64"))
        noisy = {"w": g, "b": g * residue * -0.5}                # noise 1.5 of b's scale
        cmp.add("grad", 0, {"w": g, "b": g * residue * 0.5}, target, [(noisy, 1.0)])
        cmp.add("param", 0, {"w": g, "b": g}, {"w": g, "b": g}, [({"w": g, "b": -g}, 1.0)])
        assert cmp.rows["b"]["grad"].ok
        assert set(cmp.implausible) == ({"grad:b", "param:b"} if bad else set()), cmp.implausible


def test_clipping_reads_nothing_from_the_device(group):
    """Global-norm clipping (harness.clip_by_norm, zero's shard clipping that all the sharded
    strategies share the shape of) scales on the device: no item()/tolist()/float() of the norm
    inside the step, and the same result as torch.nn.utils.clip_grad_norm_, clipped or not."""
    from test_ep_moe import HostReads
    import zero
    for max_norm in (1.0, 1e9):
        torch.manual_seed(0)
        grads = [torch.randn(5, 3, dtype=torch.float64) * 10 for _ in range(3)]
        params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        want = torch.nn.utils.clip_grad_norm_(params, max_norm)
        with HostReads(files=("strategy.py", "zero.py")) as reads:
            norm = zero.clip_shard_grads(grads, max_norm)
        assert reads.calls == [], reads.calls
        assert isinstance(norm, torch.Tensor) and torch.allclose(norm, want, rtol=1e-14)
        for p, g in zip(params, grads):
            assert torch.allclose(p.grad, g, rtol=1e-14, atol=0)


def test_train_log_writes_tensorboard_events(tmp_path):
    """harness.TrainLog: train.jsonl and, with tensorboard installed (the test extra), event
    files holding every numeric field of every row, read back with TensorBoard's own reader."""
    pytest.importorskip("tensorboard",
                        reason="tensorboard is in the test extra: pip install -e .[test]")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from harness.trainlog import TrainLog
    log = TrainLog(str(tmp_path), enabled=True)
    assert log.tb is not None
    for step, loss in enumerate((3.0, 2.5, 2.25)):
        log.write(dict(step=step, loss=loss, lr=1e-3, mfu=None))
    log.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == {"loss", "lr"}          # mfu None: not logged
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(0, 3.0), (1, 2.5), (2, 2.25)]
    assert len((tmp_path / "train.jsonl").read_text().splitlines()) == 3


def test_master_adamw_resumes_its_fp32_masters():
    """3 steps, state_dict, a fresh optimizer on the bf16 weights loads it, 2 more steps: the
    masters and the bf16 weights equal 5 uninterrupted steps bitwise (without the masters in
    the state dict they would restart from the rounded weights)."""
    torch.manual_seed(0)
    w0 = [torch.randn(32, 16).bfloat16() for _ in range(2)]
    grads = [[torch.randn(32, 16).bfloat16() for _ in w0] for _ in range(5)]

    def run(params, opt, steps):
        for g in steps:
            for p, x in zip(params, g):
                p.grad = x.clone()
            opt.step()
    full = [w.clone() for w in w0]
    opt = harness.make_adamw(full, _adamw_args(1e-2))
    run(full, opt, grads)
    part = [w.clone() for w in w0]
    first = harness.make_adamw(part, _adamw_args(1e-2))
    run(part, first, grads[:3])
    sd = first.state_dict()
    again = [p.clone() for p in part]
    second = harness.make_adamw(again, _adamw_args(1e-2))
    second.load_state_dict(sd)
    run(again, second, grads[3:])
    assert all(torch.equal(a, b) for a, b in zip(opt.master_tensors(), second.master_tensors()))
    assert all(torch.equal(a, b) for a, b in zip(full, again))
    plain = dict(sd)
    del plain["fp32_masters"]          # torch's own format still loads
    harness.make_adamw([p.clone() for p in part], _adamw_args(1e-2)).load_state_dict(plain)


def test_rounding_floor_is_sqrt_k_u_times_the_summed_magnitudes():
    """harness/spread.py: each gradient's floor, sqrt(K) u max_ij sum_t |terms|, from hooks on
    the modules that own parameters, against the sums written out by hand."""
    from torch import nn
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from harness.spread import Spread
    torch.manual_seed(0)
    m = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8), LlamaRMSNorm(8), GemmaRMSNorm(8),
                      nn.LayerNorm(8), nn.Linear(8, 3)).double()
    for p in m.parameters():
        p.data.normal_()
    ids = torch.randint(0, 10, (4, 5))
    seen = {}

    def keep(i, inp, out):
        seen[i] = (inp[0], out)
        if out.requires_grad:
            out.retain_grad()
    for i, mod in enumerate(m):
        mod.register_forward_hook(lambda _m, inp, out, i=i: keep(i, inp, out))
    with Spread(m) as s:
        m(ids).pow(2).sum().backward()
    floors, K = s.floors(1.0), 20   # (u = 1: the floor is sqrt(K) max M)
    assert not any(h for h in s.handles)   # removed on exit
    dy = {i: seen[i][1].grad.abs().reshape(-1, seen[i][1].shape[-1]) for i in seen}
    x = {i: seen[i][0].reshape(-1, seen[i][0].shape[-1]) for i in seen if i}
    rms = lambda v, eps: v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + eps)  # noqa: E731
    want = {"0.weight": torch.zeros(10, 8, dtype=torch.float64).index_add_(0, ids.reshape(-1),
                                                                          dy[0]),
            "1.weight": dy[1].T @ x[1].abs(), "1.bias": dy[1].sum(0),
            "2.weight": (dy[2] * rms(x[2], m[2].variance_epsilon).abs()).sum(0),
            "3.weight": (dy[3] * rms(x[3], m[3].eps).abs()).sum(0),
            "4.weight": (dy[4] * torch.nn.functional.layer_norm(x[4], (8,)).abs()).sum(0),
            "4.bias": dy[4].sum(0), "5.weight": dy[5].T @ x[5].abs(), "5.bias": dy[5].sum(0)}
    assert set(floors) == set(want)
    for n, w in want.items():   # (HF's RMS norms compute in float32)
        assert floors[n] == pytest.approx(K ** 0.5 * float(w.max()), rel=1e-6), n


def test_rounding_floor_raises_a_lucky_noise_sample_and_still_fails_a_bug():
    """A gradient whose measured samples are both lucky is judged against its rounding floor
    (Comparison.spread); an error of a bug's size still FAILs."""
    names = ["w"]
    ref = {"w": torch.ones(64, dtype=torch.float64)}
    noisy = {"w": ref["w"] * (1 + 1e-16)}
    policy = harness.NoisePolicy("float64")
    for rel, floor, ok in ((5e-15, 0.0, False), (5e-15, 1e-15, True), (1e-6, 1e-15, False)):
        c = harness.Comparison(names, {"w": (64,)}, policy)
        c.error("grad", 0, {"w": ref["w"] * (1 + rel)}, ref)
        c.noise("grad", 0, noisy, ref, 1.0)
        c.spread(0, {"w": floor})   # (absolute; max |g| is 1)
        c.judge()
        assert c.rows["w"]["grad"].ok is ok, (rel, floor)
        assert c.rows["w"]["grad"].noise == pytest.approx(max(floor, 1e-16), rel=0.02)


def test_rounding_floor_skips_what_is_not_its_sum():
    """A module whose forward is its own (OPT's learned positions: an nn.Embedding subclass
    called with the attention mask), a Linear called with keywords: no floor, no crash (the
    heavy tier's tiny-opt crashed on the first)."""
    from torch import nn
    from harness.spread import Spread

    class Positions(nn.Embedding):
        def forward(self, mask):   # (OPT: positions from the mask's cumsum, offset by 2)
            return super().forward((mask.cumsum(1) * mask).long() + 2)
    pos, lin = Positions(16, 4).double(), nn.Linear(4, 4).double()
    mask = torch.ones(2, 5, dtype=torch.float64)
    with Spread(nn.ModuleList([pos, lin])) as s:
        lin(input=pos(mask)).sum().backward()
    assert s.floors(1.0) == {}


def test_fingerprint_sees_any_differing_weight():
    """run.fingerprint: one entry changed anywhere, in a parameter or a floating buffer, moves
    it; the same weights give it bit for bit."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    fp = harness.run.fingerprint(m)
    assert torch.equal(fp, harness.run.fingerprint(m)) and fp.dtype == torch.float64
    for t in (m[0].weight, m[1].running_mean):
        with torch.no_grad():
            t.view(-1)[-1] += 1e-3
        assert not torch.equal(fp, harness.run.fingerprint(m))
        fp = harness.run.fingerprint(m)


def test_a_model_built_differently_on_a_rank_ends_the_run_in_one_line():
    """Every strategy's set-up all-gathers the build's fingerprints (run.same_build): the plant
    build-per-rank (rank 1's weights moved, as a device's init that is not reproducible across
    ranks) ends tp.py, which would otherwise cut its shards from two models, with one line."""
    from conftest import assert_config_error, launch
    r = launch("tp.py", 2, "--plant-bug", "build-per-rank")
    assert_config_error(r, "the model built on rank 1 differs from rank 0's")
