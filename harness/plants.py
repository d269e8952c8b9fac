"""plants.py: the switch for planted bugs (`--plant-bug NAME`), kept out of every public API.

A planted bug is a known mistake a strategy can make in itself, so that its correctness mode is
seen to FAIL (Plant in strategy.py declares one). No public class or function takes a `plant`
argument: the harness switches one bug on for the length of a run, and the strategy code tests
it on the one line the bug changes, marked with a short `# plant` comment a reader can skip:

    keep = grads if planted("overwrite-accum") else acc + grads   # plant: last micro-batch only

A user's own loop never switches anything on, so planted() is False there and the line reads
as the correct code. Names are global: a strategy that builds on another's engine (fsdp.py on
zero.py's) inherits the engine's plants by declaring the same name.
"""
from __future__ import annotations

from contextlib import contextmanager

_active: str | None = None


def planted(name: str) -> bool:
    """True while the harness runs with the planted bug `name` switched on."""
    return _active == name


def active() -> str | None:
    """The planted bug switched on now (None: the correct code)."""
    return _active


@contextmanager
def planting(name: str | None):
    """Switch on the planted bug `name` (None: none) for the body of the with-statement."""
    global _active
    before, _active = _active, name
    try:
        yield
    finally:
        _active = before
