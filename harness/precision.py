"""precision.py: the mixed-precision policy's optimizer side: fp32 master weights.

With `--dtype bfloat16` every strategy computes in bf16 (parameters, activations, gradients as
autograd makes them), and the optimizer keeps an fp32 master copy of each bf16 parameter with
fp32 Adam states, as Megatron and DeepSpeed do (Micikevicius et al. 2018):

    step:   master.grad = param.grad (to fp32);  AdamW on the masters;  param = master (to bf16)

Without masters an update smaller than half a bf16 ulp of its weight (2^-9 relative) is lost,
so a long bf16 run drifts away from the same run in fp32. ZeRO's `ZeroOptimizer` applies the same
policy to its flat shards. float32 and float64 parameters are their own masters: `make_adamw`
then returns a plain `torch.optim.AdamW`. Gradients are summed across data-parallel ranks in
fp32 by default (`grad_reduce_dtype`).
"""
from __future__ import annotations

import torch
from .plants import planted

LOW_PRECISION = (torch.bfloat16, torch.float16)


class MasterAdamW(torch.optim.AdamW):
    """torch.optim.AdamW over fp32 master copies of low-precision parameters.

    It is a torch optimizer (schedulers, `param_groups`, `state_dict` work); its parameters are
    the masters, `model_params` the module's own. Build it once the module's weights are final
    (after any broadcast or checkpoint load): the masters are copied from them here."""

    def __init__(self, params, **kw):
        self.model_params = [p for p in params]
        self.masters = [p.detach().float().clone() if p.dtype in LOW_PRECISION else p
                        for p in self.model_params]
        super().__init__(self.masters, **kw)
        self.low = [(p, m) for p, m in zip(self.model_params, self.masters) if m is not p]

    def zero_grad(self, set_to_none: bool = True):
        super().zero_grad(set_to_none)
        for p in self.model_params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None and not planted("master-keeps-grads"):   # plant: kept
                p.grad.zero_()

    @torch.no_grad()
    def step(self, closure=None):
        for p, m in self.low:
            m.grad = None if p.grad is None else p.grad.float()
        loss = super().step(closure)
        if self.low and not planted("master-no-copy"):   # plant: the bf16 weights never move
            # the bf16 copies of the updated masters, in one pass
            torch._foreach_copy_([p for p, _ in self.low], [m for _, m in self.low])
        for _, m in self.low:
            m.grad = None
        return loss

    def state_dict(self) -> dict:
        """torch's state dict, plus the fp32 masters of the low-precision parameters (without
        them a resume would rebuild the masters from the rounded bf16 weights)."""
        sd = super().state_dict()
        sd["fp32_masters"] = [m.detach().clone() for _, m in self.low]
        return sd

    def load_state_dict(self, state_dict: dict):
        """The inverse of state_dict: the masters restored in fp32, the module's parameters
        set to their rounding. A state dict without masters (torch.optim.AdamW's) keeps the
        masters copied from the parameters."""
        state_dict = dict(state_dict)
        masters = state_dict.pop("fp32_masters", None)
        super().load_state_dict(state_dict)
        if masters is not None:
            if len(masters) != len(self.low):
                raise ValueError(f"MasterAdamW.load_state_dict: {len(masters)} fp32 masters "
                                 f"for {len(self.low)} low-precision parameters")
            with torch.no_grad():
                for (p, m), saved in zip(self.low, masters):
                    m.copy_(saved)
                    p.copy_(m)

    def master_tensors(self) -> list[torch.Tensor]:
        """The fp32 copies (optimizer-side memory: 4 bytes per low-precision parameter)."""
        return [m for m, p in zip(self.masters, self.model_params) if m is not p]


def grad_reduce_dtype(dtype: torch.dtype, args=None) -> torch.dtype:
    """The dtype of the data-parallel gradient reductions (DDP's bucket all-reduce, ZeRO's and
    FSDP's reduce-scatter) and of ZeRO/FSDP's gradient shards, which accumulate the
    micro-batches: fp32 for bf16/fp16 gradients (--reduce-dtype float32, the default, as
    FSDP2's reduce_dtype and Megatron's fp32 grad buffers), the gradients' own dtype with
    --reduce-dtype param (half the bytes, one rounding per term of the sum); fp32 and fp64
    gradients reduce in their own dtype. Without args (the library API's reduce_dtype="auto"):
    the default, fp32 for bf16/fp16."""
    if dtype in LOW_PRECISION and getattr(args, "reduce_dtype", "float32") == "float32":
        return torch.float32
    return dtype


def fused_kwargs(params) -> dict:
    """{"fused": True} where torch has the fused AdamW kernel for these tensors (floating point,
    on CPU or CUDA, all on one device type): one kernel per device and dtype instead of a loop
    of elementwise ops (scripts/optimizer_step.py measures it against foreach=True:
    results/optimizer-cpu.json)."""
    from torch.distributed.tensor import DTensor
    params = list(params)
    kinds = {p.device.type for p in params}
    ok = params and len(kinds) == 1 and kinds <= {"cpu", "cuda"} and all(
        p.is_floating_point() and not isinstance(p, DTensor) for p in params)
    return {"fused": True} if ok else {}   # (DTensor parameters, the baselines': foreach)


def adamw_kwargs(params, args) -> dict:
    """The reference's AdamW hyperparameters, on the fused kernel where there is one."""
    return dict(lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.95), eps=1e-8,
                **fused_kwargs(params))


def make_adamw(params, args) -> torch.optim.AdamW:
    """The AdamW every strategy and the reference use: fp32 masters for bf16 parameters."""
    params = list(params)
    kw = adamw_kwargs(params, args)
    if any(p.dtype in LOW_PRECISION for p in params):
        return MasterAdamW(params, **kw)
    return torch.optim.AdamW(params, **kw)
