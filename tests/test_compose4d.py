"""compose4d.py: the rank grid, correctness of the composition against the single-device
reference (2x2x2 and every pair of dimensions), learning, benchmark communication, resume across
layouts (exact in float64), the HF export round trip, and bad layouts."""
import json
import os

import pytest
import torch

import compose4d
import harness
import harness.flops
import rig.compose4d
from conftest import Runs, assert_config_error, config_file
from trainer4d import checkpoint
from trainer4d.schedule import torch_schedule

N_TENSORS = 2 + 4 * 9 + 1      # tiny: embed + head + 4 layers x 9 + final norm


def test_rank_grid_arithmetic():
    g = compose4d.Grid(16, T=2, P=2, C=2)      # dp = 2
    assert g.size == dict(tp=2, cp=2, dp=2, pp=2)
    # rank = tp + 2 (cp + 2 (dp + 2 pp)): TP innermost, PP outermost
    assert g.coords(0) == dict(tp=0, cp=0, dp=0, pp=0)
    assert g.coords(1) == dict(tp=1, cp=0, dp=0, pp=0)
    assert g.coords(2) == dict(tp=0, cp=1, dp=0, pp=0)
    assert g.coords(4) == dict(tp=0, cp=0, dp=1, pp=0)
    assert g.coords(8) == dict(tp=0, cp=0, dp=0, pp=1)
    assert all(g.rank_of(g.coords(r)) == r for r in range(16))
    assert g.groups_over(("tp",))[0] == [0, 1]
    assert g.groups_over(("pp",))[0] == [0, 8]
    assert g.groups_over(("dp", "cp"))[0] == [0, 2, 4, 6]
    assert sorted(sum(g.groups_over(("dp",)), [])) == list(range(16))
    f = compose4d.Grid(16, T=2, P=2, C=2, pipeline_first=True)   # PP inside DP
    assert f.coords(4) == dict(tp=0, cp=0, dp=0, pp=1) and f.coords(8)["dp"] == 1


def test_lr_schedule_warmup_then_cosine():
    a = type("A", (), dict(lr=1.0, lr_warmup=4, lr_schedule="cosine", steps=14,
                           lr_min_ratio=0.1))
    lrs = [compose4d.lr_at(s, a) for s in range(15)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0] and lrs[4] == 1.0
    assert all(x > y for x, y in zip(lrs[4:14], lrs[5:15]))
    assert lrs[14] == pytest.approx(0.1)


@pytest.mark.parametrize("schedule", ["constant", "cosine"])
def test_lr_schedule_matches_torch_schedulers(schedule):
    """lr_at (what the strategy runs) against the reference's oracle, torch.optim.lr_scheduler
    (LinearLR warm-up, then CosineAnnealingLR, through SequentialLR), stepped once per step."""
    for warmup in range(4):
        for steps in range(1, 8):
            a = type("A", (), dict(lr=1e-3, lr_warmup=warmup, lr_schedule=schedule, steps=steps,
                                   lr_min_ratio=0.1))
            p = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
            opt = torch.optim.AdamW([p], lr=a.lr)
            sched = torch_schedule(opt, a)
            got = []
            for _ in range(steps):
                got.append(opt.param_groups[0]["lr"])
                opt.step()
                if sched is not None:
                    sched.step()
            want = [compose4d.lr_at(k, a) for k in range(steps)]
            assert got == pytest.approx(want, rel=1e-12, abs=0), (warmup, steps, got, want)


def test_lr_plant_runs_where_the_schedule_moves():
    """The configuration that must catch "lr-one-step-ahead" has a learning rate that changes
    from step to step: under a constant one the plant would be invisible."""
    import argparse
    plant = rig.compose4d.Compose4D.plants["lr-one-step-ahead"]
    p = argparse.ArgumentParser()
    rig.compose4d.Compose4D.add_args(p)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3)
    a, _ = p.parse_known_args(list(plant.args))
    lrs = [compose4d.lr_at(k, a) for k in range(a.steps + 1)]
    assert any(lrs[k] != lrs[k + 1] for k in range(a.steps)), (plant.args, lrs)


def test_model_flops_formula():
    cfg = harness.load_config("tiny")       # h 64, kv 32, I 128, L 4, V 256
    per_token = 6 * (4 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128) + 256 * 64) + 12 * 4 * 64 * 64
    assert harness.flops.model_flops(cfg, 512, 64) == 512 * per_token == 603_979_776


def assert_pass(r, world):
    """PASS under the harness's noise policy: every tensor, the loss (and the pre-clip norm)
    within tolerance of the float64 reference, the noise actually measured (not zero)."""
    assert r.rc == 0 and r.last_line.startswith("PASS"), r
    res = r.json("correctness.json")[0]
    assert res["world"] == world and res["tensors"] == N_TENSORS, res
    assert res["grads_compared"] == res["params_compared"] == N_TENSORS
    assert res["ok"] and not res["problems"] and res["worst_ratio"] <= 1.0, res
    assert res["max_grad_noise"] > 0 and res["max_param_noise"] > 0, res
    assert all(c["ok"] for c in res["checks"]), res
    return res


@pytest.mark.slow   # 8 processes on 2 cores: not in `make quick`
def test_correctness_2x2x2_eight_processes(run):
    """Also under NCCL's rules (--nccl-semantics): pp's grid, cp's ring and the tp/sp/dp
    collectives, interleaved on eight ranks, with no cycle of waits and one collective order.
    (A 300 s process-group timeout: eight ranks share two cores, where 60 s can run out.)"""
    r = run("compose4d.py", 8, "--tp", "2", "--pp", "2", "--cp", "2", "--sp", "--grad-accum", "2",
            "--clip", "0.5", "--nccl-semantics", timeout=900, pg_timeout=300)
    assert r.last_line.startswith("NCCL semantics: PASS (") and " on 8 ranks" in r.last_line, r
    r.stdout = r.stdout[:r.stdout.rindex("NCCL semantics:")]
    assert_pass(r, 8)
    assert "'tp': 2, 'cp': 2, 'dp': 1, 'pp': 2" in r.stdout


PAIRS = {
    "dp-tp": ["--dp", "2", "--tp", "2", "--sp", "--zero", "2"],                       # (+SP)
    "dp-pp": ["--dp", "2", "--pp", "2", "--schedule", "interleaved", "--grad-accum", "2"],
    "dp-cp": ["--dp", "2", "--cp", "2", "--zero", "2", "--grad-accum", "2"],
    "tp-pp": ["--tp", "2", "--pp", "2", "--pipeline-first", "--lr-schedule", "cosine",
              "--lr-warmup", "1", "--steps", "3"],
    "tp-cp": ["--tp", "2", "--cp", "2", "--sp"],
    "pp-cp": ["--pp", "2", "--cp", "2", "--clip", "0.3"],
}
TRAIN = ["--mode", "train", "--dtype", "float64", "--steps", "6", "--lr-schedule", "cosine",
         "--lr-warmup", "2", "--log-every", "1"]


def ck(base):
    return os.path.join(base, "ck")


def hf(base):
    return os.path.join(base, "hf")


def ck_keep(base):
    return os.path.join(base, "ck-keep")


# One launch per batch: the start-up paid once. Runs go in order, so a
# resumed run follows the run that saved its checkpoint.
W2 = Runs("compose4d.py", 2, {
    "saved": [*TRAIN, "--pp", "2", "--stop-at", "2", "--save-every", "1", "--save", ck],
    "kept": [*TRAIN, "--pp", "2", "--steps", "4", "--save-every", "1", "--keep", "2", "--save",
             ck_keep],
})
W4 = Runs("compose4d.py", 4, {"dp-tp": PAIRS["dp-tp"]})
SLOW_W4 = Runs("compose4d.py", 4, tier="slow", runs={
    **{k: v for k, v in PAIRS.items() if k != "dp-tp"},
    "bench-tp-pp": ["--tp", "2", "--pp", "2", "--grad-accum", "2", "--mode", "benchmark",
                    "--bench-iters", "2", "--warmup", "1"],
    "bench-sp-cp": ["--tp", "2", "--cp", "2", "--sp", "--grad-accum", "2", "--mode",
                    "benchmark", "--bench-iters", "1", "--warmup", "1"],
    # T = 4 does not divide the vocabulary (250): padded rows, exactly zero gradient
    "tp4-padded": ["--tp", "4", "--sp", "--model", "configs/tiny-gqa8.json"],
    # resume across layouts: uninterrupted, stopped at 3 on tp x pp, resumed on dp x cp
    "full": [*TRAIN, "--tp", "2", "--pp", "2"],
    "first": [*TRAIN, "--tp", "2", "--pp", "2", "--stop-at", "3", "--save", ck],
    "second": [*TRAIN, "--dp", "2", "--cp", "2", "--resume", ck, "--save", ck, "--export-hf", hf],
})
# bf16 resume on the same layout: fp32 masters and AdamW moments restored in their own dtype
BF16 = ["--mode", "train", "--dtype", "bfloat16", "--steps", "8", "--log-every", "1",
        "--dp", "2", "--lr-schedule", "cosine", "--lr-warmup", "2"]


def ck16(base):
    return os.path.join(base, "ck16")


HEAVY_W2 = Runs("compose4d.py", 2, tier="heavy", runs={   # (heavy: make test's budget)
    "learning": ["--pp", "2", "--mode", "learning", "--steps", "40", "--lr", "1e-2",
                 "--log-every", "20", "--grad-accum", "2"]})
SLOW_W2 = Runs("compose4d.py", 2, tier="slow", runs={
    "bf16-full": BF16,
    "bf16-first": [*BF16, "--stop-at", "4", "--save", ck16],
    "bf16-second": [*BF16, "--resume", ck16, "--save", ck16],
})
# 5 layers over 3 stages, tied embeddings (a copy on the last stage), vocabulary 250
SLOW_W3 = Runs("compose4d.py", 3, tier="slow", runs={"uneven-tied": [
    "--pp", "3", "--grad-accum", "3", "--batch", "6", "--model",
    config_file("tied5", vocab_size=250, num_hidden_layers=5, tie_word_embeddings=True)]})


@pytest.mark.parametrize("batch,pair", [(W4, "dp-tp"), *[
    pytest.param(SLOW_W4, p, marks=pytest.mark.slow) for p in PAIRS if p != "dp-tp"]])
def test_correctness_each_pair_at_four(runs, batch, pair):
    assert_pass(runs(batch, pair), 4)


@pytest.mark.slow
def test_correctness_uneven_tied_and_padded(runs):
    r = runs(SLOW_W3, "uneven-tied")
    assert r.rc == 0 and r.last_line.startswith("PASS"), r
    r = runs(SLOW_W4, "tp4-padded")
    assert r.rc == 0 and r.last_line.startswith("PASS"), r


@pytest.mark.heavy
def test_learning(runs):
    r = runs(HEAVY_W2, "learning")
    assert r.rc == 0 and r.last_line.startswith("PASS"), r


@pytest.mark.slow
def test_benchmark_comm_per_group(runs):
    r = runs(SLOW_W4, "bench-tp-pp")
    assert r.rc == 0 and r.last_line.startswith("PASS"), r
    b = r.json("benchmark.json")
    assert b["comm_ok"]
    comm = b["ours"]["comm"]
    # rank 0 = first stage, tp rank 0: B=8, S=64, H=64, fp32, M=2, 2 of the 4 layers
    nhb_mb = 4 * 64 * 64 * 4
    assert comm["all_reduce|tp"]["calls"] == 2 * (1 + 4 * 2)            # embedding + 2f2g/layer
    assert comm["all_reduce|tp"]["bytes"] == 2 * (1 + 4 * 2) * nhb_mb
    assert comm["isend|pp"]["calls"] == 2 and comm["isend|pp"]["bytes"] == 2 * nhb_mb
    assert (comm["all_reduce|world"]["calls"], comm["all_reduce|world"]["bytes"]) == (1, 8)
    # ZeRO-1 over dp x cp, a group of one here: nothing to reduce-scatter or gather (the shards
    # are the buffers themselves), where it once made one of each per unit of the stage
    assert not [k for k in comm if k.endswith("|dpcp")], comm


@pytest.mark.slow
def test_benchmark_sp_with_cp_comm(runs):
    r = runs(SLOW_W4, "bench-sp-cp")
    assert r.rc == 0 and r.last_line.startswith("PASS"), r
    comm = r.json("benchmark.json")["ours"]["comm"]
    # SP on one stage holding all 4 layers and the head: M (6L + 2 + 1) all-gathers
    assert comm["all_gather_into_tensor|tp"]["calls"] == 2 * (6 * 4 + 3)
    assert comm["isend|cp"]["calls"] == 2 * 4 * (3 * 1 + 1)      # M L (3(C-1) + 1)


def _train(runs, batch, key):
    r = runs(batch, key)
    assert r.rc == 0, r
    return dict((s, l) for s, l in r.json("train.json")["losses"]), r


@pytest.mark.slow
def test_resume_across_layouts_is_exact_and_export_round_trips(runs):
    full, _ = _train(runs, SLOW_W4, "full")                   # uninterrupted
    first, r1 = _train(runs, SLOW_W4, "first")
    assert sorted(first) == [0, 1, 2] and "saved" in r1.stdout
    second, r2 = _train(runs, SLOW_W4, "second")
    base = os.path.dirname(r1.out)
    # resumed from the checkpoint the stopped run saved (latest named step-3 then)
    assert "at step 3" in r2.stdout and sorted(second) == [3, 4, 5]
    for s in range(6):
        got = first.get(s, second.get(s))
        assert abs(got - full[s]) <= 1e-9 * full[s], (s, got, full[s])
    # the export loads with transformers and gives the checkpoint's logits
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(hf(base), dtype=torch.float64)
    meta, tensors = checkpoint.load_checkpoint(ck(base))
    assert meta["step"] == 6 and meta["layout"]["cp"] == 2
    ref = AutoModelForCausalLM.from_config(harness.load_config("tiny")).double()
    ref.load_state_dict(tensors["param"])
    x = torch.randint(0, 256, (2, 32))
    assert torch.equal(model(x).logits, ref(x).logits)


@pytest.mark.slow
def test_bf16_resume_is_bitwise(runs):
    """4 steps, save, resume, 4 more in bf16 give the 8 uninterrupted steps' losses bit for bit
    (a resume that rounded the fp32 masters or moments to bf16 moved them by ~1e-4)."""
    full, _ = _train(runs, SLOW_W2, "bf16-full")
    first, _ = _train(runs, SLOW_W2, "bf16-first")
    second, r = _train(runs, SLOW_W2, "bf16-second")
    assert "at step 4" in r.stdout and sorted(first) == [0, 1, 2, 3], r
    assert sorted(second) == [4, 5, 6, 7], r
    assert [first.get(s, second.get(s)) for s in range(8)] == [full[s] for s in range(8)]


def test_checkpoint_is_atomic(runs):
    """A save interrupted before its rename leaves only .tmp-step-N: `latest` still names the
    last complete step, and loading it works."""
    _, r = _train(runs, W2, "saved")
    path = ck(os.path.dirname(r.out))
    os.makedirs(os.path.join(path, ".tmp-step-4"))
    with open(os.path.join(path, ".tmp-step-4", "pp0-tp0.pt"), "wb") as f:
        f.write(b"half a file")
    meta, tensors = checkpoint.load_checkpoint(path)
    assert meta["step"] == 2 and len(tensors["param"]) == N_TENSORS
    assert set(tensors) == {"param", "exp_avg", "exp_avg_sq"}


def _damaged_copy(runs, tmp_path, damage) -> str:
    """A copy of the W2 "saved" run's checkpoint (step-1 and step-2, latest = step-2) with
    `damage(root)` applied."""
    import shutil
    _, r = _train(runs, W2, "saved")
    root = str(tmp_path / "ck")
    shutil.copytree(ck(os.path.dirname(r.out)), root)
    damage(root)
    return root


def _truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def _flip_a_byte(path):
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))
    # a second later, as an alteration after the save would be (file times are coarse: one
    # written within the same few ms as its verification could keep its time)
    t = os.stat(path).st_mtime_ns + 10 ** 9
    os.utime(path, ns=(t, t))


@pytest.mark.parametrize("damage,why", [
    (lambda root: _truncate(os.path.join(root, "step-2", "pp1-tp0.pt")),
     "step-2/pp1-tp0.pt has {} bytes, meta.json recorded"),
    (lambda root: _flip_a_byte(os.path.join(root, "step-2", "pp0-tp0.pt")),
     "step-2/pp0-tp0.pt does not match its checksum"),
    (lambda root: os.remove(os.path.join(root, "step-2", "pp0-tp0.pt")),
     "step-2/pp0-tp0.pt is missing"),
    (lambda root: os.rename(os.path.join(root, "step-2"), os.path.join(root, "gone")),
     "latest names step-2, which does not exist"),
], ids=["truncated", "altered", "missing", "latest-dangling"])
def test_a_damaged_checkpoint_falls_back(runs, tmp_path, damage, why):
    """A resume verifies each file's size and checksum (meta.json) and takes the newest intact
    step, saying which file was bad; with none intact, one line and exit 2."""
    root = _damaged_copy(runs, tmp_path, damage)
    d, problems = checkpoint.find_checkpoint(root)
    assert os.path.basename(d) == "step-1", (d, problems)
    assert len(problems) == 1 and problems[0].startswith(why.split("{}")[0]), problems
    meta, tensors = checkpoint.load_checkpoint(root, d)
    assert meta["step"] == 1 and len(tensors["param"]) == N_TENSORS
    # the same damage to step-1 too: nothing to resume from, refused before any process group
    _flip_a_byte(os.path.join(root, "step-1", "pp1-tp0.pt"))
    assert checkpoint.find_checkpoint(root)[0] is None
    from conftest import launch
    r = launch("compose4d.py", 2, "--mode", "train", "--pp", "2", "--resume", root,
               as_rank0=True)
    assert_config_error(r, f"--resume {root}: no complete, intact checkpoint (", torchrun=False)


def test_a_resume_hashes_each_step_once(runs, tmp_path, monkeypatch):
    """The configuration check, the elastic planner and the load all ask find_checkpoint: one
    process hashes a step directory once, and again only when a file changed."""
    root = _damaged_copy(runs, tmp_path, lambda root: None)
    hashed = []
    real = checkpoint._verify
    monkeypatch.setattr(checkpoint, "_verify", lambda d: hashed.append(d) or real(d))
    for _ in range(3):
        assert os.path.basename(checkpoint.find_checkpoint(root)[0]) == "step-2"
    assert len(hashed) == 1, hashed
    _flip_a_byte(os.path.join(root, "step-2", "pp0-tp0.pt"))
    d, problems = checkpoint.find_checkpoint(root)
    assert os.path.basename(d) == "step-1" and "checksum" in problems[0], problems


def test_prune_keeps_what_latest_names(tmp_path):
    """After a fallback resume (step-3 damaged, resumed from step-1, saved step-2), --keep 1
    keeps step-2, the step just saved that `latest` names, and deletes the abandoned step-3 and
    the older step-1; leftover .tmp directories go too."""
    for n in ("step-1", "step-3", "step-2", ".tmp-step-4"):
        os.makedirs(tmp_path / n)
    (tmp_path / "latest").write_text("step-2")
    checkpoint.prune(str(tmp_path), 1, 2)
    assert sorted(os.listdir(tmp_path)) == ["latest", "step-2"]


def test_keep_retains_the_newest(runs):
    """--keep 2 with a save every step of 4: steps 3 and 4 remain, no .tmp left behind."""
    _, r = _train(runs, W2, "kept")
    root = ck_keep(os.path.dirname(r.out))
    assert sorted(os.listdir(root)) == ["latest", "step-3", "step-4"], os.listdir(root)
    assert checkpoint.find_checkpoint(root) == (os.path.join(root, "step-4"), [])


def test_bad_layout_under_torchrun(run):
    assert_config_error(run("compose4d.py", 2, "--dp", "3"),
                        "world size 2 is not dp x tp x pp x cp = 3 x 1 x 1 x 1")


@pytest.mark.parametrize("nproc,args,msg", [
    (3, ["--tp", "3"], "tensor parallel size 3 does not divide num_attention_heads 4"),
    (4, ["--tp", "4"], "compose4d: tensor parallel size 4 replicates kv heads "
                       "(num_key_value_heads 2); compose4d replicates only a single kv head"),
    (2, ["--pp", "2", "--tp", "2"], "world size 2 is not divisible by tp x pp x cp"),
    (2, ["--cp", "2", "--length", "66"], "sequence length 66 is not divisible by 2 x cp = 4"),
    (3, ["--pp", "3", "--batch", "6", "--model", "TWO_LAYERS"],
     "2 decoder layers cannot fill 3 pipeline chunks"),
])
def test_bad_layouts(tmp_path, nproc, args, msg):
    """Checked before any process group: one process that believes it is rank 0 of nproc."""
    from conftest import launch
    path = tmp_path / "two.json"
    path.write_text(json.dumps(dict(harness.PRESETS["tiny"], num_hidden_layers=2)))
    args = [str(path) if a == "TWO_LAYERS" else a for a in args]
    assert_config_error(launch("compose4d.py", nproc, *args, as_rank0=True), msg,
                        torchrun=False)


def test_the_w1_overhead_measurement_runs(tmp_path):
    """scripts/compose4d_overhead.py (a smoke test, not a timed claim): compose4d at W=1 and the
    reference interleaved, both profiled, their extra ops listed."""
    import json
    import subprocess
    import sys
    from conftest import ROOT
    out = tmp_path / "o.json"
    r = subprocess.run([sys.executable, "scripts/compose4d_overhead.py", "--rounds", "2",
                        "--profile-rounds", "1", "--out", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.load(open(out))
    assert len(doc["step_ratios"]) == 2 and doc["ops_by_extra_time"], doc
    assert all(v > 0 for v in doc["profiled_ms_per_step"].values()), doc
