"""rig: the test rig, one module per strategy file. Not the algorithm: read ddp.py, not rig/ddp.py.

A learner file (ddp.py, zero.py, fsdp.py, tp.py, sp.py, pp.py, cp_ring.py, ep_moe.py, ...)
holds one parallelism and nothing else: its idea, its communication, its parallel modules or
hooks, the function a user calls on their own model (`DataParallel`, `fully_shard`,
`tp.parallelize`, ...), and a `__main__` of two lines that hands the run to this package. What it
takes to *prove* that algorithm lives here, beside it, one module per strategy file:

    the harness adapter    a `harness.Strategy` subclass: build the parallel model from the
                           reference's weights, take one step, return full gradients and
                           parameters (the contract: harness/__init__.py's docstring)
    constraint checks      a configuration the strategy cannot run (a world size that does not
                           divide heads, layers, batch ...) refused in one line, before any
                           collective
    the planted bugs       each `Plant`'s description and the configuration under which its
                           correctness run must FAIL (the planted line itself stays in the
                           learner file, where the bug would be, behind `planted(NAME)`)
    baselines              PyTorch's own implementation (DDP, FSDP2, DTensor, pipelining) run
                           through the same adapter, for `--compare-native`
    expected comm          the per-step collectives the meter must count, beside their formulas
    noise models           what a verdict is judged against where the strategy itself adds
                           noise (ZeRO++'s quantization)

The layering, kept true by tests/test_layout.py: harness/ imports no learner file and no rig;
a learner file imports torch, other learner files, and a short allowlist of harness helpers that
the algorithm truly needs (plants, dropout, precision, ...); rig/ imports learner files and the
harness; a learner file reaches its rig only from its `if __name__ == "__main__":` block (the
script's entry, not a dependency of the module). `torchrun ddp.py --mode correctness` therefore
runs ddp.py's __main__, which calls `rig.ddp.main()`, which hands `rig.ddp.DDP` to
`harness.main`.
"""
