"""trainer4d/plan.py, the layout calculator of docs/interview.md: its figures against the measured
ones they stand for (zero.py's and tp.py's benchmark bytes on tiny, harness.recompute's
formula, pp.py's simulation) and against hand counts. One process, no process group."""
import harness
from trainer4d import plan
from harness.models import load_config
import pp

TINY_PSI = 180_800   # tiny's parameters: the benchmarks print 180,800


def params_of(name):
    return plan.count_params(load_config(name) if name in harness.PRESETS else plan.load(name))


def test_parameter_counts_on_the_meta_device():
    assert params_of("tiny") == dict(total=TINY_PSI, experts=0, dense=TINY_PSI)
    p = params_of("llama3-405b")
    assert p["total"] == 405_853_388_800 and p["experts"] == 0
    moe = params_of("tiny-moe")
    assert moe["total"] == 255_296 and moe["dense"] == 58_688   # ep_moe's Psi_dense


def test_model_states_match_zero_py():
    """fp32 (e = 4): ZeRO-1/2/3 at W=2 are zero.py's measured 2.07, 1.72, 1.38 MiB exactly;
    mixed precision (e = 2) without sharding is 16 Psi."""
    p = params_of("tiny")
    got = {z: plan.state_bytes(p, plan.parse_layout(f"dp=2,zero={z}"), 4)["dense"]["total"]
           for z in (0, 1, 2, 3)}
    assert got == {0: 16 * TINY_PSI, 1: 4 * TINY_PSI + 4 * TINY_PSI + 8 * TINY_PSI / 2,
                   2: 4 * TINY_PSI + 12 * TINY_PSI / 2, 3: 16 * TINY_PSI / 2}
    assert got[1] == 2_169_600 and got[3] == 1_446_400
    mixed = plan.state_bytes(p, plan.parse_layout("zero=0"), 2)["dense"]
    assert (mixed["params"], mixed["grads"], mixed["optimizer"]) == (2 * TINY_PSI, 2 * TINY_PSI,
                                                                     12 * TINY_PSI)


def test_activations_follow_the_recompute_formula():
    from harness.recompute import activation_bytes
    cfg = load_config("configs/tiny-gqa8.json")
    for mode in ("none", "full"):
        one = activation_bytes(cfg, 2, 128, 4, mode, "sdpa")["per_layer"]
        lay = plan.parse_layout(f"seq=128,mb=2,recompute={mode}")
        a = plan.activation_bytes(cfg, lay, 4)
        assert a["per_layer"] == one and a["total"] == one * 4   # 4 layers, 1 micro-batch
        lay = plan.parse_layout(f"tp=2,sp=1,seq=128,mb=2,recompute={mode}")
        sp = plan.activation_bytes(cfg, lay, 4)
        assert sp["per_layer"] == one / 2
        tp = plan.activation_bytes(cfg, plan.parse_layout(f"tp=2,seq=128,mb=2,recompute={mode}"), 4)
        assert one / 2 < tp["per_layer"] <= one     # the norms stay whole under TP alone
    # 1F1B: the first stage holds min(M, P) micro-batches of its ceil(L/P) layers
    a = plan.activation_bytes(cfg, plan.parse_layout("pp=2,m=8,seq=128"), 4)
    assert (a["layers"], a["in_flight"]) == (2, 2)


def test_comm_matches_the_measured_benchmarks():
    """tp.py (tiny-gqa8, B=4, S=256, W=2) all-reduces 4L of N*H*b = 262,144 B in its layers;
    zero.py stage 3 at W=2 gathers 2 Psi b = 1,446,400 and reduce-scatters 723,200 (fp32)."""
    cfg = load_config("configs/tiny-gqa8.json")
    p = plan.count_params(cfg)
    rows = plan.comm_per_step(cfg, p, plan.parse_layout("tp=2,seq=256,mb=4"), 4)
    assert rows[0][:4] == ("tp", "all_reduce", 16, 16 * 262_144)
    rows = plan.comm_per_step(load_config("tiny"), params_of("tiny"),
                              plan.parse_layout("dp=2,zero=3"), 4)
    assert [r[:4] for r in rows] == [("dp", "reduce_scatter", 1, 4 * TINY_PSI),
                                     ("dp", "all_gather", 2, 2 * 4 * TINY_PSI)]
    assert rows[1][3] == 1_446_400 and rows[0][3] == 723_200


def test_bubble_table_equals_pp():
    rows = plan.bubbles(4, 8, 2, ["gpipe", "1f1b", "interleaved", "zb"], 0.2, out=lambda *_: None)
    for r in rows:
        assert abs(r["formula"] - r["simulated"]) < 1e-12
    by = {r["name"]: r for r in rows}
    assert by["1f1b"]["sends"] == 2 * 8 * (4 - 1)             # 2M (P-1)
    assert by["interleaved"]["sends"] == 2 * 8 * (4 * 2 - 1)  # 2M (PV-1)
    assert by["gpipe"]["peak"] == [8] * 4 and by["1f1b"]["peak"] == [4, 3, 2, 1]
    assert by["1f1b"]["formula"] == pp.bubble_formula("1f1b", 4, 8)


def test_ring_all_reduce_steps_and_bytes():
    for N in (2, 3, 4, 5):
        r = plan.ring_all_reduce(N, 60, out=lambda *_: None)
        assert r["ok"] and r["steps"] == 2 * (N - 1)
        assert r["sent"] == [2 * (N - 1) * (60 // N) * 4] * N


def test_bad_layout_is_one_line():
    import pytest
    with pytest.raises(SystemExit, match="unknown layout key"):
        plan.parse_layout("tp=2,xx=3")
    with pytest.raises(SystemExit, match="must divide"):
        plan.parse_layout("dp=6,ep=4")
