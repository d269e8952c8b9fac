"""Two machines, proven on one: two torchrun agents (`--nnodes 2`, a c10d rendezvous on
127.0.0.1), each starting its own ranks, as scripts/slurm_multinode.sh does across nodes. The
launcher's node layout (LOCAL_WORLD_SIZE) sets HSDP's replicas and ZeRO++'s node size."""
import os
import subprocess
import sys

import pytest

import harness

from conftest import ROOT
from harness.launch import _free_port


def two_agents(script, per_node, *args, timeout=400):
    """Both agents' (return codes, stdout + stderr)."""
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
           f"--nproc_per_node={per_node}", "--rdzv-backend", "c10d", "--rdzv-endpoint",
           f"127.0.0.1:{port}", "--rdzv-id", "test", os.path.join(ROOT, script), *args,
           "--timeout", "120"]
    agents = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               cwd=ROOT, env=env) for _ in range(2)]
    outs = [a.communicate(timeout=timeout)[0] for a in agents]
    return [a.returncode for a in agents], "\n".join(outs)


@pytest.mark.slow
def test_hsdp_across_two_nodes_defaults_its_replicas():
    rcs, out = two_agents("fsdp.py", 2, "--mode", "correctness", "--dtype", "float64",
                          "--batch", "4", "--length", "16")
    assert rcs == [0, 0], out[-4000:]
    assert "HSDP: --replicate 2 from the launcher's layout (2 nodes of 2 ranks" in out, out
    assert "\nPASS fsdp W=4" in out, out[-4000:]


@pytest.mark.slow
def test_compose4d_across_two_nodes():
    rcs, out = two_agents("compose4d.py", 2, "--tp", "2", "--dp", "2", "--mode", "correctness",
                          "--batch", "4", "--length", "16")
    assert rcs == [0, 0], out[-4000:]
    assert "\nPASS 4d-dp2-tp2" in out, out[-4000:]


def test_node_layout_from_the_launcher(monkeypatch):
    from harness import ranks_per_node
    import rig.fsdp
    import rig.zeropp
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert ranks_per_node(4) is None
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert ranks_per_node(4) is None                 # one node
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert ranks_per_node(4) == 2                    # two nodes of two
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    assert ranks_per_node(4) == 2 and not harness.uneven_nodes(4)
    monkeypatch.setenv("GROUP_WORLD_SIZE", "3")      # nodes of 2 and 1 (and 1): not a layout
    assert ranks_per_node(4) is None and "differ in size" in harness.uneven_nodes(4)
    a = type("A", (), {"replicate": None, "prefetch": 1, "batch": 8, "grad_accum": 1})()
    assert any("give --replicate R" in e for e in rig.fsdp.fsdp_constraints(a, 4, None)), a
    monkeypatch.delenv("GROUP_WORLD_SIZE")
    args = type("A", (), {"replicate": None, "node_size": None})()
    assert rig.fsdp.replicas(args, 4)[0] == 2 and rig.zeropp.node_size(args, 4) == 2
    args.replicate, args.node_size = 1, 4            # what the user says wins
    assert rig.fsdp.replicas(args, 4) == (1, None) and rig.zeropp.node_size(args, 4) == 4
