"""dropout.py: dropout whose masks do not depend on the layout, so a model with dropout gives the
same gradients on W ranks as on one device, and the correctness mode can check it.

    torchrun --nproc_per_node=2 tp.py --mode correctness --model tiny-phi3 --dropout 0.1

The problem. torch's dropout draws its mask from the device's generator: the mask of a token
depends on what else that rank drew before, so it changes with the world size, the rank, the
micro-batch split and the order the pipeline runs things in. Two layouts then train different
models, and nothing can be compared. (Reseeding a generator per step and rank, Fast-LLM's
engine's answer, makes TP ranks agree and resumes exact, but a token still gets another mask
when it moves to another rank.)

The answer here: every element's keep bit is a pure function of where it is,

    keep(seed, step, layer, site, sample, position, feature) = hash(...) >= p * 2^32

where sample is the sequence's row in the step's global batch (so the micro-batch is implied),
position its global position in the sequence, and feature the global index across the
parallel split: the hidden unit for hidden-state dropout; (head, key position) for attention
probabilities, with the query position as the token. A rank holding a shard (a dp share of the
rows, a pp micro-batch, a tp rank's heads, an sp rank's tokens) draws exactly the entries one
device would draw there. The hash is a 32-bit integer mixer (x ^= x >> 16; x *= 0x45d9f3b,
twice) applied once per coordinate, in int64 tensor arithmetic that cannot overflow, so CPU
and GPU give the same bits.

Where the coordinates come from. The strategy runs each forward inside `at(batch, hidden)`:
the step is batch.index, the samples batch.sample_ids, the positions batch.positions, and
`hidden` the columns of the batch that the residual stream holds on this rank when it is
sequence-sharded (Megatron SP, Ulysses). Modules carry the rest, set once by `install` (their
layer and site) and by the strategy that splits heads (`module.dropout_heads`: the global ids
of this rank's attention heads). Activation recompute re-runs a forward during the backward,
after the context has moved on: `checkpoint_contexts` (torch.utils.checkpoint's context_fn)
restores the forward's coordinates for the recomputation.

What a strategy cannot do it refuses in one line (cp_ring.py: the ring's online softmax and
custom backward would need the mask inside every block). Phi3's two residual dropouts are
replaced by `HiddenDropout` modules; a dropout a layer calls as a function (StarCoder2's,
OPT's) is keyed the same way by `FunctionalDropout`, a torch-function mode around the layer's
forward; attention dropout runs through `attention`, eager
attention with the mask applied to the probabilities (HF's eager_attention_forward otherwise,
softmax in float32 as it does), registered as the model's attention implementation.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from .anatomy import attention_of
from .plants import planted

IMPL = "coordinate_dropout"   # the attention implementation's name in HF's registry
M32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B1          # < 2^32: coordinate (< 2^31) x this stays below 2^63
_MUL = 0x45D9F3B              # < 2^27: a 32-bit value x this stays below 2^59

# sites within a layer (the attention probabilities, then the model's own nn.Dropout modules
# in the order the layer registers them)
ATTENTION_SITE = 0


def _mix(x):
    """A 32-bit integer mixer on Python ints, or in place on an int64 tensor, values in
    [0, 2^32)."""
    if isinstance(x, int):
        x = x ^ (x >> 16)
        x = (x * _MUL) & M32
        x = x ^ (x >> 16)
        x = (x * _MUL) & M32
        return x ^ (x >> 16)
    for _ in range(2):
        x.bitwise_xor_(x >> 16).mul_(_MUL).bitwise_and_(M32)
    return x.bitwise_xor_(x >> 16)


def _absorb(h, c):
    """h (a mixed 32-bit state) with one more coordinate c (>= 0, < 2^31) folded in: a new
    tensor of their broadcast shape (or an int)."""
    if isinstance(h, int) and isinstance(c, int):
        return _mix((h + c * _GOLDEN) & M32)
    return _mix(torch.add(h, c * _GOLDEN).bitwise_and_(M32))


def site_key(seed: int, step: int, layer: int, site: int) -> int:
    """The 32-bit key of one dropout site at one step (layer -1: outside the decoder layers)."""
    h = _mix(seed & M32)
    for c in (step, layer + 1, site):
        h = _absorb(h, c)
    return h


def keep_mask(p: float, key: int, *coords: torch.Tensor) -> torch.Tensor:
    """The keep bits (bool) at the broadcast of `coords` (int64 tensors of global indices, one
    per dimension, shaped to broadcast against each other): each coordinate is folded into the
    hash in turn, so the earlier, smaller coordinates are hashed on their own small shapes."""
    # (a fill with the key as its argument: torch.tensor(key, device=...) would copy a host
    # tensor to the device at every dropout site of every forward)
    h = torch.full((), key, dtype=torch.int64, device=coords[0].device)
    if planted("dropout-host-key"):   # plant: the key copied from the host at every site
        h = torch.tensor(key, dtype=torch.int64, device=coords[0].device)
    for c in coords:
        h = _absorb(h, c.to(torch.int64))   # (at most two int64 grids alive at the end)
    return h >= int(round(p * 2 ** 32))


def apply(x: torch.Tensor, p: float, key: int, *coords: torch.Tensor) -> torch.Tensor:
    """Dropout of x with the keep bits of `coords`, scaled by 1 / (1 - p) as torch's is."""
    return x * keep_mask(p, key, *coords).to(x.dtype) * (1.0 / (1.0 - p))


# -- where the tokens are: set by the strategy around each forward --
@dataclass
class Tokens:
    """The coordinates of one forward's tokens. samples (b,): global rows in the step's batch;
    positions (s,): global positions of the columns the attention sees; hidden (s_h,): those
    of the residual stream (a subset under sequence parallelism)."""
    step: int
    samples: torch.Tensor
    positions: torch.Tensor
    hidden: torch.Tensor


_NOW: Tokens | None = None


class _Using:
    """Sets the current tokens for a block; re-enterable (torch.utils.checkpoint enters one
    recompute context for every recomputation of a frame, e.g. a second backward)."""

    def __init__(self, tokens: Tokens | None):
        self.tokens, self.outer = tokens, []

    def __enter__(self):
        global _NOW
        self.outer.append(_NOW)
        _NOW = self.tokens

    def __exit__(self, *exc):
        global _NOW
        _NOW = self.outer.pop()


def at(batch, hidden=None):
    """A context for the forward of `batch` (harness.data.Batch): its step, rows and positions.
    `hidden` indexes the batch's columns the residual stream holds on this rank (a slice or an
    index tensor) when the strategy shards the sequence outside attention; None: all of them."""
    dev = batch.input_ids.device
    pos, rows = batch.column_positions().to(dev), batch.row_ids().to(dev)
    mine = pos if hidden is None else pos[hidden]
    if planted("dropout-rank-local"):   # plant: the local rows and columns, not the global ones
        pos, rows, mine = (torch.arange(t.numel(), device=dev) for t in (pos, rows, mine))
    return _Using(Tokens(int(batch.index), rows, pos, mine))


def current() -> Tokens:
    if _NOW is None:
        raise RuntimeError("dropout: a forward in training mode outside harness.dropout.at(batch): "
                           "the masks need the tokens' global coordinates")
    return _NOW


def checkpoint_contexts():
    """context_fn for torch.utils.checkpoint: the recomputation in the backward sees the
    coordinates its forward saw."""
    return contextlib.nullcontext(), _Recompute(_NOW, _LAYER_MODES[-1] if _LAYER_MODES else None)


# -- the two sites --
class HiddenDropout(nn.Module):
    """nn.Dropout on a (b, s, features) residual-stream tensor, its mask keyed by (sample,
    position, feature). `features`: the global feature ids (None: 0..f-1)."""

    def __init__(self, p: float, seed: int, layer: int, site: int):
        super().__init__()
        self.p, self.seed, self.layer, self.site = p, seed, layer, site
        self.features = None

    def _features_on(self, device) -> torch.Tensor:
        """`features` on the input's device, moved there once (set on the host, before the
        model's storage exists: lora.RowParallelLoRA on a meta-device model)."""
        if self.features.device != device:
            self.features = self.features.to(device)
        return self.features

    def forward(self, x):
        if not self.training or self.p == 0:
            return x
        f = None if self.features is None else self._features_on(x.device)
        return hidden_dropout(x, self.p, self.seed, self.layer, self.site, f)

    def extra_repr(self):
        return f"p={self.p}, seed={self.seed}, layer={self.layer}, site={self.site}"


def hidden_dropout(x, p: float, seed: int, layer: int, site: int, features=None):
    """Dropout of a (rows, tokens, features) residual-stream tensor keyed by (sample, position,
    feature); `features` the global feature ids (None: 0..f-1)."""
    t = current()
    if x.dim() != 3 or x.shape[1] != t.hidden.numel() or x.shape[0] != t.samples.numel():
        raise RuntimeError(f"dropout: a hidden-state dropout expects (rows {t.samples.numel()}, "
                           f"tokens {t.hidden.numel()}, features), got {tuple(x.shape)}")
    f = torch.arange(x.shape[2], device=x.device) if features is None else features
    key = site_key(seed, t.step, layer, site)
    return apply(x, p, key, t.samples[:, None, None], t.hidden[None, :, None], f[None, None, :])


def dropping(func, args, kwargs) -> tuple | None:
    """(input, p) when a torch-function call is torch.nn.functional.dropout that drops (p > 0,
    training), else None: what FunctionalDropout keys and harness/cli.py's probe records."""
    if func is not nn.functional.dropout:
        return None
    a = dict(zip(("input", "p", "training", "inplace"), args), **kwargs)
    p = a.get("p", 0.5)
    return (a["input"], p) if a.get("training", True) and p > 0 else None


class FunctionalDropout(torch.overrides.TorchFunctionMode):
    """Dropout called as a function inside one decoder layer's forward, where there is no
    nn.Dropout module to replace (StarCoder2's residual_dropout, OPT's dropout): each
    torch.nn.functional.dropout call with p > 0 in training is keyed as HiddenDropout at sites
    first, first + 1, ... in call order. Entered around the layer's forward by install's hooks,
    and around its recomputation by checkpoint_contexts (with the count it starts from). Its
    tensor must be the residual stream's, all `width` features: anything else (a sharded or
    per-head tensor) raises, it cannot be keyed. Its price: every op of the layer passes
    through this mode's Python (only models whose config drops pay it)."""

    def __init__(self, seed: int, layer: int, first: int, width: int, calls: int = 0):
        super().__init__()
        self.seed, self.layer, self.first, self.width, self.calls = seed, layer, first, width, calls

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        call = dropping(func, args, kwargs)
        if call is None:
            return func(*args, **kwargs)
        if planted("dropout-functional-torch"):   # plant: torch's masks, per rank
            return func(*args, **kwargs)
        x, p = call
        if x.shape[-1] != self.width:
            raise RuntimeError(f"dropout: a functional dropout (p={p}) on {tuple(x.shape)} in "
                               f"layer {self.layer}: not the residual stream's {self.width} "
                               f"features, it cannot be keyed")
        site, self.calls = self.first + self.calls, self.calls + 1
        t = current()
        if x.dim() == 2 and x.shape[0] == t.samples.numel() * t.hidden.numel():
            # (rows * tokens, features), OPT's MLP: the same tokens, flattened
            return hidden_dropout(x.view(t.samples.numel(), -1, x.shape[-1]), p, self.seed,
                                  self.layer, site).view(x.shape)
        return hidden_dropout(x, p, self.seed, self.layer, site)


_LAYER_MODES: list = []   # the FunctionalDropout of each decoder-layer forward running now


class _Recompute:
    """The recomputation's context (checkpoint_contexts): the forward's tokens, and the
    functional dropouts' count where the checkpointed code began; re-enterable."""

    def __init__(self, tokens: Tokens | None, mode: FunctionalDropout | None):
        self.using, self.modes = _Using(tokens), []
        self.spec = None if mode is None else (mode.seed, mode.layer, mode.first, mode.width,
                                               mode.calls)

    def __enter__(self):
        self.using.__enter__()
        if self.spec is not None:
            self.modes.append(FunctionalDropout(*self.spec))
            self.modes[-1].__enter__()

    def __exit__(self, *exc):
        if self.spec is not None:
            self.modes.pop().__exit__(*exc)
        self.using.__exit__(*exc)


class InputDropout(HiddenDropout):
    """peft's lora_dropout on an adapter's input (b, s, in), keyed by (sample, position,
    feature) like HiddenDropout: the tokens are the residual stream's, or the whole sequence's
    inside a Megatron-SP region; `features` the global input features (lora.RowParallelLoRA sets
    its columns')."""

    def forward(self, x):
        if not self.training or self.p == 0:
            return x
        t = current()
        cols = t.hidden if x.shape[1] == t.hidden.numel() else t.positions
        if x.dim() != 3 or x.shape[1] != cols.numel() or x.shape[0] != t.samples.numel():
            raise RuntimeError(f"dropout: an adapter's input dropout expects (rows "
                               f"{t.samples.numel()}, tokens {cols.numel()}, features), got "
                               f"{tuple(x.shape)}")
        f = (torch.arange(x.shape[2], device=x.device) if self.features is None
             else self._features_on(x.device))
        key = site_key(self.seed, t.step, self.layer, self.site)
        return apply(x, self.p, key, t.samples[:, None, None], cols[None, :, None],
                     f[None, None, :])


def attention_dropout(probs: torch.Tensor, p: float, module, heads=None) -> torch.Tensor:
    """Dropout of attention probabilities (b, h, s_q, s_k), over the full sequence on both
    axes, keyed by (sample, head, query position, key position). `heads`: the global ids of
    the h local heads (default: module.dropout_heads, else 0..h-1)."""
    t = current()
    b, h, sq, sk = probs.shape
    if sq != t.positions.numel() or sk != t.positions.numel():
        raise RuntimeError(f"dropout: attention over {sq} x {sk} tokens, the batch has "
                           f"{t.positions.numel()}")
    heads = heads if heads is not None else getattr(module, "dropout_heads", None)
    if heads is None or planted("dropout-rank-local"):   # plant: the local heads
        heads = torch.arange(h)
    pos = t.positions
    key = site_key(module.dropout_seed, t.step, module.dropout_layer, ATTENTION_SITE)
    return apply(probs, p, key, t.samples[:, None, None, None],
                 heads.to(probs.device)[None, :, None, None], pos[None, None, :, None],
                 pos[None, None, None, :])


def causal_mask(n: int, dtype, device) -> torch.Tensor:
    i = torch.arange(n, device=device)
    return torch.zeros(n, n, dtype=dtype, device=device).masked_fill(
        i[None, :] > i[:, None], torch.finfo(dtype).min)[None, None]


def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
              softcap=None, heads=None, **kwargs):
    """HF's eager attention (scores, optional soft-capping, the additive mask, softmax in
    float32, dropout, values) with the dropout drawn by `attention_dropout`. No mask: causal
    (as SDPA's is_causal, which the caller meant)."""
    n_rep = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(n_rep, dim=1) if n_rep > 1 else key
    v = value.repeat_interleave(n_rep, dim=1) if n_rep > 1 else value
    s = torch.matmul(query, k.transpose(2, 3)) * (module.scaling if scaling is None else scaling)
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    mask = (causal_mask(s.shape[-1], s.dtype, s.device) if attention_mask is None
            else attention_mask[:, :, :, :k.shape[-2]])
    probs = nn.functional.softmax(s + mask, dim=-1, dtype=torch.float32).to(query.dtype)
    if dropout > 0 and module.training:
        probs = attention_dropout(probs, dropout, module, heads)
    out = torch.matmul(probs, v).transpose(1, 2).contiguous()
    return out, probs


# Where the rank-local-mask plant must FAIL: a model with attention and hidden dropout (a
# strategy adds its own arguments and world size)
PLANT_DOC = ("dropout masks keyed by this rank's local rows, positions and heads instead of "
             "the global ones (each rank draws what one device would draw elsewhere)")
PLANT_ARGS = ("--model", "tiny-phi3", "--dropout", "0.1")


# -- installing it in a model --
def rate_fields(config) -> dict[str, float]:
    """Every config field that reads as a dropout rate and is not zero. Which of them the
    forward applies, and where, is found by running it (harness/cli.py: a probe forward)."""
    return {k: v for k, v in config.to_dict().items()
            if ("dropout" in k or "pdrop" in k) and isinstance(v, float) and v > 0}


def rates(config) -> dict[str, float]:
    """The model's dropout probabilities that are not zero, by config name (not the heads a
    causal LM does not run: GPT-2's summary_*, a classifier's; not Phi3's embd_pdrop, which its
    model applies nowhere)."""
    phi3 = getattr(config, "model_type", None) == "phi3"
    return {k: v for k, v in sorted(rate_fields(config).items())
            if not k.startswith(("summary_", "classifier_")) and not (phi3 and k == "embd_pdrop")}


def recorded(config, seed: int) -> dict:
    """What a checkpoint records of the dropout (a resume must match it): the rates and the
    seed that keys the masks; {} without dropout."""
    r = rates(config)
    return dict(rates=r, seed=int(seed)) if r else {}


def set_rates(config, p: float):
    """--dropout P: the model's attention dropout, and its hidden dropout where it has one."""
    config.attention_dropout = p
    for name in ("resid_pdrop", "attn_pdrop", "embd_pdrop",   # Phi3's two residual dropouts
                 "residual_dropout"):                     # per layer; GPT-2's; StarCoder2's
        if hasattr(config, name):
            setattr(config, name, p)


def _enter_layer(seed: int, layer: int, first: int, width: int):
    def enter(module, args):
        _LAYER_MODES.append(FunctionalDropout(seed, layer, first, width))
        _LAYER_MODES[-1].__enter__()
    return enter


def _exit_layer(module, args, output):
    _LAYER_MODES.pop().__exit__(None, None, None)


def install(model, layers, seed: int) -> bool:
    """In place (also on the meta device): each decoder layer's nn.Dropout modules become
    HiddenDropout (keyed by the seed, layer and site), its forward runs under FunctionalDropout
    (the dropouts it calls as functions, keyed at the sites after the modules'), its attention
    module learns its layer and the seed, and the model's attention runs through `attention`
    when the config has attention dropout. Returns whether anything drops."""
    cfg = model.config
    if not rates(cfg):
        return False
    for i, layer in enumerate(layers):
        attn = attention_of(layer)
        if attn is None:
            raise ValueError(f"dropout: {type(layer).__name__} has no attention module the "
                             f"layout-independent masks know (a child named *Attention)")
        attn.dropout_layer, attn.dropout_seed = i, int(seed)
        site = ATTENTION_SITE
        for name, m in list(layer.named_modules()):
            if isinstance(m, nn.Dropout):
                site += 1
                owner, _, attr = name.rpartition(".")
                setattr(layer.get_submodule(owner), attr, HiddenDropout(m.p, int(seed), i, site))
        if not hasattr(layer, "dropout_hooks"):   # the functional calls' sites follow the modules'
            layer.dropout_hooks = (
                layer.register_forward_pre_hook(_enter_layer(int(seed), i, site + 1,
                                                             cfg.hidden_size)),
                layer.register_forward_hook(_exit_layer, always_call=True))
    for name, m in model.named_modules():   # what is left sits outside the layers
        if isinstance(m, nn.Dropout) and m.p > 0:
            raise ValueError(f"dropout: {name} (p={m.p}) sits outside the decoder layers")
    if getattr(cfg, "attention_dropout", 0):
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
        AttentionInterface.register(IMPL, attention)
        AttentionMaskInterface.register(IMPL, ALL_MASK_ATTENTION_FUNCTIONS["eager"])
        cfg._attn_implementation = IMPL
        for layer in layers:
            attention_of(layer).config._attn_implementation = IMPL
    return True
