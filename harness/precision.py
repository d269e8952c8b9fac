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
from .collectives import local_part
from .plants import planted

LOW_PRECISION = (torch.bfloat16, torch.float16)


class Masters:
    """fp32 master copies for a torch optimizer class (a mixin: `class MasterAdamW(Masters,
    torch.optim.AdamW)`, muon.py's MasterMuon): the optimizer's parameters are the masters,
    `model_params` the module's own. Build it once the module's weights are final (after any
    broadcast or checkpoint load): the masters are copied from them here. params: tensors or
    parameter groups, as torch's optimizers take them."""

    def __init__(self, params, **kw):
        groups = list(params)
        if groups and not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        self.model_params, self.masters, master_groups = [], [], []
        for g in groups:
            ps = list(g["params"])
            ms = [p.detach().float().clone() if p.dtype in LOW_PRECISION else p for p in ps]
            self.model_params += ps
            self.masters += ms
            master_groups.append(dict(g, params=ms))
        super().__init__(master_groups, **kw)
        self.low = [(p, m) for p, m in zip(self.model_params, self.masters) if m is not p]
        self.grad_divisor = 1.0   # float16's loss scale S (harness/loss_scale.py): the
        #                           gradients arrive times S and are divided in fp32, here

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
        if self.grad_divisor != 1.0 and not planted("loss-scale-no-unscale"):   # plant: S g
            # every gradient the step uses, in fp32: the masters' copies, and the gradients of
            # parameters kept in fp32 (a router, a norm), which are their own masters
            torch._foreach_div_([local_part(m.grad) for m in self.masters
                                 if m.grad is not None], self.grad_divisor)
        loss = super().step(closure)
        if self.low and not planted("master-no-copy"):   # plant: the bf16 weights never move
            # the bf16 copies of the updated masters, in one pass
            # (a DTensor's local part: torch has no sharding rule for _foreach_copy_)
            torch._foreach_copy_([local_part(p) for p, _ in self.low],
                                 [local_part(m) for _, m in self.low])
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
                raise ValueError(f"{type(self).__name__}.load_state_dict: {len(masters)} fp32 "
                                 f"masters for {len(self.low)} low-precision parameters")
            with torch.no_grad():
                for (p, m), saved in zip(self.low, masters):
                    m.copy_(saved)
                    p.copy_(m)

    def master_tensors(self) -> list[torch.Tensor]:
        """The fp32 copies (optimizer-side memory: 4 bytes per low-precision parameter)."""
        return [m for m, p in zip(self.masters, self.model_params) if m is not p]


class MasterAdamW(Masters, torch.optim.AdamW):
    """torch.optim.AdamW over fp32 master copies of low-precision parameters. It is a torch
    optimizer (schedulers, `param_groups`, `state_dict` work)."""


def muon_kwargs(args, param_dtype: torch.dtype) -> dict:
    """muon.MuonAdamW's settings from the run's arguments (OracleMuon's: torch.optim.Muon's
    momentum 0.95 with nesterov; AdamW's betas and eps as adamw_kwargs)."""
    mode = getattr(args, "muon_mode", "auto")
    return dict(weight_decay=args.weight_decay, momentum=0.95, nesterov=True,
                ns_dtype=ns_dtype(args, param_dtype), betas=(0.9, 0.95), eps=1e-8,
                shard_mode="owner" if mode == "auto" else mode)


def ns_dtype(args, param_dtype: torch.dtype) -> torch.dtype:
    """Muon's Newton-Schulz dtype for a model of `param_dtype` (the one rule for muon.py and the
    reference's OracleMuon), by --muon-ns-dtype: auto, bfloat16 for a bf16/fp16 model as
    torch.optim.Muon, the parameters' own dtype for float32 and float64 (exact); float32, the
    same but float32 for a bf16/fp16 model; bfloat16, torch's everywhere."""
    choice = getattr(args, "muon_ns_dtype", "auto")
    if choice == "bfloat16":
        return torch.bfloat16
    if param_dtype in LOW_PRECISION:
        return torch.float32 if choice == "float32" else torch.bfloat16
    return param_dtype


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
        p.is_floating_point() for p in params)
    # all DTensors (fsdp.py's shards, FSDP2's) or none: a mix (DTensor TP's replicated norms
    # beside its shards) stays on foreach
    ok = ok and len({isinstance(p, DTensor) for p in params}) == 1
    return {"fused": True} if ok else {}


def adamw_update(state: dict, g: dict, ps: list) -> None:
    """torch's AdamW (torch.optim.adamw.adamw; fused where fused_kwargs allows) on the
    parameters `ps` of parameter group `g`, their states in `state` under torch's names (step,
    exp_avg, exp_avg_sq): muon.MuonAdamW's update of its non-matrix groups."""
    from torch.optim.adamw import adamw
    kw = fused_kwargs(ps)
    for p in ps:
        st = state[p]
        if not st:
            st["step"] = torch.zeros((), dtype=torch.float32, device=p.device if kw else "cpu")
            st["exp_avg"] = torch.zeros_like(p)
            st["exp_avg_sq"] = torch.zeros_like(p)
    sts = [state[p] for p in ps]
    adamw(ps, [p.grad for p in ps], [s["exp_avg"] for s in sts], [s["exp_avg_sq"] for s in sts],
          [], [s["step"] for s in sts], amsgrad=False, beta1=g["betas"][0],
          beta2=g["betas"][1], lr=g["lr"], weight_decay=g["weight_decay"], eps=g["eps"],
          maximize=False, **(kw or {"foreach": False}))


def adamw_kwargs(params, args) -> dict:
    """The reference's AdamW hyperparameters, on the fused kernel where there is one."""
    return dict(lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.95), eps=1e-8,
                **fused_kwargs(params))


def make_adamw(params, args) -> torch.optim.AdamW:
    """The AdamW every strategy and the reference use: fp32 masters for bf16 parameters. A
    frozen parameter (--lora's base) is left out: no master, no state."""
    params = [p for p in params if not isinstance(p, torch.nn.Parameter) or p.requires_grad]
    kw = adamw_kwargs(params, args)
    if any(p.dtype in LOW_PRECISION for p in params):
        return MasterAdamW(params, **kw)
    return torch.optim.AdamW(params, **kw)
