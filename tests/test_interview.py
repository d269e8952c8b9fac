"""docs/interview.md: every question's command is run, and every figure the page quotes from it
must appear in its output (the page's rules, stated at its top):

- a question is a `## N. title` section; its command is the first ```bash block in it (one
  command, one line); the ```text blocks after it hold output lines quoted verbatim;
- a quoted line matches an output line when its whitespace-separated tokens appear there in
  order, as whole tokens, separated only by whitespace; `...` stands for any text;
- a token that starts with `~` is a timing (or a statistic of the timed steps): any number
  matches it, the rest of the token (a unit, `%`, `x`) must be there;
- a token that starts with `≈` is a measured memory figure (activations, a peak): a number
  within APPROX (5%) of it matches, the rest of the token must be there;
- a token that starts with `^` is a figure the CPU's arithmetic decides (a noise sample, a
  roundoff-level error, an fp16 subnormal share: they differ between CPUs and BLAS builds): it is
  held to its order of magnitude, a number of the same sign within a factor of ORDER (10) of it
  (where either side is 0, both must be below ORDER units of the quoted last digit); every other token,
  numbers included (bytes, counts, verdicts), is compared exactly;
- `<!-- pending: NAME -->` on the line before the ```bash fence: the command is not written yet
  (ZeRO++, DualPipeV); its test is skipped with that reason.

The commands run in the repository root with `python` and `torchrun` meaning this interpreter; a
command used by several questions runs once. `torchrun --nproc_per_node=N script ...` is launched
by the tests' forkserver (tests/forkserver.py: the same script in a real gloo group of N forked
processes, without torchrun's ~5 s of imports and agent per launch; `TEST_LAUNCHER=torchrun`:
real torchrun): the command's `torchrun` is a small client that hands its launch to this
process over a unix socket (Relay). INTERVIEW_OUTPUTS=DIR keeps each command's output
there (to refresh the page's figures)."""
import json
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(ROOT, "docs", "interview.md")
QUESTIONS = 40
NUMBER = r"[-+]?(?:\d[\d,]*)?\.?\d+(?:[eE][-+]?\d+)?"
APPROX = 0.05   # ≈ figures: the live-tensor tracker's bytes move with torch's autograd internals
ORDER = 10.0    # ^ figures: the arithmetic's, held to their order of magnitude


# -- the page -------------------------------------------------------------------------------------
def parse(text: str) -> dict:
    """{question number: {"title", "command", "pending", "quoted": [lines]}}."""
    sections = re.split(r"^## (\d+)\. (.*)$", text, flags=re.M)
    out = {}
    for i in range(1, len(sections), 3):
        n, title, body = int(sections[i]), sections[i + 1].strip(), sections[i + 2]
        blocks = list(re.finditer(r"^```(\w+)\n(.*?)^```$", body, flags=re.M | re.S))
        bash = [b for b in blocks if b.group(1) == "bash"]
        command, pending = None, None
        if bash:
            command = bash[0].group(2).strip()
            before = body[:bash[0].start()].rstrip().splitlines()
            m = re.fullmatch(r"<!-- pending: (\S+) -->", before[-1].strip()) if before else None
            pending = m.group(1) if m else None
        start = bash[0].end() if bash else 0
        quoted = [line for b in blocks if b.group(1) == "text" and b.start() > start
                  for line in b.group(2).splitlines() if line.strip()]
        out[n] = dict(title=title, command=command, pending=pending, quoted=quoted,
                      commands=len(bash))
    return out


def pattern(quoted: str) -> re.Pattern:
    """A quoted line as a regular expression over one output line (the rules above)."""
    parts = []
    for tok in quoted.split():
        if tok == "...":
            parts.append(".*?")
        elif tok.startswith("~") and re.match(NUMBER, tok[1:]):
            rest = tok[1 + re.match(NUMBER, tok[1:]).end():]
            parts.append(NUMBER + re.escape(rest))
        elif tok.startswith(("≈", "^")) and re.match(NUMBER, tok[1:]):
            rest = tok[1 + re.match(NUMBER, tok[1:]).end():]
            parts.append(f"({NUMBER})" + re.escape(rest))   # checked by `matches`
        else:
            parts.append(re.escape(tok))
    body, prev = "", None
    for p in parts:   # tokens are separated by whitespace; `...` absorbs its own
        body += p if prev is None or p == ".*?" or prev == ".*?" else r"\s+" + p
        prev = p
    return re.compile(r"(?:^|(?<=\s))" + body + r"(?=\s|$)")


def matches(quoted: str, line: str) -> bool:
    """Whether an output line matches a quoted one (the rules above)."""
    m = pattern(quoted).search(line)
    if m is None:
        return False
    want = [(t[0], re.match(NUMBER, t[1:]).group().replace(",", ""))
            for t in quoted.split() if t.startswith(("≈", "^")) and re.match(NUMBER, t[1:])]
    got = [float(g.replace(",", "")) for g in m.groups()]
    return all(close(g, kind, w) for g, (kind, w) in zip(got, want))


def close(got: float, kind: str, quoted: str) -> bool:
    """`≈`: within APPROX; `^`: the same order of magnitude (the rules above)."""
    w = float(quoted)
    if kind == "≈":
        return abs(got - w) <= APPROX * abs(w)
    mant, _, exp = quoted.lower().partition("e")
    unit = 10.0 ** (int(exp or 0) - (len(mant.split(".")[1]) if "." in mant else 0))
    if w == 0 or got == 0:   # (a zero printed at the quoted resolution, either side: 0.00% and
        return abs(got) < ORDER * unit and abs(w) < ORDER * unit   # 0.01% are both under 0.1%)
    return got * w > 0 and 1 / ORDER <= got / w <= ORDER


def missing(quoted: list[str], output: str) -> list[str]:
    """The quoted lines that no output line matches."""
    lines = output.splitlines()
    return [q for q in quoted if not any(matches(q, line) for line in lines)]


# -- running a command -------------------------------------------------------------------------
_OUTPUTS: dict = {}


# the command's `torchrun`: a launch it can hand to the relay goes there, anything else (another
# torchrun option, no relay, TEST_LAUNCHER=torchrun) runs real torchrun
TORCHRUN_CLIENT = """
import json, os, socket, sys
args, nproc, i = sys.argv[1:], 1, 0
while i < len(args) and args[i].startswith("--"):
    if args[i].startswith("--nproc_per_node="):
        nproc = int(args[i].split("=", 1)[1])
    elif args[i] == "--nproc_per_node" and i + 1 < len(args):
        i += 1
        nproc = int(args[i])
    elif args[i] != "--standalone":
        break
    i += 1
relay = os.environ.get("INTERVIEW_RELAY")
if (not relay or os.environ.get("TEST_LAUNCHER") == "torchrun" or i >= len(args)
        or args[i].startswith("-") or not args[i].endswith(".py")
        or os.getcwd() != os.environ.get("INTERVIEW_ROOT")):    # (the server runs in the root)
    os.execv(sys.executable, [sys.executable, "-m", "torch.distributed.run", *sys.argv[1:]])
# the workers' environment: the relay's variables left out, so that a script that itself
# launches torchrun gets real torchrun, not a relay busy with its parent
env = {k: v for k, v in os.environ.items() if not k.startswith("INTERVIEW_")}
req = dict(script=args[i], argv=args[i + 1:], nproc=nproc, env=env,
           deadline=float(os.environ["INTERVIEW_DEADLINE"]))
with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
    s.connect(relay)
    s.sendall(json.dumps(req).encode())
    s.shutdown(socket.SHUT_WR)
    reply = json.loads(b"".join(iter(lambda: s.recv(1 << 16), b"")))
sys.stdout.write(reply["out"])
sys.stdout.flush()
sys.stderr.write(reply["err"])
sys.exit(reply["rc"])
"""


def shims(tmp) -> str:
    """A directory whose `python` runs this interpreter and whose `torchrun` is the client above."""
    os.makedirs(tmp, exist_ok=True)
    for name, text in (("python", f'#!/bin/sh\nexec "{sys.executable}" "$@"\n'),
                       ("torchrun", f"#!{sys.executable}\n{TORCHRUN_CLIENT}")):
        path = os.path.join(tmp, name)
        with open(path, "w") as f:
            f.write(text)
        os.chmod(path, os.stat(path).st_mode | stat.S_IEXEC)
    return tmp


class Relay:
    """A unix socket served by a thread of this process: each connection is one launch from the
    `torchrun` client, run by conftest's forkserver; the reply carries its exit code (1 when a
    rank failed, as torchrun's), stdout and stderr."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="relay-")
        self.path = os.path.join(self.dir, "sock")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(self.path)
        self.sock.listen()
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return                                  # closed
            with conn:
                try:
                    conn.sendall(json.dumps(self.launch(conn)).encode())
                except OSError:
                    pass    # the command was killed (its timeout) before the reply: next one

    @staticmethod
    def launch(conn) -> dict:
        from conftest import fork_server, launch_env
        req = json.loads(b"".join(iter(lambda: conn.recv(1 << 16), b"")))
        try:       # the launch ends by the command's own deadline (its ranks killed there)
            rc, out, err = fork_server(launch_env()).run(
                req["script"], req["nproc"], req["argv"], max(1.0, req["deadline"] - time.time()),
                env=req["env"])
        except subprocess.TimeoutExpired as e:
            rc, out, err = 124, str(e.stdout or ""), f"{e.stderr or ''}\nrelay: timed out"
        except Exception as e:                          # (the command sees it as a failure)
            rc, out, err = 1, "", f"relay: {type(e).__name__}: {e}"
        return dict(rc=rc, out=out, err=err)

    def close(self):
        import shutil
        try:
            self.sock.shutdown(socket.SHUT_RDWR)        # (wakes the blocked accept)
        except OSError:
            pass
        self.sock.close()
        self.thread.join(timeout=10)
        shutil.rmtree(self.dir, ignore_errors=True)


def command_env(bindir: str, timeout: int, relay: Relay | None = None) -> dict:
    """A command's environment: the shims first on PATH, and the relay's address, root and
    deadline (a few seconds before the command's own timeout) for the `torchrun` client."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               PATH=bindir + os.pathsep + os.environ.get("PATH", ""))
    if relay is not None:
        env.update(INTERVIEW_RELAY=relay.path, INTERVIEW_ROOT=ROOT,
                   INTERVIEW_DEADLINE=str(time.time() + timeout - 5))
    return env


def run_command(command: str, bindir: str, timeout: int = 300, relay: Relay | None = None) -> str:
    if command not in _OUTPUTS:
        env = command_env(bindir, timeout, relay)
        proc = subprocess.Popen(["bash", "-e", "-c", command], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
                                start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)          # bash and everything it started
            proc.communicate()
            raise
        proc = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
        assert proc.returncode == 0, (f"{command}\nexit {proc.returncode}\n"
                                      f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        _OUTPUTS[command] = proc.stdout + proc.stderr
        dump = os.environ.get("INTERVIEW_OUTPUTS")   # keep the outputs, to refresh the page
        if dump:
            os.makedirs(dump, exist_ok=True)
            with open(os.path.join(dump, f"{len(_OUTPUTS):02d}.txt"), "w") as f:
                f.write(f"$ {command}\n{_OUTPUTS[command]}")
    return _OUTPUTS[command]


@pytest.fixture(scope="module")
def bindir(tmp_path_factory):
    return shims(str(tmp_path_factory.mktemp("bin")))


# (under TEST_LAUNCHER=torchrun the client runs real torchrun: no relay to test)
RELAYED = pytest.mark.skipif(os.environ.get("TEST_LAUNCHER") == "torchrun",
                             reason="TEST_LAUNCHER=torchrun: the client runs real torchrun")


@pytest.fixture(scope="module")
def relay():
    r = Relay()
    yield r
    r.close()


@pytest.fixture(scope="module")
def page():
    with open(PAGE) as f:
        return parse(f.read())


# -- tests ----------------------------------------------------------------------------------------
def test_page_has_every_question_with_one_command(page):
    assert sorted(page) == list(range(1, QUESTIONS + 1))
    for n, q in page.items():
        assert q["commands"] == 1, f"question {n}: {q['commands']} bash blocks"
        assert "\n" not in q["command"], f"question {n}: one command, one line"
        if not q["pending"]:
            assert q["quoted"], f"question {n} quotes no output"
    assert {n for n, q in page.items() if q["pending"]} <= {19, 24}


def test_matcher_rules():
    out = ("  all_reduce   world   1   723,200   ok Psi*b\n"
           "zero1 (ours)   41.0   7.1   12479   7.30 MiB   1.67x")
    assert not missing(["all_reduce world 1 723,200"], out)
    assert missing(["all_reduce world 1 723,201"], out)            # a number is exact
    assert missing(["all_reduce world 1 23,200"], out)             # whole tokens only
    assert not missing(["zero1 (ours) ~99.9 ~1 ~5 7.30 MiB ~2.00x"], out)  # timings: any number
    assert missing(["zero1 (ours) ~99.9 ~1 ~5 7.31 MiB ~2.00x"], out)
    assert missing(["zero1 (ours) ~99.9 ~1 ~5 7.30 MiB ~2.00%"], out)      # the unit is kept
    assert not missing(["all_reduce ... ok Psi*b"], out)           # `...` elides
    assert missing(["all_reduce ... ok Psi*c"], out)
    assert not missing(["zero1 (ours) ... ≈7.60 MiB ~2.00x"], out)      # within 5%
    assert missing(["zero1 (ours) ... ≈7.70 MiB ~2.00x"], out)          # 5.2% off
    assert missing(["zero1 (ours) ... ≈7.30 KiB ~2.00x"], out)          # the unit is kept
    noise = "max err grad 5.7e-01 (noise 4.5e-15), ... 12.51% 0.00% 0"
    assert not missing(["max err grad 5.7e-01 (noise ^5.6e-15), ... ^3.0% ^0.00% 0"], noise)
    assert not missing(["(noise ^4.0e-14), ... ^80% ^0.0% 0"], noise)   # within a factor 10
    assert missing(["max err grad 5.7e-01 (noise ^4.0e-16),"], noise)   # 11x: another order
    assert missing(["max err grad 5.8e-01 (noise ^4.5e-15),"], noise)   # the error is exact
    assert missing(["(noise ^-4.5e-15),"], noise)                       # the sign is kept
    assert missing(["... ^1.0% ^0.00% 0"], noise)                       # 12.51 > 10 x 1.0
    assert missing(["... ^12% ^0.000% 0"], "... 12.51% 0.01% 0")       # 0.01 >= 10 x 0.001
    assert not missing(["... ^12% ^0.00% 0"], "... 12.51% 0.01% 0")    # 0.01 < 10 x 0.01
    assert not missing(["... ^12% ^0.01% 0"], "... 12.51% 0.00% 0")    # printed 0, either side
    assert missing(["... ^12% ^0.20% 0"], "... 12.51% 0.00% 0")        # 0.2 >= 10 x 0.01
    assert missing(["err ^0.0e+00"], "err 3.0e+00")                    # 3 >= 10 x 0.1


def drift(line: str) -> str | None:
    """The line with the last digit of its last exact figure (not a `~` timing, a `≈`
    measured memory figure nor a `^` order of magnitude) changed."""
    exact = [m for m in re.finditer(r"\S+", line)
             if not m.group().startswith(("~", "≈", "^")) and re.search(r"\d", m.group())]
    if not exact:
        return None
    tok = exact[-1]
    pos = tok.start() + [d for d in re.finditer(r"\d", tok.group())][-1].start()
    return line[:pos] + str((int(line[pos]) + 1) % 10) + line[pos + 1:]


def test_a_drifted_figure_fails(page):
    """A modified copy of the page fails against the output its figures were quoted from."""
    with open(PAGE) as f:
        text = f.read()
    checked = 0
    for n, q in page.items():
        if q["pending"]:
            continue
        # the output those lines were quoted from (timings replaced by other numbers)
        fake = "\n".join(re.sub(r"(?<!\S)\^(?=" + NUMBER + ")", "",
                                re.sub(r"~(" + NUMBER + ")", "123.4", line).replace("≈", ""))
                         for line in q["quoted"])
        fake = fake.replace("...", "elided text")
        assert not missing(q["quoted"], fake), n
        line = next((x for x in reversed(q["quoted"]) if drift(x)), None)
        if line is None:
            continue
        at = re.search(rf"^## {n}\. ", text, flags=re.M).start()   # in this question's section
        drifted = parse(text[:at] + text[at:].replace(line, drift(line), 1))[n]
        assert drifted["quoted"] != q["quoted"], n
        assert missing(drifted["quoted"], fake), f"question {n}: drift not caught: {drift(line)}"
        checked += 1
    assert checked >= QUESTIONS - 2


@pytest.mark.heavy   # each runs the page's command as a reader would (CI: make test-heavy)
@pytest.mark.parametrize("n", range(1, QUESTIONS + 1))
def test_question(n, page, bindir, relay):
    q = page[n]
    if q["pending"]:
        pytest.skip(f"question {n}: its command is pending ({q['pending']})")
    output = run_command(q["command"], bindir, relay=relay)
    gone = missing(q["quoted"], output)
    assert not gone, (f"question {n}: `{q['command']}` no longer prints:\n  "
                      + "\n  ".join(gone) + f"\n--- output\n{output[-6000:]}")


@RELAYED
def test_the_torchrun_client_hands_launches_to_the_relay(tmp_path, bindir, relay):
    """A command's `torchrun` runs its script in N ranks through the relay: every rank's output
    comes back, and a rank that fails fails the command (as under torchrun)."""
    script = tmp_path / "ranks.py"
    script.write_text("import os, sys\nprint('rank', os.environ['RANK'], 'of', "
                      "os.environ['WORLD_SIZE'])\nsys.exit(int(os.environ['RANK']) == 1)\n")
    p = subprocess.run(["bash", "-c", f"torchrun --standalone --nproc_per_node=3 {script}"],
                       capture_output=True, text=True, env=command_env(bindir, 120, relay),
                       cwd=ROOT, timeout=120)
    assert p.returncode == 1, (p.stdout, p.stderr)
    assert sorted(x for x in p.stdout.splitlines() if x.startswith("rank")) == [
        "rank 0 of 3", "rank 1 of 3", "rank 2 of 3"], p.stdout
    assert "rank 1 exitcode" in p.stderr, p.stderr


@RELAYED
def test_a_command_past_its_time_leaves_the_relay_serving(tmp_path, bindir, relay):
    """A launch that outlives its command's time is ended by the relay at the command's deadline,
    the command fails, and the next command's launch is served."""
    slow = tmp_path / "slow.py"
    slow.write_text("import time\ntime.sleep(60)\n")
    with pytest.raises((AssertionError, subprocess.TimeoutExpired)):
        run_command(f"torchrun --standalone --nproc_per_node=1 {slow}", bindir, timeout=8,
                    relay=relay)
    quick = tmp_path / "quick.py"
    quick.write_text("print('served')\n")
    assert "served" in run_command(f"torchrun --standalone --nproc_per_node=2 {quick}", bindir,
                                   timeout=60, relay=relay)
