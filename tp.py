"""tp.py: Megatron tensor parallelism with a vocab-parallel loss, from raw torch.distributed.

The idea (Shoeybi et al., "Megatron-LM", 2019): split each weight matrix over the T ranks of
the tp group, so a transformer block needs two all-reduces forward and two backward:
    MLP        gate, up column-parallel (I/T features each); down row-parallel (partial sums)
    attention  q, k, v column-parallel by heads (n_h/T, n_kv/T each); o_proj row-parallel
Entering a region is f (identity forward, all-reduce backward), leaving it is g (all-reduce
forward, identity backward): mirror images, and the only communication inside a block, each
rank with every rank of the group. The embedding is vocab-parallel (rank r owns rows
[r V/T, (r+1) V/T), V padded to a multiple of T; partial lookups all-reduced), the LM head is
column-parallel over V, and the loss never forms full logits (global max, sum of exponentials,
target logit: one all-reduce of N values each). Norms are replicated; with T = m x n_kv each
kv head is replicated on m ranks and its m copies' gradients are summed.
Why and how, in full: docs/internals.md, 'tp.py'. Family adapters: tp_families.py.

Run:  torchrun --nproc_per_node=2 tp.py --mode correctness   (learning, benchmark, plants)

Communication per step (N = B*S tokens, H hidden, L layers, b bytes; all over the tp group)
    forward   all_reduce  embedding 1 + 2 per layer, each N*H*b; loss 3 of N*b
    backward  all_reduce  2 per layer (the f of attention and MLP) + 1 (the f of the LM head)
    total     (4L + 2) all-reduces of N*H*b, plus 3 of N*b  (+1 for replicated kv grads:
              n_kv x the local k and v projections' elements per layer)
Memory: weights and optimizer states / T (norms replicated); activations inside attention and
MLP / T, the residual stream and norms full (sp.py shards those too).

Public API
    tpm = parallelize(model, group)   an HF decoder, split in place by the plan (PLAN below)
    tpm.loss_sum(logits, labels)      the vocab-parallel cross-entropy (sum over tokens)
    tpm.reduce_partial_grads()        after the step's last backward (replicated kv heads)
    tpm.clip(max_norm)                global-norm clipping over the shards (examples/tp_train.py)
    torch's clip_grad_norm_, torch.distributed.checkpoint, torch.compile: as on DTensor TP
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import fp8
import lora
import tp_dtensor
import tp_plan
from lora import param_like
from tp_families import embed_scale, local_heads, ShardedRMSNorm
from tp_plan import head_dims, pad_vocab, ShardedTensors, vocab_rows
from tp_plan import join_shards, meta_model, shape_constraints   # noqa: F401 (re-exported)
from harness import all_reduce_flat, IGNORE_INDEX, local_part, parts, planted, refuse_state_dict


# ----------------------------------------------------------------------------------------------
# Communication: Megatron's f and g, mirror images of each other
# ----------------------------------------------------------------------------------------------
class CopyToTP(torch.autograd.Function):
    """f: identity forward; all-reduce of the gradient backward (every rank's branch of the
    region contributed to d(input))."""

    @staticmethod
    def forward(ctx, x, group):          # (B, S, H) -> (B, S, H), the same values
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):             # (B, S, H): this rank's branch -> the sum over T
        # one copy: autograd may hand the same gradient tensor to other consumers, so it is
        # not ours to reduce in place (Megatron does; torch's contract says not to)
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, group=ctx.group)                    # (B, S, H), summed over T
        return grad, None


class ReduceFromTP(torch.autograd.Function):
    """g: all-reduce of the partial outputs forward; identity backward."""

    @staticmethod
    def forward(ctx, x, group):          # (B, S, H) partial sum -> (B, S, H) sum over T
        if x.is_contiguous() and not x._is_view():
            # the row-parallel matmul's fresh partial sum, which nothing else holds: reduced in
            # place, no copy (mark_dirty: autograd raises if any node saved the pre-reduce value)
            ctx.mark_dirty(x)
        else:
            x = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(x, group=group)                           # (B, S, H), in place
        return x

    @staticmethod
    def backward(ctx, grad):             # (B, S, H) -> (B, S, H), identity
        return grad, None


class TPRegion:
    """How activations enter and leave a parallel region (Megatron's f and g), the region being
    the column-parallel layers' input up to the row-parallel layers' output:
        region_in(x)         f: identity forward, all-reduce of the gradient backward
        region_out(x)        g: all-reduce of the partial sums forward, identity backward
        row_linear(x, w)     a row-parallel matmul followed by region_out (async_tp fuses them)
        embedding_out(x)     the vocab-parallel embedding's partial sums, all-reduced
        after_module()       called after a region's module ran (SP ends its saved-tensor hooks)
    sp.SPRegion swaps in the sequence all-gather / reduce-scatter pair, async_tp their rings."""

    def __init__(self, group):
        self.group = group

    def region_in(self, x):
        if planted("no-f"):   # plant: no f, so d(input) is this rank's branch only
            return x
        return CopyToTP.apply(x, self.group)

    def region_out(self, x):
        return ReduceFromTP.apply(x, self.group)

    def embedding_out(self, x):
        """After the vocab-parallel lookup: the partial embeddings are summed."""
        return ReduceFromTP.apply(x, self.group)

    def row_linear(self, x, weight):
        """A row-parallel layer's partial product, reduced (async_tp.py fuses the two)."""
        return self.region_out(F.linear(x, weight))   # (B, S, in/T) @ [out, in/T]^T -> (B, S, out)

    def after_module(self):
        pass


# ----------------------------------------------------------------------------------------------
# Parallel modules
# ----------------------------------------------------------------------------------------------
class ColumnParallelLinear(nn.Module):
    """Rows `rows` of the full (out, in) weight and bias: this rank computes a slice of the
    output features. `rows=None` replicates the layer (MQA's single kv head); a list of slices
    takes one slice of each segment of a fused projection (Phi3's qkv_proj: its q, k and v
    rows; gate_up_proj: its gate and up rows), so the local output keeps the fused order.
    `fp8`: a Float8Linear's GEMMs, carried over (fp8.carry: its scales over the group)."""
    fp8 = None

    def __init__(self, linear: nn.Linear, rows):
        super().__init__()
        # [out, in] -> [out/T, in]; fused: each segment's slice, concatenated along dim 0
        pick = ((lambda t: torch.cat([t[s] for s in rows])) if isinstance(rows, list)
                else (lambda t: t[rows or slice(None)]))
        # (param_like: a frozen tensor stays frozen, LoRA's base)
        self.weight = param_like(pick(linear.weight.detach()), linear.weight)
        self.bias = (param_like(pick(linear.bias.detach()), linear.bias)
                     if linear.bias is not None else None)

    def forward(self, x):                # (B, S, in) -> (B, S, out/T)
        return (self.fp8 or F.linear)(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Columns `cols` of the full weight: each rank's partial product is reduced by
    region.row_linear (in FP8: fp8, then region_out); the (replicated) bias is added once,
    after the reduction."""
    fp8 = None

    def __init__(self, linear: nn.Linear, cols: slice, region: TPRegion):
        super().__init__()
        self.region = region
        self.weight = param_like(linear.weight.detach()[:, cols], linear.weight)   # [out, in/T]
        self.bias = (param_like(linear.bias.detach(), linear.bias)
                     if linear.bias is not None else None)

    def forward(self, x):                # (B, S, in/T) -> (B, S, out), reduced by the region
        y = (self.region.region_out(self.fp8(x, self.weight)) if self.fp8
             else self.region.row_linear(x, self.weight))
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Rows [lo, lo + V_pad/T) of the (padded) embedding table. HF's padding_idx (the pad
    token's row, whose gradient stays zero) is kept: on the rank that holds the row, at its
    local index."""

    def __init__(self, emb: nn.Embedding, lo: int, per_rank: int, region: TPRegion):
        super().__init__()
        self.lo, self.per_rank, self.region = lo, per_rank, region
        pad = getattr(emb, "padding_idx", None)
        self.padding_idx = pad - lo if pad is not None and lo <= pad < lo + per_rank else None
        if planted("embed-drops-padding-idx"):   # plant: the padding row trains
            self.padding_idx = None
        self.scale = embed_scale(emb)   # (Gemma's scaled embedding; None elsewhere)
        self.weight = vocab_rows(emb.weight, lo, per_rank)   # [V/T, H], padding rows zero

    def forward(self, ids):              # (B, S) token ids -> (B, S, H)
        outside = (ids < self.lo) | (ids >= self.lo + self.per_rank)
        local = (ids - self.lo).masked_fill(outside, 0)
        # (ids of other ranks' rows read local row 0 and are zeroed: a padding_idx of 0 here
        # zeroes their gradient too, which the mask zeroes anyway)
        out = F.embedding(local, self.weight, self.padding_idx).masked_fill(outside[..., None],
                                                                            0.0)
        if planted("embed-unmasked"):   # plant: other ranks' ids add this shard's row 0
            out = F.embedding(local, self.weight, self.padding_idx)
        out = self.region.embedding_out(out)   # (B, S, H) partial -> (B, S, H) summed over T
        if self.scale is not None:
            out = out * self.scale
        return out


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token CE from vocab-sharded logits (N, V_pad/T) with three all-reduces of N values:
    the global max, the sum of exponentials, and the target logit (from its owner)."""

    @staticmethod
    def forward(ctx, logits, labels, lo, vocab, group):   # (N, V/T), (N,) -> loss (N,)
        dtype = logits.dtype
        x = logits.float() if dtype in (torch.bfloat16, torch.float16) else logits.clone()
        n_local = x.shape[-1]
        padded = torch.arange(lo, lo + n_local, device=x.device) >= vocab
        x.masked_fill_(padded, float("-inf"))                        # padding never wins
        gmax = x.max(dim=-1).values                                  # (N, V/T) -> (N,)
        dist.all_reduce(gmax, op=dist.ReduceOp.MAX, group=group)     # (N,): max over T
        x.sub_(gmax[:, None])
        exp = x.exp()
        sum_exp = exp.sum(dim=-1)                                    # (N, V/T) -> (N,)
        dist.all_reduce(sum_exp, group=group)                        # (N,): sum over T
        ignore = labels == IGNORE_INDEX
        if planted("ce-counts-ignored"):   # plant: ignored labels are not masked
            ignore = torch.zeros_like(ignore)
        t = labels - lo
        mine = (t >= 0) & (t < n_local) & ~ignore
        # (N, V/T) -> (N, 1) -> (N,): the target's logit where this rank owns it, else 0
        target = torch.where(mine, x.gather(1, t.clamp(0, n_local - 1)[:, None])[:, 0],
                             torch.zeros_like(gmax))
        dist.all_reduce(target, group=group)                         # (N,): from its owner
        loss = (sum_exp.log() - target).masked_fill(ignore, 0.0)
        exp.div_(sum_exp[:, None])                                   # local softmax
        ctx.save_for_backward(exp, t, mine, ignore)
        ctx.dtype = dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):        # (N,) -> (N, V/T) for the logits
        softmax, t, mine, ignore = ctx.saved_tensors
        grad = softmax  # d loss / d logit = softmax - onehot(target), no communication
        # -1 at each owned target (a static-shape scatter: no nonzero, so it also runs on
        # FakeTensors in oom_search's simulation)
        grad.scatter_add_(1, t.clamp(0, grad.shape[1] - 1)[:, None], -mine.to(grad.dtype)[:, None])
        grad.mul_(grad_loss.masked_fill(ignore, 0.0)[:, None])
        return grad.to(ctx.dtype), None, None, None, None


# ----------------------------------------------------------------------------------------------
# Installing it into an HF decoder
# ----------------------------------------------------------------------------------------------
# The plan (Megatron's, written as torchtitan writes its own): a decoder module's pattern -> its
# kind. A config that ships transformers' `base_model_tp_plan` (Llama, Qwen, Gemma, Phi3, OLMo,
# GPT-NeoX, StarCoder2, ...) is read over it (tp_plan.plan_of); the embedding and LM head are
# vocab, the norms on the residual stream replicated, q/k norms by their width (tp_plan.classify).
PLAN = {
    "layers.*.self_attn.q_proj": "column",       "layers.*.mlp.gate_proj": "column",
    "layers.*.self_attn.k_proj": "column",       "layers.*.mlp.up_proj": "column",
    "layers.*.self_attn.v_proj": "column",       "layers.*.mlp.down_proj": "row",
    "layers.*.self_attn.o_proj": "row",
    "layers.*.self_attn.qkv_proj": "fused",      "layers.*.mlp.gate_up_proj": "fused",
}


def classify(model, T: int) -> tuple[dict[str, str], list[str]]:
    """(the kind of every parameter, one reason per refusal): tp_plan.classify by this plan."""
    return tp_plan.classify(model, T, PLAN)


# kind -> (its split dim, the parallel module that replaces one, given (tp, name, module)); the
# other kinds stay whole (the vocabulary: below), a row layer's bias too; kv-copy is split by
# kv head, each head on T / kv_heads ranks when T > kv heads (kv_split).
#   column [out, in] -> [out/T, in]   kv-copy -> [d, H], one kv head   fused -> [sum n_i/T, in]
#   row    [out, in] -> [out, in/T]   norm-sharded [n d] -> [n d/T]
INSTALL = {
    "column": (0, lambda tp, n, lin: ColumnParallelLinear(lin, tp._cut(n, lin.out_features))),
    "kv-copy": (None, lambda tp, n, lin: ColumnParallelLinear(lin, tp._cut(n, lin.out_features))),
    "fused": (0, lambda tp, n, lin: ColumnParallelLinear(lin, tp._fused_rows(n, lin))),
    "row": (1, lambda tp, n, lin: RowParallelLinear(lin, tp._cut(n, lin.in_features), tp.region)),
    "norm-sharded": (0, lambda tp, n, norm: ShardedRMSNorm(norm, tp._cut(n, norm.weight.numel()),
                                                           norm.weight.numel(), tp.group)),
}


class TensorParallel(ShardedTensors):
    """Replaces the Linear/Embedding modules (and full-width q/k norms) of an HF decoder (in
    place) with their T-way sharded versions; HF's own attention code then runs on the local
    heads unchanged, since it reshapes with view(..., -1, head_dim). `kinds` says how each
    parameter is treated (classify()): INSTALL splits by it, and the reductions follow it."""

    def __init__(self, model, group, region: TPRegion | None = None, seq_parallel: bool = False,
                 dtensor: bool = True):
        self.model, self.group = model, group
        self.region = region or TPRegion(group)
        T, r = dist.get_world_size(group), dist.get_rank(group)
        cfg = model.config
        self.world, self.rank, self.vocab = T, r, cfg.vocab_size
        self.kinds, errs = classify(model, T)
        errs = shape_constraints(T, cfg) + errs   # (heads, kv heads, intermediate size first)
        if errs:
            raise ValueError(f"tp.parallelize: {errs[0]}")
        head_dim, hq_full, hkv = head_dims(cfg)
        hq = hq_full // T
        # More ranks than kv heads (T = m * hkv): each kv head is replicated on m consecutive
        # ranks, the ones whose q heads attend to it (Megatron's GQA with tp > kv heads).
        self.kv_copies = 1 if hkv % T == 0 else T // hkv
        self.n_kv, self.kv_head = hkv, r // self.kv_copies
        hkv_local = 1 if self.kv_copies > 1 else hkv // T
        # the layout: name -> the dim it is split along (vocab ones padded); a fused
        # projection's segment sizes along dim 0; the replicated kv projections, whose rows
        # are their kv head's (rank r holds head r // m)
        self.split_dim, self.segments, self.kv_split = {}, {}, set()
        self._kv_rows = slice(self.kv_head * head_dim, (self.kv_head + 1) * head_dim)
        lora.split_for_tp(self)   # peft's LoRA layers: base and adapters split by the kinds
        # The layout, once: each module whose weight's kind INSTALL names becomes that kind's
        # parallel module, its tensors split along the kind's dim; the other kinds stay whole
        # (the vocabulary is split below)
        for pname, kind in self.kinds.items():
            if kind not in INSTALL:
                continue
            dim, build = INSTALL[kind]
            if pname.endswith(".weight") and lora.base_name(pname)[1] is None:
                name = pname[:-len(".weight")]
                parent, leaf = name.rsplit(".", 1)
                old = model.get_submodule(name)
                setattr(model.get_submodule(parent), leaf, new := build(self, name, old))
                fp8.carry(old, new, kind, group)   # an FP8 layer's GEMMs stay in FP8
            if dim is None:
                self.kv_split.add(pname)
            elif not (kind == "row" and pname.endswith(".bias")):
                self.split_dim[pname] = dim
        # Each module holding split projections is a region (a layer's attention, its MLP; a
        # MoE block, its experts not split, runs whole on every rank outside any region): f on
        # its input, the row layers' g inside it
        split = {lora.base_name(n.rpartition(".")[0])[0] for n, k in self.kinds.items()
                 if k in ("column", "fused", "kv-copy", "row")}
        for name in sorted({m.rpartition(".")[0] for m in split}):
            a = model.get_submodule(name)
            if "Attention" in type(a).__name__:   # its per-rank head counts (tp_families)
                fused = any(self._kind(f"{name}.{c}") == "fused" for c, _ in a.named_children())
                local_heads(a, r, hq, hkv_local, fused)
            a.register_forward_pre_hook(self._enter, with_kwargs=True)
            a.register_forward_hook(self._leave)
        # Vocabulary: padded to a multiple of T, embedding and head split by rows.
        self.vocab_padded = pad_vocab(cfg.vocab_size, T)
        per = self.vocab_padded // T
        self.vocab_lo = r * per
        found = parts(model)              # the embedding and head, by HF's accessors
        embed, head_name = found.names["embed"], found.names["head"]
        self.vocab_names = (f"{embed}.weight", f"{head_name}.weight", f"{head_name}.bias")
        emb = VocabParallelEmbedding(found.embed, self.vocab_lo, per, self.region)
        head = nn.Linear(1, 1, bias=False)  # placeholder: the vocab shard's rows, below
        rows = lambda t: vocab_rows(t, self.vocab_lo, per)   # noqa: E731
        head.weight = emb.weight if found.tied else rows(found.head.weight)
        if getattr(found.head, "bias", None) is not None:   # (Phi-2's head has one)
            head.bias = rows(found.head.bias)
            self.split_dim[self.vocab_names[2]] = 0
        for name, new in ((embed, emb), (head_name, head)):
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent), leaf, new)
        head.register_forward_pre_hook(self._enter, with_kwargs=True)
        head.register_forward_hook(self._leave)
        self.split_dim[self.vocab_names[0]] = 0
        if not found.tied:
            self.split_dim[self.vocab_names[1]] = 0
        if dtensor:   # every parameter a DTensor over its shard, a label (tp_dtensor.py)
            tp_dtensor.label(self)
        else:         # plain shards, which DCP would take for whole tensors: refused
            refuse_state_dict(model, tp_dtensor.PLAIN)
        named = dict(model.named_parameters())
        # replicated kv heads: each copy's gradient covers its own q heads only, summed over
        # the m copies (name -> parameter)
        self.kv_copy_params = {n: named[n] for n, k in self.kinds.items() if k == "kv-copy"}
        # Per-head q/k norms see this rank's heads only: their gradients are summed over the
        # group; under sequence parallelism (sp.py) every replicated parameter too (the norms
        # and row biases see this rank's tokens only)
        partial = ("replicated", "partial") if seq_parallel else ("partial",)
        self.group_partials = {n: p for n, p in model.named_parameters()
                               if self.kinds.get(n) in partial}   # name -> parameter

    def _enter(self, module, args, kwargs):
        if "hidden_states" in kwargs:
            kwargs["hidden_states"] = self.region.region_in(kwargs["hidden_states"])
        else:
            args = (self.region.region_in(args[0]),) + tuple(args[1:])
        return args, kwargs

    def _leave(self, module, args, out):
        self.region.after_module()

    def loss_sum(self, logits, labels) -> torch.Tensor:   # (B, S, V/T), (B, S) -> a scalar
        return VocabParallelCrossEntropy.apply(   # (B, S, V/T) -> (N, V/T), (B, S) -> (N,)
            logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), self.vocab_lo,
            self.vocab, self.group).sum()

    def reduce_partial_grads(self):
        """All-reduce the gradients that each rank holds only a part of (one flat call). A
        replicated kv head's gradient is summed over its m copies only: each rank places it at
        its head's position in a zero buffer of all n_kv heads, so one all-reduce over the
        group serves every head (n_kv x the head's bytes; no per-head process groups).
        group_partials's (per-head q/k norms; under SP every replicated parameter) are summed
        as they are."""
        kv, plain = self.kv_copy_params, self.group_partials
        if planted("norm-grads-unreduced"):   # plant: SP's norms treated as TP's (not summed)
            plain = {n: p for n, p in plain.items() if self.kinds[n] != "replicated"}
        if planted("qk-norm-grads-unreduced"):   # plant: per-head q/k norms kept per rank
            plain = {n: p for n, p in plain.items() if self.kinds[n] != "partial"}
        if planted("lora-a-unsummed"):   # plant: a column base's lora_A gradient kept per rank
            plain = {n: p for n, p in plain.items() if lora.base_name(n)[1] != "lora_A"}
        if planted("kv-copies-summed-across-heads"):   # plant: every kv head's copies summed
            kv, plain = {}, {**kv, **plain}           # with every other head's
        back = []
        for g in map(local_part, (p.grad for p in kv.values())):   # (a DTensor's local part)
            if g is not None:
                buf = g.new_zeros(self.n_kv, *g.shape)   # [n_kv, d, H] (bias: [n_kv, d])
                buf[self.kv_head] = g                    # [d, H]: this rank's head
                back.append((g, buf))
        # flat [sum of the kv buffers' and the plain grads' numel], summed over T
        all_reduce_flat([buf for _, buf in back] + [local_part(p.grad) for p in plain.values()
                                                     if p.grad is not None], self.group)
        for g, buf in back:
            g.copy_(buf[self.kv_head])                        # [n_kv, d, H] -> [d, H]


def parallelize(model, group=None, region: TPRegion | None = None,
                seq_parallel: bool = False, dtensor: bool = True) -> TensorParallel:
    """Split an HF decoder's layers, vocabulary and loss over the ranks of `group`, in place.
    Each parameter's kind comes from the plan (the config's base_model_tp_plan where it ships
    one, else PLAN); one with no kind raises ValueError naming it, before any collective.

        tpm = tp.parallelize(model, group)               # every rank built the same weights
        loss = tpm.loss_sum(model(input_ids=ids).logits, labels) / n_tokens   # vocab-parallel
        loss.backward(); tpm.reduce_partial_grads()       # replicated kv heads, q/k norms
        torch.nn.utils.clip_grad_norm_(model.parameters(), c); optimizer.step()

    dtensor: every parameter a DTensor over its shard (tp_dtensor.py): torch's clip, DCP and
    compile work as on DTensor TP (False: plain shards and tpm.clip, compose4d's for now).
    region, seq_parallel: sp.py's (sequence-sharded edges, replicated gradients partial)."""
    return TensorParallel(model, group, region, seq_parallel, dtensor)


# ----------------------------------------------------------------------------------------------
# Formulas (rig/tp.py, trainer4d/comm.py and trainer4d/plan.py count with these)
# ----------------------------------------------------------------------------------------------
LOSS_ALL_REDUCES = 3   # the vocab-parallel CE: max, sum of exp, target logit; N values each


def region_all_reduces(layers: int, first: bool = True, last: bool = True,
                       moe_layers: int = 0, no_grad_inputs: int = 0) -> int:
    """Activation all-reduces per micro-batch, each of one (B, S, H) activation, N H b bytes: f
    and g around attention and around the MLP, forward and backward (4 per layer; 2 in a MoE
    layer, whose experts are not split), the embedding's partial sums on the first stage, the
    LM head's f on the last; less the f backward of each region whose input needs none (LoRA)."""
    return 4 * layers - 2 * moe_layers + int(first) + int(last) - first * no_grad_inputs


if __name__ == "__main__":   # torchrun tp.py --mode ...: the test rig runs it
    from rig.tp import main
    main()
