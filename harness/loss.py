"""loss.py: The loss normalisation every strategy must reproduce: the mean cross-entropy over all
target tokens of the global batch. A strategy computes the CE *sum* over its own tokens
(`lm_loss_sum`) and divides by `batch.n_tokens`; `global_loss` is the logged value."""
from __future__ import annotations


import torch
import torch.distributed as dist
import torch.nn.functional as F

from .meter import METER


IGNORE_INDEX = -100


def lm_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of token cross-entropies; half-precision logits are upcast to fp32 first."""
    if logits.dtype in (torch.bfloat16, torch.float16):
        logits = logits.float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction="sum")


def scalar(t: torch.Tensor) -> float:
    """`t.item()` for logging, and NaN for a FakeTensor (oom_search --simulate runs the real step
    on FakeTensors, which have shapes but no values)."""
    from torch._subclasses.fake_tensor import FakeTensor
    return float("nan") if isinstance(t, FakeTensor) else t.item()


def global_loss(local_sum: torch.Tensor, n_tokens: int, group=None) -> float:
    """The global mean loss from each rank's CE sum (logging only: not metered)."""
    t = local_sum.detach().to(torch.float64).reshape(1).clone()
    with METER.paused():
        dist.all_reduce(t, group=group)
    return scalar(t) / n_tokens
