"""Helpers: launch a strategy script under torchrun (real gloo process groups on CPU)."""
import atexit
import json
import os
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


class Result:
    def __init__(self, proc, out_dir):
        self.proc, self.out = proc, out_dir
        self.rc, self.stdout, self.stderr = proc.returncode, proc.stdout, proc.stderr

    def json(self, name):
        with open(os.path.join(self.out, name)) as f:
            return json.load(f)

    @property
    def last_line(self):
        lines = [l for l in self.stdout.splitlines() if l.strip()]
        return lines[-1] if lines else ""

    def __repr__(self):  # shown by pytest when an assertion on the result fails
        return f"<rc={self.rc}\n--- stdout\n{self.stdout[-4000:]}\n--- stderr\n{self.stderr[-4000:]}>"


def assert_config_error(r, msg, torchrun=True):
    """A bad configuration: exactly one `error: <msg...>` line, and exit code 2 (under torchrun,
    rank 0's code 2 is the launcher's reported root cause; torchrun itself exits 1)."""
    errors = [l for l in (r.stdout + r.stderr).splitlines() if l.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: " + msg), r
    if torchrun:
        assert r.rc != 0 and "exitcode  : 2" in r.stderr, r
    else:
        assert r.rc == 2 and r.stdout == "" and len(r.stderr.strip().splitlines()) == 1, r


_FORK = {}


def fork_server(env):
    """The session's forkserver (tests/forkserver.py), started on first use."""
    if "server" not in _FORK:
        from forkserver import ForkServer
        _FORK["server"] = ForkServer(env)
        atexit.register(_FORK["server"].close)
    return _FORK["server"]


def launch_env(**extra) -> dict:
    """The environment every launch gets: one thread per rank, no warnings, and `extra`."""
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **extra)


def step_losses(stdout: str) -> list[float]:
    """The correctness mode's per-step losses ("  step N: loss X ..."), in the order printed."""
    return [float(line.split()[3]) for line in stdout.splitlines()
            if line.startswith("  step ") and line.split()[2] == "loss"]


def assert_resume_continues(runs, batch, full: str, first: str, second: str, cut: int,
                            steps: int, rel: float = 1e-12):
    """Train-mode runs of `batch`: `first` stopped after `cut` steps and saved, `second` resumed
    from it; together their losses equal the uninterrupted `full` run's to `rel`."""
    def losses(key):
        r = runs(batch, key)
        assert r.rc == 0, r
        return dict((s, l) for s, l in r.json("train.json")["losses"])
    want, a, b = losses(full), losses(first), losses(second)
    assert sorted(a) == list(range(cut)) and sorted(b) == list(range(cut, steps)), (a, b)
    for s in range(steps):
        got = a.get(s, b.get(s))
        assert abs(got - want[s]) <= rel * want[s], (s, got, want[s])


def launch(script, nproc, *args, out=None, timeout=300, torchrun=True, as_rank0=False,
           pg_timeout=60, fork=False):
    """Run ROOT/script with `nproc` workers (torchrun) or as a plain python process.
    as_rank0: only rank 0 of `nproc` (torchrun's variables), forked from the session's
    forkserver, for configuration errors, which end before any process group exists (0.1 s
    instead of 4 s of imports). fork: the workers forked from the forkserver instead of started
    by torchrun (the shared launches). TEST_LAUNCHER=torchrun turns both off."""
    cmd = [sys.executable]
    if torchrun and not as_rank0:
        cmd += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    # the process-group timeout of a strategy script; oom_search's --timeout is its per-trial
    # wall clock (default 300 s), which a 60 s cap would cut short on a loaded machine
    timeout_flag = [] if script == "oom_search.py" else ["--timeout", str(pg_timeout)]
    cmd += [os.path.join(ROOT, script), *map(str, args), *timeout_flag]
    if out is not None:
        cmd += ["--out", str(out)]
    env = launch_env()
    if as_rank0:
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE=str(nproc))
    if (fork or as_rank0) and torchrun and os.environ.get("TEST_LAUNCHER") != "torchrun":
        argv = cmd[cmd.index(os.path.join(ROOT, script)) + 1:]
        rc, stdout, stderr = fork_server(env).run(os.path.join(ROOT, script), nproc, argv,
                                                  timeout, env, as_rank0=as_rank0)
        proc = subprocess.CompletedProcess(cmd, rc, stdout, stderr)
    else:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                              cwd=ROOT)
    return Result(proc, out)


def torchrun(path, nproc, *args, timeout=600, env=None) -> subprocess.CompletedProcess:
    """`python -m torch.distributed.run --standalone --nproc_per_node=N path args...` for a
    test's own multi-process script or an example: forked from the session's forkserver
    (TEST_LAUNCHER=torchrun: real torchrun). env: variables added to the tests' own."""
    env = launch_env(**(env or {}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", path, *map(str, args)]
    if os.environ.get("TEST_LAUNCHER") == "torchrun":
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                              cwd=ROOT)
    rc, out, err = fork_server(env).run(path, nproc, list(map(str, args)), timeout, env)
    return subprocess.CompletedProcess(cmd, rc, out, err)


class FailedLaunch:
    """What a pooled launch that raised (a timeout) leaves each of its runs: a failure."""
    def __init__(self, why: str):
        self.rc, self.stdout, self.stderr, self.out = 1, "", why, None

    def json(self, name):
        raise AssertionError(self.stderr)

    @property
    def last_line(self):
        return self.stderr

    def __repr__(self):
        return f"<launch failed: {self.stderr}>"


class RunResult(Result):
    """One run of a `--runs` launch: its own stdout segment, its --out, its verdict."""
    def __init__(self, whole: Result, out_dir, stdout: str):
        self.proc, self.out, self.stdout, self.stderr = whole.proc, out_dir, stdout, whole.stderr
        status = os.path.join(out_dir, "status.json")
        st = json.load(open(status)) if os.path.exists(status) else {}
        self.rc = 0 if st.get("ok") else (whole.rc or 1)
        self.seconds = st.get("seconds")


def launch_runs(script, nproc, runs: dict, base, timeout=900) -> dict:
    """One torchrun launch of `script` for several argument lists (`--runs`): the ~10 s of
    imports and start-up per process are paid once. runs: {key: [args...]}; each run gets its
    own --out under `base`. Returns {key: RunResult}; a crash fails every run not yet done."""
    import harness
    os.makedirs(base, exist_ok=True)
    keys = list(runs)
    outs = {k: os.path.join(str(base), f"run{i}") for i, k in enumerate(keys)}
    # a benchmark run skips the overlap profile (3 profiled steps, the costliest part of a small
    # benchmark on CPU) unless it asks for it: tests/test_overlap.py's do
    argvs = [[str(x(base) if callable(x) else x) for x in runs[k]]
             + ["--timeout", "60", "--out", outs[k]]
             + (["--overlap-steps", "0"] if "benchmark" in runs[k]
                and "--overlap-steps" not in runs[k] else []) for k in keys]
    spec = os.path.join(str(base), "runs.json")
    with open(spec, "w") as f:
        json.dump(argvs, f)
    t0 = time.time()
    whole = launch(script, nproc, "--runs", spec, timeout=timeout, fork=True)
    seconds = time.time() - t0
    parts, cur = {}, None
    for line in whole.stdout.splitlines(keepends=True):
        if line.startswith(harness.RUN_MARK):
            cur = line[len(harness.RUN_MARK):].split(" ", 1)[1].strip()
            parts[cur] = ""
        elif cur is not None:
            parts[cur] += line
    out = {k: RunResult(whole, outs[k], parts.get(outs[k], whole.stdout)) for k in keys}
    for k, r in out.items():
        RUN_SECONDS.append((f"{script} W={nproc} {k[1] if isinstance(k, tuple) else k}",
                            r.seconds))
    RUN_SECONDS.append((f"{script} W={nproc}: the whole launch ({len(keys)} runs)", seconds))
    return out


RUN_SECONDS: list = []   # (run, seconds) of every pooled run: pytest_terminal_summary's report


def pytest_terminal_summary(terminalreporter):
    """The costliest pooled runs (a pool's first test carries the whole launch in --durations):
    where make test's time goes, run by run."""
    if RUN_SECONDS:
        terminalreporter.section("costliest pooled runs (s)")
        for name, sec in sorted(RUN_SECONDS, key=lambda x: -(x[1] or 0))[:80]:
            terminalreporter.write_line(f"{sec or 0:8.1f}  {name}")


def config_file(name, preset="tiny", **overrides):
    """A `Runs` argument: writes `preset` with `overrides` to BASE/name.json, and names it."""
    def write(base):
        import harness
        path = os.path.join(str(base), f"{name}.json")
        with open(path, "w") as f:
            json.dump(dict(harness.PRESETS[preset], **overrides), f)
        return path
    return write


class Runs:
    """Runs declared up front (`{key: args}`), at import time, and launched the first time a test
    asks the `runs` fixture for one of them: together with every other declared batch of the
    same script, world size and tier (in any test module: the realistic-checkpoint and plants
    runs share ddp.py's launch with test_ddp.py's), in one torchrun launch. A tier ("quick",
    "slow", "heavy": the tests' markers) keeps `make quick` from paying for the slow runs."""
    ALL: list = []

    def __init__(self, script, nproc, runs: dict, tier: str = "quick"):
        self.script, self.nproc, self.runs, self.tier = script, nproc, runs, tier
        Runs.ALL.append(self)

    @property
    def pool(self):
        return (self.script, self.nproc, self.tier)


@pytest.fixture(scope="session")
def runs(tmp_path_factory):
    """runs(BATCH, key) -> that run's RunResult; BATCH is launched once per session, with the
    other batches of its pool."""
    done = {}

    def get(batch: Runs, key):
        if id(batch) not in done:
            pool = [b for b in Runs.ALL if b.pool == batch.pool and id(b) not in done]
            merged = {(i, k): args for i, b in enumerate(pool) for k, args in b.runs.items()}
            base = tmp_path_factory.mktemp(f"{os.path.splitext(batch.script)[0]}-W{batch.nproc}")
            try:
                res = launch_runs(batch.script, batch.nproc, merged, base,
                                  timeout=300 + 120 * len(merged))
            except (subprocess.SubprocessError, OSError) as e:
                # recorded once: every test of the pool fails with this, none relaunches it
                res = {key: FailedLaunch(f"{batch.script} W={batch.nproc}: {e!r}")
                       for key in merged}
            for i, b in enumerate(pool):
                done[id(b)] = {k: res[i, k] for k in b.runs}
        return done[id(batch)][key]
    return get


@pytest.fixture
def group():
    """A gloo process group of one, in this process (for unit tests of collective code)."""
    import torch.distributed as dist
    import harness
    from harness.launch import _free_port
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def run(tmp_path):
    def _run(script, nproc, *args, **kw):
        return launch(script, nproc, *args, out=tmp_path, **kw)
    return _run
