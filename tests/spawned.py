"""spawned.py: the few tests that start their own process group run each rank through here.

torch.multiprocessing.spawn starts W fresh interpreters; each runs the test's per-rank
function (which initialises gloo and destroys the group in a `finally`). A rank that returns
ends with os._exit, as the forkserver's workers do: under CI load, gloo's threads at
interpreter finalisation have aborted a finished, passing rank ("terminate called without an
active exception", SIGABRT) after the group was destroyed. A rank that raises still goes through
spawn's own wrapper, which writes the traceback the parent reports."""
from __future__ import annotations

import os
import sys


def spawn(fn, world: int, *args) -> None:
    """fn(rank, world, *args) on W spawned ranks; raises what a rank raised."""
    import torch.multiprocessing as mp
    mp.spawn(_rank, args=(fn, world, args), nprocs=world)


def _rank(rank, fn, world, args):
    fn(rank, world, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
