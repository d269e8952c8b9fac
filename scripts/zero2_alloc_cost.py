"""What ZeRO-2's free-and-reallocate of full gradients costs on CPU, outside any process group.

    OMP_NUM_THREADS=1 python scripts/zero2_alloc_cost.py
    MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=4294967296 \
        OMP_NUM_THREADS=1 python scripts/zero2_alloc_cost.py   # glibc keeps freed pages

Stage 1 keeps one flat gradient buffer per unit and accumulates into it in place. Stage 2 frees
each unit's buffer once reduce-scattered (zero.py: FlatUnit.free_grads) and allocates it again,
zeroed, when the unit's next gradient arrives (FlatUnit.alloc_grads). Timed here on the small
preset's units (embedding, head, 8 decoder layers: 72 MiB in float32), the same storage calls.
glibc serves a buffer this large by mmap, so every step touches fresh pages; the CUDA caching
allocator reuses its blocks instead. Measured on the 2-core AMD EPYC CPU, five runs: stage 1
4.4-5.3 ms, stage 2 38-42 ms; with glibc told to keep its pages (both variables above, four runs)
stage 2 5.8-6.4 ms."""
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def unit_sizes(preset: str = "small") -> list[int]:
    """Elements per zero.py unit (embed, each decoder layer, norm + head) of a preset, counted
    on the meta device so nothing is allocated."""
    from types import SimpleNamespace
    from harness.loading import meta_model
    from harness.models import load_config
    from zero import decoder_units
    model = meta_model(load_config(preset), SimpleNamespace(attn="sdpa", dtype="float32"))
    return [sum(p.numel() for m in mods for p in m.parameters())
            for _, mods in decoder_units(model)]


def stage1(bufs, grads):
    for b, g in zip(bufs, grads):
        b.add_(g)


def stage2(bufs, grads):
    for b, g in zip(bufs, grads):
        b.untyped_storage().resize_(b.numel() * b.element_size())   # alloc_grads
        b.zero_()
        b.add_(g)
    for b in bufs:
        b.untyped_storage().resize_(0)                               # free_grads


def main(reps: int = 10):
    sizes = unit_sizes()
    grads = [torch.randn(n) for n in sizes]
    for name, f in (("stage 1, in place", stage1), ("stage 2, free and reallocate", stage2)):
        bufs = [torch.zeros(n) for n in sizes]
        f(bufs, grads)   # warm-up
        t = time.perf_counter()
        for _ in range(reps):
            f(bufs, grads)
        print(f"{name:<30} {(time.perf_counter() - t) / reps * 1e3:6.1f} ms per step "
              f"({sum(sizes) * 4 / 2**20:.1f} MiB of gradients)")


if __name__ == "__main__":
    main()
