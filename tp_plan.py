"""tp_plan.py: which parameters tensor parallelism splits, and how, for any HF decoder.

tp.py splits a model in place; this file decides, before anything is split (on a meta-device
model too, before any process group exists), what each parameter is: `classify(model, T)` gives
every parameter one kind, and a reason for each one it cannot. A parameter of no kind is
refused, never trained wrong: the silent failure this prevents is a replicated parameter whose
gradient is in fact partial (Qwen3's per-head q/k norms see only a rank's heads). It also
holds tp.py's plumbing (shape checks, vocabulary padding, full <-> shard conversions).

Public API
    kinds, reasons = classify(model, T, table)   name -> kind (tp.classify: table=tp.PLAN)
    head_dims(config) -> (head_dim, q heads, kv heads)
    join_shards(parts, dim, segments)     the full tensor from every rank's shard
    meta_model(config)                    the architecture on the meta device
    plan_of(model), segments(...)         the plan that splits a model's layers (HF's or tp.PLAN)
    tpm.full(tensors) / tpm.local(name, full) / tpm.local_range(name, shape), tpm.clip(c)
                                          (ShardedTensors: TensorParallel's layout)
"""
import copy
import re

import torch
import torch.distributed as dist
import torch.nn as nn

import fp8
import lora
from harness import clip_by_norm, planted
from harness.collectives import local_part


# How TP treats each parameter of an HF decoder, by its name inside a layer. Every parameter
# gets one of these kinds; one that gets none is refused (classify()), never trained wrong.
#   column / row   split by output rows / input columns (Megatron)
#   fused          a fused projection split segment by segment (Phi3's qkv_proj, gate_up_proj)
#   kv-copy        a kv projection replicated on T / n_kv ranks (more ranks than kv heads)
#   vocab          the vocabulary rows of the embedding and the LM head (padded)
#   norm-sharded   a norm over a split feature dim (OLMo2's full-width q/k norm): ShardedRMSNorm
#   replicated     acts on the full residual stream: identical input and complete gradient
#   partial        replicated, but each rank's gradient covers its own heads only (Qwen3's and
#                  Gemma3's per-head q/k norms): summed over the group after the backward
# The same kinds in DTensor's placements (torch.distributed.tensor), over a 1-D mesh of the T
# ranks: (the parameter, its gradient after the backward). What one placement cannot say is said.
PLACEMENTS = {
    "column": ("Shard(0)", "Shard(0)"),
    "row": ("Shard(1)", "Shard(1)"),
    "fused": ("Shard(0) within each segment (labelled Shard(0): DCP refused)", "the same"),
    "kv-copy": ("Shard(0) over n_kv groups of T/n_kv ranks, Replicate inside each",
                "Partial() inside a group"),
    "vocab": ("Shard(0), rows padded to a multiple of T", "Shard(0)"),
    "norm-sharded": ("Shard(0)", "Shard(0)"),
    "replicated": ("Replicate()", "Replicate()"),
    "partial": ("Replicate()", "Partial(): each rank's own heads, summed after the backward"),
}
# HF's words (a config's `base_model_tp_plan`) -> the kinds above. HF gathers the output of a
# projection whose rows it cannot split in place ("colwise_gather_output": Phi3's fused
# qkv_proj, OLMo2's q/k/v before a norm over all heads); this project splits those too:
# "gathered" is a fused projection when its rows are segments (split segment by segment), else
# a column layer (the norm over all heads then sharded: norm-sharded). HF's MoE words
# ("packed_colwise", "moe_tp_experts") are not used: TP keeps the experts whole (compose4d --ep
# shards them).
HF_KINDS = {"colwise": "column", "colwise_gather_output": "gathered", "rowwise": "row",
            "rowwise_split_input": "row", "replicated_with_grad_allreduce": "partial",
            "embedding_rowwise": "vocab"}
# full-width q/k norms whose formula tp_families.ShardedRMSNorm computes (weight x normalised,
# in float32)
FULL_WIDTH_NORMS = ("Olmo2RMSNorm", "Olmo3RMSNorm")   # (the same module, renamed)


def head_dims(config) -> tuple[int, int, int]:
    """(head_dim, q heads, kv heads) of an HF config."""
    h = config.num_attention_heads
    return (getattr(config, "head_dim", None) or config.hidden_size // h, h,
            getattr(config, "num_key_value_heads", None) or h)


def plan_of(model, table: dict[str, str]) -> dict[str, str]:
    """The plan that splits `model`'s layers (module pattern under the decoder -> kind): its
    config's `base_model_tp_plan` (transformers' own), translated by HF_KINDS, over `table`
    (tp.PLAN, the canonical one) for the modules HF's plan does not name."""
    hf = getattr(model.config, "base_model_tp_plan", None) or {}
    plan = {k: HF_KINDS.get(v, f"HF's {v!r}") for k, v in hf.items()}   # HF's entries first
    return {**plan, **{k: v for k, v in table.items() if k not in plan}}


def matches(pattern: str, name: str) -> bool:
    """HF's plan patterns: `*` stands for one layer index ("layers.*.mlp.up_proj")."""
    return re.fullmatch(re.escape(pattern).replace(r"\*", r"\d+"), name) is not None


def segments(model, name: str, out: int) -> tuple[int, ...] | None:
    """The row segments of the fused projection `name` of `out` rows (their full sizes along
    dim 0), from its shape: an attention's [q; k; v] (n_h d, n_kv d, n_kv d) or an MLP's
    [gate; up] (I, I); None when the projection is neither."""
    d, hq, hkv = head_dims(model.config)
    if in_attention(model, name):
        return (hq * d, hkv * d, hkv * d) if out == (hq + 2 * hkv) * d else None
    return (out // 2,) * 2 if out == 2 * model.config.intermediate_size else None


def in_attention(model, name: str) -> bool:
    """Whether module `name` sits in a decoder layer's attention (its parent is one)."""
    return "Attention" in type(model.get_submodule(name.rpartition(".")[0])).__name__


def classify(model, T: int, table: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """(kind of every parameter, the reasons it refuses): a pure walk over the model's modules,
    no collective, on a meta-device model too. A layer's projections take their kind from the
    plan (plan_of: HF's, else tp.PLAN), refined by shape (a fused projection's segments, a kv
    projection replicated when T > kv heads); the embedding and head (found through HF's
    accessors) are vocab, the norms on the residual stream replicated, q/k norms by their
    width. A reason names the parameter and what TP cannot do with it; parallelize() and the
    scripts refuse on the first one."""
    from harness import parts
    d, hq, hkv = head_dims(model.config)
    replicate_kv = hkv % T != 0
    kinds, errs = {}, []
    found = parts(model)
    if found.layers is None or found.embed is None or found.head is None \
            or "base" not in found.names:
        return {}, [f"{type(model).__name__} is not an HF decoder whose layers, input "
                    f"embedding and LM head HF's accessors find: tensor parallelism does not "
                    f"know its layout (ddp, zero, fsdp and pp run any causal LM)"]
    plan, vocab = plan_of(model, table), (found.names.get("embed"), found.names.get("head"))
    layers = found.names["layers"] + "."
    base = found.names["base"] + "." if found.names["base"] else ""
    for name, module in model.named_modules():
        own = list(module.named_parameters(recurse=False))
        if not own:
            continue
        # inside a peft LoRA layer: the base is classified as the module it replaced, each
        # adapter by its base's kind (lora.ADAPTER_KINDS); `module` becomes what peft wrapped
        at = name
        wrapped, part = lora.base_name(name)
        if part is not None:
            name, module = wrapped, model.get_submodule(wrapped).base_layer
        inner = name[len(layers):].split(".")[1:] if name.startswith(layers) else None
        leaf, why = name.rpartition(".")[2], None
        planned = next((v for k, v in plan.items() if matches(k, name[len(base):])), None)
        if name in vocab:
            known = type(module) in (nn.Embedding, nn.Linear) or (
                isinstance(module, nn.Embedding) and hasattr(module, "scalar_embed_scale"))
            kind = "vocab" if known else None
        elif name == found.names.get("norm") or (inner is not None and len(inner) == 1
                                                  and "Norm" in type(module).__name__):
            kind = "replicated"            # on the residual stream: the same on every rank
        elif inner and leaf in ("gate", "experts") and hasattr(
                model.get_submodule(name.rpartition(".")[0]), "experts"):
            # a Mixture-of-Experts block: router and experts whole on every rank, computing the
            # same tokens (compose4d --ep shards the experts over data ranks instead)
            kind = "replicated"
        elif inner and leaf in ("q_norm", "k_norm"):
            n = module.weight.numel()
            heads = hq if leaf == "q_norm" else hkv
            if n == d:
                kind = "partial"
            elif n == heads * d and type(module).__name__ in FULL_WIDTH_NORMS:
                kind = "norm-sharded"
                if replicate_kv and leaf == "k_norm":
                    kind, why = None, (f"a full-width k_norm with more ranks ({T}) than kv "
                                       f"heads ({hkv}) is not supported")
            else:
                kind, why = None, (f"a q/k norm over {n} features (neither one head, {d}, nor "
                                   f"all heads, {heads * d}, of a norm whose formula "
                                   f"tp_families.ShardedRMSNorm implements: "
                                   f"{', '.join(FULL_WIDTH_NORMS)})")
        elif (inner and planned in ("column", "row", "fused", "gathered")
              and type(module) in (nn.Linear, fp8.Float8Linear)):   # (FP8's: fp8.carry)
            fused = segments(model, name, module.out_features) if planned != "row" else None
            kind = planned if planned in ("column", "row") else "fused" if fused else None
            if planned == "gathered" and not fused:
                # HF gathers it for a norm over all heads (OLMo2's), which norm-sharded splits
                par = model.get_submodule(name.rpartition(".")[0])
                norms = [getattr(par, n, None) for n in ("q_norm", "k_norm")]
                wide = [m for m in norms if m is not None and m.weight.numel() > d]
                kind = "column" if wide else None
                why = None if wide else ("HF's plan gathers its output (colwise_gather_output) "
                                         "for a computation this project does not split")
            elif kind is None:
                why = "a fused projection whose rows are not [q; k; v] or [gate; up]"
            if (kind == "column" and replicate_kv and in_attention(model, name)
                    and module.out_features == hkv * d):
                kind = "kv-copy"           # a k or v projection: one kv head per T/n_kv ranks
            if kind == "fused" and replicate_kv:
                kind, why = None, (f"a fused projection with more ranks ({T}) than kv heads "
                                   f"({hkv}) is not supported")
        else:
            kind = None
            if planned and planned.startswith("HF's"):
                why = f"{planned} (in its config's base_model_tp_plan) is not implemented here"
        if part in lora.ADAPTERS:
            kind = lora.adapter_kind(kind, part)
            if kind is None:
                why = why or "a LoRA adapter on a module tensor parallelism does not split"
        elif part is not None and kind == "vocab":
            kind, why = None, "a LoRA layer on the vocabulary is not supported"
        for pname, p in own:
            full = f"{at}.{pname}"
            k = kind
            if kind in ("row",) and pname == "bias":
                k = "replicated"              # added once, after the reduction
            if k is None:
                errs.append(f"{full} ({type(module).__name__}): "
                            + (why or "not a module tensor parallelism knows how to split"))
            kinds[full] = k
    return kinds, errs


def join_shards(parts: list[torch.Tensor], dim: int, segments=None) -> torch.Tensor:
    """The full tensor from every rank's shard (rank order): concatenated along `dim`, or for a
    fused projection (`segments`: the full sizes of its segments along dim 0) segment by
    segment, each segment's rank slices in order."""
    if not segments:
        return torch.cat(parts, dim=dim)                  # T x [n/T, m] -> [n, m] along dim
    local = [n // len(parts) for n in segments]
    pieces = [q.split(local) for q in parts]              # [sum n_i/T, m] -> [n_i/T, m] each
    # T x [n_i/T, m] per segment i -> [sum n_i, m]: segment by segment, ranks in order
    return torch.cat([pc[s] for s in range(len(local)) for pc in pieces])


# ----------------------------------------------------------------------------------------------
# tp.py's plumbing: shape checks, vocabulary padding, per-rank heads, full <-> shard
# ----------------------------------------------------------------------------------------------
def shape_constraints(T: int, config) -> list[str]:
    _, h, kv = head_dims(config)
    if h % T:
        return [f"tensor parallel size {T} does not divide num_attention_heads {h}"]
    if kv % T and T % kv:
        return [f"tensor parallel size {T} and num_key_value_heads {kv}: one must divide the "
                f"other (kv heads split over the ranks, or each replicated on T/kv ranks)"]
    if config.intermediate_size % T:
        return [f"tensor parallel size {T} does not divide intermediate_size "
                f"{config.intermediate_size}"]
    return []


def pad_vocab(vocab: int, t: int) -> int:
    return -(-vocab // t) * t


def vocab_rows(t: torch.Tensor, lo: int, per: int) -> nn.Parameter:
    """Rows [lo, lo + per) of a vocabulary tensor [V, ...] as this rank's parameter [per, ...]:
    the rows past the true vocabulary (the padding to a multiple of T) zero."""
    w = t.new_zeros(per, *t.shape[1:])
    mine = t.detach()[lo:lo + per]                     # [V, ...] -> [<= V/T, ...]
    w[:mine.shape[0]] = mine
    return nn.Parameter(w, requires_grad=t.requires_grad)


def pad_to(t: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    """t extended with zeros along `dim` to length n (the vocabulary padding), as a new tensor."""
    if t.shape[dim] == n:
        return t.clone()
    shape = list(t.shape)
    shape[dim] = n - t.shape[dim]
    return torch.cat([t, t.new_zeros(shape)], dim=dim)   # [n', m] -> [n, m] along dim


class ShardedTensors:
    """TensorParallel's layout queries (this rank's rows of a module: _cut, _fused_rows),
    conversions between full tensors and this rank's shards (checkpoints, harness/loading.py,
    the rig's checks) and global-norm clipping over the shards, from the layout it records:
    world (T), rank, group, model, kinds, vocab, vocab_names, vocab_padded, split_dim,
    segments, kv_split, kv_copies, n_kv, kv_head."""

    def _kind(self, module: str) -> str | None:
        """The kind of a projection's weight (its base's, under a LoRA layer)."""
        return self.kinds.get(f"{module}.weight") or self.kinds.get(f"{module}.base_layer.weight")

    def _mine(self, n_per_rank: int) -> slice:
        return slice(self.rank * n_per_rank, (self.rank + 1) * n_per_rank)

    def _cut(self, name: str, n: int) -> slice:
        """This rank's share of the module `name` whose split dim has n entries."""
        return self._kv_rows if self._kind(name) == "kv-copy" else self._mine(n // self.world)

    def _fused_rows(self, name: str, linear: nn.Linear) -> list[slice]:
        """A fused projection's rows: this rank's slice of each segment ([q; k; v] or
        [gate; up]), recorded in segments for full() / local()."""
        segs = segments(self.model, name, linear.out_features)
        for kind in ("weight", "bias", "base_layer.weight", "base_layer.bias"):
            self.segments[f"{name}.{kind}"] = segs
        for a in getattr(self.model.get_submodule(name), "lora_B", {}):   # a LoRA layer's B:
            self.segments[f"{name}.lora_B.{a}.weight"] = segs          # rows as W's segments
        return [slice(a, b) for _, a, b in self.local_range(f"{name}.weight", None)]

    def full(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Full tensors from this rank's shards (collective): gather along the split dim and
        drop the vocabulary padding."""
        out = {}
        for name, t in tensors.items():
            t, d = local_part(t), self.split_dim.get(name)   # (a DTensor's local part)
            if t is None or (d is None and name not in self.kv_split):   # (None: a frozen
                out[name] = t                                              # tensor's gradient)
                continue
            parts = [torch.empty_like(t) for _ in range(self.world)]
            dist.all_gather(parts, t.contiguous(), group=self.group)   # T x [n/T, m] (d=1 [m, n/T])
            if name in self.kv_split:      # one copy of each kv head: n_kv x [d, H] -> [n_kv d, H]
                out[name] = torch.cat(parts[::self.kv_copies], dim=0)
                continue
            full = join_shards(parts, d, self.segments.get(name))   # -> [n, m] (d=1: [m, n])
            if name in self.vocab_names:
                full = full[:self.vocab]                             # [V_pad, H] -> [V, H]
            out[name] = full
        return out

    def full_shape(self, name: str, shape) -> tuple:
        """The full tensor's shape from this rank's shard's (what full() returns)."""
        s = list(shape)
        if name in self.kv_split:           # one kv head's rows -> every head's
            s[0] *= self.n_kv
        elif name in self.split_dim:
            s[self.split_dim[name]] *= self.world
            if name in self.vocab_names:
                s[0] = self.vocab
        return tuple(s)

    def local_range(self, name: str, full_shape):
        """(dim, start, stop) of the full tensor `name` that this rank holds, or None when it
        holds the whole tensor; a fused projection's is a list of them, one per segment, to be
        concatenated. For the vocabulary-split embedding and head, stop may pass the true
        vocabulary: those rows are zero padding. A checkpoint loader reads just these ranges
        (harness/loading.py); local() cuts them from a full tensor."""
        if name in self.segments:
            out, off = [], 0
            for n in self.segments[name]:
                k = n // self.world
                out.append((0, off + self.rank * k, off + (self.rank + 1) * k))
                off += n
            return out
        if name in self.kv_split:           # a replicated kv projection: one head's rows
            n = full_shape[0] // self.n_kv
            return 0, self.kv_head * n, (self.kv_head + 1) * n
        d = self.split_dim.get(name)
        if d is None:
            return None
        size = (self.vocab_padded if name in self.vocab_names
                else full_shape[d])
        n = size // self.world
        return d, self.rank * n, (self.rank + 1) * n

    def local(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's shard of a full tensor (the inverse of full(): vocabulary rows padded
        with zeros, then the rank's range along the split dim)."""
        r = self.local_range(name, full.shape)
        if r is None:
            return full
        if isinstance(r, list):
            return torch.cat([full.narrow(d, a, b - a) for d, a, b in r], dim=0)  # [sum n_i/T, m]
        d, a, b = r
        # [n, m] -> [n/T, m] (d=1: [m, n/T]); a vocabulary shard zero-padded to [V_pad/T, H]
        return pad_to(full.narrow(d, a, max(0, min(b, full.shape[d]) - a)), d, b - a)

    def clip(self, max_norm: float) -> float:
        """Global-norm clipping: sharded grads' squares summed over the group, replicated ones
        counted once."""
        sharded = torch.zeros(1, dtype=torch.float64, device=self.device())
        replicated = torch.zeros(1, dtype=torch.float64, device=self.device())
        grads = {n: local_part(p.grad) for n, p in self.model.named_parameters()
                 if p.grad is not None}   # (the DTensor labels' local parts)
        for n, g in grads.items():
            target = sharded if n in self.split_dim else replicated
            if planted("clip-norm-scale"):   # plant: replicated ones counted T times
                target = sharded
            sq = g.double().pow(2).sum()
            if n in self.kv_split:   # a kv head's m copies count once
                target, sq = sharded, sq / self.kv_copies
            target += sq
        dist.all_reduce(sharded, group=self.group)   # (1,) float64: the shards' squares, summed
        return clip_by_norm(sharded + replicated, list(grads.values()), max_norm)

    def device(self):
        return next(self.model.parameters()).device


def meta_model(config):
    """The architecture of `config` on the meta device (no storage): what classify() walks
    before any process group exists."""
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(copy.deepcopy(config))
