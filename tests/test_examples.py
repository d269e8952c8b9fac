"""examples/: the standalone loops a user copies run under torchrun and learn."""
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT


def run_example(name, nproc, *args):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", os.path.join(ROOT, "examples", name), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"))


@pytest.mark.parametrize("name,nproc,args,last", [
    ("ddp_train.py", 2, [], None),
    ("zero_train.py", 2, ["--stage", "2"], "saved the optimizer state of"),
    ("fsdp_train.py", 2, [], "gathered"),
    ("tp_train.py", 2, [], "gathered"),
    ("tp_train.py", 2, ["--sp"], "gathered"),
    ("pp_train.py", 2, [], None),
    ("cp_train.py", 2, [], None),
    ("ep_train.py", 2, [], None),
    pytest.param("tp_train.py", 4, [], "gathered", marks=pytest.mark.slow),  # kv heads replicated
    pytest.param("zero_train.py", 3, ["--stage", "1"], "saved", marks=pytest.mark.slow),
])
def test_example_learns(name, nproc, args, last):
    p = run_example(name, nproc, *args)
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", p.stdout)]
    assert len(losses) == 4, p.stdout
    assert losses[-1] < 0.5 * losses[0], p.stdout          # the toy task is learnable
    if last:
        assert p.stdout.strip().splitlines()[-1].startswith(last), p.stdout
