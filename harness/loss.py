"""loss.py: The loss normalisation every strategy must reproduce: the mean cross-entropy over all
target tokens of the global batch. A strategy computes the CE *sum* over its own tokens
(`lm_loss_sum`) and divides by `batch.n_tokens`; `global_loss` is the logged value.

Chunked cross-entropy (`--ce-chunk N`, `chunked_loss_sum`): the logits of N tokens at a time.
The full (tokens, vocabulary) logits are the largest activation of a small model on a long
sequence: at S = 16,384 and V = 128,256 the bf16 logits, their float32 upcast, the
log-softmax kept for the backward and the gradient are 12 bytes per entry, 23.5 GiB.
ChunkedCrossEntropy forms each chunk's logits from the final hidden states and the head's
weight, reduces them to the chunk's loss and, in the same pass,
to its gradients with respect to the hidden states and the weight (autograd on the chunk: the
very loss function and rounding of the plain path), then frees them; its backward only scales
the accumulated gradients by the incoming one. Peak: one chunk's logits (12 bytes per entry in
bf16), the float32 gradients of the hidden states (4 N H) and of the weight (4 V H), kept from
the forward to the backward, and one chunk's weight gradient on its way into that sum (2 V H;
scripts/chunked_ce.py measures it: results/chunked-ce-cpu.json). The head's flops are the plain path's (one matmul forward, two for
the gradients), so the step time is unchanged up to the chunk loop (Liger-Kernel's fused linear
cross-entropy does the same in a fused kernel). The loss function is a parameter: tp.py passes
its vocab-parallel one (three all-reduces per chunk instead of three in all, the same bytes).
"""
from __future__ import annotations

import contextlib


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


class ChunkedCrossEntropy(torch.autograd.Function):
    """sum over tokens of loss_sum(hidden @ weight.T, labels), `chunk` tokens at a time, the
    gradients computed in the forward (module docstring). hidden (..., H), labels (...)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk, loss_sum):
        h, y = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
        acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        need_h, need_w = ctx.needs_input_grad[:2]
        gh = torch.zeros(h.shape, dtype=acc, device=h.device) if need_h else None
        gw = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        w = weight.detach().requires_grad_(need_w)
        total = torch.zeros((), dtype=acc, device=h.device)
        for i in range(0, h.shape[0], chunk):
            with torch.enable_grad():
                hc = h[i:i + chunk].detach().requires_grad_(need_h)
                loss = loss_sum(hc @ w.t(), y[i:i + chunk])
            total += loss.detach()
            wanted = [(t, g) for t, g, need in ((hc, gh, need_h), (w, gw, need_w)) if need]
            if wanted:
                grads = torch.autograd.grad(loss, [t for t, _ in wanted])
                if need_h:
                    gh[i:i + chunk] = grads[0]
                if need_w:
                    gw += grads[-1]
            del loss
        ctx.save_for_backward(gh, gw)
        ctx.meta = hidden.shape, hidden.dtype, weight.dtype
        return total

    @staticmethod
    def backward(ctx, g):
        gh, gw = ctx.saved_tensors
        shape, h_dtype, w_dtype = ctx.meta
        return (None if gh is None else (gh * g).to(h_dtype).reshape(shape),
                None if gw is None else (gw * g).to(w_dtype), None, None, None)


@contextlib.contextmanager
def head_deferred(head: torch.nn.Module):
    """Inside, the LM head module returns its input: the model's .logits are the final hidden
    states, as the head receives them (after its hooks: a tensor-parallel region's entry)."""
    head.forward = lambda x: x
    try:
        yield head
    finally:
        del head.forward


def chunked_loss_sum(model, input_ids, labels, chunk: int, loss_sum=lm_loss_sum,
                     **kwargs) -> torch.Tensor:
    """The CE sum of `model` (an HF causal LM, or a wrapper with it at .module) on input_ids,
    `chunk` tokens of logits at a time (ChunkedCrossEntropy); the same value and gradients as
    loss_sum(model(input_ids).logits, labels). `loss_sum`: the CE sum of a chunk's logits
    (tp.py passes its vocab-parallel one with its local head shard)."""
    head = getattr(model, "module", model).lm_head
    with head_deferred(head):
        hidden = model(input_ids=input_ids, **kwargs).logits
    return ChunkedCrossEntropy.apply(hidden, head.weight, labels, chunk, loss_sum)
