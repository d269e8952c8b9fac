"""lora.py: LoRA fine-tuning under the suite's parallelisms, from raw torch.distributed.

The idea (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models")
    Freeze the pretrained W [out, in] and learn two thin matrices A [r, in] and B [out, r]:
        y = W x + s B A x,     s = alpha / r,     r << min(out, in)
    B starts at zero, so training starts from W's function. Only A and B have gradients and
    optimizer states: Psi_a = r (in + out) per target against Psi = out in for W.
    peft (LoraConfig + get_peft_model) injects them: each target nn.Linear becomes a
    peft.tuners.lora.Linear holding base_layer, lora_A["default"] and lora_B["default"], so
    parameters are named `...q_proj.base_layer.weight`, `...q_proj.lora_A.default.weight`.

What each layout does with the adapters (a frozen parameter has no gradient: nothing to
reduce, no optimizer state)
    ddp, zero-1/2  reduce the adapters' gradients only: Psi_a * b bytes per step, not Psi * b
    tp             the adapters split by their base's kind (tp_plan.classify gives each one);
                   no extra collective forward or backward:
      column base  (q, k, v, gate, up: W's rows split, the input x whole on every rank)
                   B [out/T, r] split like W's rows: this rank's outputs are B_i (A x)
                   A [r, in] whole; its gradient sum_rows B_i^T dy_i x^T covers this rank's
                   outputs only: partial, all-reduced with tp's other partial gradients
      row base     (o, down: W's columns split, x split along in)
                   A [r, in/T] split like W's columns: A_i x_i is a partial sum
                   B [out, r] whole: B A_i x_i is partial too and rides on the all-reduce that
                   W_i x_i already needs (W x = sum_i W_i x_i; B A x = sum_i B A_i x_i); B's
                   gradient dy (A_i x_i)^T is partial: all-reduced with the others
      fused        (Phi3's qkv_proj, gate_up_proj) B split segment by segment, like W;
      kv-copy      (more ranks than kv heads) B holds this rank's kv head, like W
    Per step tp all-reduces the partial gradients once (rig.tp.partial_numel): r in per column
    target's A and r out per row target's B (tp_partial_numel; with more ranks than kv heads,
    k and v's B travel in n_kv-head buffers as the base's kv-copy rule has it), and no frozen
    tensor's. Freezing also removes backward collectives: the regions before the first trainable
    parameter send no input gradient (tp.region_all_reduces, sp.region_collectives).

Model states of a replica under AdamW (state_bytes; Psi: every parameter, the adapters
included): Psi b, plus for each of the Psi_a trainable ones a gradient (b), two fp32 moments
(8) and, when b = 2 (bf16), an fp32 master (4): bf16 2 Psi + 14 Psi_a against full
fine-tuning's 16 Psi; float32 4 Psi + 12 Psi_a.

Public API
    model = peft.get_peft_model(hf_model, LoraConfig(...)).base_model.model   (peft's own)
    tpm = tp.parallelize(model, group)    splits base and adapters (ColumnParallelLoRA,
                                          RowParallelLoRA below); tpm.reduce_partial_grads()
    merged(full_params) -> HF state dict  W + s B A for every adapter (merge)
    export(full_params, config, lora_config, out)   a merged HF directory and peft's adapter
                                          directory, from any layout's full tensors
    examples/lora_train.py: peft in a plain loop under tp.parallelize.

Run:  torchrun --nproc_per_node=2 tp.py --mode correctness --lora 8   (any strategy's --lora)
"""
from __future__ import annotations

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

from harness import planted
from harness.models import ADAPTERS, base_name  # noqa: F401  (peft's names; re-exported)


def is_lora_layer(module) -> bool:
    """A peft LoRA layer (peft.tuners.lora.Linear and its relatives): a base_layer and adapters."""
    return hasattr(module, "base_layer") and hasattr(module, "lora_A")


# How TP treats each adapter, by its base's kind (tp_plan's kinds): (A's kind, B's kind).
#   column-like bases split B like W's rows and keep A whole with a partial gradient; a row
#   base splits A like W's columns and keeps B whole with a partial gradient.
ADAPTER_KINDS = {"column": ("partial", "column"), "kv-copy": ("partial", "kv-copy"),
                 "fused": ("partial", "fused"), "row": ("row", "partial")}


def adapter_kind(base_kind: str | None, part: str) -> str | None:
    """The TP kind of an adapter (part: 'lora_A' or 'lora_B') on a base of base_kind, or None
    (a base TP does not split as a matrix: refused by the classification)."""
    kinds = ADAPTER_KINDS.get(base_kind)
    return kinds[ADAPTERS.index(part)] if kinds else None


# ----------------------------------------------------------------------------------------------
# The parallel LoRA layers (tp.py installs them in place of peft's)
# ----------------------------------------------------------------------------------------------
def _rows(t: torch.Tensor, rows) -> torch.Tensor:
    """Rows `rows` of t: a slice, or for a fused projection a list of slices (one per
    segment) concatenated: [out, k] -> [out/T, k]."""
    return torch.cat([t[s] for s in rows]) if isinstance(rows, list) else t[rows]


def param_like(t: torch.Tensor, like: nn.Parameter) -> nn.Parameter:
    """A new parameter holding a copy of t, frozen or trainable as `like` is."""
    return nn.Parameter(t.clone(), requires_grad=like.requires_grad)


def _linear(weight: nn.Parameter) -> nn.Linear:
    """An nn.Linear without bias around `weight` [n, k] (the adapters' modules, as peft's)."""
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    lin.weight = weight
    return lin


class _Holder(nn.Module):
    """Holds a weight (and bias): keeps peft's parameter names (base_layer.weight, lora_A.default.
    weight) on the parallel layers, so checkpoints and the export read them unchanged."""

    def __init__(self, weight, bias=None):
        super().__init__()
        self.weight, self.bias = weight, bias


class _ParallelLoRA(nn.Module):
    """What both parallel layers keep of peft's layer: its adapter names, scales and dropout."""

    def __init__(self, layer):
        super().__init__()
        self.adapters = [a for a in layer.active_adapters if a in layer.lora_A]
        extra = [a for a in layer.lora_A if a not in self.adapters]
        if extra or any(layer.lora_B[a].bias is not None for a in self.adapters) or any(
                getattr(layer, "use_dora", {}).get(a) for a in self.adapters):
            raise ValueError(f"lora: {type(layer).__name__} with inactive adapters {extra}, a "
                             f"bias on B or DoRA: the parallel layers keep plain active LoRA")
        self.scaling = {a: layer.scaling[a] for a in self.adapters}
        self.lora_dropout = layer.lora_dropout
        for part in ADAPTERS:
            setattr(self, part, nn.ModuleDict())

    def lora_delta(self, x):             # (B, S, in or in/T) -> (B, S, out/T, or out partial)
        out = 0
        for a in self.adapters:
            h = self.lora_A[a](self.lora_dropout[a](x))    # (B, S, k) @ A^T -> (B, S, r)
            s = self.scaling[a]                                # alpha / r
            if planted("lora-scaled-twice"):   # plant: (alpha / r)^2
                s = s * s
            out = out + self.lora_B[a](h) * s                  # (B, S, r) @ B^T -> (B, S, n)
        return out


class ColumnParallelLoRA(_ParallelLoRA):
    """A column-parallel base with its adapters: this rank's rows `rows` of W, b and B, A whole.
    Forward: x (whole) -> W_i x + b_i + s B_i (A x), this rank's out/T features."""

    def __init__(self, layer, rows):
        super().__init__(layer)
        base = layer.base_layer
        self.base_layer = _Holder(param_like(_rows(base.weight.detach(), rows), base.weight),
                                  param_like(_rows(base.bias.detach(), rows), base.bias)
                                  if base.bias is not None else None)       # [out/T, in]
        for a in self.adapters:
            A, B = layer.lora_A[a], layer.lora_B[a]
            self.lora_A[a] = _linear(param_like(A.weight.detach(), A.weight))   # [r, in], whole
            B_i = _rows(B.weight.detach(), rows)                                # [out/T, r]
            self.lora_B[a] = _linear(param_like(B_i, B.weight))

    def forward(self, x):                # (B, S, in) -> (B, S, out/T)
        return (F.linear(x, self.base_layer.weight, self.base_layer.bias)
                + self.lora_delta(x))


class RowParallelLoRA(_ParallelLoRA):
    """A row-parallel base with its adapters: this rank's columns `cols` of W and of A, B whole.
    Forward: x_i (in/T features) -> the partial sum W_i x_i + s B (A_i x_i), all-reduced once by
    the region (Megatron's g), then the whole bias."""

    def __init__(self, layer, cols: slice, region):
        super().__init__(layer)
        self.region = region
        base = layer.base_layer
        W_i = base.weight.detach()[:, cols]                                      # [out, in/T]
        self.base_layer = _Holder(param_like(W_i, base.weight),
                                  param_like(base.bias.detach(), base.bias)
                                  if base.bias is not None else None)
        for d in self.lora_dropout.values():   # (layout-independent masks: by global column)
            if hasattr(d, "features"):
                if not planted("lora-dropout-local-columns"):   # plant: local columns' masks
                    d.features = torch.arange(base.in_features)[cols]   # (host; the mask moves it)
        for a in self.adapters:
            A, B = layer.lora_A[a], layer.lora_B[a]
            self.lora_A[a] = _linear(param_like(A.weight.detach()[:, cols], A.weight))  # [r, in/T]
            self.lora_B[a] = _linear(param_like(B.weight.detach(), B.weight))           # [out, r]

    def forward(self, x):                # (B, S, in/T) -> (B, S, out)
        partial = F.linear(x, self.base_layer.weight) + self.lora_delta(x)   # (B, S, out) partial
        y = self.region.region_out(partial)          # summed over T: base and adapters at once
        return y + self.base_layer.bias if self.base_layer.bias is not None else y


def split_for_tp(tpm):
    """tp.TensorParallel's step for peft's LoRA layers, in place: each becomes a parallel base
    with its adapters split by the base's kind (tpm.kinds): B like W's rows under a column-like
    base, A like W's columns under a row base, the other adapter whole, its gradient partial.
    (tp's _cut and _fused_rows give this rank's rows or columns; _fused_rows also records B's
    segments for tpm.full / tpm.local.)"""
    model = tpm.model
    for name, layer in [(n, m) for n, m in model.named_modules() if is_lora_layer(m)]:
        kind, base = tpm.kinds[f"{name}.base_layer.weight"], layer.base_layer
        if kind == "row":
            new = RowParallelLoRA(layer, tpm._cut(name, base.in_features), tpm.region)
        else:
            new = ColumnParallelLoRA(layer, tpm._fused_rows(name, base) if kind == "fused"
                                     else tpm._cut(name, base.out_features))
        parent, leaf = name.rsplit(".", 1)
        setattr(model.get_submodule(parent), leaf, new)


# ----------------------------------------------------------------------------------------------
# Merge and export (from any layout's full tensors)
# ----------------------------------------------------------------------------------------------
def merged(full: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """The HF state dict with every adapter merged into its base: W' = W + s B A (B [out, r],
    A [r, in]), computed in float32 at least and cast back to W's dtype; peft's name parts
    dropped ('q_proj.base_layer.weight' -> 'q_proj.weight')."""
    out = {}
    for name, t in full.items():
        layer, part = base_name(name)
        if part in ADAPTERS:
            continue
        if part == "base_layer":
            leaf = name.rsplit(".", 1)[1]
            A, B = (full.get(f"{layer}.{p}.default.weight") for p in ADAPTERS)
            if leaf == "weight" and A is not None:
                acc = torch.promote_types(t.dtype, torch.float32)
                t = (t.to(acc) + scaling * (B.to(acc) @ A.to(acc))).to(t.dtype)   # [out, in]
            name = f"{layer}.{leaf}"
        out[name] = t
    return out


def export(full: dict[str, torch.Tensor], config, lora_config, out: str):
    """Write `out`/merged (an HF model directory: the adapters merged into the base, loadable
    with AutoModelForCausalLM.from_pretrained) and `out`/adapter (peft's adapter directory,
    loadable with PeftModel.from_pretrained over the base). `full`: every parameter's full
    tensor by peft's names (a strategy's full_params())."""
    import copy

    import peft
    from transformers import AutoModelForCausalLM
    if lora_config.use_rslora or lora_config.rank_pattern or lora_config.alpha_pattern:
        raise ValueError("lora.export: one scale alpha / r for every adapter (no rsLoRA, no "
                         "rank or alpha pattern)")
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config))
    dtype = next(iter(full.values())).dtype
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()   # (may hold one copy)
    miss, extra = model.to(dtype).load_state_dict(
        merged(full, lora_config.lora_alpha / lora_config.r), strict=False)
    assert not extra and set(miss) <= tied, (miss, extra)
    model.save_pretrained(os.path.join(out, "merged"))
    pm = peft.get_peft_model(AutoModelForCausalLM.from_config(copy.deepcopy(config)).to(dtype),
                             copy.deepcopy(lora_config), autocast_adapter_dtype=False)
    miss, extra = pm.base_model.model.load_state_dict(full, strict=False)
    assert not extra and set(miss) <= tied, (miss, extra)
    pm.save_pretrained(os.path.join(out, "adapter"))


# ----------------------------------------------------------------------------------------------
# Formulas (tests/test_lora.py checks them by hand; the rigs' expected communication and memory
# rows count the model's own tensors, trainable ones apart)
# ----------------------------------------------------------------------------------------------
def adapter_numel(shapes, r: int) -> int:
    """Psi_a: the adapters' parameters for targets of shapes [(out, in), ...] at rank r."""
    return sum(r * (o + i) for o, i in shapes)


def layer_numel(cfg, r: int, T: int = 1) -> float:
    """A decoder layer's adapter parameters on one rank, every projection targeted (q, k, v,
    o, gate, up, down: r (in + out) each, 9h + 2kv + 3I in all); under TP a column base's B and
    a row base's A are split T ways, the other adapter whole (7h r). oom_search predicts with it."""
    h, I = cfg.hidden_size, cfg.intermediate_size
    kv = cfg.num_key_value_heads * (h // cfg.num_attention_heads)
    return r * (7 * h + (2 * h + 2 * kv + 3 * I) / T)


def state_bytes(psi: int, psi_a: int, b: int) -> int:
    """Model-state bytes of a replica under AdamW: every parameter (psi, adapters included) b
    bytes, and each trainable one (psi_a) a gradient (b) and 2 fp32 moments (8), plus an fp32
    master (4) when b = 2. Full fine-tuning is state_bytes(psi, psi, b)."""
    per_trainable = b + 8 + (4 if b == 2 else 0)
    return psi * b + psi_a * per_trainable


def tp_partial_numel(column_shapes, row_shapes, r: int) -> int:
    """Elements of TP's all-reduce of the adapters' partial gradients per step: A [r, in] of
    each column-like target, B [out, r] of each row target (T <= kv heads: replicated kv
    heads add their B's n_kv-head buffers, rig.tp.partial_numel)."""
    return sum(r * i for _, i in column_shapes) + sum(r * o for o, _ in row_shapes)
