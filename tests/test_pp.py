"""pp.py: schedules without processes, then the pipeline under torchrun on CPU."""
import json

import pytest

import common
import pp
from conftest import assert_config_error

CASES = [(P, M, V) for P in (2, 3, 4) for M in (1, 2, 3, 4, 8) for V in (1, 2)]


def valid(name, P, M, V):
    if name != "interleaved":
        return V == 1
    return V > 1 and M % P == 0 and M >= P


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved", "zb"])
def test_schedules(name):
    checked = 0
    for P, M, V in CASES:
        if not valid(name, P, M, V):
            continue
        C = P * V
        for r in range(P):
            acts = pp.schedule(name, P, M, V, r)
            seen = {}
            for i, a in enumerate(acts):
                assert a not in seen, (name, P, M, V, r, a)
                seen[a] = i
            kinds = {"F", "B"} if name != "zb" else {"F", "I", "W"}
            mine = [c for c in range(C) if c % P == r]
            # counts: every (chunk, micro-batch) once per kind
            assert set(seen) == {(k, c, m) for k in kinds for c in mine for m in range(M)}
            for c in mine:
                for m in range(M):  # F before its backward on this stage, I before W
                    back = ("B", c, m) if name != "zb" else ("I", c, m)
                    assert seen[("F", c, m)] < seen[back]
                    if name == "zb":
                        assert seen[("I", c, m)] < seen[("W", c, m)]
        # cross-stage dependencies: the event simulation completes (raises on deadlock)
        _, _, bubble, peak = pp.simulate(name, P, M, V)
        if name == "gpipe":
            assert peak == [M] * P
        if name in ("1f1b", "zb"):
            assert max(peak) <= P
        if M >= P:  # the bubble of the unit-cost simulation is the textbook formula
            assert bubble == pytest.approx(pp.bubble_formula(name, P, M, V), abs=1e-12)
        checked += 1
    assert checked >= 4


def test_zero_bubble_beats_1f1b():
    assert pp.simulate("zb", 4, 8)[2] < pp.simulate("1f1b", 4, 8)[2] / 2


def test_split_balances_with_embeddings_and_head():
    # 4 equal layers, embeddings and head each worth 0.5 layer: 2 stages of 2 layers each
    assert pp.split_layers([1.0] * 4, 0.5, 0.5, 2) == [range(0, 2), range(2, 4)]
    # a heavy embedding pushes layers to the later stages
    assert pp.split_layers([1.0] * 4, 3.0, 0.0, 2) == [range(0, 1), range(1, 4)]
    assert pp.split_layers([1.0] * 4, 0.0, 0.0, 4) == [range(i, i + 1) for i in range(4)]


@pytest.fixture
def cfg(tmp_path):
    def _cfg(**kw):
        path = tmp_path / "cfg.json"
        path.write_text(json.dumps(dict(common.PRESETS["tiny"], **kw)))
        return path
    return _cfg


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", "zb"])
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_correctness(run, cfg, schedule, world):
    extra = ["--model", cfg(num_hidden_layers=8)] if (schedule == "interleaved"
                                                       and world == 4) else []
    r = run("pp.py", world, "--schedule", schedule, "--microbatches", "4", "--clip", "0.5",
            *extra)
    assert r.rc == 0 and r.last_line.startswith("PASS"), r
    res = r.json("correctness.json")[0]
    assert res["strategy"] == f"pp-{schedule}" and res["tensors"] == res["grads_compared"]


@pytest.mark.slow
def test_tied_embeddings_and_fewer_microbatches_than_stages(run, cfg):
    r = run("pp.py", 4, "--schedule", "1f1b", "--microbatches", "2",
            "--model", cfg(tie_word_embeddings=True))
    assert r.rc == 0 and r.last_line.startswith("PASS"), r
    assert r.json("correctness.json")[0]["tensors"] == 38


def test_learning(run):
    r = run("pp.py", 2, "--mode", "learning", "--steps", "40")
    assert r.rc == 0 and r.last_line.startswith("PASS"), r


def test_benchmark_comm_bubble_timeline(run):
    M, B, S, H = 4, 8, 64, 64
    r = run("pp.py", 2, "--mode", "benchmark", "--schedule", "1f1b", "--microbatches", M,
            "--warmup", "1", "--bench-iters", "2")
    assert r.rc == 0 and r.last_line.startswith("PASS"), r
    act = B // M * S * H * 4
    c = r.json("benchmark.json")["ours"]["comm"]
    assert c["isend|world"] == c["irecv|world"] == {"calls": M, "bytes": M * act}
    assert "formula 0.200" in r.stdout and "rank 1 |" in r.stdout


@pytest.mark.parametrize("args,world,msg", [
    (["--layers2"], 3, "2 decoder layers cannot fill 3 pipeline chunks"),
    (["--schedule", "interleaved", "--microbatches", "3", "--batch", "6"], 2,
     "interleaved 1F1B needs --microbatches (3) to be a multiple of the pipeline size 2"),
])
def test_bad_config(run, cfg, args, world, msg):
    if args == ["--layers2"]:
        args = ["--model", cfg(num_hidden_layers=2)]
    assert_config_error(run("pp.py", world, *args), msg)
