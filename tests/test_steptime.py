"""The step-time model (trainer4d/steptime.py): its arithmetic pinned on hand-worked examples, its
constants read from the suite's own H100 measurements, and the validation against published runs
(results/plan-validation.json) reproduced from the code."""
import json
import os
import subprocess
import sys

import pytest

from trainer4d import steptime as st
from trainer4d.plan import comm_per_step, parse_layout, validate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# a toy model: 2 layers, h 8, 2 heads (kv 2: d 4), gated MLP 16, vocab 32, untied
TOY = dict(layers=2, hidden=8, heads=2, kv_heads=2, ffn=16, gated=True, vocab=32, tied=False)
# a toy GPU with round numbers: 100 FLOP/s peak, matmuls at 50, 1,000 B/s HBM, NVLink 10 B/s,
# network 1 B/s, 4 GPUs per node
GPU = dict(name="toy", peak=100.0, hbm=1000.0, nvlink=10.0, nic=1.0, nics=4, per_node=4, mamf=50.0)


def toy_layout(**kw):
    lay = parse_layout("tp=1")
    lay.update(seq=4, mb=1, m=1, zero=0)
    lay.update(kw)
    return lay


def step(lay, passes=0.0, attn_eff=0.25):
    """The toy model's step on the toy GPU, with plan.comm_per_step's rows for the layout."""
    n = st.param_count(TOY)
    rows = comm_per_step(st.config_of(TOY), dict(total=n, dense=n, experts=0), lay, 2)
    return st.step_time(TOY, lay, GPU, rows, elem=2, passes=passes, attn_eff=attn_eff)


def test_flops_per_token_by_hand():
    # a layer's matmuls: q, o 8x8 each, k, v 8x8 each (2 kv heads x 4), MLP 3 x 8 x 16 = 640
    assert st.layer_matmul_params(TOY) == 2 * 64 + 2 * 64 + 3 * 128 == 640
    # model: 6 (2 x 640 + 32 x 8) + 12 x 2 x 8 x 4 = 6 x 1536 + 768
    assert st.flops_per_token(TOY, 4, "model") == 6 * 1536 + 768 == 9984
    # hardware (Narayanan's Eq. 3): 8 x 1280 + 6 x 256 + 16 x 2 x 8 x 4
    assert st.flops_per_token(TOY, 4, "hardware") == 10240 + 1536 + 1024
    # parameters: layers (640 + two norms of 8), embedding and head (2 x 256), the final norm
    assert st.param_count(TOY) == 2 * 656 + 512 + 8 == 1832
    # Narayanan's own formula: 96 B s l h^2 (1 + s/6h + V/16lh) for GPT (4h MLP, MHA, tied)
    g = dict(layers=3, hidden=12, heads=3, kv_heads=3, ffn=48, gated=False, vocab=64, tied=True)
    s, L, h, V = 16, 3, 12, 64
    assert st.flops_per_token(g, s, "hardware") == pytest.approx(
        96 * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h)) / s)


def test_one_gpu_step_by_hand():
    """One GPU, no elementwise passes: matmuls at the matmul ceiling, causal attention (half the
    12 L h s) at its efficiency, the optimizer's 30 bytes per parameter through HBM."""
    r = step(toy_layout())
    n = 4
    assert r["matmul"] == pytest.approx(6 * 1536 * n / 50.0)
    assert r["attention"] == pytest.approx(12 * 2 * 8 * 4 * n / 2 / (0.25 * 100.0))
    assert r["optimizer"] == pytest.approx(30 * 1832 / 1000.0)
    assert r["step"] == pytest.approx(r["matmul"] + r["attention"] + r["optimizer"])
    assert r["dp"] == r["tp"] == r["bubble"] == r["elementwise"] == 0
    # full recompute: the layers' forward again (8 per parameter for them), attention + 1/3
    f = step(toy_layout(recompute="full"))
    assert f["matmul"] == pytest.approx((8 * 1280 + 6 * 256) * n / 50.0)
    assert f["attention"] == pytest.approx(r["attention"] * 16 / 12)


def test_elementwise_is_the_kept_bytes_times_the_passes():
    lay = toy_layout()
    per_layer, logits = st.kept_bytes(TOY, lay, 2)
    r = step(lay, passes=3.0)
    assert r["elementwise"] == pytest.approx(3.0 * (2 * per_layer + logits) / 1000.0)
    # one layer in two recomputed: its forward's third of the passes again, for half the layers
    h = step(toy_layout(recompute="full", recompute_every=2), passes=3.0)
    assert h["elementwise"] == pytest.approx(r["elementwise"] * (1 + 0.5 / 3))
    assert h["matmul"] == pytest.approx((7 * 1280 + 6 * 256) * 4 / 50.0)


def test_fp8_by_hand():
    """fp8=1: the decoder linears' matmuls at the ceiling times the FP8 / bf16 peak ratio (the LM
    head stays bf16), and each linear's casts, 6 bytes per input and output feature and token,
    through HBM; a GPU without FP8 is refused."""
    g8 = dict(GPU, fp8=200.0)   # FP8 twice the toy's bf16 peak
    n = st.param_count(TOY)
    lay = toy_layout(fp8=1)
    rows = comm_per_step(st.config_of(TOY), dict(total=n, dense=n, experts=0), lay, 2)
    r = st.step_time(TOY, lay, g8, rows, elem=2, passes=0.0, attn_eff=0.25)
    tokens = 4
    assert r["matmul"] == pytest.approx((6 * 1280 / 2 + 6 * 256) * tokens / 50.0)
    # q, k, v, o, gate, up in 8 each + down in 16; out: q 8, k 8, v 8, o 8, gate 16, up 16, down 8
    assert st.layer_linear_features(TOY) == (6 * 8 + 16) + (8 * 4 + 2 * 16 + 8) == 136
    assert r["elementwise"] == pytest.approx(6 * 136 * tokens * 2 / 1000.0)
    with pytest.raises(SystemExit):
        st.step_time(TOY, lay, dict(GPU, fp8=None), rows, elem=2, passes=0.0, attn_eff=0.25)


def test_report_by_hand():
    """tokens/s per GPU, TFLOP/s per GPU and MFU from the step, in both conventions."""
    n = st.param_count(TOY)
    lay = toy_layout(dp=2, m=3)
    rows = comm_per_step(st.config_of(TOY), dict(total=n, dense=n, experts=0), lay, 2)
    r = st.report(TOY, lay, GPU, rows, 2, "model")
    tokens = 1 * 4 * 3 * 2                                     # mb x seq x M x dp
    assert r["tokens"] == tokens and r["gpus"] == 2
    assert r["tokens_per_gpu"] == pytest.approx(tokens / r["step"] / 2)
    assert r["tflops"] == pytest.approx(9984 * tokens / r["step"] / 2 / 1e12)
    assert r["mfu"] == pytest.approx(r["tflops"] * 1e12 / 100.0)
    hw = st.report(TOY, lay, GPU, rows, 2, "hardware")
    assert hw["tflops"] / r["tflops"] == pytest.approx(12800 / 9984)
    # MFU with causal attention's half: 6 L h s per token instead of 12; HFU = MFU without
    # recompute, and Narayanan's count under full recompute
    assert r["mfu_causal"] / r["mfu"] == pytest.approx((9984 - 6 * 2 * 8 * 4) / 9984)
    assert r["hfu"] == pytest.approx(r["mfu"])
    full = toy_layout(dp=2, m=3, recompute="full")
    f = st.report(TOY, full, GPU, rows, 2, "model")
    assert f["hfu"] / f["mfu"] == pytest.approx(12800 / 9984)
    assert st.executed_per_token(TOY, full) == st.flops_per_token(TOY, 4, "hardware")
    sel = st.executed_per_token(TOY, toy_layout(recompute="selective"))
    assert sel == 9984 + 4 * 2 * 8 * 4


def test_eager_attention_computes_the_whole_square_at_the_matmul_ceiling():
    r = step(toy_layout(attn="eager"))
    assert r["attention"] == pytest.approx(12 * 2 * 8 * 4 * 4 / 50.0)
    per_layer, _ = st.kept_bytes(TOY, toy_layout(attn="eager"), 2)
    assert per_layer > st.kept_bytes(TOY, toy_layout(), 2)[0]       # the s x s scores kept


def test_data_parallel_exposure_by_hand():
    """dp 2 in one node, ZeRO-0: the fp32 all-reduce's wire 2(N-1)/N x 4 Psi over NVLink, behind
    one micro-batch's backward (2/3 of its compute) except the last layer's bucket."""
    lay = toy_layout(dp=2)
    r = step(lay)
    t = 2 * (2 - 1) / 2 * 4 * 1832 / 10.0
    compute = r["matmul"] + r["attention"]
    assert r["dp"] == pytest.approx(max(0.0, t - 2 * compute / 3) + t / 2)
    # ZeRO-3: a forward and a backward gather (Psi e each, (N-1)/N on the wire) and a
    # reduce-scatter (Psi x 4); the backward's gather and the reduction share the link
    z3 = step(toy_layout(dp=2, zero=3))
    ag, rs = 1832 * 2 / 2 / 10.0, 1832 * 4 / 2 / 10.0
    assert z3["dp"] == pytest.approx(max(0.0, ag - compute / 3)
                                     + max(0.0, rs + ag - 2 * compute / 3) + rs / 2 + ag / 2)
    # FSDP1's BACKWARD_POST (bwd_prefetch=post): the backward's first unit (one of the two
    # layers) has no unit before it to prefetch its gather, which it waits for
    post = step(toy_layout(dp=2, zero=3, bwd_prefetch="post"))
    assert post["dp"] == pytest.approx(z3["dp"] + ag / 2)
    m3 = [step(toy_layout(dp=2, zero=3, m=3, bwd_prefetch=b))["dp"] for b in ("pre", "post")]
    assert m3[1] - m3[0] == pytest.approx(3 * ag / 2)                # in every micro-batch
    # not overlapped (Megatron 2021's local DDP): the whole all-reduce after the backward
    assert step(toy_layout(dp=2, dp_overlap=0))["dp"] == pytest.approx(t)
    # reduced in fp16 (reduce_bytes=2): half the bytes
    half = step(toy_layout(dp=2, dp_overlap=0, reduce_bytes=2))
    assert half["dp"] == pytest.approx(t / 2)
    # across nodes (12 GPUs of 4 per node): the network's bandwidth instead, the group's 4 ranks
    # per node under rings over the node's 4 NICs (1.0 each)
    far = step(toy_layout(dp=12))
    t12 = 2 * 11 / 12 * 4 * 1832 / (4 * 1.0)
    assert far["dp"] == pytest.approx(max(0.0, t12 - 2 * compute / 3) + t12 / 2)
    # on exactly two nodes NCCL's tree all-reduce crosses the network with half the ring's
    # traffic: twice the node's NICs (capped by NVLink); a reduce-scatter stays a ring
    two = step(toy_layout(dp=8))
    t8 = 2 * 7 / 8 * 4 * 1832 / (2 * 4 * 1.0)
    assert two["dp"] == pytest.approx(max(0.0, t8 - 2 * compute / 3) + t8 / 2)
    lay8 = toy_layout(dp=8)
    assert st.tree_on_two_nodes(lay8, "dp", "all_reduce", GPU)
    # NVLink caps the tree at its measured share: faster NICs (2 each: 2 x 8 = 16 > 10) reach
    # the in-node rate (NVLink at half its datasheet's), not more
    fast = dict(GPU, nic=2.0, link_efficiency={"nvlink": 0.5, "network": 1.0})
    rows = [("dp", "all_reduce", 1, 1000.0, "")]
    two_nodes = st.comm_seconds(rows, lay8, fast)[("dp", "all_reduce")]["seconds"]
    assert two_nodes == pytest.approx(2 * 7 / 8 * 1000.0 / (10.0 * 0.5))
    one_node = st.comm_seconds(rows, toy_layout(dp=4), fast)[("dp", "all_reduce")]["seconds"]
    assert two_nodes / (2 * 7 / 8) >= one_node / (2 * 3 / 4)         # never faster per byte
    assert not st.tree_on_two_nodes(lay8, "dp", "reduce_scatter", GPU)
    assert not st.tree_on_two_nodes(toy_layout(tp=4, dp=2), "dp", "all_reduce", GPU)  # 1 a node


def test_tensor_parallel_comm_and_its_overlap_by_hand():
    """tp 2: 4 all-reduces per layer per micro-batch of b s h e bytes, 2(T-1)/T of it on the wire,
    exposed; with tp_overlap only what exceeds the matmuls' time."""
    r = step(toy_layout(tp=2))
    t = 4 * 2 * (1 * 4 * 8 * 2) * (2 * 1 / 2) / 10.0
    assert r["tp"] == pytest.approx(t)
    assert r["matmul"] == pytest.approx(6 * 1536 * 4 / 2 / 50.0)
    o = step(toy_layout(tp=2, tp_overlap=1))
    assert o["tp"] == pytest.approx(max(0.0, t - r["matmul"]))
    # full recompute: each layer's 2 forward all-reduces again, 6 per layer
    f = step(toy_layout(tp=2, recompute="full"))
    assert f["tp"] == pytest.approx(t * 6 / 4)
    # SP: the same bytes as 6 all-gathers and 4 reduce-scatters per layer, (T-1)/T each
    sp_ = step(toy_layout(tp=2, sp=1))
    assert sp_["tp"] == pytest.approx(2 * (6 + 4) * (1 * 4 * 8 * 2) * (1 / 2) / 10.0)


def test_pipeline_bubble_by_hand():
    """pp 2, M 4, 1F1B: the step is M slots / (1 - (P-1)/(M+P-1)), each slot one micro-batch
    through the slower stage (the last: a layer and the LM head) plus its send (b s h e: at
    P = 2 the first stage sends activations forward, the last gradients back; NVLink)."""
    lay = toy_layout(pp=2, m=4)
    r = step(lay)
    slot = (r["matmul"] + r["attention"]) / 4 + r["pp_send"] / 4
    assert r["pp_send"] == pytest.approx(4 * (4 * 8 * 2) / 10.0)
    assert r["bubble"] == pytest.approx(4 * slot / (1 - 1 / 5) - 4 * slot)
    # pp_overlap (Megatron-core's interleaved overlap_p2p_comm): the sends hidden behind the
    # micro-batch's compute; a toy spec's overlap is free, a named GPU's costs its slowdown
    ov = toy_layout(pp=2, m=4, schedule="interleaved", pp_overlap=1)
    hid = step(ov)
    assert hid["pp_send"] == 0.0 and hid["step"] < r["step"]
    rows = comm_per_step(st.config_of(TOY), dict(total=1832, dense=1832, experts=0), ov, 2)
    on = lambda g: st.step_time(TOY, ov, g, rows, elem=2, passes=0.0, attn_eff=0.25)  # noqa: E731
    assert on(dict(GPU, overlap_slowdown=0.25))["pp_send"] == pytest.approx(0.25 * r["pp_send"])
    # sends longer than a micro-batch's whole compute (forward and backward): only the excess
    c = on(dict(GPU, nvlink=0.01))
    sends = 4 * (4 * 8 * 2) / 0.01
    assert c["pp_send"] == pytest.approx(sends - (c["matmul"] + c["attention"]))
    assert r["matmul"] == pytest.approx(4 * 6 * (640 + 256) * 4 / 50.0)
    # interleaved, V = 2 over 4 layers: (P-1)/(V M + P-1) of the step idle
    four = dict(TOY, layers=4)
    n = st.param_count(four)
    lay = toy_layout(pp=2, m=4, schedule="interleaved", v=2)
    rows = comm_per_step(st.config_of(four), dict(total=n, dense=n, experts=0), lay, 2)
    i = st.step_time(four, lay, GPU, rows, elem=2, passes=0.0, attn_eff=0.25)
    busy = i["step"] - i["bubble"] - i["dp"] - i["optimizer"]
    assert i["bubble"] / (busy + i["bubble"]) == pytest.approx(1 / (2 * 4 + 1))
    assert st.stages(4, 2) == [(2, False), (2, True)] and st.stages(7, 3) == [(3, False), (1, True)]


def test_link_follows_the_rank_order():
    g = st.GPUS["h100"]
    lay = parse_layout("tp=8,pp=16,dp=64")
    assert st.link(lay, "tp", g) == ("nvlink", 450e9)
    assert st.link(lay, "dp", g)[0] == "network" and st.link(lay, "pp", g)[0] == "network"
    assert st.link(parse_layout("tp=2,dp=4"), "dp", g)[0] == "nvlink"      # 2 x 4 = 8 per node
    assert st.link(parse_layout("tp=2,dp=8"), "dp", g)[0] == "network"


def test_published_rows_are_layouts_the_cli_takes():
    """published.lay() skips parse_layout: each row's framework flags stay where the CLI takes
    them (pp_overlap under the interleaved schedule, bwd_prefetch=post under ZeRO-3)."""
    from trainer4d.published import ROWS
    for rid, lay in ((r[0], r[5]) for r in ROWS):
        parse_layout(",".join(f"{k}={v}" for k, v in lay.items()))   # exit 2 on a bad one
        if lay.get("pp_overlap"):
            assert lay["schedule"] == "interleaved" and lay["pp"] > 1, rid
        if lay.get("bwd_prefetch") == "post":
            assert lay["zero"] == 3, rid


def test_rings_over_rails_share_the_nodes_nics():
    """NCCL's ring per rail leaves a node once: a group with g ranks per node gets g NIC shares
    per GPU (one beside tp = 8, all eight when DP fills the node), NVLink its cap; a pipeline
    send and an all-to-all their GPU's own share; fewer or slower NICs (the CLI's
    --nics-per-node, --nic-gbps) scale every network link."""
    g = st.GPUS["h100"]
    assert st.link(parse_layout("tp=8,dp=64"), "dp", g) == ("network", 50e9)        # g = 1
    assert st.link(parse_layout("tp=2,dp=32"), "dp", g) == ("network", 4 * 50e9)    # g = 4
    assert st.link(parse_layout("dp=64"), "dp", g) == ("network", 8 * 50e9)         # g = 8
    assert st.link(parse_layout("tp=16"), "tp", g) == ("network", 8 * 50e9)
    assert st.link(parse_layout("pp=16"), "pp", g) == ("network", 50e9)
    # the ring's hops inside a node run over NVLink: each at its measured share, the slower wins
    lay = parse_layout("dp=64,zero=3")
    rows = [("dp", "all_gather", 1, 1e9, "")]
    t = st.comm_seconds(rows, lay, g)[("dp", "all_gather")]["seconds"]
    assert t == pytest.approx(1e9 * 63 / 64 / (450e9 * 0.81))      # not 8 x 50 x 0.96 = 384
    slow = st.comm_seconds(rows, lay, dict(g, nvlink=900e9))[("dp", "all_gather")]["seconds"]
    assert slow == pytest.approx(1e9 * 63 / 64 / (400e9 * 0.96))
    four = dict(g, nics=4, nic=100e9 / 8)          # 4 x 100 Gb/s per node of 8 GPUs
    assert st.link(parse_layout("dp=64"), "dp", four) == ("network", 8 * 4 * 12.5e9 / 8)
    assert st.link(parse_layout("pp=16"), "pp", four) == ("network", 4 * 12.5e9 / 8)


def test_cli_network_flags(capsys):
    """--nics-per-node and --nic-gbps describe the --gpu machine (named in the report); FSDP over
    64 GPUs slows on 4 x 100 Gb/s per node; a bad value or the flags without --gpu: one line,
    exit 2, before any report."""
    from trainer4d import plan
    args = ["--model", "llama2-7b", "--layout", "dp=64,zero=3,seq=4096", "--gpu", "h100"]
    fast = plan.main(args)[0]["steptime"]
    slow = plan.main(args + ["--nics-per-node", "4", "--nic-gbps", "100"])[0]["steptime"]
    out = capsys.readouterr().out
    assert "4 x 100 Gb/s NICs per node" in out and slow["dp"] > 4 * fast["dp"], (fast, slow)
    for bad in (["--nic-gbps", "0"], ["--nics-per-node", "-1"]):
        with pytest.raises(SystemExit) as e:
            plan.main(args + bad)
        assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        plan.main(["--model", "llama2-7b", "--layout", "dp=8", "--nic-gbps", "100"])
    err = capsys.readouterr()
    assert e.value.code == 2 and "give --gpu" in err.err and "parameters" not in err.out


def test_constants_come_from_the_h100_measurements():
    """The attention efficiency is the measured fused SDPA row's; the elementwise passes make the
    model reproduce the measured reference step exactly (and nothing else is fitted)."""
    with open(st.ATTENTION_FILE) as f:
        d = json.load(f)
    row = [r for r in d["rows"] if r["kernel"] == "fused SDPA, whole sequence"
           and r["dtype"] == "bfloat16"][0]
    flops = 3 * 4 * d["heads"] * d["seq"] ** 2 * d["head_dim"] / 2      # causal, fwd + 2 bwd
    c = st.constants()
    assert c["attention_efficiency"] == pytest.approx(flops / (row["ms"] / 1e3) / 989.4e12)
    lay = toy_layout(seq=2048, mb=4)
    r = st.step_time(st.LLAMA32_1B, lay, "h100", [])
    assert r["step"] == pytest.approx(c["reference_step_s"], rel=1e-9)
    assert 1 < c["elementwise_passes"] < 30     # bytes kept by the forward, moved ~10 times


def test_validation_reproduces_the_results_file():
    with open(os.path.join(ROOT, "results", "plan-validation.json")) as f:
        saved = json.load(f)
    lines = []
    fresh = validate(out=lines.append)
    assert fresh["rows"] == saved["rows"]          # the committed figures are the code's
    assert saved["unpublished_v"]["2"] == fresh["median_abs_rel_err"] == saved["median_abs_rel_err"]
    assert len(fresh["rows"]) >= 12 and len({r["source"] for r in fresh["rows"]}) >= 3
    for r in fresh["rows"]:
        assert set(r) >= {"source", "layout", "metric", "published", "predicted", "rel_err"}
        assert r["rel_err"] == pytest.approx(r["predicted"] / r["published"] - 1, abs=2e-3)
    assert lines[-1].startswith("median |error| ")


def test_validation_says_how_each_source_counts_attention():
    """Like with like: every row is predicted with causal attention in full, and the validation
    prints each source's own count: Megatron's rows from r0.8.0's formula (in full, where current
    Megatron-LM halves it), Narayanan's in hardware FLOPs, Llama 3's count an assumption."""
    from trainer4d.published import ROWS, SOURCES
    lines = []
    validate(out=lines.append)
    said = {l.split(":", 1)[0].rsplit(" ", 1)[-1]: l.split(":", 1)[1]
            for l in lines if l.startswith("causal attention's FLOPs, ")}
    assert set(said) == {r[1] for r in ROWS} and set(said) <= set(SOURCES)
    assert "r0.8.0" in said["megatron"] and "in full" in said["megatron"]
    assert "halves" in said["megatron"] and "r0.8.0" in SOURCES["megatron"]
    assert "assumed" in said["llama3"] and "recompute" in said["narayanan"]
    for r in ROWS:   # each row's convention as its source counted
        want = ("hardware" if r[1] in ("narayanan", "bloom") else
                "causal" if r[1] == "mcore-moe" else "model")
        assert r[8] == want, r[0]
        assert (r[8] == "hardware") == ("recompute's forward" in said[r[1]]), r[0]
        assert (r[8] == "causal") == ("causal half" in said[r[1]] and r[6] == "tflops"), r[0]

def test_every_validation_row_runs_through_the_cli(tmp_path, capsys):
    """What the validation proves is what a user gets: each published row's model written as an
    HF config file (published.hf_config: Llama's when gated, GPT-2's otherwise, with its biases
    and learned positions) and its layout as the CLI's text, `python -m trainer4d.plan --model
    FILE --layout ... --gpu ...` predicts the row's step: exactly for the Llama-shaped rows, within
    0.5% for GPT's (its biases and position embeddings, which the row's shape leaves out, add
    optimizer and gradient bytes)."""
    from trainer4d import plan
    from trainer4d.published import ROWS, hf_config
    val = {r["id"]: r for r in validate(out=lambda *_: None)["rows"]}
    for rid, _, _, sh, gpu, lay, *_ in ROWS:
        path = str(tmp_path / f"{rid}.json")
        hf_config(sh, lay["seq"]).to_json_file(path)
        rows = plan.main(["--model", path, "--layout", ",".join(f"{k}={v}" for k, v in lay.items()),
                          "--gpu", gpu])
        got, want = rows[0]["steptime"]["step"], val[rid]["step_s"]
        assert got == pytest.approx(want, rel=5e-3 if not sh["gated"] else 1e-4), rid
    capsys.readouterr()


@pytest.mark.parametrize("kind,kw,gated", [
    ("gpt2", dict(n_embd=1024, n_layer=4, n_head=16), False),           # GPT-3-shaped: GELU
    ("bloom", dict(hidden_size=1024, n_layer=4, n_head=16), False),     # ALiBi, LayerNorm bias
    ("mpt", dict(d_model=1024, n_layers=4, n_heads=16, expansion_ratio=4), False),
    ("nemotron", dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=4,
                      num_attention_heads=16, num_key_value_heads=4), False),  # squared ReLU
    ("mistral", dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                     num_attention_heads=16, num_key_value_heads=1), True),    # MQA
])
def test_any_dense_decoder_config_reaches_the_step_time(kind, kw, gated, tmp_path, capsys):
    """The CLI prices any dense HF decoder, its shape read from the model built on the meta
    device (steptime.shape_of), not from family names: gated or not, norms with or without bias,
    GQA/MQA. The layer's matmul parameters and the model's parameters are the meta model's
    exactly, and the step's matmul time is 6 Psi_matmul per token at the matmul ceiling."""
    from transformers import CONFIG_MAPPING
    from trainer4d import plan
    from trainer4d.elastic import count_params
    path = str(tmp_path / "config.json")
    config = CONFIG_MAPPING[kind](vocab_size=32000, **kw)
    config.to_json_file(path)
    sh = st.shape_of(config)
    assert sh["gated"] is gated and sh["params"] == count_params(config)["total"], sh
    h, f = config.hidden_size, sh["ffn"]
    assert sh["layer_matmul"] - (3 if gated else 2) * h * f == (2 * h + 2 * sh["kv_heads"] *
                                                                  sh["head_dim"]) * h, sh
    rows = plan.main(["--model", path, "--layout", "tp=2,dp=4,seq=2048,m=4", "--gpu", "h100"])
    r = rows[0]["steptime"]
    out = capsys.readouterr().out
    assert "not modelled" not in out and "step time on H100" in out, out
    n = 4 * 2048
    assert r["matmul"] == pytest.approx(
        6 * (4 * sh["layer_matmul"] + 32000 * h) * n / 2 / st.gpu_spec("h100")["mamf"], rel=1e-9)

def test_cli_step_time_and_a_bad_gpu():
    run = [sys.executable, "-m", "trainer4d.plan", "--model", "llama2-7b", "--layout", "dp=8"]
    r = subprocess.run(run + ["--gpu", "h100"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "step time on H100 80GB SXM" in r.stdout and "MFU" in r.stdout
    bad = subprocess.run(run + ["--gpu", "v100"], capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.strip().startswith("error: unknown --gpu 'v100'")
    assert len(bad.stderr.strip().splitlines()) == 1
    fp8 = subprocess.run(run[:-1] + ["dp=8,fp8=1", "--gpu", "a100"], capture_output=True,
                         text=True, cwd=ROOT)
    assert fp8.returncode == 2 and fp8.stdout == "", fp8
    assert fp8.stderr.strip() == "error: fp8=1 on A100 80GB SXM: it has no FP8 tensor cores"


def test_the_docs_example_is_the_calculators_output(capsys):
    """docs/steptime.md's example block is what its command prints today."""
    from trainer4d import plan
    with open(os.path.join(ROOT, "docs", "steptime.md")) as f:
        doc = f.read()
    command = doc.split("```bash\n")[1].split("\n")[0]
    assert command.startswith("python -m trainer4d.plan ")
    plan.main(command.split()[3:])
    out = capsys.readouterr().out
    block = doc.split("```text\n")[1].split("```")[0]
    assert block == out[out.index("  step time"):], out


def test_moe_step_by_hand(capsys):
    """MoE: the shape measured on the meta model (Qwen3-30B-A3B's config: every parameter, the
    active matmuls per layer: attention at 32 heads of 128, the router, 8 of 128 experts);
    MoE parallel folding (EP 32 over TP 2 x DP 16 with SP: each tp rank's tokens dispatched on
    their own, the experts' ZeRO group 1); where the ep and edp groups sit in each rank order;
    the all-to-alls' bytes, their exposure with and without ep_overlap, and the token copies a
    MoE layer keeps."""
    from transformers import Qwen3MoeConfig
    from trainer4d.elastic import count_params
    from trainer4d.plan import comm_per_step, step_report
    from trainer4d.published import QWEN3_30B_A3B
    cfg = Qwen3MoeConfig(hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                         num_key_value_heads=4, head_dim=128, num_experts=128,
                         num_experts_per_tok=8, moe_intermediate_size=768, vocab_size=151936,
                         tie_word_embeddings=False)
    sh = st.shape_of(cfg)
    h, k = 2048, 8
    attn = 2 * h * 128 * (32 + 4)
    assert sh["layer_matmul"] == attn + h * 128 + 3 * h * k * 768
    assert sh["params"] == count_params(cfg)["total"] == QWEN3_30B_A3B["params"]
    assert sh["expert_params"] == 48 * 128 * 3 * h * 768 and sh["ffn"] == k * 768
    assert st.attention_width(sh) == 4096
    fold = parse_layout("tp=2,pp=8,dp=16,ep=32,sp=1,seq=4096,m=16")
    assert st.folded(fold) and st.expert_dp(fold) == 1
    g = st.GPUS["h100"]
    assert st.in_node(fold, "ep", 8) == 2          # Llama 3's order: the tp pair, dp at stride 16
    mega = dict(fold, order="megatron")            # DP inside PP: dp at stride 2, 4 per node
    assert st.in_node(mega, "ep", 8) == 8 and st.link(mega, "ep", g) == ("network", 50e9)
    flat = parse_layout("dp=32,ep=8")              # 8 consecutive ranks hold all the experts;
    assert st.link(flat, "ep", g)[0] == "nvlink"   # those holding the same ones sit 8 apart
    assert st.pieces(flat, "edp") == [(4, 8)] and st.link(flat, "edp", g) == ("network", 50e9)
    with pytest.raises(SystemExit) as e:
        parse_layout("tp=2,dp=16,ep=32")                                  # folding needs SP
    assert e.value.code == 2 and "folding" in capsys.readouterr().err
    n = 1 * 4096                                   # tokens per micro-batch on this GPU
    rows = {(g, op): (c, b) for g, op, c, b, _ in comm_per_step(
        st.config_of(sh), dict(total=sh["params"], dense=sh["params"] - sh["expert_params"],
                               experts=sh["expert_params"]), fold, 2)}
    assert rows["ep", "all_to_all"] == (4 * 6 * 16, 4 * 6 * 16 * k * n * h * 2 / 2)   # / tp
    lay = parse_layout("dp=32,ep=8,seq=4096,m=8")
    plain, hidden = (step_report(sh, dict(lay, ep_overlap=o), "h100", 2) for o in (0, 1))
    ep = plain["comm"]["ep", "all_to_all"]["seconds"] / 8
    assert plain["ep"] == pytest.approx(8 * ep)
    exposed = max(0.0, ep - plain["matmul"] / 8)   # + the matmuls' slowdown beside the rest
    assert hidden["ep"] == pytest.approx(8 * (exposed + st.OVERLAP_SLOWDOWN * (ep - exposed)))
    dense = {x: v for x, v in sh.items() if x not in ("experts", "top_k", "moe_layers")}
    assert st.kept_bytes(sh, lay, 2)[0] - st.kept_bytes(dense, lay, 2)[0] == 2 * k * h * 2 * n


def test_packed_documents_cut_attentions_work_by_one_formula():
    """doc_min=N: rows cut by the suite's document lengths (harness.data.doc_lengths), each
    document attending within itself; attention's work is the share of causal pairs left
    (steptime.doc_work, by hand here), the rest of the step unchanged; N = seq: one document."""
    from harness.data import doc_lengths
    S, N = 64, 4
    want = sum(sum(n * (n + 1) // 2 for n in doc_lengths(0, i, S, N)) for i in range(64))
    assert st.doc_work(S, N) == pytest.approx(want / 64 / (S * (S + 1) / 2), rel=1e-12)
    assert st.doc_work(S, S) == 1.0 and 0 < st.doc_work(8192, 256) < st.doc_work(8192, 2048) < 1
    lay = toy_layout()
    plain, packed = step(lay), step(dict(lay, seq=lay["seq"], doc_min=2))
    share = st.doc_work(lay["seq"], 2)
    assert packed["attention"] == pytest.approx(plain["attention"] * share)
    assert packed["matmul"] == plain["matmul"] and packed["elementwise"] == plain["elementwise"]


def test_routed_experts_split_over_tp_only_when_folded():
    """Without folding every tp rank routes the same tokens through the same experts (
    compose_moe.py): only the rest of the layer splits T ways; folded (sequence parallel), the
    tp ranks' tokens differ and the experts' work splits too."""
    from trainer4d.plan import step_report
    from trainer4d.published import QWEN3_30B_A3B as sh
    routed = 3 * 2048 * 8 * 768                    # per layer: top 8 of 768 wide, gated
    one = step_report(sh, parse_layout("dp=16,ep=8,seq=4096,m=1"), "h100", 2)["matmul"]
    tp = step_report(sh, parse_layout("tp=2,dp=8,ep=8,seq=4096,m=1"), "h100", 2)["matmul"]
    fold = step_report(sh, parse_layout("tp=2,dp=8,ep=16,sp=1,seq=4096,m=1"), "h100",
                       2)["matmul"]
    per = one / (48 * sh["layer_matmul"] + 151936 * 2048)   # seconds per matmul parameter
    assert tp == pytest.approx(per * (48 * (sh["layer_matmul"] - routed) / 2 + 48 * routed
                                      + 151936 * 2048 / 2))
    assert fold == pytest.approx(one / 2)


def test_selective_recompute_reruns_the_scores_only_when_unfused():
    """Selective recompute re-runs core attention's forward: its matmuls (att_again) under any
    kernel, and under unfused attention (attn=eager) also the softmax's elementwise work over
    the s x s scores, a third of what their kept bytes cost (steptime.scores_bytes); a fused
    kernel keeps no scores and adds none."""
    passes = 3.0
    for attn, extra in (("eager", True), ("flash", False)):
        none = step(toy_layout(attn=attn), passes=passes)
        sel = step(toy_layout(attn=attn, recompute="selective"), passes=passes)
        s = st.scores_bytes(TOY, toy_layout(attn=attn), 2)
        assert (s > 0) == extra
        want = passes * s * TOY["layers"] / 3 / GPU["hbm"]
        assert sel["elementwise"] - none["elementwise"] == pytest.approx(want, abs=1e-12)


def test_a_named_gpus_links_run_at_nccls_measured_share():
    """A named GPU's collectives run at NCCL's measured share of a link (LINK_EFFICIENCY: 0.81
    of NVLink, a ring's nccl-tests busbw; 0.96 of a NIC), a toy spec without it at the
    datasheet's rate: tp's all-reduce inside a node over NVLink, dp's across nodes over the NICs
    (tp 8 beside it: one NIC share per GPU)."""
    lay = parse_layout("tp=8,dp=4")
    rows = [("tp", "all_reduce", 1, 1e9, None), ("dp", "reduce_scatter", 1, 1e9, None)]
    h100 = st.GPUS["h100"]
    got = st.comm_seconds(rows, lay, h100)
    wire = {g: st.wire_bytes(g, op, 1e9, lay) for g, op, *_ in rows}
    assert got["tp", "all_reduce"]["seconds"] == pytest.approx(wire["tp"] / (450e9 * 0.81))
    assert got["dp", "reduce_scatter"]["seconds"] == pytest.approx(wire["dp"] / (50e9 * 0.96))
    toy = {k: v for k, v in h100.items() if k != "link_efficiency"}
    assert st.comm_seconds(rows, lay, toy)["tp", "all_reduce"]["seconds"] == pytest.approx(
        wire["tp"] / 450e9)


def test_a_hidden_second_slows_the_compute_beside_it():
    """A named GPU's overlapped communication costs OVERLAP_SLOWDOWN (0.189, Lee et al. 2025)
    of each hidden second, charged to that communication: TP overlapped behind the matmuls
    (Megatron's --tp-comm-overlap) costs 0.189 x its time where a toy spec (no slowdown field)
    hides it for free; exposed TP costs the same either way."""
    lay = parse_layout("tp=8,seq=4096,tp_overlap=1,sp=1")
    h100 = st.GPUS["h100"]
    free = {k: v for k, v in h100.items() if k != "overlap_slowdown"}
    from trainer4d.published import LLAMA3_70B as sh
    n = st.param_count(sh)
    rows = comm_per_step(st.config_of(sh), dict(total=n, dense=n, experts=0), lay, 2)
    named, toy = (st.step_time(sh, lay, g, rows) for g in (h100, free))
    tp = sum(v["seconds"] for (grp, _), v in named["comm"].items() if grp == "tp")
    assert tp < named["matmul"] and toy["tp"] == 0.0          # all of it hidden
    assert named["tp"] == pytest.approx(st.OVERLAP_SLOWDOWN * tp)
    plain = dict(lay, tp_overlap=0)
    assert st.step_time(sh, plain, h100, rows)["tp"] == pytest.approx(
        st.step_time(sh, plain, free, rows)["tp"])
