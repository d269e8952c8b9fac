"""loss_scale.py: float16 training needs a loss scale, bfloat16 does not; measured on one device.

    python -m harness.loss_scale --batch 4 --steps 20 --init-scale 2^24

The idea (Micikevicius et al. 2018, "Mixed Precision Training")
    float16 keeps 10 mantissa bits but only 5 exponent bits: nothing below 2^-25 survives
    (2^-24 is its smallest subnormal), and below 2^-14 (the smallest normal number) a value keeps fewer bits the smaller it is.
    A language model's gradients are small (the loss is a mean over every token of the batch,
    so each logit's gradient is ~1/N), and a share of them falls there. The fix: multiply the
    loss by S before the backward, so every gradient of the backward is S times larger and
    lands in float16's range, and divide the gradients by S in fp32, on the master copies,
    before the optimizer uses them. Too large an S overflows (65504 is float16's largest):
    an inf or nan anywhere and the step is skipped. The dynamic rule (torch.amp.GradScaler's,
    Megatron's DynamicGradScaler without its hysteresis): an overflow halves S and skips the
    step; `growth_interval` steps in a row without one double it.
    bfloat16 has float32's 8 exponent bits: every gradient float32 can hold, bf16 can too, so
    no scale is needed; it pays with 7 mantissa bits (8x float16's rounding). Either way the
    optimizer keeps fp32 masters (harness/precision.py): an update under half a unit in the
    last place of its 16-bit weight would otherwise be lost.

Under parallelism
    Ranks that hold different gradients (TP's and pipeline stages' own parameters, ZeRO's and
    FSDP's reduce-scattered shards) each see only theirs: an overflow on one rank must skip the
    step on all of them, or the replicas part ways (one rank keeps the old weights, the
    others step). `found_inf` is all-reduced (MAX) over every rank that steps before anyone
    decides (Megatron: over the model-parallel group, or every gradient-holding rank with
    its distributed optimizer). After DDP's all-reduce the replicas' gradients are equal,
    and so is their verdict, but not under ZeRO. In this suite no strategy trains in float16
    (`--dtype` is float64, float32 or bfloat16): the rule is shown and tested on its own
    (tests/loss_scale_check.py: ranks holding different fp16 parameters).

The step (`DynamicLossScaler.step`), given fp16 parameters and harness.precision's masters
    found = any inf/nan in the fp16 gradients        (a device scalar)
    all_reduce(found, MAX, group)                    (every rank the same verdict)
    read found to the host                           (the step's one host read: Megatron reads
                                                      it too; torch's GradScaler hands found_inf
                                                      to a fused optimizer instead, which skips
                                                      on the device)
    found: no step, S <- S * backoff_factor; else the masters' fp32 copies divided by S, the
    optimizer's step, and S <- S * growth_factor after growth_interval good steps in a row

Public API
    DynamicLossScaler(init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5,
                      growth_interval=2000, group=None)
        .scale_loss(loss) -> loss * S      .step(optimizer) -> True if it stepped
        .scale (float), .skipped (int)
    census(model32, ids, labels, dtype, scale) -> dict   one step's gradients in dtype at loss
        scale S against float32's: zero where float32 is not, subnormal, non-finite, relative error
    python -m harness.loss_scale ...   the formats, the census at the first and the last step,
        and float32 / bfloat16 / float16 without and with the scaler trained from one start
"""
from __future__ import annotations

import argparse
import copy
import math
import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .plants import planted
from .precision import make_adamw


# ----------------------------------------------------------------------------------------------
# The scaler
# ----------------------------------------------------------------------------------------------
def found_non_finite(grads, device) -> torch.Tensor:
    """1.0 if any gradient holds an inf or a nan, else 0.0: a float32 scalar on `device` (the
    parameters'; 0.0 without gradients: a rank holding none still joins the all-reduce)."""
    if not grads:
        return torch.zeros((), device=device)
    flags = [torch.logical_not(torch.isfinite(g)).any() for g in grads]
    return torch.stack(flags).any().float()


class DynamicLossScaler:
    """The loss scale S of float16 training and its dynamic rule (module docstring). Use:

        loss = scaler.scale_loss(loss); loss.backward(); scaler.step(optimizer)

    `optimizer`: harness.precision's MasterAdamW (fp32 masters of fp16 parameters), whose
    `grad_divisor` divides the gradients in fp32 inside its step, so that nothing is divided
    in float16. `group`: the ranks that must skip together (None: this process alone). The
    division happens inside the optimizer's step, so there is no point between it and the
    update to clip at: clipping under a loss scale needs the division split out (torch's
    GradScaler.unscale_), not offered here."""

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, group=None):
        self.scale, self.growth_factor, self.backoff_factor = init_scale, growth_factor, \
            backoff_factor
        self.growth_interval, self.group = growth_interval, group
        self.good_steps = 0     # steps in a row without an overflow
        self.skipped = 0        # steps skipped so far

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    @torch.no_grad()
    def step(self, optimizer) -> bool:
        if not hasattr(optimizer, "grad_divisor"):
            raise TypeError("DynamicLossScaler.step needs harness.precision's MasterAdamW "
                            "(make_adamw over float16 parameters)")
        grads = [p.grad for p in optimizer.model_params if p.grad is not None]
        found = found_non_finite(grads, optimizer.model_params[0].device)   # () float32
        if self.group is not None and not planted("loss-scale-local-inf"):   # plant: own verdict
            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=self.group)
        if found.item():                                      # the one host read
            optimizer.zero_grad(set_to_none=True)
            self.scale *= self.backoff_factor
            self.good_steps, self.skipped = 0, self.skipped + 1
            return False
        optimizer.grad_divisor = self.scale                   # unscaled in fp32, on the masters
        optimizer.step()
        optimizer.grad_divisor = 1.0
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0
        return True


# ----------------------------------------------------------------------------------------------
# The measurements
# ----------------------------------------------------------------------------------------------
def formats() -> list[dict]:
    """The three formats' ranges, from torch.finfo."""
    rows = []
    for dt in (torch.float16, torch.bfloat16, torch.float32):
        f = torch.finfo(dt)
        rows.append(dict(name=str(dt).split(".")[1], mantissa=int(round(-math.log2(f.eps))),
                         exponent=f.bits - 1 - int(round(-math.log2(f.eps))), max=f.max,
                         normal=f.tiny, subnormal=f.tiny * f.eps, eps=f.eps))
    return rows


def _loss(model, ids, labels) -> torch.Tensor:
    """The mean next-token cross-entropy, in float32 whatever the model's dtype."""
    logits = model(input_ids=ids).logits.float()          # (B, S, V)
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _layer_output_grads(model, ids, labels, scale: float) -> tuple[list, list]:
    """One forward and backward with the loss times `scale`: the parameters' gradients and the
    gradients of each decoder layer's output (the activation gradients the backward carries
    from layer to layer), as autograd made them, in the model's dtype."""
    acts, hooks = [], []

    def keep(module, inputs, out):
        h = out[0] if isinstance(out, tuple) else out        # (B, S, H)
        h.register_hook(lambda g: acts.append(g.detach()))

    for layer in model.model.layers:
        hooks.append(layer.register_forward_hook(keep))
    model.zero_grad(set_to_none=True)
    try:
        (_loss(model, ids, labels) * scale).backward()
    finally:
        for h in hooks:
            h.remove()
    return [p.grad for p in model.parameters()], acts[::-1]   # (backward order -> layer order)


def census(model32, ids, labels, dtype, scale: float, ref=None) -> dict:
    """One forward and backward of a `dtype` copy of model32 with the loss times `scale`, against
    model32's own in float32: for the parameter gradients and for the layer outputs' gradients,
    the share of entries that are zero where float32's is not (underflow, or rounding that
    cancels: a difference of two nearly equal numbers, which both formats show at any scale)
    and the share subnormal in `dtype` (0 < |g| < its smallest normal: fewer mantissa bits the
    smaller); the inf/nan entries of both; the parameter gradients' relative error
    ||g/scale - g32|| / ||g32|| (None when any entry is not finite: the step would be
    skipped). Shares are of all entries. ref: model32's own gradients on this batch
    (_layer_output_grads at scale 1), when several rows share them."""
    ref_p, ref_a = ref or _layer_output_grads(model32, ids, labels, 1.0)
    low_p, low_a = _layer_output_grads(copy.deepcopy(model32).to(dtype), ids, labels, scale)
    tiny = torch.finfo(dtype).tiny

    def shares(low, ref):
        n = sum(g.numel() for g in ref)
        zeroed = sum(int(((g == 0) & (r != 0)).sum()) for g, r in zip(low, ref))
        subnormal = sum(int(((g != 0) & (g.abs() < tiny)).sum()) for g in low)
        return zeroed / n, subnormal / n

    bad = sum(int((~torch.isfinite(g)).sum()) for g in low_p + low_a)
    err = None
    if not bad:
        num = sum(float(((g.double() / scale - r.double()) ** 2).sum())
                  for g, r in zip(low_p, ref_p))
        err = math.sqrt(num / sum(float((r.double() ** 2).sum()) for r in ref_p))
    (pf, ps), (af, as_) = shares(low_p, ref_p), shares(low_a, ref_a)
    return dict(dtype=str(dtype).split(".")[1], scale=scale, param_zeroed=pf,
                param_subnormal=ps, act_zeroed=af, act_subnormal=as_, non_finite=bad,
                rel_error=err)


def train(model32, batches, dtype, lr: float, scaler: DynamicLossScaler | None = None) -> dict:
    """AdamW on a `dtype` copy of model32 over `batches` (fp32 masters for 16-bit parameters,
    harness.precision), the loss scaled by `scaler` if given. The losses, skipped steps and
    the scale at each step."""
    model = copy.deepcopy(model32).to(dtype)
    opt = make_adamw(model.parameters(), argparse.Namespace(lr=lr, weight_decay=0.0))
    losses, scales = [], []
    for ids, labels in batches:
        loss = _loss(model, ids, labels)
        losses.append(float(loss.detach()))                          # (the logged loss)
        scales.append(scaler.scale if scaler else 1.0)
        (scaler.scale_loss(loss) if scaler else loss).backward()
        if scaler:
            scaler.step(opt)
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)
    return dict(losses=losses, scales=scales, skipped=scaler.skipped if scaler else 0,
                model=model)


def _scale_arg(text: str) -> float:
    """A loss scale on the command line: a number, or 2^k."""
    return 2.0 ** float(text[2:]) if text.startswith("2^") else float(text)


def _pow2(x: float) -> str:
    e = math.log2(x)
    return f"2^{e:.0f}" if e == round(e) else f"{x:g}"


def main(argv=None):
    from transformers import AutoModelForCausalLM
    from .data import MarkovLanguage
    from .models import load_config, model_kwargs
    p = argparse.ArgumentParser(prog="python -m harness.loss_scale",
                                description="float16 with and without a loss scale against "
                                            "bfloat16 and float32, one process")
    p.add_argument("--model", default="tiny", help="a preset of harness/models.py or a config")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--length", type=int, default=64)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--init-scale", type=_scale_arg, default=2.0 ** 16,
                   help="the scaler's first S, a number or 2^k (default 2^16: "
                        "torch.amp.GradScaler's)")
    p.add_argument("--growth-interval", type=int, default=2000,
                   help="good steps in a row before S doubles (GradScaler's default 2000)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    config = load_config(a.model)
    lang = MarkovLanguage(config.vocab_size, a.seed)
    batches = []
    for s in range(a.steps):
        x = torch.from_numpy(lang.sample(s * a.batch, a.batch, a.length))   # (B, S + 1)
        batches.append((x[:, :-1], x[:, 1:]))
    torch.manual_seed(a.seed)
    model32 = AutoModelForCausalLM.from_config(config, **model_kwargs(config, "eager")).float()
    model32.train()
    print(f"float16 against bfloat16: {a.model} ({config.num_hidden_layers} layers, h "
          f"{config.hidden_size}), batch {a.batch} x {a.length} tokens, AdamW lr {a.lr}, fp32 "
          f"masters, one CPU process")
    print(f"{'format':<9} {'exponent':>8} {'mantissa':>8} {'largest':>9} {'smallest normal':>15} "
          f"{'smallest subnormal':>18} {'eps':>8}")
    for f in formats():
        print(f"{f['name']:<9} {f['exponent']:>8} {f['mantissa']:>8} {f['max']:>9.3g} "
              f"{f['normal']:>15.3g} {f['subnormal']:>18.3g} {f['eps']:>8.3g}")

    runs = {"float32": train(model32, batches, torch.float32, a.lr),
            "bfloat16": train(model32, batches, torch.bfloat16, a.lr),
            "float16, no scale": train(model32, batches, torch.float16, a.lr)}
    scaler = DynamicLossScaler(a.init_scale, growth_interval=a.growth_interval)
    runs["float16, dynamic scale"] = train(model32, batches, torch.float16, a.lr, scaler)

    trained = runs["float32"]["model"]
    print("one step's gradients against float32's (the same weights and batch), shares of the "
          "entries zero where float32's is not / subnormal: of the parameters' gradients, of the "
          "layer outputs' (the backward's activation gradients)")
    print(f"  {'weights':<8} {'dtype':<9} {'scale':>5} {'params zeroed':>14} {'subnormal':>9} "
          f"{'acts zeroed':>12} {'subnormal':>9} {'inf/nan':>7} {'rel. error':>10}")
    ids, labels = batches[-1]
    for when, m in (("step 0", model32), (f"step {a.steps}", trained)):
        ref = _layer_output_grads(m, ids, labels, 1.0)        # float32's, once per weights
        for dt, s in ((torch.float16, 1.0), (torch.float16, 2.0 ** 8), (torch.float16, 2.0 ** 16),
                      (torch.float16, 2.0 ** 24), (torch.bfloat16, 1.0)):
            c = census(m, ids, labels, dt, s, ref)
            err = "-" if c["rel_error"] is None else f"{c['rel_error']:.1e}"
            print(f"  {when:<8} {c['dtype']:<9} {_pow2(s):>5} {c['param_zeroed']:>14.2%} "
                  f"{c['param_subnormal']:>9.2%} {c['act_zeroed']:>12.2%} "
                  f"{c['act_subnormal']:>9.2%} {c['non_finite']:>7} {err:>10}")

    means = {name: statistics.mean(r["losses"][-10:]) for name, r in runs.items()}
    print(f"training {a.steps} steps from one start: the loss, mean of the last 10 steps")
    for name, r in runs.items():
        mean, extra = means[name], ""
        if name.endswith("dynamic scale"):
            extra = (f"; skipped {r['skipped']} steps, scale {_pow2(a.init_scale)} -> "
                     f"{_pow2(scaler.scale)} (min {_pow2(min(r['scales']))}, max "
                     f"{_pow2(max(r['scales']))})")
        print(f"  {name:<24} {mean:.4f} ({mean - means['float32']:+.4f} vs float32){extra}")
    return runs


if __name__ == "__main__":
    main()
