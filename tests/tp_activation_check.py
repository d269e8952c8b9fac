"""The activation model's TP/SP split against each rank's live storage.

    torchrun --nproc_per_node=T tests/tp_activation_check.py [--preset tiny] [--modes none selective]

harness.recompute.activation_bytes(config, b, s, e, mode, tp=T, sp=...) is the suite's one
activation model (trainer4d/plan.py, oom_search, the elastic planner). At T = 1 test_recompute.py
proves it byte for byte; here every rank builds the model, splits it with tp.parallelize (or
sp.parallelize), and measures the layers' share of its activation peak
(recompute.per_layer_measured: L layers minus L/2). One line per case on rank 0:
`<dtype> <mode> sp=<bool> measured <bytes per rank> model <bytes> unsplit <bytes>`, then PASS
or FAIL: every rank's measurement within the noise of the model (below); the unsplit figure (tp=1)
more than 4 times the noise away, so the check tells a split from none. Full recompute keeps only the layer input, too small at this
size against the logits for the L - L/2 difference to isolate; it is left to T = 1's test.
"""
import argparse
import datetime
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, __file__.rsplit("/tests/", 1)[0])
import sp as sp_  # noqa: E402
import tp as tp_  # noqa: E402
from harness import teardown  # noqa: E402
from harness.models import load_config  # noqa: E402
from harness.recompute import activation_bytes, per_layer_measured  # noqa: E402

# The measured noise: on one rank, across runs, a case's L - L/2 difference moves by at most
# one (b, s, h/T) float32 tensor (16 KiB of 280-380 KiB on tiny; 8 KiB in bf16), freed earlier
# or later around a collective; most runs are byte-exact. The tolerance is that one tensor.
def noise(cfg, b, s, T):
    return b * s * cfg.hidden_size // T * 4


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="tiny")
    p.add_argument("--modes", nargs="+", default=["none", "selective"])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--plant", choices=["sp-unsplit"], help="a wrong model that must FAIL: "
                   "the norms' tokens not split under SP")
    p.add_argument("--timeout", type=int, default=60, help="the process group's, in seconds")
    a = p.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.timeout))
    T, rank = dist.get_world_size(), dist.get_rank()
    cfg, ok = load_config(a.preset), True
    for dtype in (torch.float32, torch.bfloat16):
        for mode in a.modes:
            for sp in (False, True):
                wrap = sp_.parallelize if sp else tp_.parallelize
                got = per_layer_measured(cfg, mode, "sdpa", dtype, a.batch, a.seq, repeats=0,
                                         wrap=wrap)["per_layer"]
                every = [None] * T
                dist.all_gather_object(every, got)
                want, unsplit = (activation_bytes(cfg, a.batch, a.seq, dtype.itemsize, mode,
                                                  "sdpa", tp=t, sp=sp and t > 1
                                                  and a.plant != "sp-unsplit")["per_layer"]
                                 for t in (T, 1))
                tol = noise(cfg, a.batch, a.seq, T)
                ok &= (all(abs(m - want) <= tol for m in every)
                       and abs(unsplit - want) > 4 * tol)
                if rank == 0:
                    print(f"{str(dtype)[6:]} {mode} sp={sp} measured {every} model {want} "
                          f"unsplit {unsplit}", flush=True)
    if rank == 0:
        print("PASS" if ok else "FAIL", flush=True)
    teardown()
    return ok


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
