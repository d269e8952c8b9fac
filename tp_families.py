"""tp_families.py: what tensor parallelism needs beyond Megatron's layers, family by family.

tp.py holds the idea (f and g, the column / row / vocab-parallel layers, the vocab-parallel
loss) and one install loop over the plan. A model family that computes something the plain
layers do not cover gets a small adapter here, named by the family it serves, so the learner
file reads as Megatron's algorithm and these read as the price of running on real models:

    ShardedRMSNorm (+ SumOverTP)  OLMo2 / OLMo3: an RMSNorm over all heads' q or k features,
                                  which TP splits; the mean square summed over the ranks
    embed_scale(emb)              Gemma 2 / 3: the embedding multiplied by sqrt(H), rounded to
                                  the weights' dtype as HF does
    local_heads(attn, ...)        every family: the attention's per-rank head counts (Llama's
                                  num_heads attributes; Phi3's q rows read from the config,
                                  through a LocalHeads view of it)

Where the kind of each parameter comes from (HF's base_model_tp_plan, tp.PLAN, the shapes):
tp_plan.py."""
import torch
import torch.distributed as dist
import torch.nn as nn

from lora import param_like


class SumOverTP(torch.autograd.Function):
    """A sum of every rank's partial value, forward; its gradient is summed the same way
    backward (each rank's output fed every rank's input)."""

    @staticmethod
    def forward(ctx, x, group):          # (B, S, 1) this rank's part -> (B, S, 1) the sum
        ctx.group = group
        x = x.clone()
        dist.all_reduce(x, group=group)                           # (B, S, 1)
        return x

    @staticmethod
    def backward(ctx, grad):             # (B, S, 1) -> (B, S, 1), summed over T
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, group=ctx.group)                    # (B, S, 1)
        return grad, None


class ShardedRMSNorm(nn.Module):
    """An RMSNorm over a feature dimension that TP splits (OLMo2's q_norm / k_norm over all
    heads' features): each rank holds `rows` of the weight and of the features, and the mean
    square is the all-reduced sum of squares over the full width, 1 all-reduce of N values
    forward and 1 backward. Computes as OLMo2's norm does: in at least float32, weight times
    the normalised features, then the input's dtype."""

    def __init__(self, norm: nn.Module, rows: slice, width: int, group):
        super().__init__()
        self.weight = param_like(norm.weight.detach()[rows], norm.weight)   # [n d] -> [n d/T]
        self.eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6))
        self.width, self.group = width, group

    def forward(self, x):                # (B, S, n d/T) -> (B, S, n d/T), n = n_h or n_kv
        dtype = x.dtype
        h = x.to(torch.promote_types(dtype, torch.float32))
        sq = SumOverTP.apply(h.pow(2).sum(-1, keepdim=True), self.group)     # (B, S, 1)
        return (self.weight * (h * torch.rsqrt(sq / self.width + self.eps))).to(dtype)


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


def embed_scale(emb: nn.Embedding) -> float | None:
    """Gemma's scaled embedding multiplies by its embed_scale buffer, sqrt(H) as a float32 (then
    cast to the weights' dtype), exactly as HF does; None for an embedding without one. Rounded
    to the weights' dtype once, here: a Python scalar that is exact in that dtype multiplies as
    the dtype's tensor would, without a tensor made per forward."""
    if not hasattr(emb, "scalar_embed_scale"):
        return None
    buf = getattr(emb, "embed_scale", None)
    scale = (buf.item() if buf is not None and not buf.is_meta else
             torch.tensor(emb.scalar_embed_scale, dtype=torch.float32).item())
    return torch.tensor(scale, dtype=emb.weight.dtype).item()


def local_heads(attn: nn.Module, rank: int, hq: int, hkv: int, fused: bool) -> None:
    """An HF attention module set to run this rank's hq query and hkv kv heads: the head-count
    attributes a family reads (num_heads, num_key_value_heads, num_key_value_groups), the heads'
    global indices (dropout.py keys its mask by them), and for a fused qkv_proj (Phi3, which
    finds its q rows at config.num_attention_heads * head_dim) a per-rank view of the config
    (cp_ring and recompute change its attention implementation later, through the view)."""
    if fused:
        attn.config = LocalHeads(attn.config, hq)
    attn.dropout_heads = torch.arange(rank * hq, (rank + 1) * hq)
    attn.num_key_value_groups = hq // hkv
    for name, n in (("num_heads", hq), ("num_key_value_heads", hkv)):
        if hasattr(attn, name):
            setattr(attn, name, n)
