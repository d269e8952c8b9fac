"""sp.py: sequence parallelism, Megatron-style (with TP) and Ulysses, from raw torch.distributed.

--variant megatron (Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
Models", 2022)
    Tensor parallelism (tp.py) leaves the norms, residual adds and dropout outside the parallel
    regions, so every rank stores their activations in full. SP shards them along the sequence:
    between regions each rank holds S/T tokens. Megatron's f/g pair becomes
      enter  all-gather along the sequence   (backward: reduce-scatter)
      exit   reduce-scatter along the sequence (backward: all-gather)
    An all-gather plus a reduce-scatter move the same bytes as one all-reduce, so each of TP's
    region all-reduces costs what SP's pair costs; SP adds 2L+2 all-gathers (below) and divides
    the remaining activations by T. The norms (and row-parallel biases) now see only their own
    tokens, so their gradients are all-reduced over the group. The embedding's partial sums
    are all-reduced and each rank keeps its sequence chunk at the first layer.
    Megatron reduce-scatters there, but HF builds its RoPE tables and causal mask from the
    embedding output's length, so it stays full-length until then: attention always runs on the
    gathered full sequence, and RoPE sees true positions. The LM head gathers the sequence and
    the loss is the vocab-parallel one, over every token.

--variant ulysses (Jacobs et al., "DeepSpeed Ulysses", 2023)
    Full weights on every rank; rank r holds tokens [r*S/W, (r+1)*S/W) of every sequence and
    passes their global position ids, so RoPE is right. Attention needs all tokens, so an
    all-to-all turns (local tokens, all heads) into (all tokens, local heads) before attention and
    back after. The attention heads must divide by W: heads are what Ulysses shards, so its degree
    is at most the head count (Ulysses' own limit). That the kv heads must divide by W too is this
    implementation's limit, not Ulysses': with fewer kv heads than W, each could be repeated
    (W / kv heads times) before the all-to-all (GQA's repeat_kv, moved earlier) at the cost of
    more bytes; here that configuration is refused in one line. The attention function plugs
    into HF's attention registry. Replicated weights see different tokens, so their gradients
    are all-reduced (ddp.DataParallel).

Communication per step (N = B*S tokens, H hidden, H_kv = kv heads x head dim, L layers,
b bytes, W = T ranks; per-rank wire bytes of a ring: all_reduce 2(W-1)/W of its buffer,
all_gather / reduce_scatter / all_to_all (W-1)/W)
    megatron  all_gather (6L+3) and reduce_scatter (4L+1) of N*H*b each (expected_comm), and
              all_reduce: embedding N*H*b, loss 3 x N*b, norm/bias grads 1. TP's 4L+1 region
              all-reduces become 4L+1 all-gather / reduce-scatter pairs and the embedding's
              all-reduce stays: the same bytes. On top come 2L+2 all-gathers: the first layer's
              split (backward) and the 2L+1 re-gathers of the region inputs that are not kept for
              the weight gradients (what divides their memory by T). Per-rank wire bytes:
                  SP = TP + (2L+2) (W-1)/W N*H*b = (10L+6)/(8L+4) x TP   (1.25x as L grows)
              (TP: (4L+2) all-reduces, 2 (W-1)/W (4L+2) N*H*b), plus the norms' gradient
              all-reduce (Psi_norm*b).
    ulysses   all_to_all per layer: q, k, v in and the output back, forward and backward:
              buffers of 2 x (2H + 2 H_kv) x N/W * b per layer, against TP's 4 all-reduces of N*H*b:
                  buffer bytes      (H + H_kv) / (H W) of TP's: 2/W without GQA, towards 1/W
                                    as H_kv / H shrinks;
                  per-rank wire     (H + H_kv) / (2 H W) of TP's (an all-to-all sends (W-1)/W of
                                    its buffer, a ring all-reduce twice that): 1/W without GQA,
                                    less with it;
              plus the data-parallel all_reduce of the gradients (Psi*b).

--async-tp (megatron): each region's all-gather + column matmuls and row matmul + reduce-scatter
    run as rings of chunked matmuls whose transfers overlap them (async_tp.py; the same bytes in
    (10L+3)(T-1) point-to-point hops); SyncMegatronSP is its --compare-native / --paired baseline.

Public API
    tpm = parallelize(model, group, async_tp=False)   Megatron SP: tp.parallelize with
        sequence-sharded regions
        (the loop is tp.py's; the norms' gradients join tpm.reduce_partial_grads())
    dp = parallelize_ulysses(model, group)   Ulysses: the all-to-all attention installed, the
        model returned under ddp.DataParallel; each rank feeds its 1/W of every sequence
    Complete loops: examples/tp_train.py --sp, examples/ulysses_train.py.
"""

import torch
import torch.distributed as dist
import torch.nn as nn

from harness import attention_of, parts, planted
from harness import dropout as harness_dropout
from harness import recompute
import async_tp as async_tp_
import ddp
import tp


# ----------------------------------------------------------------------------------------------
# Megatron SP: sequence all-gather / reduce-scatter pair (dim 1 of (B, S, H))
# ----------------------------------------------------------------------------------------------
def _gather_seq(x, group):
    """(B, s, H) chunks from every rank -> (B, W*s, H), contiguous (so the linears that consume
    it save views of this very storage, which _Regather recognises)."""
    W = dist.get_world_size(group)
    B, s = x.shape[:2]
    out = torch.empty((W * B, s) + x.shape[2:], dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(out, x.contiguous(), group=group)   # dim 0: source rank
    return out.view((W, B, s) + x.shape[2:]).transpose(0, 1).reshape((B, W * s) + x.shape[2:])


def _reduce_scatter_seq(x, group):
    """(B, S, H) partial sums -> this rank's (B, S/W, H) chunk of the sum."""
    W = dist.get_world_size(group)
    xt = x.transpose(0, 1).contiguous()
    out = torch.empty((xt.shape[0] // W,) + xt.shape[1:], dtype=x.dtype, device=x.device)
    dist.reduce_scatter_tensor(out, xt, group=group)
    return out.transpose(0, 1)


class GatherFromSP(torch.autograd.Function):
    """enter: all-gather the sequence forward; reduce-scatter the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        if planted("enter-grad-unreduced"):   # plant: own chunk, not summed over the ranks
            r, s = dist.get_rank(ctx.group), grad.shape[1] // dist.get_world_size(ctx.group)
            return grad[:, r * s:(r + 1) * s], None
        return _reduce_scatter_seq(grad, ctx.group), None


class ReduceScatterToSP(torch.autograd.Function):
    """exit: reduce-scatter the partial sums forward; all-gather the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_seq(grad, ctx.group), None


class SplitToSP(torch.autograd.Function):
    """Keep this rank's chunk of a full (replicated) sequence; backward all-gathers."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        W, r = dist.get_world_size(group), dist.get_rank(group)
        s = x.shape[1] // W
        mine = x[:, r * s:(r + 1) * s]
        if planted("split-strided"):   # plant: tokens r, r+W, ... but gathered as chunks
            mine = x[:, r::W]
        return mine.contiguous()

    @staticmethod
    def backward(ctx, grad):
        return _gather_seq(grad.contiguous(), ctx.group), None


class _Regather:
    """Saved-tensor hooks for one region's forward: a tensor saved for the backward that views
    the gathered sequence is stored as this rank's chunk instead, and all-gathered again (once,
    shared by q/k/v or gate/up) when the backward needs it. This is what makes SP's activation
    memory 1/T: Megatron re-gathers the region input in the backward rather than keep it."""

    def __init__(self, full, local, group):
        self.key = full.untyped_storage()._cdata   # the StorageImpl (FakeTensors share data_ptr 0)
        self.local, self.group, self.cache = local, group, None

    def pack(self, t):
        if t.device.type != "meta" and t.untyped_storage()._cdata == self.key:
            return (self, t.shape, t.stride(), t.storage_offset())
        return t

    @staticmethod
    def unpack(packed):
        if not isinstance(packed, tuple):
            return packed
        self, shape, stride, offset = packed
        if self.cache is None:
            self.cache = _gather_seq(self.local, self.group)
        return torch.as_strided(self.cache, shape, stride, offset)


class SPRegion(tp.TPRegion):
    def __init__(self, group):
        super().__init__(group)
        self._contexts = []

    def enter(self, x):
        full = GatherFromSP.apply(x, self.group)
        # (inside a fully recomputed layer the checkpoint keeps the layer's input, this rank's
        # chunk, and nothing else: the re-gather hooks would keep what it drops)
        if torch.is_grad_enabled() and not recompute.inside_checkpoint():
            r = _Regather(full, x.detach(), self.group)
            ctx = torch.autograd.graph.saved_tensors_hooks(r.pack, _Regather.unpack)
            ctx.__enter__()
            self._contexts.append(ctx)
        return full

    def leave(self):
        if self._contexts:
            self._contexts.pop().__exit__(None, None, None)

    def exit(self, x):
        return ReduceScatterToSP.apply(x, self.group)


def parallelize(model, group=None, async_tp: bool = False) -> tp.TensorParallel:
    """Megatron sequence parallelism: tp.parallelize with all-gather / reduce-scatter regions,
    and the residual stream sequence-sharded between them. The loop is tp's (the norms'
    gradients join tpm.reduce_partial_grads()); each rank still feeds the whole sequence.
    async_tp: each region's all-gather + matmul and matmul + reduce-scatter decomposed into
    rings of chunked matmuls that overlap the transfers (async_tp.py)."""
    region = SPRegion(group)
    if async_tp:
        region = async_tp_.AsyncSPRegion(group, region)
    tpm = tp.parallelize(model, group, region=region)
    if async_tp:
        async_tp_.fuse_columns(model, region)
    tpm.extra_partial = shard_residual_stream(model, group, tpm.kinds)
    return tpm


def shard_residual_stream(model, group, kinds: dict[str, str]) -> list[nn.Parameter]:
    """Megatron SP on a model whose linear layers tensor_parallel already split with an
    SPRegion: the residual stream is sequence-sharded from the first layer's input on (call
    before a pipeline drops layers). Returns the parameters whose gradients are partial over the
    group, from tp's `kinds`: the replicated ones (norms and row-parallel biases act on this
    rank's tokens only) and the partial ones (per-head q/k norms: this rank's heads)."""
    parts(model).layers[0].register_forward_pre_hook(
        lambda mod, args, kwargs: _split_first(args, kwargs, group), with_kwargs=True)
    return [p for n, p in model.named_parameters() if kinds.get(n) in ("replicated", "partial")]


def _split_first(args, kwargs, group):
    if "hidden_states" in kwargs:
        kwargs["hidden_states"] = SplitToSP.apply(kwargs["hidden_states"], group)
    else:
        args = (SplitToSP.apply(args[0], group),) + tuple(args[1:])
    return args, kwargs


# ----------------------------------------------------------------------------------------------
# Ulysses: all-to-all between sequence-sharded and head-sharded layouts
# ----------------------------------------------------------------------------------------------
def _seq_to_heads(x, group):
    """(B, h, s, d) with local tokens -> (B, h/W, W*s, d) with local heads."""
    W = dist.get_world_size(group)
    B, h, s, d = x.shape
    send = x.reshape(B, W, h // W, s, d).transpose(0, 1).contiguous()   # (W, B, h/W, s, d)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)                     # dim 0: source rank
    if planted("a2a-permute"):   # plant: (B, W, h/W, s, d) viewed as (B, h/W, W*s, d)
        return recv.transpose(0, 1).reshape(B, h // W, W * s, d)
    return recv.permute(1, 2, 0, 3, 4).reshape(B, h // W, W * s, d)


def _heads_to_seq(x, group):
    """(B, h/W, S, d) with local heads -> (B, h, S/W, d) with local tokens."""
    W = dist.get_world_size(group)
    B, hl, S, d = x.shape
    send = x.reshape(B, hl, W, S // W, d).permute(2, 0, 1, 3, 4).contiguous()  # (W, B, hl, s, d)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)                     # dim 0: head group
    return recv.transpose(0, 1).reshape(B, W * hl, S // W, d)


class SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _seq_to_heads(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad.contiguous(), ctx.group), None


class HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _heads_to_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad.contiguous(), ctx.group), None


def ulysses_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                      **kwargs):
    """HF attention-interface function: q/k/v arrive as (B, heads, local tokens, d)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    group = module.sp_group
    q, k, v = (SeqToHeads.apply(t, group) for t in (query, key, value))
    # All tokens of the sequence are here now: plain causal attention over them.
    if dropout > 0 and module.training:   # (dropout.py: masks keyed by global heads)
        h, r = q.shape[1], dist.get_rank(group)
        heads = getattr(module, "dropout_heads", None)
        heads = (torch.arange(h * dist.get_world_size(group)) if heads is None else heads)
        out, _ = harness_dropout.attention(module, q, k, v, None, scaling, dropout,
                                           heads=heads[r * h:(r + 1) * h])
    else:
        out, _ = sdpa_attention_forward(module, q, k, v, None, scaling=scaling, dropout=dropout,
                                        is_causal=True)
    out = HeadsToSeq.apply(out.transpose(1, 2).contiguous(), group)      # (B, h, s, d)
    return out.transpose(1, 2).contiguous(), None


def parallelize_ulysses(model, group=None, **dp_kwargs):
    """DeepSpeed-Ulysses for an HF Llama-family model over the ranks of `group`, in place:
    attention runs through HF's attention registry with an all-to-all from sequence shards to
    head shards and back. With attention dropout (a model built by harness.build_model) each
    forward must run inside harness.dropout.at(batch, hidden=pos), whose masks it keys by the
    global heads. Returns the model wrapped in ddp.DataParallel over the same group
    (the weights are replicated; `dp_kwargs` go to it). Each rank feeds its contiguous 1/W of
    every sequence with its global position ids (ddp.token_sharded_step shows the loop)."""
    from transformers import AttentionInterface
    AttentionInterface.register("ulysses", ulysses_attention)
    model.config._attn_implementation = "ulysses"
    for layer in parts(model).layers:
        attention_of(layer).sp_group = group
    return ddp.DataParallel(model, group, **dp_kwargs)


if __name__ == "__main__":   # torchrun sp.py --mode ...: the test rig runs it
    from rig.sp import main
    main()
