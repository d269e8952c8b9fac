"""loss.py: The loss normalisation every strategy must reproduce: the mean cross-entropy over all
target tokens of the global batch. A strategy computes the CE *sum* over its own tokens
(`lm_loss_sum`) and divides by `batch.n_tokens`; `global_loss` is the logged value.

Chunked cross-entropy (`--ce-chunk N`, `chunked_loss_sum`): the logits of N tokens at a time.
The full (tokens, vocabulary) logits are the largest activation of a small model on a long
sequence: at S = 16,384 and V = 128,256 the bf16 logits, their float32 upcast, the
log-softmax kept for the backward and the gradient are 12 bytes per entry, 23.5 GiB.
ChunkedCrossEntropy forms each chunk's logits from the final hidden states and the head's
weight, reduces them to the chunk's loss and, in the same pass, to its gradients with respect
to the hidden states and the weight (autograd on the chunk: the plain path's own loss
function; in float64 the same numbers to rounding, in bf16 the weight gradient is rounded once
per chunk and scaled after, so the two paths differ by bf16 noise), then frees them; its
backward only scales the accumulated gradients by the incoming one (so the head's gradient
matmuls run, and are timed, in the forward phase). Peak: in the forward one chunk's logits (12
bytes per entry in bf16) beside the float32 gradients of the hidden states (4 N H) and of the
weight (4 V H) kept for the backward; in the backward those and their scaled bf16 copies,
6 (N + V) H (scripts/chunked_ce.py measures both: results/chunked-ce-cpu.json). The head's
flops are the plain path's (one matmul forward, two for the gradients), so the step time is
unchanged up to the chunk loop (Liger-Kernel's fused linear cross-entropy does the same in a
fused kernel). The loss function is a parameter: tp.py passes its vocab-parallel one (three
all-reduces per chunk instead of three in all, the same bytes). Under no_grad (evaluation) the
chunks' losses are summed and no gradient is formed.
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
                del grads   # (before the next chunk's: one chunk's head gradient at a time)
            del loss
        ctx.save_for_backward(gh, gw)
        ctx.meta, ctx.chunk = (hidden.shape, hidden.dtype, weight.dtype), chunk
        return total

    @staticmethod
    def backward(ctx, g):
        gh, gw = ctx.saved_tensors
        shape, h_dtype, w_dtype = ctx.meta
        return (None if gh is None else _scaled(gh, g, h_dtype, ctx.chunk).reshape(shape),
                None if gw is None else _scaled(gw, g, w_dtype, ctx.chunk), None, None, None)


def _scaled(acc: torch.Tensor, g: torch.Tensor, dtype, rows: int) -> torch.Tensor:
    """(acc * g).to(dtype), `rows` rows at a time: one new tensor in dtype and a chunk-sized
    temporary, not a full float32 copy (the saved acc stays as it is: a second backward of
    the same graph scales it again from the start)."""
    out = torch.empty(acc.shape, dtype=dtype, device=acc.device)
    for i in range(0, acc.shape[0], rows):
        out[i:i + rows] = acc[i:i + rows] * g
    return out


@contextlib.contextmanager
def head_deferred(head: torch.nn.Module):
    """Inside, the LM head module returns its input: the model's .logits are the final hidden
    states, as the head receives them (after its hooks: a tensor-parallel region's entry). A
    forward already set on the instance is put back after."""
    if getattr(head, "bias", None) is not None or getattr(head, "weight", None) is None:
        raise ValueError(f"chunked cross-entropy: the LM head ({type(head).__name__}) must be "
                         f"a linear map without a bias")
    before = head.__dict__.get("forward")
    head.forward = lambda x: x
    try:
        yield head
    finally:
        if before is None:
            del head.forward
        else:
            head.forward = before


def chunked_loss_sum(model, input_ids, labels, chunk: int, loss_sum=lm_loss_sum,
                     **kwargs) -> torch.Tensor:
    """The CE sum of `model` (an HF causal LM, or a wrapper with it at .module) on input_ids,
    `chunk` tokens of logits at a time (ChunkedCrossEntropy); the same value and gradients as
    loss_sum(model(input_ids).logits, labels). `loss_sum`: the CE sum of a chunk's logits
    (tp.py passes its vocab-parallel one with its local head shard)."""
    from .collectives import local_part
    from .models import parts
    head = parts(model).head
    with head_deferred(head):
        hidden = model(input_ids=input_ids, **kwargs).logits
    w = local_part(head.weight)   # (tp's DTensor label: its local rows, differentiable)
    if not torch.is_grad_enabled():   # evaluation: the chunks' losses, no gradients formed
        h, y = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
        return sum(loss_sum(h[i:i + chunk] @ w.t(), y[i:i + chunk])
                   for i in range(0, h.shape[0], chunk))
    return ChunkedCrossEntropy.apply(hidden, w, labels, chunk, loss_sum)
