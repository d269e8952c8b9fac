"""The tests' forkserver (tests/forkserver.py), which starts every shared launch: the same
results as torchrun, torchrun's handling of a failed worker, and the timeout."""
import subprocess
import time

import pytest

from conftest import fork_server, launch, launch_env, step_losses

ENV = launch_env()


def test_forked_workers_give_torchruns_results(tmp_path):
    """ddp W=2, two steps, float64: the same losses to the last printed digit and the same
    verdict, started by torchrun and forked from the server."""
    args = ("ddp.py", 2, "--steps", "2")
    a = launch(*args, out=tmp_path / "torchrun")
    b = launch(*args, out=tmp_path / "fork", fork=True)
    assert a.rc == b.rc == 0 and a.last_line.startswith("PASS"), (a, b)
    losses = step_losses(a.stdout)
    assert b.last_line == a.last_line and step_losses(b.stdout) == losses and len(losses) == 2, \
        (a, b)


def _script(tmp_path, body, name="w.py"):
    path = tmp_path / name
    path.write_text("import os, sys, time\nrank = int(os.environ['RANK'])\n" + body)
    return str(path)


def test_a_failed_worker_stops_the_others(tmp_path):
    """Rank 1 exits 3 at once while rank 0 would sleep a minute: as torchrun, the launch ends
    (rank 0 stopped after the 5 s grace) with rc 1 and each failed rank's exit code."""
    script = _script(tmp_path, "print(rank, os.environ['WORLD_SIZE'], os.environ['LOCAL_RANK'], "
                               "flush=True)\nsys.exit(3) if rank == 1 else time.sleep(60)\n")
    t0 = time.time()
    rc, out, err = fork_server(ENV).run(script, 2, [], timeout=120)
    assert time.time() - t0 < 30 and rc == 1, (out, err)
    assert sorted(out.split("\n")[:2]) == ["0 2 0", "1 2 1"], out
    assert "rank 1 exitcode  : 3" in err and "rank 0 exitcode  : -15" in err, err


def test_a_worker_that_ignores_sigterm_is_killed_after_the_grace(tmp_path):
    """SIGTERM first (5 s after the failure), SIGKILL 5 s later for a worker that ignores it."""
    script = _script(tmp_path, "import signal\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                               "sys.exit(3) if rank == 1 else time.sleep(60)\n")
    server = fork_server(ENV)
    server.run(_script(tmp_path, "pass\n", "start.py"), 1, [], timeout=60)   # (not timed)
    t0 = time.time()
    rc, out, err = server.run(script, 2, [], timeout=120)
    assert 9 < time.time() - t0 < 30 and rc == 1, (out, err)
    assert "rank 1 exitcode  : 3" in err and "rank 0 exitcode  : -9" in err, err


def test_the_timeout_kills_every_worker(tmp_path):
    script = _script(tmp_path, "time.sleep(60)\n")
    fork_server(ENV).run(_script(tmp_path, "pass\n", "start.py"), 1, [], timeout=60)
    t0 = time.time()
    with pytest.raises(subprocess.TimeoutExpired):
        fork_server(ENV).run(script, 2, [], timeout=2)
    assert time.time() - t0 < 10
