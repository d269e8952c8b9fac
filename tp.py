"""tp.py: Megatron tensor parallelism with a vocab-parallel loss, from raw torch.distributed.

The idea (Shoeybi et al., "Megatron-LM", 2019)
    Split each weight matrix across T ranks so that a transformer block needs just two
    all-reduces in the forward and two in the backward:
      MLP        gate and up are column-parallel (each rank computes a slice of the intermediate
                 features), down is row-parallel (each rank's partial sum, then all-reduce);
      attention  q, k and v are column-parallel by heads (q heads and kv heads both / T), so each
                 rank attends with its own heads; o_proj is row-parallel.
    Entering a parallel region is Megatron's f (identity forward, all-reduce backward); leaving it
    is g (all-reduce forward, identity backward). They mirror each other and are the only
    communication inside a block.

Vocabulary
    The embedding is vocab-parallel: rank r owns rows [r*V/T, (r+1)*V/T), looks up the ids it
    owns (zeros for the rest) and the partial embeddings are all-reduced. The LM head is
    column-parallel over the vocabulary, and the loss never materialises full logits: the global
    max, the sum of exponentials and the target logit each come from one all-reduce of size
    B*S. A vocabulary that T does not divide is padded with rows that are masked to -inf in the
    loss (their gradient is exactly zero). With tied embeddings the same shard serves both.

Replicated parameters
    The norms are replicated, with identical inputs and gradients on every rank (the grad of a
    region's input is already all-reduced by f), so they need no communication; correctness
    checks that they stay identical. With more ranks than kv heads (T = m x n_kv, e.g. MQA's
    single head, or 2 kv heads on 4 ranks) each kv head is replicated on the m ranks whose q
    heads attend to it, as in Megatron: a copy's gradient covers its own q heads only, so the
    m copies' gradients are summed (one all-reduce over the group of a zero buffer holding
    every kv head, n_kv x a head's bytes, each rank adding its own head's).

Communication per step (N = B*S tokens, H hidden, L layers, b bytes; all over the tp group)
    forward   all_reduce  embedding 1 + 2 per layer, each N*H*b; loss 3 of N*b
    backward  all_reduce  2 per layer (the f of attention and MLP) + 1 (the f of the LM head)
    total     (4L + 2) all-reduces of N*H*b, plus 3 of N*b  (+1 for replicated kv grads:
              n_kv x the local k and v projections' elements per layer)
Memory: weights and optimizer states / T (norms replicated); activations inside attention and
MLP / T, the residual stream and norms full (sp.py shards those too).

Public API
    tpm = parallelize(model, group)   an HF Llama-family model, split in place
    tpm.loss_sum(logits, labels)      the vocab-parallel cross-entropy (sum over tokens)
    tpm.reduce_partial_grads()        after the step's last backward (replicated kv heads)
    tpm.clip(max_norm)                global-norm clipping over the shards
    examples/tp_train.py is a complete loop.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from tp_plan import classify, head_dims, join_shards
from harness import all_reduce_flat, IGNORE_INDEX, clip_by_norm, planted


# ----------------------------------------------------------------------------------------------
# Communication: Megatron's f and g, mirror images of each other
# ----------------------------------------------------------------------------------------------
class CopyToTP(torch.autograd.Function):
    """f: identity forward; all-reduce of the gradient backward (every rank's branch of the
    region contributed to d(input))."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        # one copy: autograd may hand the same gradient tensor to other consumers, so it is
        # not ours to reduce in place (Megatron does; torch's contract says not to)
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ReduceFromTP(torch.autograd.Function):
    """g: all-reduce of the partial outputs forward; identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        if x.is_contiguous() and not x._is_view():
            # the row-parallel matmul's fresh partial sum, which nothing else holds: reduced in
            # place, no copy (mark_dirty: autograd raises if any node saved the pre-reduce value)
            ctx.mark_dirty(x)
        else:
            x = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class TPRegion:
    """How activations enter and leave a parallel region: f/g for TP; sp.py swaps in the
    sequence all-gather / reduce-scatter pair."""

    def __init__(self, group):
        self.group = group

    def enter(self, x):
        if planted("no-f"):   # plant: no f, so d(input) is this rank's branch only
            return x
        return CopyToTP.apply(x, self.group)

    def exit(self, x):
        return ReduceFromTP.apply(x, self.group)

    def embed_exit(self, x):
        """After the vocab-parallel lookup: the partial embeddings are summed."""
        return ReduceFromTP.apply(x, self.group)

    def row(self, x, weight):
        """A row-parallel layer's partial product, reduced (async_tp.py fuses the two)."""
        return self.exit(F.linear(x, weight))

    def leave(self):
        """Called after the region's module has run (sp.py ends its saved-tensor hooks)."""


# ----------------------------------------------------------------------------------------------
# Parallel modules
# ----------------------------------------------------------------------------------------------
class ColumnParallelLinear(nn.Module):
    """Rows `rows` of the full (out, in) weight and bias: this rank computes a slice of the
    output features. `rows=None` replicates the layer (MQA's single kv head); a list of slices
    takes one slice of each segment of a fused projection (Phi3's qkv_proj: its q, k and v
    rows; gate_up_proj: its gate and up rows), so the local output keeps the fused order."""

    def __init__(self, linear: nn.Linear, rows):
        super().__init__()
        pick = ((lambda t: torch.cat([t[s] for s in rows])) if isinstance(rows, list)
                else (lambda t: t[rows or slice(None)]))
        self.weight = nn.Parameter(pick(linear.weight.detach()).clone())
        self.bias = (nn.Parameter(pick(linear.bias.detach()).clone())
                     if linear.bias is not None else None)

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class SumOverTP(torch.autograd.Function):
    """A sum of every rank's partial value, forward; its gradient is summed the same way
    backward (each rank's output fed every rank's input)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ShardedRMSNorm(nn.Module):
    """An RMSNorm over a feature dimension that TP splits (OLMo2's q_norm / k_norm over all
    heads' features): each rank holds `rows` of the weight and of the features, and the mean
    square is the all-reduced sum of squares over the full width, 1 all-reduce of N values
    forward and 1 backward. Computes as OLMo2's norm does: in at least float32, weight times
    the normalised features, then the input's dtype."""

    def __init__(self, norm: nn.Module, rows: slice, width: int, group):
        super().__init__()
        self.weight = nn.Parameter(norm.weight.detach()[rows].clone())
        self.eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6))
        self.width, self.group = width, group

    def forward(self, x):
        dtype = x.dtype
        h = x.to(torch.promote_types(dtype, torch.float32))
        sq = SumOverTP.apply(h.pow(2).sum(-1, keepdim=True), self.group)     # (B, S, 1)
        return (self.weight * (h * torch.rsqrt(sq / self.width + self.eps))).to(dtype)


class RowParallelLinear(nn.Module):
    """Columns `cols` of the full weight: each rank's partial product is reduced by
    region.exit; the (replicated) bias is added once, after the reduction."""

    def __init__(self, linear: nn.Linear, cols: slice, region: TPRegion):
        super().__init__()
        self.region = region
        self.weight = nn.Parameter(linear.weight.detach()[:, cols].clone())
        self.bias = (nn.Parameter(linear.bias.detach().clone())
                     if linear.bias is not None else None)

    def forward(self, x):
        y = self.region.row(x, self.weight)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Rows [lo, lo + V_pad/T) of the (padded) embedding table. HF's padding_idx (the pad
    token's row, whose gradient stays zero) is kept: on the rank that holds the row, at its
    local index."""

    def __init__(self, emb: nn.Embedding, lo: int, per_rank: int, region: TPRegion):
        super().__init__()
        self.lo, self.per_rank, self.region = lo, per_rank, region
        pad = getattr(emb, "padding_idx", None)
        self.padding_idx = (pad - lo if pad is not None and lo <= pad < lo + per_rank
                            and not planted("embed-drops-padding-idx") else None)   # plant
        # Gemma's scaled embedding multiplies by its embed_scale buffer, sqrt(H) as a float32
        # (then cast to the weights' dtype), exactly as HF does
        self.scale = None
        if hasattr(emb, "scalar_embed_scale"):
            buf = getattr(emb, "embed_scale", None)
            scale = (buf.item() if buf is not None and not buf.is_meta else
                     torch.tensor(emb.scalar_embed_scale, dtype=torch.float32).item())
            # rounded to the weights' dtype once, here: a Python scalar that is exact in that
            # dtype multiplies as the dtype's tensor would, without a tensor made per forward
            self.scale = torch.tensor(scale, dtype=emb.weight.dtype).item()
        w = torch.zeros(per_rank, emb.weight.shape[1], dtype=emb.weight.dtype,
                        device=emb.weight.device)
        rows = emb.weight.detach()[lo:lo + per_rank]
        w[:rows.shape[0]] = rows  # rows past the true vocabulary stay zero (padding)
        self.weight = nn.Parameter(w)

    def forward(self, ids):
        outside = (ids < self.lo) | (ids >= self.lo + self.per_rank)
        local = (ids - self.lo).masked_fill(outside, 0)
        # (ids of other ranks' rows read local row 0 and are zeroed: a padding_idx of 0 here
        # zeroes their gradient too, which the mask zeroes anyway)
        out = F.embedding(local, self.weight, self.padding_idx).masked_fill(outside[..., None],
                                                                            0.0)
        if planted("embed-unmasked"):   # plant: other ranks' ids add this shard's row 0
            out = F.embedding(local, self.weight, self.padding_idx)
        out = self.region.embed_exit(out)
        if self.scale is not None:
            out = out * self.scale
        return out


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token CE from vocab-sharded logits (N, V_pad/T) with three all-reduces of N values:
    the global max, the sum of exponentials, and the target logit (from its owner)."""

    @staticmethod
    def forward(ctx, logits, labels, lo, vocab, group):
        dtype = logits.dtype
        x = logits.float() if dtype in (torch.bfloat16, torch.float16) else logits.clone()
        n_local = x.shape[-1]
        padded = torch.arange(lo, lo + n_local, device=x.device) >= vocab
        x.masked_fill_(padded, float("-inf"))                        # padding never wins
        gmax = x.max(dim=-1).values
        dist.all_reduce(gmax, op=dist.ReduceOp.MAX, group=group)
        x.sub_(gmax[:, None])
        exp = x.exp()
        sum_exp = exp.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)
        ignore = labels == IGNORE_INDEX
        if planted("ce-counts-ignored"):   # plant: ignored labels are not masked
            ignore = torch.zeros_like(ignore)
        t = labels - lo
        mine = (t >= 0) & (t < n_local) & ~ignore
        target = torch.where(mine, x.gather(1, t.clamp(0, n_local - 1)[:, None])[:, 0],
                             torch.zeros_like(gmax))
        dist.all_reduce(target, group=group)
        loss = (sum_exp.log() - target).masked_fill(ignore, 0.0)
        exp.div_(sum_exp[:, None])                                   # local softmax
        ctx.save_for_backward(exp, t, mine, ignore)
        ctx.dtype = dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, t, mine, ignore = ctx.saved_tensors
        grad = softmax  # d loss / d logit = softmax - onehot(target), no communication
        # -1 at each owned target (a static-shape scatter: no nonzero, so it also runs on
        # FakeTensors in oom_search's simulation)
        grad.scatter_add_(1, t.clamp(0, grad.shape[1] - 1)[:, None], -mine.to(grad.dtype)[:, None])
        grad.mul_(grad_loss.masked_fill(ignore, 0.0)[:, None])
        return grad.to(ctx.dtype), None, None, None, None


# ----------------------------------------------------------------------------------------------
# Installing it into an HF Llama
# ----------------------------------------------------------------------------------------------
def pad_vocab(vocab: int, t: int) -> int:
    return -(-vocab // t) * t


def pad_to(t: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    """t extended with zeros along `dim` to length n (the vocabulary padding), as a new tensor."""
    if t.shape[dim] == n:
        return t.clone()
    shape = list(t.shape)
    shape[dim] = n - t.shape[dim]
    return torch.cat([t, t.new_zeros(shape)], dim=dim)


class LocalHeads:
    """A model config seen with this rank's number of attention heads; every other attribute
    is the shared config's, read and written through."""

    def __init__(self, config, heads: int):
        object.__setattr__(self, "_config", config)
        object.__setattr__(self, "num_attention_heads", heads)

    def __getattr__(self, name):
        if name == "_config":
            raise AttributeError(name)
        return getattr(self._config, name)

    def __setattr__(self, name, value):
        setattr(self._config, name, value)


class TensorParallel:
    """Replaces the Linear/Embedding modules (and full-width q/k norms) of an HF decoder (in
    place) with their T-way sharded versions; HF's own attention code then runs on the local
    heads unchanged, since it reshapes with view(..., -1, head_dim). `kinds` says how each
    parameter is treated (classify()); the reductions follow from it."""

    def __init__(self, model, group, region: TPRegion | None = None):
        self.model, self.group = model, group
        self.region = region or TPRegion(group)
        T, r = dist.get_world_size(group), dist.get_rank(group)
        cfg = model.config
        self.T, self.rank, self.vocab = T, r, cfg.vocab_size
        self.kinds, errs = classify(model, T)
        if errs:
            raise ValueError(f"tp.parallelize: {errs[0]}")
        head_dim, hq_full, hkv = head_dims(cfg)
        hq = hq_full // T
        # More ranks than kv heads (T = m * hkv): each kv head is replicated on m consecutive
        # ranks, the ones whose q heads attend to it (Megatron's GQA with tp > kv heads).
        self.kv_copies = 1 if hkv % T == 0 else T // hkv
        self.replicate_kv = self.kv_copies > 1
        self.n_kv, self.kv_head = hkv, r // self.kv_copies
        hkv_local = 1 if self.replicate_kv else hkv // T
        # sharded: name -> dim along which the full tensor is split (vocab ones are padded)
        self.split_dim: dict[str, int] = {}
        # fused projections: name -> the full sizes of its segments along dim 0
        self.segments: dict[str, tuple[int, ...]] = {}
        # the replicated kv projections (kv_copies of each; rank r holds kv head r // m)
        self.kv_split: set[str] = set()

        def rows(n_per_rank):
            return slice(r * n_per_rank, (r + 1) * n_per_rank)
        kv_rows = (slice(self.kv_head * head_dim, (self.kv_head + 1) * head_dim)
                   if self.replicate_kv else rows(hkv_local * head_dim))
        base = model.model
        for i, layer in enumerate(base.layers):
            a, m, p = layer.self_attn, layer.mlp, f"model.layers.{i}."
            if hasattr(a, "qkv_proj"):       # Phi3: [q; k; v] rows, each split by heads
                q_n, kv_n = hq_full * head_dim, hkv * head_dim
                a.qkv_proj = ColumnParallelLinear(a.qkv_proj, [
                    rows(hq * head_dim), slice(q_n + kv_rows.start, q_n + kv_rows.stop),
                    slice(q_n + kv_n + kv_rows.start, q_n + kv_n + kv_rows.stop)])
                for kind in ("weight", "bias"):
                    self.segments[p + f"self_attn.qkv_proj.{kind}"] = (q_n, kv_n, kv_n)
                # Phi3 finds its q rows at config.num_attention_heads * head_dim: this rank's
                # heads, the rest read through from the shared config (cp_ring and recompute
                # change its attention implementation later)
                a.config = LocalHeads(a.config, hq)
            else:
                a.q_proj = ColumnParallelLinear(a.q_proj, rows(hq * head_dim))
                a.k_proj = ColumnParallelLinear(a.k_proj, kv_rows)
                a.v_proj = ColumnParallelLinear(a.v_proj, kv_rows)
            a.o_proj = RowParallelLinear(a.o_proj, rows(hq * head_dim), self.region)
            a.dropout_heads = torch.arange(r * hq, (r + 1) * hq)   # (dropout.py's mask key)
            a.num_key_value_groups = hq // hkv_local
            for attr, n in (("num_heads", hq), ("num_key_value_heads", hkv_local)):
                if hasattr(a, attr):
                    setattr(a, attr, n)
            for n, heads, sl in (("q_norm", hq_full, rows(hq * head_dim)), ("k_norm", hkv, kv_rows)):
                if self.kinds.get(p + f"self_attn.{n}.weight") == "norm-sharded":
                    setattr(a, n, ShardedRMSNorm(getattr(a, n), sl, heads * head_dim, group))
            if hasattr(m, "experts"):        # a MoE block: whole on every rank, no region
                a.register_forward_pre_hook(self._enter_kwargs, with_kwargs=True)
                a.register_forward_hook(self._leave)
                continue
            if hasattr(m, "gate_up_proj"):   # Phi3: [gate; up] rows, each split
                inter = m.gate_up_proj.weight.shape[0] // 2
                m.gate_up_proj = ColumnParallelLinear(
                    m.gate_up_proj, [rows(inter // T), slice(inter + r * (inter // T),
                                                             inter + (r + 1) * (inter // T))])
                for kind in ("weight", "bias"):
                    self.segments[p + f"mlp.gate_up_proj.{kind}"] = (inter, inter)
                inter_local = inter // T
            else:
                inter_local = m.gate_proj.weight.shape[0] // T
                m.gate_proj = ColumnParallelLinear(m.gate_proj, rows(inter_local))
                m.up_proj = ColumnParallelLinear(m.up_proj, rows(inter_local))
            m.down_proj = RowParallelLinear(m.down_proj, rows(inter_local), self.region)
            # Entering each region: f on the shared input of q/k/v, and of gate/up.
            a.register_forward_pre_hook(self._enter_kwargs, with_kwargs=True)
            m.register_forward_pre_hook(self._enter_args)
            for mod in (a, m):
                mod.register_forward_hook(self._leave)
        for name, kind in self.kinds.items():
            if kind in ("column", "fused", "norm-sharded"):
                self.split_dim[name] = 0
            elif kind == "row" and name.endswith(".weight"):
                self.split_dim[name] = 1
            elif kind == "kv-copy":
                self.kv_split.add(name)
        named = dict(model.named_parameters())
        # replicated kv heads: each copy's gradient covers its own q heads only, summed over
        # the m copies
        self.partial_grads: list[nn.Parameter] = [named[n] for n, k in self.kinds.items()
                                                  if k == "kv-copy"]
        # Vocabulary: padded to a multiple of T, embedding and head split by rows.
        self.vocab_padded = pad_vocab(cfg.vocab_size, T)
        per = self.vocab_padded // T
        self.vocab_lo = r * per
        tied = model.lm_head.weight is base.embed_tokens.weight
        base.embed_tokens = VocabParallelEmbedding(base.embed_tokens, self.vocab_lo, per,
                                                   self.region)
        head = nn.Linear(1, 1, bias=False)  # placeholder replaced by the vocab shard below
        if tied:
            head.weight = base.embed_tokens.weight
        else:
            full = model.lm_head.weight.detach()
            w = torch.zeros(per, full.shape[1], dtype=full.dtype, device=full.device)
            mine = full[self.vocab_lo:self.vocab_lo + per]
            w[:mine.shape[0]] = mine
            head.weight = nn.Parameter(w)
        model.lm_head = head
        model.lm_head.register_forward_pre_hook(self._enter_args)
        model.lm_head.register_forward_hook(self._leave)
        self.split_dim["model.embed_tokens.weight"] = 0
        if not tied:
            self.split_dim["lm_head.weight"] = 0
        # Per-head q/k norms see this rank's heads only: their gradients are summed over the
        # group (sp.py replaces this list with every replicated parameter: under SP the norms
        # see this rank's tokens only too)
        named = dict(model.named_parameters())
        self.extra_partial: list[nn.Parameter] = [
            named[n] for n, k in self.kinds.items() if k == "partial"]

    def _enter_kwargs(self, module, args, kwargs):
        if "hidden_states" in kwargs:
            kwargs["hidden_states"] = self.region.enter(kwargs["hidden_states"])
        else:
            args = (self.region.enter(args[0]),) + tuple(args[1:])
        return args, kwargs

    def _enter_args(self, module, args):
        return (self.region.enter(args[0]),) + tuple(args[1:])

    def _leave(self, module, args, out):
        self.region.leave()

    def loss_sum(self, logits, labels) -> torch.Tensor:
        return VocabParallelCrossEntropy.apply(
            logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), self.vocab_lo,
            self.vocab, self.group).sum()

    def reduce_partial_grads(self):
        """All-reduce the gradients that each rank holds only a part of (one flat call). A
        replicated kv head's gradient is summed over its m copies only: each rank places it at
        its head's position in a zero buffer of all n_kv heads, so one all-reduce over the
        group serves every head (n_kv x the head's bytes; no per-head process groups).
        extra_partial's (per-head q/k norms; under SP every replicated parameter) are summed
        as they are."""
        kv, plain = self.partial_grads, self.extra_partial
        if planted("qk-norm-grads-unreduced"):   # plant: per-head q/k norms kept per rank
            plain = [p for p in plain if self.kinds.get(self._name(p)) != "partial"]
        if planted("kv-copies-summed-across-heads"):   # plant: every kv head's copies summed
            kv, plain = [], [*kv, *plain]             # with every other head's
        back = []
        for p in kv:
            if p.grad is not None:
                buf = p.grad.new_zeros(self.n_kv, *p.grad.shape)
                buf[self.kv_head] = p.grad
                back.append((p, buf))
        all_reduce_flat([buf for _, buf in back] + [p.grad for p in plain if p.grad is not None],
                        self.group)
        for p, buf in back:
            p.grad.copy_(buf[self.kv_head])

    def _name(self, p) -> str:
        return next(n for n, q in self.model.named_parameters() if q is p)

    def partial_numel(self) -> int:
        """Elements of the partial gradients' all-reduce (the kv heads' buffers and the
        extra partial gradients)."""
        return (sum(p.numel() * self.n_kv for p in self.partial_grads)
                + sum(p.numel() for p in self.extra_partial))

    def full(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Full tensors from this rank's shards (collective): gather along the split dim and
        drop the vocabulary padding."""
        out = {}
        for name, t in tensors.items():
            d = self.split_dim.get(name)
            if d is None and name not in self.kv_split:
                out[name] = t
                continue
            parts = [torch.empty_like(t) for _ in range(self.T)]
            dist.all_gather(parts, t.contiguous(), group=self.group)
            if name in self.kv_split:      # one copy of each kv head
                out[name] = torch.cat(parts[::self.kv_copies], dim=0)
                continue
            full = join_shards(parts, d, self.segments.get(name))
            if name in ("model.embed_tokens.weight", "lm_head.weight"):
                full = full[:self.vocab]
            out[name] = full
        return out

    def local_range(self, name: str, full_shape):
        """(dim, start, stop) of the full tensor `name` that this rank holds, or None when it
        holds the whole tensor; a fused projection's is a list of them, one per segment, to be
        concatenated. For the vocabulary-split embedding and head, stop may pass the true
        vocabulary: those rows are zero padding. A checkpoint loader reads just these ranges
        (harness/loading.py); local() cuts them from a full tensor."""
        if name in self.segments:
            out, off = [], 0
            for n in self.segments[name]:
                k = n // self.T
                out.append((0, off + self.rank * k, off + (self.rank + 1) * k))
                off += n
            return out
        if name in self.kv_split:           # a replicated kv projection: one head's rows
            n = full_shape[0] // self.n_kv
            return 0, self.kv_head * n, (self.kv_head + 1) * n
        d = self.split_dim.get(name)
        if d is None:
            return None
        size = (self.vocab_padded if name in ("model.embed_tokens.weight", "lm_head.weight")
                else full_shape[d])
        n = size // self.T
        return d, self.rank * n, (self.rank + 1) * n

    def local(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's shard of a full tensor (the inverse of full(): vocabulary rows padded
        with zeros, then the rank's range along the split dim)."""
        r = self.local_range(name, full.shape)
        if r is None:
            return full
        if isinstance(r, list):
            return torch.cat([full.narrow(d, a, b - a) for d, a, b in r], dim=0)
        d, a, b = r
        return pad_to(full.narrow(d, a, max(0, min(b, full.shape[d]) - a)), d, b - a)

    def clip(self, max_norm: float) -> float:
        """Global-norm clipping: sharded grads' squares summed over the group, replicated ones
        counted once."""
        sharded = torch.zeros(1, dtype=torch.float64, device=self.device())
        replicated = torch.zeros(1, dtype=torch.float64, device=self.device())
        for n, p in self.model.named_parameters():
            if p.grad is not None:
                target = sharded if n in self.split_dim else replicated
                if planted("clip-norm-scale"):   # plant: replicated ones counted T times
                    target = sharded
                sq = p.grad.double().pow(2).sum()
                if n in self.kv_split:   # a kv head's m copies count once
                    target, sq = sharded, sq / self.kv_copies
                target += sq
        dist.all_reduce(sharded, group=self.group)
        return clip_by_norm(sharded + replicated,
                            [p.grad for p in self.model.parameters() if p.grad is not None],
                            max_norm)

    def device(self):
        return next(self.model.parameters()).device


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


def parallelize(model, group=None, region: TPRegion | None = None) -> TensorParallel:
    """Split an HF decoder's layers, vocabulary and loss over the ranks of `group`, in place
    (the one entry the harness, sp.py, compose4d and users call). Llama, Mistral, Qwen2/3,
    OLMo2, Gemma2 and Phi3 layouts are known (classify()); any parameter that is not raises
    ValueError naming it, before any collective. In a loop:

        tpm = tp.parallelize(model, group)              # every rank built the same weights
        logits = model(input_ids=ids).logits             # this rank's vocabulary shard
        loss = tpm.loss_sum(logits, labels) / n_tokens   # vocab-parallel cross-entropy
        loss.backward()
        tpm.reduce_partial_grads()                       # once per step: replicated kv
                                                         # heads, per-head q/k norms
        tpm.clip(max_norm); optimizer.step()             # the norm over all shards

    `tpm.full(...)` / `tpm.local(...)` convert between full tensors and this rank's shards."""
    errs = shape_constraints(dist.get_world_size(group), model.config)
    if errs:
        raise ValueError(f"tp.parallelize: {errs[0]}")
    return TensorParallel(model, group, region)


if __name__ == "__main__":   # torchrun tp.py --mode ...: the test rig runs it
    from rig.tp import main
    main()
