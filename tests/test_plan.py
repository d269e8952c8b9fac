"""trainer4d/plan.py, the layout calculator of docs/interview.md: its figures against the measured
ones they stand for (zero.py's and tp.py's benchmark bytes on tiny, harness.recompute's
formula, pp.py's simulation) and against hand counts. One process, no process group."""
import harness
from trainer4d import plan
from harness.models import load_config
import pp
from conftest import ROOT

TINY_PSI = 180_800   # tiny's parameters: the benchmarks print 180,800


def params_of(name):
    return plan.count_params(load_config(name) if name in harness.PRESETS else plan.load(name))


def test_parameter_counts_on_the_meta_device():
    # fp8_linear: the decoder linears' weights, 4 x (2 x 64 x 64 + 2 x 32 x 64 + 3 x 128 x 64)
    assert params_of("tiny") == dict(total=TINY_PSI, experts=0, dense=TINY_PSI,
                                     fp8_linear=147_456)
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


def test_the_fp8_all_gather_saves_what_fsdp_measured():
    """fp8_gather=1 (fsdp.py's --fp8-all-gather, torchao's FSDP float8 all-gather): the decoder
    linears' weights gathered at 1 byte instead of 2. On configs/tiny-fp8.json at dp=2 the
    forward and backward gathers save 2 x 327,680 B, what fsdp.py's benchmark measured between
    its bf16 and FP8 gathers (results/fp8-cpu.json; scripts/fp8_study.py)."""
    import json
    import os
    cfg = load_config("configs/tiny-fp8.json")
    p = plan.count_params(cfg)
    gathered = [dict((r[:2], r[3]) for r in plan.comm_per_step(cfg, p, plan.parse_layout(
        f"dp=2,zero=3,fp8=1{extra}"), 2))[("dp", "all_gather")] for extra in ("", ",fp8_gather=1")]
    m = json.load(open(os.path.join(ROOT, "results", "fp8-cpu.json")))
    measured = (m["all_gather_bytes_bf16"]["measured"] - m["all_gather_bytes_fp8"]["measured"])
    assert gathered[0] - gathered[1] == 2 * p["fp8_linear"] == measured == 655_360, gathered


def test_bad_layout_is_one_line(capsys):
    import pytest
    for text, msg in [("tp=2,xx=3", "unknown layout key 'xx'"), ("dp=6,ep=4", "ep=4 must divide"),
                      ("pp=4,m=6,schedule=interleaved", "interleaved 1F1B needs the "
                       "micro-batches (6) to be a multiple of the pipeline size 4"),
                      ("pp=4,m=6,schedule=dualpipev", "DualPipeV needs the micro-batches (6)"),
                      ("dp=8,zero=1,fp8=1,fp8_gather=1", "fp8_gather=1: the FP8 all-gather of "
                       "FSDP's weights needs fp8=1 and zero=3"),
                      ("dp=8,zero=1,bwd_prefetch=post", "bwd_prefetch=post: pre or post, and "
                       "post (FSDP1's BACKWARD_POST"), ("dp=8,zero=3,bwd_prefetch=late",
                                                        "bwd_prefetch=late: pre or post"),
                      ("pp=4,m=8,pp_overlap=1", "pp_overlap=1: Megatron-core overlaps the "
                       "pipeline's sends under the interleaved schedule only")]:
        with pytest.raises(SystemExit) as e:
            plan.parse_layout(text)
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error: " + msg), err
    plan.parse_layout("pp=4,m=8,schedule=interleaved")   # a multiple: priced


def test_a_layout_the_schedule_cannot_run_ends_before_any_report():
    """The CLI, as a user runs it: exit 2 and one line, nothing printed before it (the
    simulator's deadlock used to end it in a traceback after the memory report)."""
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "trainer4d.plan", "--model", "llama3-70b", "--gpu",
                        "h100", "--layout", "tp=8,pp=4,dp=32,m=6,schedule=interleaved"],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2 and r.stdout == "", r
    assert r.stderr.strip().splitlines() == [
        "error: interleaved 1F1B needs the micro-batches (6) to be a multiple of the pipeline "
        "size 4 (layout tp=8,pp=4,dp=32,m=6,schedule=interleaved)"], r.stderr


def test_the_planners_take_their_activations_from_one_model(monkeypatch):
    """trainer4d.plan, oom_search.predict_peak and the elastic planner all call
    harness.recompute.activation_bytes: they agree with it and with each other, and a changed
    model changes all three (a planner with a formula of its own would not follow)."""
    import harness.recompute as rc
    import oom_search
    from trainer4d import elastic
    cfg = load_config("tiny")

    def figures():
        lay = plan.parse_layout("tp=2,seq=128,mb=2")
        return (plan.activation_bytes(cfg, lay, 2)["total"],
                oom_search.predict_peak("tp", 2, 128, 2, cfg, 2)["activations"],
                elastic.MemoryModel(config=cfg).activations(2, 128, 64, 4, tp=2))
    real = rc.activation_bytes
    want = real(cfg, 2, 128, 2, "none", "sdpa", tp=2)["layers"]
    assert figures() == (want, want, want)
    monkeypatch.setattr(rc, "activation_bytes",
                        lambda *a, **k: {n: 3 * v for n, v in real(*a, **k).items()})
    assert figures() == (3 * want, 3 * want, 3 * want)


# Each strategy's communication counts are written once, as functions in its learner file;
# these modules count with them (a source check below, the meter's benchmark tests check the
# numbers against the measured traffic).
FORMULAS = {"rig/tp.py": ["region_all_reduces", "LOSS_ALL_REDUCES"],
            "rig/sp.py": ["region_collectives", "ULYSSES_ALL_TO_ALLS", "ulysses_bytes"],
            "rig/fsdp.py": ["collectives_per_unit"],
            "rig/zero.py": ["collectives_per_unit"],
            "rig/pp.py": ["boundary_messages"],
            "rig/cp_ring.py": ["ring_messages", "ring_bytes", "ALLGATHER_COLLECTIVES"],
            "rig/ep_moe.py": ["TOKEN_ALL_TO_ALLS", "COUNT_ALL_TO_ALLS"],
            "compose_moe.py": ["TOKEN_ALL_TO_ALLS", "COUNT_ALL_TO_ALLS"],
            "trainer4d/comm.py": ["region_all_reduces", "LOSS_ALL_REDUCES", "region_collectives",
                                  "collectives_per_unit", "boundary_messages", "ring_messages",
                                  "ring_bytes"],
            "trainer4d/plan.py": ["region_all_reduces", "region_collectives",
                                  "collectives_per_unit", "boundary_messages",
                                  "ALLGATHER_COLLECTIVES", "TOKEN_ALL_TO_ALLS",
                                  "activation_bytes"],
            "trainer4d/elastic.py": ["activation_bytes", "model_state_bytes"],
            "oom_search.py": ["activation_bytes", "model_state_bytes"]}
# what a restated formula looks like: counts per layer written as literals
RESTATED = (r"\b(4|5|6|8|10) \* (L|L_st|layers|moe_l)\b|3 \* \((W|C) - 1\) \+ 1"
            r"|\b4 \* (k|kept)\b")


def code_names(text: str) -> set[str]:
    """The names a module's code uses (not its docstrings or comments)."""
    import ast
    out = set()
    for n in ast.walk(ast.parse(text)):
        if isinstance(n, ast.Name):
            out.add(n.id)
        elif isinstance(n, ast.Attribute):
            out.add(n.attr)
        elif isinstance(n, ast.alias):
            out |= {n.name.rpartition(".")[2], n.asname or ""}
    return out


def restated(text: str) -> list[str]:
    import re
    return [line.strip() for line in text.splitlines() if re.search(RESTATED, line)]


def test_the_comm_formulas_are_the_learner_files(monkeypatch):
    """trainer4d.plan counts with tp.py's, zero.py's, cp_ring.py's and pp_schedule.py's formula
    functions: patched there, the plan follows; and no counting module restates one."""
    import os
    import cp_ring
    import pp_schedule
    import tp
    import zero
    from conftest import ROOT
    cfg, p = load_config("tiny"), params_of("tiny")
    lay = plan.parse_layout("tp=2,cp=2,pp=4,dp=2,zero=3,m=8")
    monkeypatch.setattr(tp, "region_all_reduces", lambda *a, **k: 1000)
    monkeypatch.setattr(zero, "collectives_per_unit", lambda stage, M: (7, 11))
    monkeypatch.setattr(cp_ring, "ALLGATHER_COLLECTIVES", (5, 3))
    monkeypatch.setattr(pp_schedule, "boundary_messages", lambda *a: 13)
    got = {r[:2]: r[2] for r in plan.comm_per_step(cfg, p, lay, 2)}
    assert got == {("tp", "all_reduce"): 8 * 1000, ("cp", "all_gather"): 5 * 1 * 8,
                   ("cp", "reduce_scatter"): 3 * 1 * 8, ("pp", "send"): 8 * 13,
                   ("dp", "reduce_scatter"): 7, ("dp", "all_gather"): 11}, got
    for path, names in FORMULAS.items():
        text = open(os.path.join(ROOT, path)).read()
        assert [n for n in names if n not in code_names(text)] == [], path
        assert restated(text) == [], path
    # the checks see a formula named only in a docstring, and a restated count
    assert "region_all_reduces" not in code_names('"""tp.region_all_reduces"""\nx = 4 * L\n')
    assert restated("        calls = 4 * L + 2 + 3 * K\n        n = 3 * (W - 1) + 1\n") == [
        "calls = 4 * L + 2 + 3 * K", "n = 3 * (W - 1) + 1"]


def test_the_model_state_formula_is_zeros(monkeypatch):
    """ZeRO's table is written once, zero.model_state_bytes: trainer4d.plan, the elastic
    planner and oom_search's prediction all take their model states from it."""
    import oom_search
    import zero
    from trainer4d import elastic
    cfg = load_config("tiny")
    lay = plan.parse_layout("dp=4,zero=2")
    want = zero.model_state_bytes(TINY_PSI, 2, 4, 2, 2, 12)
    assert plan.state_bytes(params_of("tiny"), lay, 2)["dense"]["total"] == (
        sum(want.values()) - 2 * TINY_PSI / 4 + 4 * TINY_PSI / 4)   # the fp32 gradient shard
    monkeypatch.setattr(zero, "model_state_bytes",
                        lambda *a: dict(params=1.0, grads=2.0, optimizer=4.0))
    assert plan.state_bytes(params_of("tiny"), lay, 2)["dense"]["total"] == 7.0 + 2.0
    assert elastic.MemoryModel().states(TINY_PSI, 2, 4) == 7.0
    assert oom_search.predict_peak("zero2", 4, 128, 1, cfg, 2)["states"] == 7.0


def test_no_fit_verdict_on_a_partial_sum():
    """Without an activation model (DeepSeek-V3's MLA/MoE layers) the states alone never
    'fit': only 'does not fit' can be said of a partial sum."""
    lines = []
    cfg = plan.load("deepseek-v3")
    params = plan.count_params(cfg)
    r = plan.plan(cfg, params, plan.parse_layout("pp=16,dp=128,ep=64,zero=1,seq=4096,m=120"),
                  2, 80, out=lines.append)
    assert r["activations"] is None and "fits in" not in r["fits"], r["fits"]
    assert any(l.strip().startswith("states/GPU") and "no verdict" in l for l in lines), lines
    r = plan.plan(cfg, params, plan.parse_layout("pp=16,dp=128,ep=64,zero=1,seq=4096,m=120"),
                  2, 5, out=lines.append)
    assert "does not fit in 5 GiB" in r["fits"]


def test_mixed_precision_states_keep_zero_pys_fp32_gradient_shard():
    """bf16 with zero.py's default fp32 reduction: 2 + 2 + 16/N, 2 + 16/N, 18/N bytes per
    parameter (docs/interview.md question 3's table, measured byte for byte by test_zero.py);
    without sharding 16 Psi."""
    p = params_of("tiny")
    got = {z: plan.state_bytes(p, plan.parse_layout(f"dp=4,zero={z}"), 2)["dense"]["total"]
           for z in (0, 1, 2, 3)}
    assert got == {0: 16 * TINY_PSI, 1: (4 + 16 / 4) * TINY_PSI, 2: (2 + 16 / 4) * TINY_PSI,
                   3: 18 / 4 * TINY_PSI}


def test_tp_kinds_as_dtensor_placements():
    """`python -m trainer4d.plan tp`: every kind tp_plan can assign has a DTensor placement, and
    Qwen3 at T = 4 shows the kinds a plain Shard/Replicate reading gets wrong."""
    import tp_plan
    kinds = plan.tp_kinds(plan.load("tiny-qwen3"), 4, out=lambda *_: None)
    assert set(tp_plan.PLACEMENTS) >= set(kinds.values())
    assert {kinds["model.layers.0.self_attn.q_norm.weight"],
            kinds["model.layers.0.self_attn.k_proj.weight"]} == {"partial", "kv-copy"}
    assert tp_plan.PLACEMENTS["partial"][1].startswith("Partial()")
    assert tp_plan.PLACEMENTS["row"][0] == "Shard(1)" and tp_plan.PLACEMENTS["column"][0] == "Shard(0)"
    phi = plan.tp_kinds(plan.load("tiny-phi3"), 2, out=lambda *_: None)
    assert "fused" in phi.values() and set(tp_plan.PLACEMENTS) >= set(phi.values())
    # kv-copy at T = 8 over 2 kv heads: 2 groups (one per kv head) of 4 ranks (tp.py's
    # kv_copies = T // n_kv), where "T/n_kv groups" would have said 4
    wide = plan.load("tiny-qwen3")
    wide.num_attention_heads, wide.num_key_value_heads = 8, 2
    lines = []
    kinds = plan.tp_kinds(wide, 8, out=lines.append)
    assert kinds["model.layers.0.self_attn.k_proj.weight"] == "kv-copy"
    kv = next(x for x in lines if x.startswith("model.layers.0.self_attn.k_proj.weight"))
    assert "Shard(0) over 2 groups of 4 ranks, Replicate inside each" in kv, kv
