"""sp.py: sequence parallelism, Megatron-style (with TP) and Ulysses, from raw torch.distributed.

megatron (Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models",
2022): tp.py's norms, residual adds and dropout run on S/T tokens per rank (activations / T);
f/g become, among the T ranks of the tp group,
    region_in   all-gather along the sequence     (backward: reduce-scatter)
    region_out  reduce-scatter along the sequence (backward: all-gather)
  The norms' and row biases' gradients are all-reduced; the residual stream is split at the
  first layer (HF's RoPE and mask need the full embedding); attention and the loss see the
  whole sequence. --async-tp: the regions as rings of chunked matmuls (async_tp.py).
ulysses (Jacobs et al., "DeepSpeed Ulysses", 2023): full weights; rank r holds tokens
  [r S/W, (r+1) S/W) with their global positions; an all-to-all turns (local tokens, all heads)
  into (all tokens, local heads) around attention (n_h, n_kv divisible by W); ddp all-reduces.
  In full: docs/internals.md, 'sp.py'.

Communication per step (N = B*S, H_kv = n_kv d, L layers, b bytes, W = T; per-rank ring wire
bytes: all_reduce 2(W-1)/W of its buffer, all_gather / reduce_scatter / all_to_all (W-1)/W)
    megatron  all_gather (6L+3) and reduce_scatter (4L+1) of N*H*b; all_reduce: embedding N*H*b,
              loss 3 x N*b, norm/bias grads 1 (Psi_norm*b). TP's 4L+1 region all-reduces become
              as many pairs (the same bytes), plus 2L+2 all-gathers (first-layer split, 2L+1
              re-gathers):  SP = TP + (2L+2) (W-1)/W N*H*b = (10L+6)/(8L+4) x TP  (-> 1.25x)
              (TP: (4L+2) all-reduces, 2 (W-1)/W (4L+2) N*H*b)
    ulysses   all_to_all of q, k, v in and the output back, fwd and bwd: 2 (2H + 2 H_kv) N/W b
              per layer vs TP's 4 all-reduces of N*H*b: buffer (H + H_kv)/(H W) of TP's (2/W no
              GQA), per-rank wire (H + H_kv)/(2 H W) (1/W no GQA); + the grads' all_reduce, Psi*b

Public API
    tpm = parallelize(model, group, async_tp=False)   Megatron SP; tp.py's loop (the norms'
        gradients join tpm.reduce_partial_grads())
    dp = parallelize_ulysses(model, group)   Ulysses, under ddp.DataParallel; each rank feeds
        its 1/W of every sequence; set_documents(model, doc_positions) for packed documents.
        Loops: examples/tp_train.py --sp, examples/ulysses_train.py

Run:  torchrun --nproc_per_node=2 sp.py --mode correctness --variant ulysses   (megatron)
"""

import torch
import torch.distributed as dist

from harness import attention_of, parts, planted
from harness.data import document_mask
from harness import dropout as harness_dropout
from harness import recompute
import async_tp as async_tp_
import ddp
import tp


# ----------------------------------------------------------------------------------------------
# Megatron SP: sequence all-gather / reduce-scatter pair (dim 1 of (B, S, H))
# ----------------------------------------------------------------------------------------------
def _gather_seq(x, group):
    """(B, S/W, H) chunks from every rank -> (B, S, H), contiguous (so the linears that consume
    it save views of this very storage, which _Regather recognises)."""
    W = dist.get_world_size(group)
    B, s = x.shape[:2]
    out = torch.empty((W * B, s) + x.shape[2:], dtype=x.dtype, device=x.device)   # (W*B, S/W, H)
    dist.all_gather_into_tensor(out, x.contiguous(), group=group)   # dim 0: source rank
    # (W*B, S/W, H) -> (W, B, S/W, H) -> (B, W, S/W, H) -> (B, S, H): rank r's tokens at r*S/W
    return out.view((W, B, s) + x.shape[2:]).transpose(0, 1).reshape((B, W * s) + x.shape[2:])


def _reduce_scatter_seq(x, group):
    """(B, S, H) partial sums -> this rank's (B, S/W, H) chunk of the sum."""
    W = dist.get_world_size(group)
    xt = x.transpose(0, 1).contiguous()                                 # (B, S, H) -> (S, B, H)
    out = torch.empty((xt.shape[0] // W,) + xt.shape[1:], dtype=x.dtype, device=x.device)
    dist.reduce_scatter_tensor(out, xt, group=group)   # (S, B, H) -> (S/W, B, H), summed over W
    return out.transpose(0, 1)                         # (S/W, B, H) -> (B, S/W, H), a view


class GatherFromSP(torch.autograd.Function):
    """region_in: all-gather the sequence forward; reduce-scatter the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):          # (B, S/T, H) -> (B, S, H)
        ctx.group = group
        return _gather_seq(x, group)

    @staticmethod
    def backward(ctx, grad):             # (B, S, H) -> (B, S/T, H), summed over T
        if planted("enter-grad-unreduced"):   # plant: own chunk, not summed over the ranks
            r, s = dist.get_rank(ctx.group), grad.shape[1] // dist.get_world_size(ctx.group)
            return grad[:, r * s:(r + 1) * s], None
        return _reduce_scatter_seq(grad, ctx.group), None


class ReduceScatterToSP(torch.autograd.Function):
    """region_out: reduce-scatter the partial sums forward; all-gather the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):          # (B, S, H) partial sums -> (B, S/T, H) of the sum
        ctx.group = group
        return _reduce_scatter_seq(x, group)

    @staticmethod
    def backward(ctx, grad):             # (B, S/T, H) -> (B, S, H)
        return _gather_seq(grad, ctx.group), None


class SplitToSP(torch.autograd.Function):
    """Keep this rank's chunk of a full (replicated) sequence; backward all-gathers."""

    @staticmethod
    def forward(ctx, x, group):          # (B, S, H) replicated -> (B, S/T, H) this rank's tokens
        ctx.group = group
        W, r = dist.get_world_size(group), dist.get_rank(group)
        s = x.shape[1] // W
        mine = x[:, r * s:(r + 1) * s]   # (B, S, H) -> (B, S/T, H), tokens [r S/T, (r+1) S/T)
        if planted("split-strided"):   # plant: tokens r, r+W, ... but gathered as chunks
            mine = x[:, r::W]
        return mine.contiguous()

    @staticmethod
    def backward(ctx, grad):             # (B, S/T, H) -> (B, S, H)
        return _gather_seq(grad.contiguous(), ctx.group), None


class _Regather:
    """Saved-tensor hooks for one region's forward: a tensor saved for the backward that views
    the gathered sequence is stored as this rank's chunk instead, and all-gathered again (once,
    shared by q/k/v or gate/up) when the backward needs it. This is what makes SP's activation
    memory 1/T: Megatron re-gathers the region input in the backward rather than keep it."""

    def __init__(self, full, local, group):   # full (B, S, H), local (B, S/T, H)
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
            self.cache = _gather_seq(self.local, self.group)   # (B, S/T, H) -> (B, S, H)
        return torch.as_strided(self.cache, shape, stride, offset)   # the saved view, again


class SPRegion(tp.TPRegion):
    def __init__(self, group):
        super().__init__(group)
        self._contexts = []

    def region_in(self, x):
        full = GatherFromSP.apply(x, self.group)       # (B, S/T, H) -> (B, S, H)
        # (inside a fully recomputed layer the checkpoint keeps the layer's input, this rank's
        # chunk, and nothing else: the re-gather hooks would keep what it drops)
        if torch.is_grad_enabled() and not recompute.inside_checkpoint():
            r = _Regather(full, x.detach(), self.group)
            ctx = torch.autograd.graph.saved_tensors_hooks(r.pack, _Regather.unpack)
            ctx.__enter__()
            self._contexts.append(ctx)
        return full

    def after_module(self):
        if self._contexts:
            self._contexts.pop().__exit__(None, None, None)

    def region_out(self, x):
        return ReduceScatterToSP.apply(x, self.group)  # (B, S, H) partial -> (B, S/T, H)


def parallelize(model, group=None, async_tp: bool = False,
                dtensor: bool = True) -> tp.TensorParallel:
    """Megatron sequence parallelism: tp.parallelize with all-gather / reduce-scatter regions,
    and the residual stream sequence-sharded between them. The loop is tp's (the norms'
    gradients join tpm.reduce_partial_grads()); each rank still feeds the whole sequence.
    async_tp: each region's all-gather + matmul and matmul + reduce-scatter decomposed into
    rings of chunked matmuls that overlap the transfers (async_tp.py)."""
    region = SPRegion(group)
    if async_tp:
        region = async_tp_.AsyncSPRegion(group, region)
    tpm = tp.parallelize(model, group, region=region, seq_parallel=True, dtensor=dtensor)
    if async_tp:
        async_tp_.fuse_columns(model, region)
    shard_residual_stream(model, group)
    return tpm


def shard_residual_stream(model, group):
    """Megatron SP on a model whose linear layers tp.parallelize already split with an
    SPRegion (seq_parallel=True, which makes the norms' and row biases' gradients partial over
    the group: they act on this rank's tokens only): the residual stream is sequence-sharded
    from the first layer's input on (call before a pipeline drops layers)."""
    parts(model).layers[0].register_forward_pre_hook(
        lambda mod, args, kwargs: _split_first(args, kwargs, group), with_kwargs=True)


def _split_first(args, kwargs, group):   # the first layer's input: (B, S, H) -> (B, S/T, H)
    if "hidden_states" in kwargs:
        kwargs["hidden_states"] = SplitToSP.apply(kwargs["hidden_states"], group)
    else:
        args = (SplitToSP.apply(args[0], group),) + tuple(args[1:])
    return args, kwargs


# ----------------------------------------------------------------------------------------------
# Ulysses: all-to-all between sequence-sharded and head-sharded layouts
# ----------------------------------------------------------------------------------------------
def _seq_to_heads(x, group):
    """(B, n, S/W, d) with local tokens -> (B, n/W, S, d) with local heads (n = n_h or n_kv)."""
    W = dist.get_world_size(group)
    B, h, s, d = x.shape
    # (B, n, S/W, d) -> (B, W, n/W, S/W, d) -> (W, B, n/W, S/W, d): dim 0 the destination rank
    send = x.reshape(B, W, h // W, s, d).transpose(0, 1).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)   # (W, B, n/W, S/W, d), dim 0: source rank
    if planted("a2a-permute"):   # plant: (B, W, h/W, s, d) viewed as (B, h/W, W*s, d)
        return recv.transpose(0, 1).reshape(B, h // W, W * s, d)
    # (W, B, n/W, S/W, d) -> (B, n/W, W, S/W, d) -> (B, n/W, S, d)
    return recv.permute(1, 2, 0, 3, 4).reshape(B, h // W, W * s, d)


def _heads_to_seq(x, group):
    """(B, n/W, S, d) with local heads -> (B, n, S/W, d) with local tokens."""
    W = dist.get_world_size(group)
    B, hl, S, d = x.shape
    # (B, n/W, S, d) -> (B, n/W, W, S/W, d) -> (W, B, n/W, S/W, d): dim 0 the destination rank
    send = x.reshape(B, hl, W, S // W, d).permute(2, 0, 1, 3, 4).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)   # (W, B, n/W, S/W, d), dim 0: head group
    # (W, B, n/W, S/W, d) -> (B, W, n/W, S/W, d) -> (B, n, S/W, d)
    return recv.transpose(0, 1).reshape(B, W * hl, S // W, d)


class SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):          # (B, n, S/W, d) -> (B, n/W, S, d)
        ctx.group = group
        return _seq_to_heads(x, group)

    @staticmethod
    def backward(ctx, grad):             # (B, n/W, S, d) -> (B, n, S/W, d)
        return _heads_to_seq(grad.contiguous(), ctx.group), None


class HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):          # (B, n/W, S, d) -> (B, n, S/W, d)
        ctx.group = group
        return _heads_to_seq(x, group)

    @staticmethod
    def backward(ctx, grad):             # (B, n, S/W, d) -> (B, n/W, S, d)
        return _seq_to_heads(grad.contiguous(), ctx.group), None


def ulysses_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                      **kwargs):
    """HF attention-interface function: q/k/v arrive as (B, n, S/W, d), n = n_h or n_kv."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    group = module.sp_group
    q, k, v = (SeqToHeads.apply(t, group) for t in (query, key, value))   # -> (B, n/W, S, d)
    # All tokens of the sequence are here now: plain causal attention over them, or causal
    # within each packed document (set_documents): (B, 1, S, S), True where a query may attend
    docs = module.sp_documents             # (B, S) positions within packed documents, or None
    mask = None if docs is None else document_mask(docs)[:, None]   # -> (B, 1, S, S)
    if planted("ulysses-causal-only"):   # plant: packed documents attend across boundaries
        mask = None
    if dropout > 0 and module.training:   # (dropout.py: masks keyed by global heads)
        h, r = q.shape[1], dist.get_rank(group)
        heads = getattr(module, "dropout_heads", None)
        heads = (torch.arange(h * dist.get_world_size(group)) if heads is None else heads)
        additive = None if mask is None else torch.zeros(
            mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, torch.finfo(q.dtype).min)
        out, _ = harness_dropout.attention(module, q, k, v, additive, scaling, dropout,
                                           heads=heads[r * h:(r + 1) * h])   # [n_h] -> [n_h/W]
    else:
        out, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=scaling, dropout=dropout,
                                        is_causal=mask is None)
    # out (B, S, n_h/W, d) -> (B, n_h/W, S, d) -> (B, n_h, S/W, d)
    out = HeadsToSeq.apply(out.transpose(1, 2).contiguous(), group)
    return out.transpose(1, 2).contiguous(), None                    # -> (B, S/W, n_h, d)


def set_documents(model, doc_positions):
    """Packed documents for the next forwards (--doc-mask): the whole sequences' (B, S)
    positions within their documents (None: one document per row). Ulysses attends over the
    whole sequence, so it masks by them itself (harness.data.document_mask); HF's forward gets
    each rank's own columns of them as position_ids (the rotary restarts)."""
    for layer in parts(model).layers:
        attention_of(layer).sp_documents = doc_positions


def parallelize_ulysses(model, group=None, **dp_kwargs):
    """DeepSpeed-Ulysses for an HF Llama-family model over the ranks of `group`, in place:
    attention runs through HF's attention registry with an all-to-all from sequence shards to
    head shards and back. With attention dropout (a model built by harness.build_model) each
    forward must run inside harness.dropout.at(batch, hidden=pos), whose masks it keys by the
    global heads. Returns the model wrapped in ddp.DataParallel over the same group
    (the weights are replicated; `dp_kwargs` go to it). Each rank feeds its contiguous 1/W of
    every sequence with its global position ids (rig/ddp.py's token_sharded_step shows the loop)."""
    from transformers import AttentionInterface
    AttentionInterface.register("ulysses", ulysses_attention)
    model.config._attn_implementation = "ulysses"
    for layer in parts(model).layers:
        attention_of(layer).sp_group = group
    set_documents(model, None)
    return ddp.DataParallel(model, group, **dp_kwargs)


# ----------------------------------------------------------------------------------------------
# Formulas (rig/sp.py, trainer4d/comm.py and trainer4d/plan.py count with these)
# ----------------------------------------------------------------------------------------------
def region_collectives(layers: int, first: bool = True, last: bool = True,
                       async_tp: bool = False, regathered: int | None = None,
                       no_grad_inputs: int = 0) -> dict[str, int]:
    """Megatron SP's collectives per micro-batch, each of one (B, S, H) activation, N H b
    bytes: per layer 2 region entries forward, their 2 re-gathers for the weight gradients and
    the 2 row exits' backward (6 all-gathers), 2 row exits forward and 2 entries backward (4
    reduce-scatters); the LM head's entry on the last stage (2 and 1); the first layer's split
    on the first (its backward all-gather). The embedding's partial sums stay an all-reduce
    (tp.region_all_reduces). async_tp: every one of them but the split a ring of T-1 hops.
    LoRA: only a region whose input a trainable weight reads is re-gathered (`regathered`,
    default all 2L + 1); the first `no_grad_inputs` regions' inputs need no gradient: no
    backward for their entries (reduce-scatter), the split, and the exits of all but the last of
    them (all-gathers: its output trains)."""
    regathered = 2 * layers + int(last) if regathered is None else regathered
    n = no_grad_inputs if first else 0
    ag = 4 * layers + regathered + int(last) + int(first) - n
    rs = 4 * layers + int(last) - n
    if async_tp:
        return {"all_gather_into_tensor": int(first), "ring": ag - int(first) + rs}
    return {"all_gather_into_tensor": ag, "reduce_scatter_tensor": rs}


ULYSSES_ALL_TO_ALLS = 8   # per layer: q, k, v in and the output back, forward and backward


def ulysses_bytes(tokens: int, hidden: int, kv_hidden: int, world: int, elem: int) -> int:
    """One layer's all-to-all send bytes per rank: q and the output H wide, k and v H_kv wide,
    N/W tokens each, forward and backward: 2 (2H + 2H_kv) N/W b."""
    return 2 * (2 * hidden + 2 * kv_hidden) * tokens // world * elem


if __name__ == "__main__":   # torchrun sp.py --mode ...: the test rig runs it
    from rig.sp import main
    main()
