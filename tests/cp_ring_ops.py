"""The ring loop's per-block work, counted: every aten op one rank's ring attention dispatches
(forward and backward, through the real autograd Function and its hops), by kind, and the bytes
its elementwise ops write.

    torchrun --nproc_per_node=W tests/cp_ring_ops.py [--seq S] [--dtype D] [--kernel torch|sdpa]
        [--out FILE]    (results/cp-ring-ops-cpu.json: W=2, bfloat16, sdpa)

Prints one JSON line from rank 0: per ring step (the totals / W), the ops by kind
    attention  the block kernels' own (the fused SDPA ops, or the pure kernel's matmuls)
    view       metadata only (views, reshapes of contiguous tensors, as_strided): no traffic
    comm       the hops and collectives (c10d)
    other      everything else: copies, casts, the merge, the masks, allocations
and the bytes the `other` ops write. On a GPU each `other` op is a kernel launch, and its bytes
pass through HBM: the loop's overhead around the attention itself (issue 74).
"""
import argparse
import json
import sys
from collections import Counter

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, __file__.rsplit("/tests/", 1)[0])
import cp_kernels  # noqa: E402
import cp_ring  # noqa: E402
from harness import teardown  # noqa: E402

ATTENTION = ("aten::_scaled_dot_product", "aten::bmm", "aten::mm", "aten::matmul")
VIEW = {"aten::view", "aten::_unsafe_view", "aten::as_strided", "aten::t", "aten::transpose",
        "aten::expand", "aten::slice", "aten::select", "aten::unsqueeze", "aten::squeeze",
        "aten::permute", "aten::alias", "aten::detach", "aten::split", "aten::unbind"}


class Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops, self.bytes = Counter(), 0
        self.names = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func._schema.name
        kind = ("attention" if name.startswith(ATTENTION) else "view" if name in VIEW
                else "comm" if name.startswith("c10d") else "other")
        self.ops[kind] += 1
        if kind == "other":
            self.names[name] += 1
            outs = out if isinstance(out, (tuple, list)) else (out,)
            if name == "aten::copy_" and args[0].data_ptr() == args[1].data_ptr():
                outs = ()   # a view copied onto itself (`x[i] += y`): ATen moves no bytes
            self.bytes += sum(t.numel() * t.element_size() for t in outs
                              if isinstance(t, torch.Tensor))
        return out


def main(a):
    dist.init_process_group("gloo")
    rank, W = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, a.dtype)
    g = torch.Generator().manual_seed(0)
    B, H, HKV, D = 1, 4, 2, 16
    q, k, v, do = (torch.randn(B, h, a.seq // W, D, generator=g).to(dtype)
                   for h in (H, HKV, HKV, H))
    kernel = (cp_kernels.SDPAKernel("cpu", dtype) if a.kernel == "sdpa"
              else cp_ring.TorchKernel())
    res = {}
    for variant in ("zigzag", "ring", "allgather"):
        cp = cp_ring.CPContext(variant, None, a.seq, kernel=kernel)
        leaf = [t.clone().requires_grad_() for t in (q, k, v)]
        with Count() as c:
            cp_ring.cp_attention(*leaf, cp, D ** -0.5).backward(do)
        res[variant] = dict(other_ops=c.ops["other"] / W, attention_ops=c.ops["attention"] / W,
                            view_ops=c.ops["view"] / W, comm_ops=c.ops["comm"] / W,
                            other_bytes=c.bytes / W,
                            other_by_name=dict(c.names.most_common(12)))
    if rank == 0:
        doc = dict(world=W, seq=a.seq, dtype=a.dtype, kernel=kernel.name, per_ring_step=res,
                   command=" ".join(["torchrun --nproc_per_node=%d tests/cp_ring_ops.py" % W]
                                    + sys.argv[1:]))
        print(json.dumps(doc), flush=True)
        if a.out:   # (a `before` the file holds, measured on older code, is kept)
            try:
                doc["before"] = json.load(open(a.out))["before"]
            except (OSError, KeyError, ValueError):
                pass
            with open(a.out, "w") as f:
                json.dump(doc, f, indent=1)
    teardown()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--kernel", default="sdpa", choices=["torch", "sdpa"])
    p.add_argument("--out", default=None)
    main(p.parse_args())
