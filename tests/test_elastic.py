"""trainer4d/elastic.py's batch planner: the rule, the memory model, infeasible counts, and the CLI."""
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, assert_config_error
from trainer4d import elastic

GiB = 2**30
BASE = dict(params=5e9, hidden=4096, layers=32, seq=4096, mem_bytes=80 * GiB, tolerance=0.10,
            max_micro_batch=8)


def test_memory_model_matches_the_stated_formulas():
    m = elastic.MemoryModel()
    psi, dp = 1e9, 8
    assert m.states(psi, 0, dp) == 14 * psi                     # 2 + 4 + 8 bytes per parameter
    assert m.states(psi, 1, dp) == 2 * psi + 4 * psi + 8 * psi / dp
    assert m.states(psi, 2, dp) == 2 * psi + 12 * psi / dp
    assert m.states(psi, 3, dp) == 14 * psi / dp
    assert m.states(psi, 0, dp, tp=2, pp=2) == 14 * psi / 4
    assert m.activations(2, 4096, 4096, 32) == 16 * 2 * 4096 * 4096 * 32 * 2


def test_keeps_the_global_batch_exactly_when_it_can_and_prefers_low_zero():
    p = elastic.plan_world(64, 512, **BASE)
    assert p.global_batch == 512 and p.delta == 0
    assert p.zero == 1                   # ZeRO-0 would need 70 GB of states + activations
    roomy = elastic.plan_world(64, 512, **dict(BASE, params=1e9))
    assert roomy.zero == 0 and roomy.global_batch == 512
    assert roomy.micro_batch * roomy.grad_accum * 64 == 512


def test_memory_forces_a_higher_zero_stage_and_smaller_micro_batch():
    tight = elastic.plan_world(8, 512, **dict(BASE, mem_bytes=30 * GiB))
    assert tight.feasible and tight.zero == 3 and tight.memory <= 30 * GiB
    assert tight.global_batch == 512


def test_infeasible_counts():
    # more data-parallel ranks than the tolerance allows: 800 GPUs, batch 512 +- 10%
    p = elastic.plan_world(800, 512, **BASE)
    assert not p.feasible and "within 10%" in p.why
    # a world that tp x pp does not divide
    q = elastic.plan_world(12, 512, **BASE, tp=8)
    assert not q.feasible and "multiple of tp pp cp" in q.why
    # nothing fits in memory
    r = elastic.plan_world(8, 512, **dict(BASE, mem_bytes=1 * GiB))
    assert not r.feasible


def test_tolerance_band_and_minimal_deviation():
    p = elastic.plan_world(24, 512, **BASE)       # 512 / 24 is not an integer
    assert p.feasible and abs(p.global_batch - 512) <= 0.1 * 512
    best = min(abs(24 * b * a - 512) for b in range(1, 9) for a in range(1, 40))
    assert abs(p.global_batch - 512) == best


def test_plan_command_prints_the_table():
    r = subprocess.run([sys.executable, "compose4d.py", "plan", "--params", "5e9", "--hidden",
                        "4096", "--layers", "32", "--seq", "4096", "--world", "64",
                        "--micro-batch", "2", "--grad-accum", "4", "--zero", "0", "--nodes",
                        "1:100", "--gpus-per-node", "8", "--mem-gib", "80", "--tolerance", "0.1",
                        "--max-micro-batch", "8"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("target global batch 512")
    rows = [l.split() for l in lines[2:]]
    assert len(rows) == 100
    assert rows[0][:6] == ["1", "8", "1", "2", "32", "512"]
    assert rows[99][2] == "-"                     # 800 GPUs cannot keep 512 within 10%


@pytest.mark.parametrize("bad", [["--world", "6", "--tp", "4"]])
def test_plan_rejects_a_world_that_tp_does_not_divide(bad):
    r = subprocess.run([sys.executable, "compose4d.py", "plan", "--params", "1e9", "--hidden",
                        "1024", "--layers", "8", "--seq", "1024", "--micro-batch", "1",
                        "--grad-accum", "1", *bad], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2 and r.stderr.strip().startswith("error: --world 6"), r.stderr


# ----------------------------------------------------------------------------------------------
# compose4d.py --mode train: SIGTERM, mid-step checkpoints, restarts on other world sizes
# ----------------------------------------------------------------------------------------------
TRAIN = ["--mode", "train", "--dtype", "float64", "--steps", "6", "--lr-schedule", "cosine",
         "--lr-warmup", "2", "--log-every", "1", "--batch", "8", "--elastic",
         "--max-micro-batch", "1"]


def _losses(r):
    return dict((s, l) for s, l in r.json("train.json")["losses"])


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The reference curve: 6 steps at W=4 without interruption (float64: the same for every
    layout to ~1e-15, so both restart tests compare against it)."""
    from conftest import launch
    out = tmp_path_factory.mktemp("full")
    r = launch("compose4d.py", 4, *TRAIN, out=out, timeout=600)
    assert r.rc == 0, r
    return _losses(r)


def _trainer(tmp_path, ck, layout=()):
    from conftest import launch

    def train(nproc, name, *extra):
        out = tmp_path / name
        r = launch("compose4d.py", nproc, *TRAIN, *layout, "--save", str(ck), *extra, out=out,
                   timeout=600)
        return r, _losses(r)
    return train


@pytest.mark.slow
def test_sigterm_mid_step_restarts_at_2_then_4_equal_uninterrupted(tmp_path, uninterrupted):
    ck = tmp_path / "ck"
    train = _trainer(tmp_path, ck)
    full = uninterrupted
    # W=4 (dp 4, micro-batch 1, accum 2): SIGTERM from the launcher after micro-batch 0 of step 1,
    # cut there (--preempt-at micro-batch; the default finishes the step, see below)
    r1, l1 = train(4, "a", "--test-sigterm-at", "1:0", "--preempt-at", "micro-batch")
    assert "SIGTERM: saved" in r1.stdout and "after 4 of 8 sequences of step 1" in r1.stdout, r1
    assert "s after the signal (grace 30 s)" in r1.stdout, r1
    assert "past --grace-s" not in r1.stdout, r1
    assert (ck / "latest").read_text() == "step-1"
    meta = json.loads((ck / "step-1" / "meta.json").read_text())
    assert meta["cut"]["rows_done"] == [0, 2, 4, 6] and meta["layout"]["dp"] == 4
    assert sorted(l1) == [0]
    # restart on 2 ranks: re-planned to accum 4, finishes step 1 from the saved gradients; cut again
    r2, l2 = train(2, "b", "--resume", str(ck), "--test-sigterm-at", "3:1",
                   "--preempt-at", "micro-batch")
    assert "micro 1 accum 4 restarts 1" in r2.stdout and "step 3" in r2.stdout, r2
    # and back on 4
    r3, l3 = train(4, "c", "--resume", str(ck))
    assert "accum 2 restarts 2" in r3.stdout, r3
    got = {**l1, **l2, **l3}
    assert sorted(got) == list(range(6))
    for s in range(6):
        assert abs(got[s] - full[s]) <= 1e-9 * full[s], (s, got[s], full[s])


@pytest.mark.slow
def test_crash_during_save_keeps_the_last_good_checkpoint(tmp_path):
    from conftest import launch
    ck = tmp_path / "ck"
    base = ["--mode", "train", "--steps", "4", "--save", str(ck)]
    r = launch("compose4d.py", 2, *base, "--stop-at", "2", out=tmp_path / "a", fork=True)
    assert r.rc == 0 and (ck / "latest").read_text() == "step-2", r
    r = launch("compose4d.py", 2, *base, "--resume", str(ck), "--test-crash-in-save",
               out=tmp_path / "b", fork=True)
    assert r.rc != 0                                  # died inside the step-4 save
    assert (ck / ".tmp-step-4").is_dir() and not (ck / "step-4").exists()
    assert (ck / "latest").read_text() == "step-2"
    from trainer4d import checkpoint
    meta, tensors = checkpoint.load_checkpoint(str(ck))
    assert meta["step"] == 2 and len(tensors["param"]) == 39
    # and a restart resumes from it
    r = launch("compose4d.py", 2, *base, "--resume", str(ck), out=tmp_path / "c", fork=True)
    assert r.rc == 0 and "resumed from" in r.stdout and "at step 2" in r.stdout, r
    assert (ck / "latest").read_text() == "step-4"


def _torchrun(nproc, args, out, *launcher):
    """compose4d.py under torchrun with extra launcher flags (--max-restarts); (the finished
    process, the time it ended). The launcher does not share its rendezvous store with the
    workers: with it shared, a restarted gloo group reads its previous attempt's addresses
    (pytorch/pytorch#135712; docs/training.md)."""
    import time
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", *launcher, os.path.join(ROOT, "compose4d.py"), *args,
           "--timeout", "60", "--out", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT,
                       env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
                                TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"))
    return p, time.time()


@pytest.mark.heavy   # (make test's budget)
def test_sigkill_mid_step_ends_the_job_and_a_restart_resumes_exactly(tmp_path):
    """A worker killed with SIGKILL in the middle of a step: the job ends (no hang) and no
    survivor writes a checkpoint or moves `latest`; `torchrun --max-restarts=1` with --resume
    (killed again on its first attempt) completes the run with the uninterrupted losses, bit
    for bit (float64, the same layout)."""
    import re
    ck = tmp_path / "ck"
    base = ["--mode", "train", "--dtype", "float64", "--steps", "5", "--log-every", "1",
            "--dp", "2", "--grad-accum", "2", "--batch", "4", "--save-every", "1"]
    p, _ = _torchrun(2, base, tmp_path / "full")
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    full = dict((s, l) for s, l in json.loads((tmp_path / "full" / "train.json").read_text())
                ["losses"])
    # killed before micro-batch 1 of step 2: checkpoints step-1 and step-2 exist, nothing after
    p, end = _torchrun(2, [*base, "--save", str(ck), "--test-sigkill-at", "2:1"], tmp_path / "a")
    assert p.returncode != 0 and "test hook: SIGKILL at" in p.stdout, p.stdout + p.stderr[-3000:]
    killed = float(re.search(r"SIGKILL at ([\d.]+)", p.stdout).group(1))
    assert end - killed < 60, end - killed            # within the process-group timeout
    assert (ck / "latest").read_text() == "step-2"
    assert sorted(os.listdir(ck)) == ["latest", "step-1", "step-2"], os.listdir(ck)
    # one launch, two attempts: killed at step 3, restarted by torchrun, resumed, completed
    p, _ = _torchrun(2, [*base, "--save", str(ck), "--resume", str(ck), "--test-sigkill-at",
                         "3:1"], tmp_path / "b", "--max-restarts=1")
    assert p.returncode == 0 and "test hook: SIGKILL at" in p.stdout, p.stdout + p.stderr[-3000:]
    assert "at step 3" in p.stdout, p.stdout                   # the second attempt's resume
    got = dict((s, l) for s, l in json.loads((tmp_path / "b" / "train.json").read_text())
               ["losses"])
    assert sorted(got) == [3, 4] and all(got[s] == full[s] for s in got), (got, full)
    assert (ck / "latest").read_text() == "step-5"


def test_infeasible_world_ends_with_one_line():
    # 3 data-parallel ranks cannot hold a global batch of 8 exactly (tolerance 0)
    from conftest import launch
    r = launch("compose4d.py", 3, "--mode", "train", "--elastic", "--batch", "8",
               "--batch-tolerance", "0", "--steps", "1", as_rank0=True)
    assert_config_error(r, "--elastic: no (zero, micro-batch, grad-accum) keeps the global batch",
                        torchrun=False)


@pytest.mark.heavy   # (make test's budget)
def test_sigterm_inside_a_pipeline_step_drains_and_resumes_exactly(tmp_path, uninterrupted):
    """pp=2 fixed, dp 2 -> 1: the cut drains the micro-batches already in the pipeline."""
    ck = tmp_path / "ck"
    train = _trainer(tmp_path, ck, ["--pp", "2"])
    full = uninterrupted
    r1, l1 = train(4, "a", "--test-sigterm-at", "2:0", "--nccl-semantics",
                   "--preempt-at", "micro-batch")
    assert "after 2 of 8 sequences of step 2" in r1.stdout, r1
    # the drain's agreement at the grid's cut: no cycle of waits under NCCL's rules
    assert r1.last_line.startswith("NCCL semantics: PASS ("), r1
    r2, l2 = train(2, "b", "--resume", str(ck))
    assert "accum 8 restarts 1" in r2.stdout and "at step 2" in r2.stdout, r2
    got = {**l1, **l2}
    assert sorted(got) == list(range(6))
    for s in range(6):
        assert abs(got[s] - full[s]) <= 1e-9 * full[s], (s, got[s], full[s])


@pytest.mark.slow
def test_sigterm_mid_step_by_default_finishes_the_step_and_resumes_exactly(tmp_path,
                                                                          uninterrupted):
    """The default (--preempt-at step), pp 2 x dp 2: SIGTERM after micro-batch 0 of step 2; no
    rank asks about it until the step's loss all-reduce, so step 2 runs to its end and is saved
    there (no cut); resumed on 2 ranks, the curve equals the uninterrupted run."""
    ck = tmp_path / "ck"
    train = _trainer(tmp_path, ck, ["--pp", "2"])
    full = uninterrupted
    # --grace-s: a save that ends past it after the signal is warned about
    r1, l1 = train(4, "a", "--test-sigterm-at", "2:0", "--nccl-semantics", "--grace-s", "0.001")
    assert "SIGTERM: saved" in r1.stdout and "step-3 at the end of step 2" in r1.stdout, r1
    assert "past --grace-s 0.001" in r1.stdout, r1
    assert (ck / "latest").read_text() == "step-3"
    meta = json.loads((ck / "step-3" / "meta.json").read_text())
    assert "cut" not in meta and meta["samples"] == 24 and meta["layout"]["dp"] == 2
    assert sorted(l1) == [0, 1, 2]
    assert r1.last_line.startswith("NCCL semantics: PASS ("), r1
    r2, l2 = train(2, "b", "--resume", str(ck))
    assert "at step 3" in r2.stdout and "restarts 1" in r2.stdout, r2
    got = {**l1, **l2}
    assert sorted(got) == list(range(6))
    for s in range(6):
        assert abs(got[s] - full[s]) <= 1e-9 * full[s], (s, got[s], full[s])


@pytest.mark.slow
def test_save_costs_no_collective_or_host_read_per_micro_batch(tmp_path):
    """The preemption check of --save, counted (tests/count_calls.py wraps every
    torch.distributed call and Tensor.item/tolist, per step): pp 2, M = 4 micro-batches, with
    and without --save. The default rides in the loss all-reduce: at most one extra small
    collective per step (none, in fact) and not one extra host read. --preempt-at micro-batch
    is the control that shows the counter sees the agreement: one all-reduce and one read before
    each micro-batch after the first (M - 1 per step)."""
    from conftest import launch
    M, steps = 4, 5
    base = ["--mode", "train", "--pp", "2", "--grad-accum", str(M), "--batch", "8",
            "--steps", str(steps), "--log-every", "100"]

    def calls(name, *extra):
        out = tmp_path / name
        r = launch("tests/count_calls.py", 2, *base, *extra, out=out)
        assert r.rc == 0, r
        return [json.loads((out / f"calls-rank{k}.json").read_text()) for k in range(2)]

    plain = calls("plain")
    saved = calls("save", "--save", tmp_path / "ck")
    per_mb = calls("mb", "--save", tmp_path / "ck2", "--preempt-at", "micro-batch")
    for rank in range(2):
        assert len(plain[rank]) == steps
        for s in range(1, steps):         # whole windows: the end of step s - 1 to that of s
            p, q, m = plain[rank][s], saved[rank][s], per_mb[rank][s]
            extra = {k: q.get(k, 0) - p.get(k, 0) for k in set(p) | set(q)}
            coll = sum(v for k, v in extra.items() if not k.startswith("host:"))
            reads = sum(v for k, v in extra.items() if k.startswith("host:"))
            assert 0 <= coll <= 1 and reads == 0, (rank, s, p, q)
            assert m.get("all_reduce", 0) - p.get("all_reduce", 0) == M - 1, (rank, s, p, m)
            assert m.get("host:item", 0) - p.get("host:item", 0) == M - 1, (rank, s, p, m)
