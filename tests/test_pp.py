"""pp.py: schedules without processes, then the pipeline under torchrun on CPU."""
import copy
import json
import types

import pytest

import harness
import pp
from conftest import Runs, assert_config_error, config_file

try:   # torch's own pipeline-schedule IR, validator and comms simulator (private, torch >= 2.5)
    from torch.distributed.pipelining import schedules as T
    TORCH_ORACLE = all(hasattr(T, n) for n in (
        "_Action", "_ComputationType", "_validate_schedule", "_add_send_recv",
        "_simulate_comms_compute", "_format_pipeline_order"))
except ImportError:
    T, TORCH_ORACLE = None, False
needs_torch_oracle = pytest.mark.skipif(
    not TORCH_ORACLE, reason="this torch has no torch.distributed.pipelining.schedules."
    "_validate_schedule / _add_send_recv / _simulate_comms_compute to check pp's schedules with")

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


# ----------------------------------------------------------------------------------------------
# The independent oracle: torch.distributed.pipelining's own schedule IR. pp's (kind, chunk,
# micro-batch) actions are torch's _Action(stage, F/B/I/W, micro-batch) one to one (chunk c on
# rank c % P is torch's looped stage-to-rank mapping), so every schedule of pp's is expressible.
# ----------------------------------------------------------------------------------------------
def torch_order(name, P, M, V):
    """pp's compute schedule in torch's format: {rank: [_Action(stage, F|B|I|W, mb)]}."""
    return {r: [T._Action(c, T._ComputationType(k), m) for k, c, m in pp.schedule(name, P, M, V, r)]
            for r in range(P)}


def with_executor_comms(order, C):
    """The point-to-point as pp's executor issues it: a blocking receive right before the action
    that consumes it, an asynchronous send right after the action that produced it (torch's
    simulator models exactly that: a send is ready once its compute ran, a receive once the
    peer's send was issued)."""
    out = {}
    for r, acts in order.items():
        seq = []
        for a in acts:
            k, c, m = a.computation_type, a.stage_index, a.microbatch_index
            fwd, back = k == T.F, k in (T.B, T.I)
            if fwd and c > 0:
                seq.append(T._Action(c, T.RECV_F, m))
            if back and c < C - 1:
                seq.append(T._Action(c, T.RECV_B, m))
            seq.append(a)
            if fwd and c < C - 1:
                seq.append(T._Action(c, T.SEND_F, m))
            if back and c > 0:
                seq.append(T._Action(c, T.SEND_B, m))
        out[r] = seq
    return out


@needs_torch_oracle
@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved", "zb"])
def test_schedules_pass_torch_validator_and_comms_simulation(name):
    checked = 0
    for P, M, V in CASES:
        if not valid(name, P, M, V):
            continue
        C, stage_to_rank = P * V, (lambda s, P=P: s % P)
        order = torch_order(name, P, M, V)
        # every stage runs F, then B (or I then W), once per micro-batch, on one rank: c % P
        assert T._validate_schedule(order, P, C, M) == {c: c % P for c in range(C)}
        # torch's own lowering: sends and receives inserted by torch, then its dry run (raises
        # "Schedule is not progressing" on a deadlock)
        T._simulate_comms_compute(T._add_send_recv(copy.deepcopy(order), stage_to_rank, C),
                                  stage_to_rank, C)
        # the order in which pp's executor really posts them
        sim = T._simulate_comms_compute(with_executor_comms(order, C), stage_to_rank, C)
        assert all(sim[r] for r in range(P))
        checked += 1
    assert checked >= 4


@needs_torch_oracle
def test_torch_oracle_catches_a_deadlocking_schedule(capsys):
    """The oracle can fail: stage 0 waits for B(0) before it sends F(1), stage 1 waits for F(1)
    before it sends B(0)'s gradient."""
    A, F_, B_ = T._Action, T.F, T.B
    order = {0: [A(0, F_, 0), A(0, B_, 0), A(0, F_, 1), A(0, B_, 1)],
             1: [A(1, F_, 0), A(1, F_, 1), A(1, B_, 0), A(1, B_, 1)]}
    T._validate_schedule(order, 2, 2, 2)      # counts and per-stage order are fine ...
    with pytest.raises(ValueError, match="not progressing"):   # ... the communication is not
        T._simulate_comms_compute(with_executor_comms(order, 2), lambda s: s % 2, 2)
    with pytest.raises(AssertionError, match="without first running Forward"):
        T._validate_schedule({0: [A(0, B_, 0), A(0, F_, 0)]}, 1, 1, 1)


def torch_generated(name, P, M, V):
    """torch's own generator for the same schedule, compute actions only (its Nones are
    timing slots). Its 1F1B IR (Schedule1F1B._get_pipeline_order) cannot serve: in torch 2.13 it
    numbers the last rank's forwards from 1 and fails torch's own validator, so 1F1B is taken
    from ZB1P with one stage per rank, whose I's are 1F1B's B's once the W's are dropped."""
    if name == "gpipe":
        o = T.ScheduleGPipe._get_pipeline_order(
            types.SimpleNamespace(_num_stages=P, _n_microbatches=M))
    else:
        cls = T.ScheduleInterleaved1F1B if name == "interleaved" else \
            T.ScheduleInterleavedZeroBubble
        rounds = max(1, M // P)
        ns = types.SimpleNamespace(n_local_stages=V, pp_group_size=P, _n_microbatches=M,
                                   microbatches_per_round=M // rounds)
        o = {r: cls._calculate_single_rank_operations(ns, r) for r in range(P)}
    keep = (T.F, T.B, T.I, T.W)
    o = {r: [a for a in acts if a is not None and a.computation_type in keep]
         for r, acts in o.items()}
    if name == "1f1b":
        o = {r: [T._Action(a.stage_index, T.B if a.computation_type == T.I else T.F,
                           a.microbatch_index) for a in acts if a.computation_type != T.W]
             for r, acts in o.items()}
    return o


@needs_torch_oracle
@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved", "zb"])
def test_schedules_are_torchs_own(name):
    """Same actions in the same order per rank as torch's ScheduleGPipe, ZB1P (V = 1) without
    W, ScheduleInterleaved1F1B (Megatron's, M a multiple of P) and ScheduleInterleavedZeroBubble
    (ZB1P; with V = 1 it is ZB-H1: W deferred by `rank` backwards)."""
    if not all(hasattr(T, c) for c in ("ScheduleGPipe", "ScheduleInterleaved1F1B",
                                       "ScheduleInterleavedZeroBubble")):
        pytest.skip("this torch lacks one of torch's schedule classes")
    checked = 0
    for P, M, V in CASES:
        if valid(name, P, M, V):
            assert torch_generated(name, P, M, V) == torch_order(name, P, M, V), (P, M, V)
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


SCHEDULES = ["gpipe", "1f1b", "interleaved", "zb"]
CORRECT = ["--microbatches", "4", "--clip", "0.5"]
W2 = Runs("pp.py", 2, {  # one launch per batch: the start-up (~10 s a process) paid once
    **{s: ["--schedule", s, *CORRECT] for s in SCHEDULES},
    "learning": ["--mode", "learning", "--steps", "40"],
    "bench": ["--mode", "benchmark", "--schedule", "1f1b", "--microbatches", "4",
              "--warmup", "1", "--bench-iters", "2"],
})
SLOW_W4 = Runs("pp.py", 4, tier="slow", runs={
    **{s: ["--schedule", s, *CORRECT] for s in SCHEDULES if s != "interleaved"},
    "interleaved": ["--schedule", "interleaved", *CORRECT,
                    "--model", config_file("layers8", num_hidden_layers=8)],
    "tied-m2": ["--schedule", "1f1b", "--microbatches", "2",
                "--model", config_file("tied", tie_word_embeddings=True)],
})


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("batch", [W2, pytest.param(SLOW_W4, marks=pytest.mark.slow)])
def test_correctness(runs, schedule, batch):
    r = runs(batch, schedule)
    assert r.rc == 0 and r.last_line.startswith("PASS"), r
    res = r.json("correctness.json")[0]
    assert res["strategy"] == f"pp-{schedule}" and res["tensors"] == res["grads_compared"]


@pytest.mark.slow
def test_tied_embeddings_and_fewer_microbatches_than_stages(runs):
    r = runs(SLOW_W4, "tied-m2")
    assert r.rc == 0 and r.last_line.startswith("PASS"), r
    assert r.json("correctness.json")[0]["tensors"] == 38


def test_learning(runs):
    r = runs(W2, "learning")
    assert r.rc == 0 and r.last_line.startswith("PASS"), r


def test_benchmark_comm_bubble_timeline(runs):
    M, B, S, H = 4, 8, 64, 64
    r = runs(W2, "bench")
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
def test_bad_config(run, tmp_path, args, world, msg):
    if args == ["--layers2"]:
        args = ["--model", config_file("layers2", num_hidden_layers=2)(tmp_path)]
    assert_config_error(run("pp.py", world, *args), msg)
