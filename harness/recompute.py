"""recompute.py: activation recomputation, `--recompute none|full|selective`, one helper for
every HF Llama-family model the strategies and compose4d train (after Korthikanti et al. 2022,
"Reducing Activation Recomputation in Large Transformer Models").

    apply_recompute(model, "full")        each decoder layer keeps only its input; its forward
                                          runs again in the backward (torch.utils.checkpoint,
                                          non-reentrant)
    apply_recompute(model, "selective")   only the attention core, softmax(Q K^T / sqrt(d)) V, is
                                          recomputed: its O(s^2) scores and probabilities are
                                          never kept (an attention function registered in HF's
                                          registry that wraps the model's current one, so it
                                          composes with cp_ring's ring attention)

Apply it after a strategy installed its own attention (cp_ring) and before the first forward;
layers a pipeline stage dropped (nn.Identity) are skipped. The recomputation repeats whatever
the layer's forward communicates (TP's and SP's collectives, CP's ring hops) in the backward, so
the benchmark's communication formulas assume `--recompute none`.

Saved activations per decoder layer and micro-batch (b sequences of s tokens; hidden h, a query
heads and g kv heads of size d, SwiGLU width I, e bytes per element; float32 / float64), counted
op by op on HF's Llama and equal to the measurement (tests/test_recompute.py):
    each RMSNorm   its input x, x_hat = x / rms(x) (for the weight's gradient), the output
                   w * x_hat (kept by the next linear), 1 / rms in float32: 3 e b s h + 4 b s
                   (the first norm's input is the layer's input; the second's the residual sum)
    attention      q (h per token), k and v (g d each: sdpa takes them unrepeated; eager repeats
                   them to a heads, h each), the output (= o_proj's input; eager copies it once
                   more in the transpose), and sdpa's logsumexp (4 b a s) or eager's float32
                   softmax (4 b a s^2)
    SwiGLU         gate, up, silu(gate), their product: 4 e b s I
so
    none, eager attention    e b s (10 h + 4 I) + 8 b s + 4 b a s^2
    none, sdpa (CPU flash)   e b s (8 h + 2 g d + 4 I) + 8 b s + 4 b a s
    selective                e b s (8 h + 2 g d + 4 I) + 8 b s       (q, k, v kept; no s^2)
    full                     e b s h                                  (the layer's input)
Korthikanti's GPT layer keeps s b h (34 + 5 a s / h) bytes in 16-bit with dropout; Llama has
no dropout masks, a SwiGLU instead of a 4h GELU MLP, RMSNorm and GQA, so the coefficients
differ, and the s^2 term (5 a s^2 b there: scores, softmax, dropout mask) is one float32 softmax
output here. Selective recomputation removes exactly that term, for the price of one attention
forward per layer in the backward. A fused kernel that keeps no s^2 tensor (SDPA's flash path,
also on CPU) has already removed it, and selective then saves only the logsumexp. Full keeps
one tensor per layer for the price of a whole layer forward. (bf16: the norms keep float32
copies, outside this formula.)

    python -m harness.recompute --model tiny --batch 4 --length 256 --attn eager

measures each mode with the live-storage tracker (layers' share: the model at L layers minus
the model at L/2 layers, over L/2) beside the formula, and the step time.
"""
from __future__ import annotations

import argparse
import copy
import functools
import statistics
import sys
import time

import torch
from torch.utils.checkpoint import checkpoint

MODES = ("none", "full", "selective")


def decoder_layers(model):
    return [l for l in model.model.layers if not isinstance(l, torch.nn.Identity)]


def apply_recompute(model, mode: str):
    """Install recomputation `mode` into an HF CausalLM in place; returns the model."""
    if mode not in MODES:
        raise ValueError(f"--recompute must be one of {', '.join(MODES)} (got {mode!r})")
    if mode == "none":
        return model
    if getattr(model, "_recompute", "none") != "none":
        raise ValueError(f"recompute {model._recompute!r} is installed already")
    model._recompute = mode
    # a KV cache would be updated again by each recomputed forward (HF's own gradient
    # checkpointing turns it off for the same reason); training never reads it
    model.config.use_cache = False
    if mode == "full":
        for layer in decoder_layers(model):
            layer.forward = functools.partial(_checkpointed, layer.forward)
    elif mode == "selective":
        _wrap_attention(model)
    return model


def recompute_what(model) -> str:
    """One line for the log: what is recomputed in this (stage of the) model."""
    n = len(decoder_layers(model))
    mode = getattr(model, "_recompute", "none")
    if mode == "full":
        return f"{n} decoder layers keep only their inputs"
    if mode == "selective":
        return f"attention core of {n} decoder layers ({model.config._attn_implementation})"
    return "none"


def _checkpointed(forward, *args, **kwargs):
    """A decoder layer's forward that keeps only its inputs (the hooks on the layer itself,
    e.g. FSDP's gathers, stay outside and run once)."""
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def _wrap_attention(model):
    """Register `recompute_<impl>`: the model's attention function run under checkpoint, so
    only q, k, v are kept for the backward, and point the model's config at it."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    impl = model.config._attn_implementation or "eager"
    layers = decoder_layers(model)
    if impl == "eager":
        base = sys.modules[type(layers[0].self_attn).__module__].eager_attention_forward
    else:
        base = ALL_ATTENTION_FUNCTIONS[impl]

    def attention(module, query, key, value, attention_mask, **kwargs):
        def core(q, k, v):
            return base(module, q, k, v, attention_mask, **kwargs)[0]
        if not torch.is_grad_enabled():
            return core(query, key, value), None
        return checkpoint(core, query, key, value, use_reentrant=False), None

    name = f"recompute_{impl}"
    AttentionInterface.register(name, attention)
    # HF builds the attention mask by implementation name, and gives an unknown name none:
    # eager needs its causal mask (sdpa falls back to is_causal, cp_ring masks by itself)
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    if impl in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[impl])
    model.config._attn_implementation = name
    for layer in layers:       # (each attention module reads its own config reference)
        layer.self_attn.config._attn_implementation = name


# -- the formula ------------------------------------------------------------------------------
def activation_bytes(config, batch: int, seq: int, dtype_bytes: int, mode: str,
                     attn: str = "sdpa") -> int:
    """Saved activations of one decoder layer for one micro-batch (the docstring's table)."""
    h, I, a = config.hidden_size, config.intermediate_size, config.num_attention_heads
    d = getattr(config, "head_dim", None) or h // a
    g = config.num_key_value_heads
    e, bs = dtype_bytes, batch * seq
    if mode == "full":
        return e * bs * h
    norms = 2 * 4 * bs                      # two RMSNorms' inverse RMS, float32
    if mode == "selective":
        return e * bs * (8 * h + 2 * g * d + 4 * I) + norms
    if attn == "eager":
        return e * bs * (10 * h + 4 * I) + norms + 4 * batch * a * seq * seq
    return e * bs * (8 * h + 2 * g * d + 4 * I) + norms + 4 * batch * a * seq


# -- measuring --------------------------------------------------------------------------------
def _forward_backward(model, ids):
    from .meter import phase
    with phase("forward"):
        logits = model(input_ids=ids, use_cache=False).logits
        loss = logits.float().logsumexp(-1).mean()
    loss.backward()


def activation_peak(model, ids) -> int:
    """Peak bytes of storages created in the forward and alive at once (the tracker of
    harness/memory.py), over one forward and backward."""
    from .memory import MemoryTracker
    model.zero_grad(set_to_none=True)
    tracker = MemoryTracker([p for p in model.parameters()])
    with tracker:
        _forward_backward(model, ids)
    return tracker.act_peak


def step_time(model, ids, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats + 1):
        model.zero_grad(set_to_none=True)
        t = time.perf_counter()
        _forward_backward(model, ids)
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:])


def per_layer_measured(config, mode: str, attn: str, dtype, batch: int, seq: int,
                       seed: int = 0) -> dict:
    """The layers' share of the activation peak: (model at L layers - model at L/2) / (L/2)."""
    from transformers import AutoModelForCausalLM
    from .models import model_kwargs, promote_norms
    L = config.num_hidden_layers
    out = {}
    for n in (L, L // 2):
        cfg = copy.deepcopy(config)
        cfg.num_hidden_layers = n
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, **model_kwargs(cfg, attn))
        model = apply_recompute(promote_norms(model.to(dtype)).train(), mode)
        ids = torch.randint(0, cfg.vocab_size, (batch, seq),
                            generator=torch.Generator().manual_seed(seed))
        out[n] = (activation_peak(model, ids), step_time(model, ids) if n == L else None)
    per = (out[L][0] - out[L // 2][0]) / (L - L // 2)
    return dict(per_layer=per, total=out[L][0], step_s=out[L][1])


def main(argv=None):
    from .models import DTYPES, load_config
    p = argparse.ArgumentParser(prog="python -m harness.recompute")
    p.add_argument("--model", default="tiny")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--dtype", default="float32", choices=list(DTYPES))
    p.add_argument("--attn", default="eager", choices=["eager", "sdpa"])
    a = p.parse_args(argv)
    config, dtype = load_config(a.model), DTYPES[a.dtype]
    print(f"activation memory per decoder layer, {a.model} ({config.num_hidden_layers} layers), "
          f"micro-batch {a.batch} x {a.length} tokens, {a.dtype}, attention {a.attn}, CPU")
    print(f"{'mode':<10} {'measured':>12} {'formula':>12} {'ratio':>6} {'whole model':>12} "
          f"{'step':>9} {'extra':>7}")
    base = None
    rows = []
    for mode in MODES:
        m = per_layer_measured(config, mode, a.attn, dtype, a.batch, a.length)
        f = activation_bytes(config, a.batch, a.length, dtype.itemsize, mode, a.attn)
        base = base or m["step_s"]
        rows.append(dict(mode=mode, formula=f, **m))
        print(f"{mode:<10} {m['per_layer']:>12,.0f} {f:>12,} {m['per_layer'] / f:>6.3f} "
              f"{m['total']:>12,} {m['step_s'] * 1e3:>7.1f}ms {m['step_s'] / base - 1:>+7.1%}")
    return rows


if __name__ == "__main__":
    main()
