"""NCCL's rules, checked on CPU (harness/nccl.py, `--nccl-semantics`).

The checker on hand-written traces: every rule can fail. The pipeline's grid on every schedule
(pure: no process group): it passes, and the one-op-per-batch pattern it replaced deadlocks
where the issue said it would. Then real runs of every strategy with --nccl-semantics, in the
launches their own tests already pay for."""
import pytest

import pp
from conftest import Runs, config_file
from harness.nccl import check

W2 = ("0", (0, 1))          # communicators: (torch's group name, global ranks)
OTHER = ("1", (0, 1))


def slow(script, world, runs):
    """A batch of this file's runs, in the slow tier (conftest.Runs)."""
    return Runs(script, world, runs, tier="slow")


def p2p(comm, *ops, wait=True, i=0):
    """A trace entry: ops (is_send, peer, bytes, dtype, tag); waited right away or never."""
    return ["p2p", comm, f"test:{i}", None, list(ops)], wait


def coll(name, comm, key="8 B float32", wait=True):
    return [name, comm, "test", None, key], wait


def trace(*entries):
    out = []
    for i, (e, wait) in enumerate(entries):
        e[3] = i + 1 if wait else None
        out.append(e)
    return out


def S(peer, tag=0, n=8):
    return (True, peer, n, "float32", tag)


def R(peer, tag=0, n=8):
    return (False, peer, n, "float32", tag)


# ----------------------------------------------------------------------------------------------
# The checker: each rule passes the right pattern and fails the wrong one
# ----------------------------------------------------------------------------------------------
def test_a_send_and_receive_to_each_other_pass_in_one_batch_and_deadlock_apart():
    together = [trace(p2p(W2, S(1), R(1))), trace(p2p(W2, S(0), R(0)))]
    ok, line = check(together)
    assert ok and line.startswith("NCCL semantics: PASS (4 p2p ops in 2 batches"), line
    apart = [trace(p2p(W2, S(1)), p2p(W2, R(1))), trace(p2p(W2, S(0)), p2p(W2, R(0)))]
    ok, line = check(apart)
    assert not ok and "deadlock: rank 0 op #0 p2p[send 8 B to 1" in line, line
    assert line.count("waits for") >= 2, line      # the cycle, rank by rank


def test_tags_are_ignored_fifo_order_must_agree():
    # gloo pairs by tag, so this runs there; NCCL pairs the first send with the first receive
    sends = trace(p2p(W2, S(1, tag=1), S(1, tag=2)))
    recvs = trace(p2p(W2, R(0, tag=2), R(0, tag=1)))
    ok, line = check([sends, recvs])
    assert not ok and "tags are ignored" in line and "tag 1" in line and "tag 2" in line, line
    ok, _ = check([sends, trace(p2p(W2, R(0, tag=1), R(0, tag=2)))])
    assert ok


def test_sizes_must_agree_and_every_message_must_be_received():
    ok, line = check([trace(p2p(W2, S(1, n=8))), trace(p2p(W2, R(0, n=16)))])
    assert not ok and "size mismatch" in line, line
    ok, line = check([trace(p2p(W2, S(1)), p2p(W2, S(1))), trace(p2p(W2, R(0)))])
    assert not ok and "unmatched: rank 0 sends 2 message(s) to rank 1" in line, line


def test_collectives_must_run_in_one_order_per_communicator():
    a = trace(coll("all_reduce", W2), coll("broadcast", W2))
    ok, line = check([a, trace(coll("broadcast", W2), coll("all_reduce", W2))])
    assert not ok and "collective order" in line, line
    ok, line = check([a, trace(coll("all_reduce", W2, key="16 B float32"),
                               coll("broadcast", W2))])
    assert not ok and "collective order" in line and "16 B" in line, line
    ok, line = check([a, trace(coll("all_reduce", W2))])
    assert not ok and "rank 1 never joins #1 broadcast" in line, line
    ok, _ = check([a, trace(coll("all_reduce", W2), coll("broadcast", W2))])
    assert ok


def test_an_unwaited_send_does_not_block_another_communicator_a_waited_one_does():
    """Rank 0 sends, then joins a collective; rank 1 joins the collective, then receives. NCCL
    queues per communicator and the host does not block: fine unless the send is waited before
    the collective, or the collective shares the send's communicator (one FIFO queue)."""
    def run(wait, comm):
        r0 = trace(p2p(W2, S(1), wait=wait), coll("all_reduce", comm))
        r1 = trace(coll("all_reduce", comm), p2p(W2, R(0)))
        return check([r0, r1])
    assert run(wait=False, comm=OTHER)[0]
    ok, line = run(wait=True, comm=OTHER)
    assert not ok and "deadlock" in line and "not yet issued" in line, line
    ok, line = run(wait=False, comm=W2)
    assert not ok and "deadlock" in line, line


# ----------------------------------------------------------------------------------------------
# The pipeline's grid (pure)
# ----------------------------------------------------------------------------------------------
def grid_traces(name, P, M, V):
    """Every rank's p2p as pp.Pipeline.run posts it: one batch per grid step, waited lazily
    (before the receiving action; sends at the end of the step)."""
    g = pp.Grid(name, P, M, V)
    comm, C = ("0", tuple(range(P))), P * pp.chunks_per_rank(name, V)
    owner = lambda c: pp.chunk_owner(name, c, P)   # noqa: E731
    out = []
    for r in range(P):
        t = []
        for _, sends, recvs in g.steps[r]:
            ops = ([S(owner(d), (m * C + d) * 2 + b) for _, d, m, b in sends]
                   + [R(owner(s), (m * C + d) * 2 + b) for s, d, m, b in recvs])
            if ops:
                t.append(["p2p", comm, "grid", None, ops])
        out.append(t)
    return out


def unbatched_traces(name, P, M, V):
    """The executor before the grid: each receive posted alone right before its action (and
    waited), each send alone right after it (waited at the end of the step)."""
    C, comm = P * V, ("0", tuple(range(P)))
    out = []
    for r in range(P):
        t = []
        for kind, c, m in pp.schedule(name, P, M, V, r):
            recv, send = pp.messages(kind, c, m, C)
            if recv:
                t.append(["p2p", comm, "recv", len(t) + 1,
                          [R(recv[0] % P, (m * C + recv[1]) * 2 + recv[3])]])
            if send:
                t.append(["p2p", comm, "send", None,
                          [S(send[1] % P, (m * C + send[1]) * 2 + send[3])]])
        out.append(t)
    return out


CASES = [(name, P, M) for name in ("gpipe", "1f1b", "interleaved", "zb", "dualpipev")
         for P in (2, 3, 4)
         for M in ((P, 2 * P) if name == "interleaved" else
                   (2 * P, 2 * P + 1) if name == "dualpipev" else (P, 2 * P + 1))]


@pytest.mark.parametrize("name,P,M", CASES)
def test_every_schedule_on_the_grid_follows_nccl_rules(name, P, M):
    V = 2 if name == "interleaved" else 1
    C = P * pp.chunks_per_rank(name, V)
    g = pp.Grid(name, P, M, V)
    for r in range(P):   # every action once, in the schedule's order
        assert [a for a, _, _ in g.steps[r] if a] == pp.schedule(name, P, M, V, r)
    sent = {}
    for r in range(P):   # a message is received in the step it is sent, used only after it
        for t, (a, sends, recvs) in enumerate(g.steps[r]):
            for k in sends:
                sent[k] = t
    for r in range(P):
        for t, (a, _, recvs) in enumerate(g.steps[r]):
            assert all(sent[k] == t for k in recvs)
            recv, _ = pp.messages(*a, C) if a else (None, None)
            if recv and pp.chunk_owner(name, recv[0], P) == r:   # the V's turn: in memory
                assert name == "dualpipev" and recv[:2] in ((P - 1, P), (P, P - 1))
                continue
            assert recv is None or sent[recv] < t
    ok, line = check(grid_traces(name, P, M, V))
    assert ok, line


@pytest.mark.parametrize("name,P,M,V,stalls", [
    ("1f1b", 2, 4, 1, True), ("zb", 4, 8, 1, True), ("interleaved", 2, 4, 2, True),
    ("gpipe", 4, 8, 1, False)])
def test_one_op_per_batch_stalls_where_predicted(name, P, M, V, stalls):
    ok, line = check(unbatched_traces(name, P, M, V))
    assert ok != stalls and (not stalls or "deadlock" in line), line


# ----------------------------------------------------------------------------------------------
# Real runs with --nccl-semantics (each joins its script's launch at that world size)
# ----------------------------------------------------------------------------------------------
NCCL = ["--nccl-semantics", "--steps", "1"]
EIGHT = config_file("eight-layers", num_hidden_layers=8)   # interleaved: P x V chunks


def pp_runs(P):
    runs = {}
    for name, p, M in CASES:
        if p == P:
            extra = (["--model", EIGHT, "--virtual-stages", "2"] if name == "interleaved" else
                     ["--model", EIGHT] if name == "dualpipev" else [])
            runs[f"{name}-M{M}"] = [*NCCL, "--schedule", name, "--microbatches", M,
                                    "--batch", M * (8 // M or 1), *extra]
    return runs


RUNS = {   # every run in the slow tier: the checker replays each collective and p2p op
    "pp-2": slow("pp.py", 2, pp_runs(2)),
    "pp-3": slow("pp.py", 3, pp_runs(3)),
    "pp-4": slow("pp.py", 4, pp_runs(4)),
    "cp": slow("cp_ring.py", 2, {v: [*NCCL, "--variant", v]
                                 for v in ("zigzag", "ring", "allgather")}),
    "ep": slow("ep_moe.py", 2, {"ep": NCCL}),
    "ddp": slow("ddp.py", 2, {"ddp": [*NCCL, "--grad-accum", "2"]}),
    "zero": slow("zero.py", 2, {f"zero{s}": [*NCCL, "--stage", s, "--clip", "0.5"]
                                for s in ("1", "2", "3")}),
    "fsdp": slow("fsdp.py", 2, {"fsdp": [*NCCL, "--clip", "0.5"]}),
    "tp": slow("tp.py", 2, {"tp": NCCL}),
    "sp": slow("sp.py", 2, {v: [*NCCL, "--variant", v] for v in ("megatron", "ulysses")}),
}
CHECKS = [pytest.param(k, run, id=f"{b.script[:-3]}-W{b.nproc}-{run}")
          for k, b in RUNS.items() for run in b.runs]


@pytest.mark.slow
@pytest.mark.parametrize("batch,key", CHECKS)
def test_real_runs_pass_nccl_rules(runs, batch, key):
    r = runs(RUNS[batch], key)
    lines = [l for l in r.stdout.splitlines() if l.strip()]
    assert r.rc == 0 and lines[-1].startswith("NCCL semantics: PASS ("), r
    assert any(l.startswith("PASS ") for l in lines), r      # the correctness verdict too
    n_p2p = int(lines[-1].split("(")[1].split()[0])
    ring = batch.startswith("pp") or key in ("zigzag", "ring")   # allgather CP: collectives
    assert (n_p2p > 0) == ring, lines[-1]


# ----------------------------------------------------------------------------------------------
# bf16 mixed precision on CPU: every strategy at W=2 against the float64 reference, judged by
# its error against the single-device bf16 reference's (error-vs-error)
# ----------------------------------------------------------------------------------------------
BF16 = ["--dtype", "bfloat16"]
BF16_RUNS = {
    "ddp": slow("ddp.py", 2, {"bf16": BF16, "bf16-no-average": [*BF16, "--plant-bug",
                                                                "no-average"]}),
    "zero": slow("zero.py", 2, {f"bf16-zero{s}": [*BF16, "--stage", s] for s in "123"}),
    "fsdp": slow("fsdp.py", 2, {"bf16": BF16}),
    "tp": slow("tp.py", 2, {"bf16": BF16}),
    "sp": slow("sp.py", 2, {f"bf16-{v}": [*BF16, "--variant", v]
                            for v in ("megatron", "ulysses")}),
    "pp": slow("pp.py", 2, {f"bf16-{s}": [*BF16, "--schedule", s] for s in ("1f1b", "zb")}),
    "cp": slow("cp_ring.py", 2, {"bf16": BF16}),
    "ep": slow("ep_moe.py", 2, {"bf16": BF16}),
    "compose4d": slow("compose4d.py", 2, {"bf16-tp": [*BF16, "--tp", "2"],
                                          "bf16-pp": [*BF16, "--pp", "2"]}),
}


@pytest.mark.slow
@pytest.mark.parametrize("batch,key", [(b, k) for b, r in BF16_RUNS.items() for k in r.runs])
def test_bf16_correctness_on_cpu(runs, batch, key):
    r = runs(BF16_RUNS[batch], key)
    verdict = next(l for l in r.stdout.splitlines() if l.startswith(("PASS ", "FAIL ")))
    assert " W=2 bfloat16: 2 steps" in verdict, verdict
    if "no-average" in key:   # the check can fail in bf16: a 2x gradient is far above its noise
        assert r.rc != 0 and verdict.startswith("FAIL "), r
    else:
        assert r.rc == 0 and verdict.startswith("PASS "), r
        assert "(single-device bfloat16 vs float64" in verdict, verdict


# Gradient reductions of bf16 runs sum in fp32 by default (--reduce-dtype float32): the result
# is the exact sum rounded once to bf16 (0.5% of entries off by a double rounding at W=3); in
# bf16 (--reduce-dtype param) every step of the sum rounds (37% of entries off at W=3). The
# benchmark's formulas follow the reduce dtype's bytes (4 vs 2 per element).
BENCH_BF16 = [*BF16, "--mode", "benchmark", "--warmup", "1", "--bench-iters", "1"]
REDUCE = {
    "ddp": slow("ddp.py", 3, {rd: [*BENCH_BF16, "--reduce-dtype", rd, "--batch", "6"]
                              for rd in ("float32", "param")}),
    "zero": slow("zero.py", 2, {f"bench-bf16-{s}-{rd}": [*BENCH_BF16, "--stage", s,
                                                         "--reduce-dtype", rd]
                                for s in "123" for rd in ("float32", "param")}),
    "fsdp": slow("fsdp.py", 2, {"bench-bf16": BENCH_BF16}),
}


@pytest.mark.parametrize("rd", ["float32", "param"])
@pytest.mark.slow
def test_ddp_reduction_error_shown_in_bf16(runs, rd):
    r = runs(REDUCE["ddp"], rd)
    assert r.rc == 0 and "communication matches the formulas" in r.stdout, r
    line = next(l for l in r.stdout.splitlines() if l.startswith("gradient all-reduce in"))
    differ = float(line.split("(")[-1].split("%")[0]) / 100
    if rd == "float32":      # the fp32 sum rounded once: the rounded exact sum, but for ties
        assert line.startswith("gradient all-reduce in float32") and differ < 0.02, line
    else:                    # 3 bf16 terms (and bf16 pre-division by 3): rounding in the sum
        assert line.startswith("gradient all-reduce in bfloat16") and differ > 0.10, line


@pytest.mark.slow
@pytest.mark.parametrize("key", [k for r in (REDUCE["zero"], REDUCE["fsdp"]) for k in r.runs])
def test_zero_fsdp_bf16_benchmark_follows_the_reduce_dtype(runs, key):
    r = runs(REDUCE["fsdp" if key == "bench-bf16" else "zero"], key)
    assert r.rc == 0 and "communication matches the formulas" in r.stdout, r
    # The bytes themselves, from the model's size and not from the code's buffers (whose
    # element size would follow a reduce dtype the code ignored): tiny's 180,800 parameters,
    # every unit even (W=2 pads nothing), 4 bytes per element reduced in float32, 2 in bf16.
    e = 2 if key.endswith("-param") else 4
    comm = r.json("benchmark.json")["ours"]["comm"]
    assert comm["reduce_scatter_tensor|world"]["bytes"] == 180_800 * e, comm
