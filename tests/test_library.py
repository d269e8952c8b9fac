"""The public API in a user's own loop (tests/library_oracles.py): ddp.DataParallel against
torch DDP, zero.ZeroOptimizer against the unsharded torch optimizer, fsdp.fully_shard against
FSDP2, each with a negative control the comparison must see, and bad input."""
import os

import pytest

from conftest import ROOT, torchrun

# the verdict lines library_oracles.py prints, by check
EXPECTED = {
    "ddp": ["ddp adamw, set_to_none, no_sync x2, find_unused: DataParallel vs torch DDP",
            "control ddp without the initial broadcast",
            "control ddp without the gradient all-reduce",
            "ddp sgd momentum, zero in place, unused param: DataParallel vs torch DDP",
            "ddp with reentrant activation checkpointing, summing: DataParallel vs itself "
            "without",
            "ddp float64 and float32 parameters: DataParallel vs torch DDP"],
    "zero": [f"zero stage {s} sgd, accum 2, one bucket, model.zero_grad(): ZeroOptimizer vs "
             f"torch.optim" for s in (2, 1)]
    + [f"zero stage {s} {k}{extra}: {what}"
             for s, k, extra in ((1, "adamw", ""), (2, "adamw", ", accum 2, clip 0.05"),
                                 (2, "sgd", ", accum 2"), (1, "adam", ""))
             for what in ("ZeroOptimizer vs torch.optim on the global batch",
                          "state_dict() vs the torch optimizer's",
                          "load_state_dict(torch's) then 2 more steps")]
    + [f"zero stage 2 {k}, StepLR: ZeroOptimizer vs torch.optim"
       for k in ("adamax", "nadam", "radam", "rmsprop", "adagrad")]
    + ["zero stage 1 adamw, accum 2, clip 0.05, last backward in reduce_in_backward(): "
       "ZeroOptimizer vs torch.optim",
       "control zero stage 1: a backward after reduce_in_backward's is refused",
       "control zero stage 2 summing instead of averaging"],
    "fsdp": ["fsdp adamw, accum 2 without sync, clip 0.05: fully_shard vs FSDP2, 5 steps, "
             "shards and grads as to_local()",
             "fsdp sgd, reshard_after_forward=False: fully_shard vs FSDP2",
             "fsdp adamw, accum 2 reducing each, an unused layer: fully_shard vs FSDP2",
             "fsdp adamw, float32 with a bfloat16 policy: fully_shard vs FSDP2",
             "fsdp bfloat16 policy: the fp32 shards are the initial weights",
             "control fsdp bfloat16 policy: masters rounded through param_dtype",
             "fsdp adamw, float32 with a float16 policy: fully_shard vs FSDP2",
             "fsdp float16 policy: the fp32 shards are the initial weights",
             "control fsdp float16 policy: masters rounded through param_dtype",
             "fsdp HF Llama sgd, float32: fully_shard vs FSDP2",
             "fsdp HF Llama adamw, float32 with a bfloat16 policy: fully_shard vs FSDP2",
             "fsdp sgd, accum 2: fully_shard vs torch.optim on the global batch",
             "fsdp adamw, clip 0.05: fully_shard vs torch.optim on the global batch",
             "fsdp fc2 in ignored_params: vs sharded",
             "fsdp state_dict() as to_local(), full_state_dict -> load_full_state_dict",
             "fsdp sgd, accum 2, fc2 under reentrant checkpointing: vs without",
             "fsdp sgd, accum 2, fc2 under non-reentrant checkpointing: vs without",
             "fsdp sgd, a layer used on rank 0 only: fully_shard vs torch DDP",
             "control fsdp no-average", "control fsdp sync-drops-accumulated",
             "error: Muon over fully_shard's shards: fsdp: Muon would update a shard",
             "error: a tie across units: fully_shard: Linear.weight is tied"],
    "errors": ["error: ZeroOptimizer(LBFGS): ZeroOptimizer: LBFGS is not known to update "
               "elementwise", "error: ZeroOptimizer(Adafactor)",
               "error: DataParallel(meta module): DataParallel: emb.weight is on the meta device"],
}


def oracles(world, only):
    p = torchrun(os.path.join(ROOT, "tests", "library_oracles.py"), world, "--only",
                 ",".join(only))
    lines = [l for l in p.stdout.splitlines() if l.startswith(("PASS", "FAIL"))]
    return p, lines


def check(p, lines, only):
    want = [w for k in only for w in EXPECTED[k]]
    assert p.returncode == 0 and not any(l.startswith("FAIL") for l in lines), \
        p.stdout + p.stderr[-3000:]
    assert len(lines) == len(want), lines
    for line, w in zip(lines, want):
        assert line.startswith("PASS " + w), (line, w)


def test_library_against_torch_w2():
    only = ["ddp", "zero", "fsdp", "errors"]
    check(*oracles(2, only), only)


@pytest.mark.slow
def test_library_against_torch_w3():
    # uneven: 3 ranks, ZeRO's flat buffers and FSDP's dim-0 chunks padded
    only = ["ddp", "zero", "fsdp"]
    check(*oracles(3, only), only)
