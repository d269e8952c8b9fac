"""Helpers: launch a strategy script under torchrun (real gloo process groups on CPU)."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


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


def launch(script, nproc, *args, out=None, timeout=300, torchrun=True, as_rank0=False):
    """Run ROOT/script with `nproc` workers (torchrun) or as a plain python process.
    as_rank0: one plain process that believes it is rank 0 of `nproc` (torchrun's variables),
    for configuration errors, which end before any process group exists (3 s instead of 3 s
    per process)."""
    cmd = [sys.executable]
    if torchrun and not as_rank0:
        cmd += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd += [os.path.join(ROOT, script), *map(str, args), "--timeout", "60"]
    if out is not None:
        cmd += ["--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    if as_rank0:
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE=str(nproc))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    return Result(proc, out)


@pytest.fixture
def group():
    """A gloo process group of one, in this process (for unit tests of collective code)."""
    import torch.distributed as dist
    import common
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(common._free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def run(tmp_path):
    def _run(script, nproc, *args, **kw):
        return launch(script, nproc, *args, out=tmp_path, **kw)
    return _run
