"""forkserver.py: the tests' fast launcher for the shared launches (conftest.Runs).

One server process imports torch, transformers and every strategy module once. Each launch
forks W workers from it (copy-on-write: nothing is imported again, where a torchrun launch pays
about 4 s of imports per process and 1.5 s for the agent), each with torchrun's environment
(RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and running the
script as `python script args...` would: its directory first on sys.path, `__main__`, its exit
code. Like torchrun it stops the other workers once one has failed, and kills all of them at
the launch's timeout. The workers are real processes in a real gloo group, as under torchrun;
torch's own MultiProcessTestCase forks its gloo workers the same way.

What it is not: torchrun. The tests of the launcher's behaviour (restarts, SIGTERM through the
agent, the root cause's exit code, the multi-node rendezvous) keep starting real torchrun;
`TEST_LAUNCHER=torchrun` sends every launch there. Forked workers also share the server's
string-hash seed (a set ordered differently per rank would not show here) and end with
os._exit after the atexit functions (no interpreter finalisation: the harness's own teardown
destroys the process groups before). A worker dies with the server (PR_SET_PDEATHSIG).

Safe to fork because the server never computes: no torch thread pool, CUDA context or process
group exists when it forks. Python's and numpy's global generators are reseeded in each worker,
as a fresh process would have them."""
from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
REPLY_FD = None     # the server's protocol channel (closed in the workers)
SERVER_PID = None
MODELS = ["AutoModelForCausalLM", "LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM",
          "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Olmo2ForCausalLM", "Gemma2ForCausalLM",
          "Phi3ForCausalLM"]
PRELOAD = ["rig.ddp", "rig.zero", "rig.zeropp", "rig.fsdp", "rig.tp", "rig.sp", "rig.pp",
           "rig.cp_ring", "rig.ep_moe", "rig.compose4d"]


# ----------------------------------------------------------------------------------------------
# client (the pytest process)
# ----------------------------------------------------------------------------------------------
class ForkServer:
    def __init__(self, env: dict):
        import threading
        self.env = env      # the server's (and the default for its workers)
        self.proc = None
        self.lock = threading.Lock()   # one launch at a time (test_interview's relay thread)

    def _start(self):
        import tempfile
        self.log = tempfile.TemporaryFile("w+")     # the server's own stderr
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__)], cwd=ROOT,
                                     env=self.env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True)
        ready = self.proc.stdout.readline()
        if ready.strip() != "ready":
            self.log.seek(0)
            raise OSError(f"forkserver did not start: {self.log.read()[-2000:]}")

    def run(self, script: str, nproc: int, argv: list, timeout: float,
            env: dict | None = None, as_rank0: bool = False) -> tuple[int, str, str]:
        """(rc, stdout, stderr) of one launch; rc 0 when every worker exited 0, else 1 (as
        torchrun), with each failed rank's exit code in the last lines of stderr. as_rank0:
        only rank 0 of the `nproc` runs (for configuration errors, which end before any
        process group exists), and rc is its own exit code, as a plain process's."""
        with self.lock:
            return self._run(script, nproc, argv, timeout, env, as_rank0)

    def _run(self, script, nproc, argv, timeout, env, as_rank0):
        import tempfile
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        with tempfile.TemporaryDirectory() as d:
            out, err = os.path.join(d, "out"), os.path.join(d, "err")
            req = dict(script=script, argv=argv, nproc=nproc, timeout=timeout, out=out, err=err,
                       env=env or self.env, cwd=ROOT, ranks=1 if as_rank0 else nproc)
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
            reply = self.proc.stdout.readline()
            if not reply:
                self.proc = None
                self.log.seek(0)
                raise OSError(f"forkserver died: {self.log.read()[-2000:]}")
            reply = json.loads(reply)
            stdout, stderr = (open(p).read() if os.path.exists(p) else "" for p in (out, err))
        if reply["timed_out"]:
            raise subprocess.TimeoutExpired(script, timeout, stdout, stderr)
        codes = reply["codes"]
        if as_rank0:
            return codes[0], stdout, stderr
        failed = [f"forkserver: rank {r} exitcode  : {c}" for r, c in enumerate(codes) if c]
        return (1 if failed else 0), stdout, stderr + "".join(f"{f}\n" for f in failed)

    def close(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)


# ----------------------------------------------------------------------------------------------
# server
# ----------------------------------------------------------------------------------------------
def _worker(req: dict, rank: int, port: int) -> int:
    """In the forked child: torchrun's variables, the script's stdout/stderr, then the script."""
    import random
    import runpy
    import traceback
    os.setpgid(0, 0)                       # its own group: the server can kill what it starts
    _die_with_the_server()
    os.close(REPLY_FD)
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND
    os.dup2(os.open(req["out"], flags, 0o644), 1)
    os.dup2(os.open(req["err"], flags, 0o644), 2)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.environ.clear()
    # torchrun's variables; none of its agent's (TORCHELASTIC_*: no agent to signal or wait
    # for); rank 0 alone (a configuration error) gets no rendezvous address, so a check that
    # let a bad configuration through fails at once, as a plain process does, not at the timeout
    os.environ.update({k: v for k, v in req["env"].items() if not k.startswith("TORCHELASTIC")})
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0",
                      WORLD_SIZE=str(req["nproc"]), LOCAL_WORLD_SIZE=str(req["nproc"]))
    if req["ranks"] == req["nproc"]:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    else:
        for k in ("MASTER_ADDR", "MASTER_PORT"):
            os.environ.pop(k, None)
    random.seed()
    try:
        import numpy as np
        np.random.seed()
    except ImportError:
        pass
    os.chdir(req["cwd"])
    script = os.path.abspath(req["script"])
    sys.argv = [script, *req["argv"]]
    # as `python script`: its directory first (the suite's root stays, for lazy imports)
    sys.path[:] = [os.path.dirname(script)] + [p for p in sys.path if p != HERE]
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()            # what interpreter shutdown would have run
    finally:
        for f in (sys.stdout, sys.stderr):
            try:
                f.flush()
            except Exception:
                pass
    return code


def _die_with_the_server():
    """Linux: the kernel SIGKILLs this worker when the server exits (pytest interrupted, CI
    timed out), so no orphaned group runs on; gone already, exit now."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != SERVER_PID:
        os._exit(1)


def _kill(pids, sig):
    for pid in pids:
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _launch(req: dict) -> dict:
    from harness.launch import _free_port
    port = _free_port()
    sys.stdout.flush()
    sys.stderr.flush()
    pids = []
    for rank in range(req["ranks"]):
        pid = os.fork()
        if pid == 0:
            os._exit(_worker(req, rank, port))
        try:
            os.setpgid(pid, pid)             # (as the child does: no race with a kill)
        except OSError:
            pass
        pids.append(pid)
    try:
        return _wait(req, pids)
    finally:                                 # whatever happened here, nothing is left running
        _kill(pids, signal.SIGKILL)


def _wait(req: dict, pids: list) -> dict:
    codes = {pid: None for pid in pids}
    deadline = time.time() + req["timeout"]
    failed_at = stopped = None
    timed_out = False
    while any(c is None for c in codes.values()):
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid in codes:
            codes[pid] = os.waitstatus_to_exitcode(status)
            if codes[pid] != 0 and failed_at is None:
                failed_at = time.time()
            continue
        now = time.time()
        live = [p for p, c in codes.items() if c is None]
        if now > deadline:
            timed_out = True
            _kill(live, signal.SIGKILL)
        elif failed_at is not None and now - failed_at > 5:
            # as torchrun: once a worker failed, the others are stopped (after a grace for
            # the ones already on their way out, e.g. rank 0 printing a configuration error):
            # SIGTERM, then SIGKILL for what is still there 5 s later
            if stopped is None:
                _kill(live, signal.SIGTERM)
                stopped = now
            elif now - stopped > 5:
                _kill(live, signal.SIGKILL)
        time.sleep(0.02)
    return dict(codes=[codes[p] for p in pids], timed_out=timed_out)


def serve():
    global REPLY_FD, SERVER_PID
    SERVER_PID = os.getpid()
    REPLY_FD = os.dup(1)
    reply = os.fdopen(REPLY_FD, "w")        # the protocol's channel, apart from fd 1
    os.dup2(2, 1)                          # anything the server itself prints: stderr
    sys.path.insert(0, ROOT)
    import importlib
    transformers = importlib.import_module("transformers")
    for name in MODELS:   # transformers imports each model class lazily (~2 s the first)
        getattr(transformers, name)
    for name in ["harness", *PRELOAD]:
        importlib.import_module(name)
    try:      # the benchmark's overlap picture (harness/overlap.py): ~1.3 s per pool otherwise
        import matplotlib
        matplotlib.use("Agg")
        importlib.import_module("matplotlib.pyplot")
    except ImportError:
        pass
    import gc
    gc.collect()
    gc.freeze()          # the workers' collections skip what the server imported
    reply.write("ready\n")
    reply.flush()
    for line in sys.stdin:
        reply.write(json.dumps(_launch(json.loads(line))) + "\n")
        reply.flush()


if __name__ == "__main__":
    serve()
