"""pp_schedule.py's schedules without processes (nor torch), then pp.py's pipeline under
torchrun on CPU."""
import copy
import subprocess
import sys
import types

import pytest

import harness
import pp_schedule
from conftest import ROOT, Runs, assert_config_error, config_file

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


NAMES = ["gpipe", "1f1b", "interleaved", "zb", "dualpipev"]


def valid(name, P, M, V):
    if name == "dualpipev":
        return V == 1 and M >= 2 * P
    if name != "interleaved":
        return V == 1
    return V > 1 and M % P == 0 and M >= P


def chunks(name, P, V):
    return P * pp_schedule.chunks_per_rank(name, V)


@pytest.mark.parametrize("name", NAMES)
def test_schedules(name):
    checked = 0
    for P, M, V in CASES + [(3, 6, 1), (4, 9, 1), (4, 16, 1)]:
        if not valid(name, P, M, V):
            continue
        C = chunks(name, P, V)
        for r in range(P):
            acts = pp_schedule.schedule(name, P, M, V, r)
            seen = {}
            for i, a in enumerate(acts):
                assert a not in seen, (name, P, M, V, r, a)
                seen[a] = i
            mine = [c for c in range(C) if pp_schedule.chunk_owner(name, c, P) == r]
            if name == "dualpipev":      # the V: chunks r and 2P-1-r
                assert mine == [r, 2 * P - 1 - r]
            for c in mine:
                for m in range(M):  # F before its backward on this stage, I before W
                    split = ("I", c, m) in seen
                    if name in ("zb", "dualpipev"):  # each backward whole (B) or as I then W
                        assert split == (("W", c, m) in seen) != (("B", c, m) in seen)
                    back = ("I", c, m) if split else ("B", c, m)
                    assert seen[("F", c, m)] < seen[back]
                    if split:
                        assert seen[("I", c, m)] < seen[("W", c, m)]
            # counts: every (chunk, micro-batch) once per kind, nothing else
            n = len(mine) * M
            assert sum(k == "F" for k, *_ in acts) == n
            assert sum(k in ("B", "I") for k, *_ in acts) == n
            if name not in ("zb", "dualpipev"):
                assert {k for k, *_ in acts} == {"F", "B"}
            elif name == "zb":
                assert {k for k, *_ in acts} == {"F", "I", "W"}
        # cross-stage dependencies: the event simulation completes (raises on deadlock)
        _, _, bubble, peak = pp_schedule.simulate(name, P, M, V)
        if name == "gpipe":
            assert peak == [M] * P
        if name in ("1f1b", "zb"):
            assert max(peak) <= P
        if name == "dualpipev":
            # DualPipe's table: activations of PP+1 = 2P+1 chunk micro-batches per rank (1F1B:
            # P micro-batches of a stage, 2P chunks' worth); the bubble (P-1)(F&B + B - 3W) is
            # that of F&B pairs started together; this executor starts each half as soon as its
            # input is there, which at unit costs halves it: (P-1) T_F idle per rank
            assert peak == [2 * P + 1] * P, peak
            paired = pp_schedule.simulate(name, P, M, V, paired=True)[2]
            assert paired == pytest.approx(pp_schedule.bubble_formula(name, P, M, V), abs=1e-12)
            assert bubble == pytest.approx((P - 1) / (6 * M + P - 1), abs=1e-12)
        elif M >= P:  # the bubble of the unit-cost simulation is the textbook formula
            assert bubble == pytest.approx(pp_schedule.bubble_formula(name, P, M, V), abs=1e-12)
        checked += 1
    assert checked >= 4


@pytest.mark.parametrize("cost", [dict(F=1, B=2, I=1, W=1), dict(F=2, B=3, I=2, W=1),
                                  dict(F=1, B=3, I=2, W=1), dict(F=3, B=4, I=2, W=2)])
def test_dualpipev_bubble_against_deepseeks_formula(cost):
    """DualPipe's (PP/2 - 1)(F&B + B - 3W) per rank (PP = 2P chunk stages, F&B = F + B when the
    pair is not overlapped): the paired simulation meets it where the formula's assumptions hold
    (T_F = T_I: the first two costs; elsewhere it is an estimate, e.g. one W per rank and stage
    off at F=3 I=W=2); starting each half as soon as it can (this executor) is never worse than
    the pairs."""
    for P, M in ((2, 4), (3, 6), (4, 8), (4, 12)):
        idle = {}
        for paired in (False, True):
            tl, T, _, _ = pp_schedule.simulate("dualpipev", P, M, cost=cost, paired=paired)
            per_rank = {T - sum(e - s for *_, s, e in tl[r]) for r in range(P)}
            assert len(per_rank) == 1         # every rank idles the same
            idle[paired] = per_rank.pop()
        paper = (P - 1) * ((cost["F"] + cost["B"]) + cost["B"] - 3 * cost["W"])
        if cost["F"] == cost["I"]:
            assert idle[True] == paper, (P, M, idle)
        assert idle[False] <= idle[True], (P, M, idle)


def test_dualpipev_against_1f1b_at_equal_depth():
    """Same P ranks and M micro-batches: DualPipeV's idle share is ZB-H1's formula with 2P half
    stages; 1F1B's is (P-1)/(M+P-1); ZB-H1's (P-1)/(3M+P-1)."""
    for P, M in ((2, 4), (4, 8), (4, 16)):
        v, one, zb = (pp_schedule.simulate(n, P, M)[2] for n in ("dualpipev", "1f1b", "zb"))
        assert v < zb < one


# ----------------------------------------------------------------------------------------------
# The independent oracle: torch.distributed.pipelining's own schedule IR. pp's (kind, chunk,
# micro-batch) actions are torch's _Action(stage, F/B/I/W, micro-batch) one to one (chunk c on
# rank c % P is torch's looped stage-to-rank mapping), so every schedule of pp's is expressible.
# ----------------------------------------------------------------------------------------------
def torch_order(name, P, M, V):
    """pp's compute schedule in torch's format: {rank: [_Action(stage, F|B|I|W, mb)]}."""
    return {r: [T._Action(c, T._ComputationType(k), m)
                for k, c, m in pp_schedule.schedule(name, P, M, V, r)] for r in range(P)}


def with_executor_comms(order, C, owner=None):
    """The point-to-point as pp's executor issues it: a blocking receive right before the action
    that consumes it, an asynchronous send right after the action that produced it (torch's
    simulator models exactly that: a send is ready once its compute ran, a receive once the
    peer's send was issued)."""
    out, owner = {}, owner or (lambda c: c % len(order))
    for r, acts in order.items():
        seq = []
        for a in acts:
            k, c, m = a.computation_type, a.stage_index, a.microbatch_index
            fwd, back = k == T.F, k in (T.B, T.I)
            up, down = c < C - 1 and owner(c + 1) != r, c > 0 and owner(c - 1) != r
            if fwd and down:        # (the V's turn, a neighbour on this rank: no message)
                seq.append(T._Action(c, T.RECV_F, m))
            if back and up:
                seq.append(T._Action(c, T.RECV_B, m))
            seq.append(a)
            if fwd and up:
                seq.append(T._Action(c, T.SEND_F, m))
            if back and down:
                seq.append(T._Action(c, T.SEND_B, m))
        out[r] = seq
    return out


@needs_torch_oracle
@pytest.mark.parametrize("name", NAMES)
def test_schedules_pass_torch_validator_and_comms_simulation(name):
    checked = 0
    for P, M, V in CASES:
        if not valid(name, P, M, V):
            continue
        C = chunks(name, P, V)
        stage_to_rank = (lambda s, P=P: pp_schedule.chunk_owner(name, s, P))
        order = torch_order(name, P, M, V)
        # every stage runs F, then B (or I then W), once per micro-batch, on one rank: c % P,
        # or the V
        assert T._validate_schedule(order, P, C, M) == {c: stage_to_rank(c) for c in range(C)}
        # torch's own lowering: sends and receives inserted by torch, then its dry run (raises
        # "Schedule is not progressing" on a deadlock)
        T._simulate_comms_compute(T._add_send_recv(copy.deepcopy(order), stage_to_rank, C),
                                  stage_to_rank, C)
        # the order in which pp's executor really posts them
        sim = T._simulate_comms_compute(with_executor_comms(order, C, stage_to_rank),
                                        stage_to_rank, C)
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
    elif name == "dualpipev":     # its F&B pairs are OVERLAP_F_B actions holding both halves
        ns = types.SimpleNamespace(pp_group_size=P, _n_microbatches=M)
        o = {r: [s for a in T.ScheduleDualPipeV._calculate_single_rank_operations(ns, r)
                 for s in (a.sub_actions if a.computation_type == T.OVERLAP_F_B else (a,))]
             for r in range(P)}
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
@pytest.mark.parametrize("name", NAMES)
def test_schedules_are_torchs_own(name):
    """Same actions in the same order per rank as torch's ScheduleGPipe, ZB1P (V = 1) without
    W, ScheduleInterleaved1F1B (Megatron's, M a multiple of P), ScheduleInterleavedZeroBubble
    (ZB1P; with V = 1 it is ZB-H1: W deferred by `rank` backwards) and ScheduleDualPipeV (from
    DeepSeek's code; its F&B pairs taken apart in order)."""
    if not all(hasattr(T, c) for c in ("ScheduleGPipe", "ScheduleInterleaved1F1B",
                                       "ScheduleInterleavedZeroBubble", "ScheduleDualPipeV")):
        pytest.skip("this torch lacks one of torch's schedule classes")
    checked = 0
    for P, M, V in CASES:
        if valid(name, P, M, V):
            assert torch_generated(name, P, M, V) == torch_order(name, P, M, V), (P, M, V)
            checked += 1
    assert checked >= 4


def test_zero_bubble_beats_1f1b():
    assert pp_schedule.simulate("zb", 4, 8)[2] < pp_schedule.simulate("1f1b", 4, 8)[2] / 2


def test_split_balances_with_embeddings_and_head():
    # 4 equal layers, embeddings and head each worth 0.5 layer: 2 stages of 2 layers each
    assert pp_schedule.split_layers([1.0] * 4, 0.5, 0.5, 2) == [range(0, 2), range(2, 4)]
    # a heavy embedding pushes layers to the later stages
    assert pp_schedule.split_layers([1.0] * 4, 3.0, 0.0, 2) == [range(0, 1), range(1, 4)]
    assert pp_schedule.split_layers([1.0] * 4, 0.0, 0.0, 4) == [range(i, i + 1) for i in range(4)]


def test_schedules_plan_without_torch():
    """pp_schedule is pure Python: it imports, simulates and lays out the grid with torch
    unimportable (the figures and the plan calculator need no torch.distributed)."""
    code = ("import sys; sys.modules['torch'] = None\n"
            "import pp_schedule as s\n"
            "s.Grid('dualpipev', 4, 8)\n"
            "print(s.simulate('1f1b', 4, 8)[2], s.split_layers([1.0] * 4, 0, 0, 2))")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert float(p.stdout.split()[0]) == pytest.approx(3 / 11, abs=1e-12), p.stdout


SCHEDULES = ["gpipe", "1f1b", "interleaved", "zb", "dualpipev"]
CORRECT = ["--microbatches", "4", "--clip", "0.5"]
W2 = Runs("pp.py", 2, {  # one launch per batch: the start-up paid once
    **{s: ["--schedule", s, *CORRECT] for s in SCHEDULES}})
SLOW_W2 = Runs("pp.py", 2, tier="slow", runs={
    "learning": ["--mode", "learning", "--steps", "40"],
    "bench-v": ["--mode", "benchmark", "--schedule", "dualpipev", "--microbatches", "4",
                "--warmup", "1", "--bench-iters", "2"],
    "bench": ["--mode", "benchmark", "--schedule", "1f1b", "--microbatches", "4",
              "--warmup", "1", "--bench-iters", "2"],
    # the baseline, torch.distributed.pipelining (--compare-native: ours, then torch's): 1F1B
    # in float64 with clipping; ZB-H1 (torch's ZB1P, split I/W) tied, in float32
    "native-1f1b": ["--compare-native", "--schedule", "1f1b", *CORRECT],
    "native-zb": ["--compare-native", "--schedule", "zb", *CORRECT, "--dtype", "float32",
                  "--model", "configs/tiny-tied.json"],
})
SLOW_W4 = Runs("pp.py", 4, tier="slow", runs={
    **{s: ["--schedule", s, *CORRECT] for s in SCHEDULES if s != "interleaved"},
    "interleaved": ["--schedule", "interleaved", *CORRECT,
                    "--model", config_file("layers8", num_hidden_layers=8)],
    # P = 4: 8 chunks, M >= 2P; tied (rank 0 holds both ends); NCCL's rules checked
    "dualpipev": ["--schedule", "dualpipev", "--microbatches", "8", "--clip", "0.5",
                  "--nccl-semantics",
                  "--model", config_file("layers8-tied", num_hidden_layers=8,
                                         tie_word_embeddings=True)],
    "tied-m2": ["--schedule", "1f1b", "--microbatches", "2",
                "--model", config_file("tied", tie_word_embeddings=True)],
})


SLOW_W3 = Runs("pp.py", 3, tier="slow", runs={   # an odd pipeline: 6 chunks, the turn on rank 2
    "dualpipev": ["--schedule", "dualpipev", "--microbatches", "6", "--batch", "6",
                  "--dtype", "float32",
                  "--model", config_file("layers6", num_hidden_layers=6)],
})


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("batch", [W2, pytest.param(SLOW_W4, marks=pytest.mark.slow)])
def test_correctness(runs, schedule, batch):
    r = runs(batch, schedule)
    nccl = schedule == "dualpipev" and batch is SLOW_W4     # its last line: the NCCL verdict
    assert r.rc == 0 and r.last_line.startswith("NCCL semantics: PASS" if nccl else "PASS"), r
    res = r.json("correctness.json")[0]
    assert res["strategy"] == f"pp-{schedule}" and res["tensors"] == res["grads_compared"]
    if nccl:
        assert res["tensors"] == 74 and "\nPASS pp-dualpipev W=4" in r.stdout, r


@pytest.mark.slow
def test_dualpipev_odd_pipeline(runs):
    r = runs(SLOW_W3, "dualpipev")
    assert r.rc == 0 and r.last_line.startswith("PASS"), r


@pytest.mark.slow
def test_tied_embeddings_and_fewer_microbatches_than_stages(runs):
    r = runs(SLOW_W4, "tied-m2")
    assert r.rc == 0 and r.last_line.startswith("PASS"), r
    assert r.json("correctness.json")[0]["tensors"] == 38


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "zb"])
def test_torch_pipelining_baseline(runs, schedule):
    """PyTorch's own schedule (Schedule1F1B; ScheduleInterleavedZeroBubble, ZB1P, with one
    stage per rank) on the same cut, micro-batches and loss scaling passes the same correctness
    check as ours: every gradient, parameter and loss against the float64 reference."""
    r = runs(SLOW_W2, f"native-{schedule}")
    assert r.rc == 0 and r.last_line.startswith("PASS torch-pp-" + schedule), r
    res = r.json("correctness.json")
    assert [x["strategy"] for x in res] == [f"pp-{schedule}", f"torch-pp-{schedule}"]
    n = 39 if schedule == "1f1b" else 38         # (tied: one tensor fewer)
    assert all(x["ok"] and x["tensors"] == x["grads_compared"] == n for x in res), res


@pytest.mark.slow
def test_learning(runs):
    r = runs(SLOW_W2, "learning")
    assert r.rc == 0 and r.last_line.startswith("PASS"), r


@pytest.mark.slow
def test_benchmark_comm_bubble_timeline(runs):
    M, B, S, H = 4, 8, 64, 64
    r = runs(SLOW_W2, "bench")
    assert r.rc == 0 and r.last_line.startswith("PASS"), r
    act = B // M * S * H * 4
    c = r.json("benchmark.json")["ours"]["comm"]
    assert c["isend|world"] == c["irecv|world"] == {"calls": M, "bytes": M * act}
    assert "formula 0.200" in r.stdout and "rank 1 |" in r.stdout


@pytest.mark.slow
def test_dualpipev_benchmark_comm_and_bubble(runs):
    """Rank 0 holds chunks 0 and 3 of 4: M activations out of chunk 0 and M gradients out of
    chunk 3 (rank 1's chunks 1 and 2 meet at the V's turn, in memory)."""
    M, B, S, H = 4, 8, 64, 64
    r = runs(SLOW_W2, "bench-v")
    assert r.rc == 0 and r.last_line.startswith("PASS"), r
    act = B // M * S * H * 4
    c = r.json("benchmark.json")["ours"]["comm"]
    assert c["isend|world"] == c["irecv|world"] == {"calls": 2 * M, "bytes": 2 * M * act}
    assert "tied" not in str(c)
    # (P-1)(F&B + B - 3W) / (2M(F + B) + that) = 2 / 26 at P = 2, M = 4; the executor's own 1 / 25
    assert "formula 0.077" in r.stdout and "simulated 0.040" in r.stdout, r.stdout
    assert "peak in-flight micro-batches per stage [5, 5]" in r.stdout

@pytest.mark.parametrize("args,world,msg", [
    (["--layers2"], 3, "2 decoder layers cannot fill 3 pipeline chunks"),
    (["--schedule", "interleaved", "--microbatches", "3", "--batch", "6"], 2,
     "interleaved 1F1B needs the micro-batches (3) to be a multiple of the pipeline size 2"),
    (["--schedule", "dualpipev", "--microbatches", "3", "--batch", "6"], 2,
     "DualPipeV needs the micro-batches (3) >= 2 x the pipeline size (4)"),
    (["--schedule", "dualpipev", "--microbatches", "6", "--batch", "6"], 3,
     "4 decoder layers cannot fill 6 pipeline chunks (3 stages x 2 chunks)"),
    (["--schedule", "1f1b", "--microbatches", "1", "--batch", "2", "--compare-native"], 2,
     "--compare-native: torch's Schedule1F1B needs --microbatches (1) >= the number of stages"),
])
def test_bad_config(run, tmp_path, args, world, msg):
    if args == ["--layers2"]:
        args = ["--model", config_file("layers2", num_hidden_layers=2)(tmp_path)]
    # (one process as rank 0: the check ends before any process group; ddp's test_bad_config_
    # torchrun covers the launcher's side)
    assert_config_error(run("pp.py", world, *args, as_rank0=True), msg, torchrun=False)


# ----------------------------------------------------------------------------------------------
# The split backward (ZB-H1, DualPipeV): I + W is one backward, not two
# ----------------------------------------------------------------------------------------------
def _split_backward_case(split: bool, count_flops=False):
    import gc
    import weakref
    import torch
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoModelForCausalLM

    import pp
    cfg = harness.load_config("tiny")
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").double()
    m.config.use_cache = False
    store = pp.WeightGradStore()
    linears = pp.defer_linears([m], store)
    deferred = {id(lin.weight) for lin in linears}
    small = [p for p in m.parameters() if id(p) not in deferred]
    ids = torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    refs, flops = [], 0
    for mb in range(2):                       # two micro-batches accumulate
        loss = m(input_ids=ids.roll(mb, 1), labels=ids.roll(mb, 1)).loss
        with FlopCounterMode(display=False) as fc:
            if split:
                store.key = (0, mb)
                torch.autograd.backward(loss, inputs=small)      # I
                store.key = None
                refs += [weakref.ref(t) for _, x, g in store.pending[(0, mb)] for t in (x, g)]
                store.flush((0, mb))                              # W
            else:
                loss.backward()
        if mb == 0:   # (the first: FlopCounterMode does not count the in-place addmm_ with
            flops = fc.get_total_flops()     # which W accumulates the second)
        del loss
    gc.collect()
    grads = {n: p.grad for n, p in m.named_parameters()}
    return grads, flops, refs


def test_split_backward_is_one_backward():
    """I + W gives the same gradients as B (two micro-batches accumulated, float64), in the same
    FLOPs (no second traversal), leaves plain leaf gradients (no graph), and frees every stashed
    input and output gradient after W."""
    ref, ref_flops, _ = _split_backward_case(False)
    got, flops, refs = _split_backward_case(True)
    assert set(got) == set(ref) and all(g is not None for g in got.values())
    for n in ref:
        assert (got[n] - ref[n]).abs().max().item() <= 1e-12 * max(1.0, ref[n].abs().max().item()), n
        assert got[n].grad_fn is None and not got[n].requires_grad, n
    assert flops == ref_flops, (flops, ref_flops)
    assert refs and all(r() is None for r in refs), sum(r() is not None for r in refs)


def test_the_docstrings_worked_1f1b_is_the_grids():
    """pp.py's docstring shows 1F1B at P=2, M=4 on the lockstep grid: the rows it prints are
    pp_schedule.Grid's."""
    import re
    import pp
    import pp_schedule
    rows = {int(r): cells.split() for r, cells in
            re.findall(r"^ +rank (\d) +((?:(?:[FB]\d|\.) +)+)", pp.__doc__, re.M)}
    grid = pp_schedule.Grid("1f1b", 2, 4, 1)
    want = {r: ["." if a is None else f"{a[0]}{a[2]}" for a, _, _ in grid.steps[r]]
            for r in range(2)}
    assert rows == want, (rows, want)
