"""recompute.py: activation recomputation, `--recompute none|full|selective`, one helper for
every HF Llama-family (and Mixtral) model the strategies and compose4d train (after Korthikanti
et al. 2022, "Reducing Activation Recomputation in Large Transformer Models").

The idea
    The backward needs tensors the forward computed. Instead of keeping them, keep less and
    compute them again during the backward: memory for time.
      full        each decoder layer keeps only its input; its forward runs again in the
                  backward (torch.utils.checkpoint, non-reentrant), one layer at a time. Saved
                  bytes fall from tens of h per token to one h per token; the price is a second
                  forward of every layer (~ +1/3 of a step whose backward is twice the forward).
      selective   only the attention core, softmax(Q K^T / sqrt(d)) V, runs under checkpoint:
                  its O(s^2) probabilities are never kept, only q, k, v (its inputs) are. The
                  price is one attention forward per layer. Korthikanti's point: the s^2 terms
                  dominate at long s and are cheap to recompute (few FLOPs per byte).

Public API
    MODES = ("none", "full", "selective")
    apply_recompute(model, mode) -> model     in place, on model.model.layers (nn.Identity entries,
                                             a pipeline stage's dropped layers, are skipped); a
                                             second application is refused (ValueError)
    activation_bytes(config, micro_batch, seq_len, dtype_bytes, mode, attn)
                                          -> {"per_layer": B, "layers": L * B}   (the formula)
    measure(model, batch, mode) -> {"activation_bytes": ..., "step_s": ...}  (one forward +
                                             backward under harness/memory.py's tracker; the
                                             median of timed forward+backward passes)
    python -m harness.recompute --model tiny --batch 4 --length 256 --dtype float32 --attn eager

How it is installed
    full: each layer's `forward` becomes checkpoint(forward, *args, use_reentrant=False,
    **kwargs), so the keyword arguments HF passes (attention_mask, position_ids,
    position_embeddings=(cos, sin), ...) reach the recomputation unchanged, except a KV cache,
    which each recomputation would append to again (HF's gradient checkpointing drops it too;
    the model's config is left alone, so an exported config keeps use_cache). Hooks on the layer
    module itself (FSDP's / ZeRO-3's gather before the forward, free after it, gather again
    before the backward) stay outside the checkpoint and run once; the recomputation runs
    inside the layer's backward, after the pre-backward gather. (Units smaller than a decoder
    layer would have their hooks re-run by the recomputation: this helper assumes they are not.)
    selective: HF (transformers 5) resolves the attention per call with
    ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, eager_attention_forward).
    A function `recompute_<impl>` that runs <impl> under checkpoint is registered in that
    registry (and <impl>'s mask function under the same name) and the config points at it;
    "eager" is no registry entry but the default of the attention module's own modeling file,
    looked up the same way. Applied after a strategy installed its attention (cp_ring's
    "ring_cp"), it wraps that one.
    Apply it after the strategy's parallelize / wrapper and before the first forward: the
    harness does so in run.make_pair (correctness, learning), train.py in the train mode.

Communication
    A recomputed forward repeats its collectives in the backward (TP's / SP's all-reduces and
    gathers, CP's ring hops), on every rank in the same order, so the result stays correct;
    torch stops a recomputation early, after the last op that saves a tensor, so by that rule
    a collective after it (a TP layer's closing all-reduce) is not repeated (not metered here).
    The benchmark's comm formulas assume none:
    `--mode benchmark|peak` refuses --recompute (harness/models.common_constraints). ep_moe
    refuses full: its routing statistics are recorded in the MoE layer's forward and a
    recomputed layer would record them twice (selective does not rerun the MoE block).
    Checked correct at W=2 (correctness mode, float64, 2 steps): tp (full; selective eager and
    sdpa), fsdp (full, also with --grad-accum 2 --prefetch 2; selective eager), zero --stage 3
    (full, selective), cp_ring (full zigzag; selective zigzag and allgather), pp (selective 1f1b
    and zb, full interleaved and zb), ep (selective; full passed too, before the refusal),
    compose4d (cp 2 full, tp 2 + sp selective). tests/test_recompute.py keeps compose4d's two and
    pp zb full (quick), tp full and selective, fsdp full, zero-3 selective, cp_ring selective
    (slow).

Saved activations per decoder layer and micro-batch (b sequences of s tokens; hidden h, a query
heads and g kv heads of size d, SwiGLU width I, e bytes per element), HF's Llama counted op by
op (what each autograd node saves), float32 / float64 (where HF's upcasts are no-ops):
    each RMSNorm   x (by pow), 1/rms (float32, by rsqrt and mul: 4 b s), x_hat = x/rms (by the
                   weight's mul), the output w * x_hat (by the next linears): 3 e b s h + 4 b s
                   (the first norm's x is the layer's input, the second's the residual sum)
    rotary         nothing per layer (mul saves only cos, sin: computed once per forward)
    attention      eager: q after rotary (h), k and v repeated to a heads (h each, by the two
                   matmuls), the float32 softmax output (4 b a s^2, by softmax and the second
                   matmul: one storage), the transposed output (h, by o_proj): 4 e b s h +
                   4 b a s^2. sdpa, CPU flash kernel: q (h), k, v unrepeated (g d each), its
                   output (h, laid out (b, s, a, d), so HF's transpose().contiguous() is the same
                   storage and o_proj keeps it) and the logsumexp (4 b a s): e b s (2 h + 2 g d)
                   + 4 b a s. Dropout p = 0 saves nothing.
    SwiGLU         gate (by silu), up and silu(gate) (by mul), their product (by down_proj):
                   4 e b s I
    residuals      nothing (add saves nothing)
so, per layer, in float32:
    none, eager    e b s (10 h + 4 I) + 8 b s + 4 b a s^2
    none, sdpa     e b s (8 h + 2 g d + 4 I) + 8 b s + 4 b a s
    selective      e b s (8 h + 2 g d + 4 I) + 8 b s      (q, k, v kept unrepeated; no s^2)
    full           e b s h                                 (the layer's input)
In bf16 (and float64), with f = max(e, 4) the width of HF's float32 upcasts (float64 stays
float64: Float64Kept): each norm keeps its input upcast to f (a copy beside the bf16 input, which
nothing then keeps: + (f - e) b s h per norm) and 1/rms in f (2 f b s for the two), the
logsumexp and eager's softmax are f wide, and eager's softmax is cast back to e for the second
matmul (+ e b a s^2, a second storage). activation_bytes computes exactly this, byte for byte
against the live-storage measurement in float32, bfloat16 and float64
(tests/test_recompute.py). Mixtral's MoE block saves other tensors (routing, expert rows).

Korthikanti et al.'s GPT layer (16-bit, their eq. 1: LayerNorm, a 4h GELU MLP, dropout; a
attention heads), in bytes:
    none           s b h (34 + 5 a s / h)     selective  34 s b h     full  2 s b h
How the Llama count differs (in elements per token, theirs being bytes / 2):
    MLP        SwiGLU of width I keeps 4 I (gate, up, silu(gate), product); their 4h GELU MLP
               keeps 9 h (the GELU's input and output, 4 h each, and its input h, which here
               is counted with the norm)
    attention  GQA: k and v are g d each (sdpa takes them unrepeated; eager repeats them to h);
               theirs keeps Q, K, V at h each
    norms      HF's RMSNorm is unfused: besides its input and output it keeps x_hat = x/rms for
               the weight's gradient (one more h per norm) and 1/rms in float32 (4 b s)
    dropout    none: their two residual-branch masks (1 byte per element, 2 s b h) and the
               attention-dropout mask and output (3 a s^2 b) are gone
    s^2        eager keeps one float32 softmax output, 4 b a s^2 (theirs: 5 a s^2 b = softmax
               output 2 + dropout mask 1 + dropout output 2); SDPA's flash path (also on CPU)
               keeps no s^2 tensor, so selective then saves only its logsumexp.

Measured figures (bytes per layer against the formula, step time per mode, the extra time's
median and spread over paired rounds): results/recompute-small-cpu.json, made by
`python -m harness.recompute --model small ... --out results/recompute-small-cpu.json`, the one
table docs/training.md renders and the other pages link to.
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

from . import dropout
from .meter import quantile
from .models import Float64Kept, attention_of, kv_heads, parts

MODES = ("none", "full", "selective")


def decoder_layers(model):
    """The decoder layers this (stage of the) model runs: model.model.layers without the
    nn.Identity placeholders a pipeline stage leaves for the layers it dropped."""
    layers = parts(model).layers if hasattr(model, "config") else None
    if layers is None:
        raise ValueError(f"recompute: {type(model).__name__} is not an HF causal LM with "
                         f"a list of decoder layers (unwrap a DataParallel's .module)")
    return [l for l in layers if not isinstance(l, torch.nn.Identity)]


def apply_recompute(model, mode: str):
    """Install recomputation `mode` ("none", "full", "selective") into an HF Llama-family or
    Mixtral CausalLM in place; returns the model. Call it after a strategy installed its layers
    and attention (cp_ring's "ring_cp") and before the first forward. A second application
    (other than "none") is refused."""
    if mode not in MODES:
        raise ValueError(f"--recompute must be one of {', '.join(MODES)} (got {mode!r})")
    if mode == "none":
        return model
    if getattr(model, "_recompute", "none") != "none":
        raise ValueError(f"recompute {model._recompute!r} is installed already")
    layers = decoder_layers(model)
    if mode == "full":
        for layer in layers:
            layer.forward = functools.partial(_checkpointed, layer.forward)
    elif mode == "selective":
        _wrap_attention(model)
    model._recompute = mode
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


CACHE_KWARGS = ("past_key_values", "cache")   # the layer's KV-cache argument: transformers
# 5.24 renamed past_key_values to cache (and still accepts the old name with a warning)


_INSIDE = 0   # how many checkpointed layer forwards are running (the forward or its recompute)


def inside_checkpoint() -> bool:
    """Whether a full-recompute layer's forward is running now, the first time or recomputed
    in the backward: code that would install its own saved-tensor hooks (sp.py's re-gather)
    must not, or its hooks, innermost, win over the checkpoint's and keep what it drops."""
    return _INSIDE > 0


def _counted(forward):
    def run(*args, **kwargs):
        global _INSIDE
        _INSIDE += 1
        try:
            return forward(*args, **kwargs)
        finally:
            _INSIDE -= 1
    return run


def _checkpointed(forward, *args, **kwargs):
    """A decoder layer's forward that keeps only its inputs (the hooks on the layer itself,
    e.g. FSDP's gathers, stay outside and run once). A KV cache is not passed on: each
    recomputation would append the layer's keys and values to it again (HF's own gradient
    checkpointing drops it too); a training step never reads it. Without gradients (evaluation,
    generation) the layer runs as it is, cache included."""
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    for key in CACHE_KWARGS:
        if kwargs.get(key) is not None:
            kwargs = dict(kwargs, **{key: None}, use_cache=False)
    # (context_fn: a dropout mask recomputed in the backward keyed as in the forward)
    return checkpoint(_counted(forward), *args, use_reentrant=False,
                      context_fn=dropout.checkpoint_contexts, **kwargs)


def _wrap_attention(model):
    """Register `recompute_<impl>`: the model's attention function run under checkpoint, so
    only q, k, v are kept for the backward, and point the model's config at it.

    HF (transformers 5) resolves the function per call with
    ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, eager_attention_forward):
    "eager" is not in the registry, it is the default of the attention module's own file
    (modeling_llama's or modeling_mixtral's eager_attention_forward), so it is looked up the
    same way here, from the module being run."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    impl = model.config._attn_implementation or "eager"
    if impl.startswith("recompute_"):
        raise ValueError(f"selective recompute is installed already ({impl})")
    if impl != "eager" and impl not in ALL_ATTENTION_FUNCTIONS:
        raise ValueError(f"selective recompute: attention {impl!r} is not registered in HF's "
                         f"AttentionInterface")
    layers = decoder_layers(model)

    def attention(module, query, key, value, attention_mask, **kwargs):
        base = (sys.modules[type(module).__module__].eager_attention_forward if impl == "eager"
                else ALL_ATTENTION_FUNCTIONS[impl])

        def core(q, k, v):
            if q.dtype != torch.float64:
                return base(module, q, k, v, attention_mask, **kwargs)[0]
            # a float64 run keeps eager's softmax in float64 (models.Float64Kept); the
            # recomputation in the backward runs outside the attention module's forward, so
            # it enters the mode itself: the same numbers as the forward
            with Float64Kept():
                return base(module, q, k, v, attention_mask, **kwargs)[0]
        if not torch.is_grad_enabled():
            return core(query, key, value), None
        # (the probabilities eager would return are not kept: that is the point)
        return checkpoint(core, query, key, value, use_reentrant=False,
                          context_fn=dropout.checkpoint_contexts), None

    name = f"recompute_{impl}"
    AttentionInterface.register(name, attention)
    # HF builds the attention mask by implementation name, and gives an unknown name none:
    # eager needs its causal mask (sdpa falls back to is_causal, cp_ring masks by itself)
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    if impl in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[impl])
    model.config._attn_implementation = name
    for layer in layers:       # (each attention module reads its own config reference)
        attention_of(layer).config._attn_implementation = name


# -- the formula ------------------------------------------------------------------------------
def activation_bytes(config, micro_batch: int, seq_len: int, dtype_bytes: int, mode: str,
                     attn: str = "sdpa", tp: int = 1, sp: bool = False) -> dict:
    """Saved activations of one micro-batch's forward on one rank (the docstring's table), the
    one activation model of the suite (trainer4d/plan.py, oom_search.predict_peak and the
    elastic planner call it):
    {"per_layer": bytes one decoder layer keeps, "layers": all config.num_hidden_layers of them,
     "outside": the residual stream's share of per_layer (the two RMSNorms), "inside": the rest
     (attention and MLP)}.
    attn: the attention the layers run ("eager", or "sdpa" with the CPU flash kernel, which
    keeps its output and logsumexp); it does not matter for full. tp: the tensor-parallel size
    (the heads and the MLP width inside TP's regions split T ways; a kv head replicated when
    T > kv heads); sp: Megatron sequence parallelism, the norms' tokens split T ways too (and
    full recompute's layer input). Measured byte for byte at T = 1, and per rank at T = 2
    with and without SP (tests/tp_activation_check.py)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)} (got {mode!r})")
    if attn not in ("eager", "sdpa"):
        raise ValueError(f"attn must be eager or sdpa (got {attn!r})")
    h, I, a = config.hidden_size, config.intermediate_size, config.num_attention_heads
    d = getattr(config, "head_dim", None) or h // a
    g = kv_heads(config)
    a, g, I = a // tp, max(g // tp, 1), I // tp          # this TP rank's heads and MLP width
    e, b, s = dtype_bytes, micro_batch, seq_len
    f = max(e, 4)       # HF's float32 upcasts (norms, softmax, logsumexp): a copy when e < 4
    ns = s // tp if sp else s                             # the norms' tokens
    if mode == "full":                                    # the layer's input
        outside, inside = e * b * ns * h, 0
    else:   # each RMSNorm: its input (upcast to f), x_hat, its output (e); 1/rms (f)
        outside = 2 * b * ns * (h * (f + 2 * e) + f)
        if mode == "selective" or attn == "sdpa":         # q, k, v (k, v unrepeated), output
            inside = e * b * s * (2 * a * d + 2 * g * d + 4 * I)
            if mode == "none":                            # sdpa's logsumexp
                inside += f * b * a * s
        else:                           # eager: k, v repeated to a heads; the f softmax, and
            inside = e * b * s * (4 * a * d + 4 * I) + f * b * a * s * s   # its copy in e
            inside += e * b * a * s * s if e != f else 0
    per = outside + inside
    return dict(per_layer=per, layers=per * config.num_hidden_layers, outside=outside,
                inside=inside)


def korthikanti_bytes(config, micro_batch: int, seq_len: int, mode: str) -> int:
    """Korthikanti et al.'s GPT layer, 16-bit, with dropout (their eq. 1 and section 4.2):
    none s b h (34 + 5 a s / h), selective s b h 34, full s b h 2. For comparison only."""
    h, a, s, b = config.hidden_size, config.num_attention_heads, seq_len, micro_batch
    return {"none": s * b * h * 34 + 5 * a * s * s * b, "selective": s * b * h * 34,
            "full": 2 * s * b * h}[mode]


# -- measuring --------------------------------------------------------------------------------
def _ids(batch):
    return batch.input_ids if hasattr(batch, "input_ids") else batch


def _forward_backward(model, ids):
    from .data import Batch
    from .meter import phase
    with phase("forward"), dropout.at(Batch(ids, ids, 0)):   # (a model with dropout: step 0's)
        logits = model(input_ids=ids, use_cache=False).logits
        loss = logits.float().logsumexp(-1).mean()
    loss.backward()


def activation_peak(model, ids) -> int:
    """Peak bytes of storages created in the forward and alive at once (the tracker of
    harness/memory.py, as measure_memory uses it: storages created inside phase("forward")
    count as activations; the model's parameters are seeded as preexisting), over one forward
    and backward. A recomputation runs in the backward, outside phase("forward"): its
    transient tensors (one layer's at a time) are not counted."""
    from .memory import MemoryTracker
    model.zero_grad(set_to_none=True)
    tracker = MemoryTracker([p for p in model.parameters()])
    with tracker:
        _forward_backward(model, ids)
    return tracker.act_peak


def step_time(model, ids, repeats: int = 5) -> float | None:
    """Median wall time of `repeats` forward+backward passes, after one warm-up (None: 0)."""
    if repeats < 1:
        return None
    times = []
    for _ in range(repeats + 1):
        model.zero_grad(set_to_none=True)
        t = time.perf_counter()
        _forward_backward(model, ids)
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:])


def measure(model, batch, mode: str, repeats: int = 5) -> dict:
    """One forward+backward of `model` on `batch` (input ids (B, S), or a harness Batch) with
    recompute `mode`, applied to a copy (the model is left as it is; a model that has `mode`
    installed already is measured itself):
    {"activation_bytes": the peak of live forward-created storages (activation_peak),
     "step_s": the median forward+backward time (step_time)}."""
    installed = getattr(model, "_recompute", "none")
    if installed != mode:
        if installed != "none":
            raise ValueError(f"measure: the model has recompute {installed!r} installed; "
                             f"give it one without")
        model = apply_recompute(copy.deepcopy(model), mode)
    ids = _ids(batch)
    return dict(activation_bytes=activation_peak(model, ids),
                step_s=step_time(model, ids, repeats))


def _tiny_model(config, layers: int, mode: str, attn: str, dtype, seed: int, wrap=None):
    from transformers import AutoModelForCausalLM
    from .models import model_kwargs, keep_float64
    cfg = copy.deepcopy(config)
    cfg.num_hidden_layers = layers
    torch.manual_seed(seed)
    model = keep_float64(AutoModelForCausalLM.from_config(cfg, **model_kwargs(cfg, attn))
                         .to(dtype)).train()
    if wrap is not None:
        wrap(model)
    return apply_recompute(model, mode)


def per_layer_measured(config, mode: str, attn: str, dtype, batch: int, seq: int,
                       seed: int = 0, repeats: int = 5, wrap=None) -> dict:
    """The layers' share of the activation peak: (model at L layers - model at L/2) / (L/2),
    which cancels the embedding, final norm, logits and loss; the whole model's peak and step
    time at L layers. wrap(model): a parallelisation applied in place before the recompute
    (tp.parallelize under torchrun: this rank's share, tests/tp_activation_check.py)."""
    L = config.num_hidden_layers
    if L < 2:
        raise ValueError("per_layer_measured needs a config with >= 2 decoder layers")
    ids = torch.randint(0, config.vocab_size, (batch, seq),
                        generator=torch.Generator().manual_seed(seed))
    out = {n: measure(_tiny_model(config, n, mode, attn, dtype, seed, wrap), ids, mode,
                      repeats if n == L else 0) for n in (L, L // 2)}
    per = (out[L]["activation_bytes"] - out[L // 2]["activation_bytes"]) / (L - L // 2)
    return dict(per_layer=per, total=out[L]["activation_bytes"], step_s=out[L]["step_s"])


def interleaved_step_times(models: dict, ids, repeats: int) -> dict:
    """{key: [forward+backward seconds of each round]}, the models timed in turn (one step each,
    round after round), so that a change in the machine's load falls on every mode alike."""
    times = {k: [] for k in models}
    for k, m in models.items():                     # warm-up
        step_time(m, ids, 1)
    for _ in range(repeats):
        for k, m in models.items():
            m.zero_grad(set_to_none=True)
            t = time.perf_counter()
            _forward_backward(m, ids)
            times[k].append(time.perf_counter() - t)
    return times


MIN_SPREAD_REPEATS = 5     # fewer rounds give no spread: no extra time is printed


def extra_time(rounds: dict, mode: str) -> dict | None:
    """A mode's extra time over `none`: the median, 10th and 90th percentile of the per-round
    ratios (the two timed back to back in each round; the benchmark's --paired quantiles),
    minus 1; None under MIN_SPREAD_REPEATS rounds, where one slow step decides the sign."""
    xs = sorted(a / b for a, b in zip(rounds[mode], rounds["none"]))
    if len(xs) < MIN_SPREAD_REPEATS:
        return None
    return dict(median=statistics.median(xs) - 1, p10=quantile(xs, 0.1) - 1,
                p90=quantile(xs, 0.9) - 1)


def main(argv=None):
    from .models import DTYPES, load_config
    p = argparse.ArgumentParser(prog="python -m harness.recompute",
                                description="saved activations per decoder layer and step time "
                                            "for each --recompute mode, one process")
    p.add_argument("--model", default="tiny",
                   help="a preset of harness/models.py or an HF model directory / config.json")
    p.add_argument("--batch", type=int, default=4, help="micro-batch (sequences)")
    p.add_argument("--length", type=int, default=256, help="sequence length")
    p.add_argument("--dtype", default="float32", choices=list(DTYPES))
    p.add_argument("--attn", default="eager", choices=["eager", "sdpa"])
    p.add_argument("--repeats", type=int, default=11,
                   help="timed forward+backward passes per mode, in rounds (each round times "
                        "every mode once); the extra time over none is the median of the "
                        "per-round ratios with its p10-p90, printed from %d rounds"
                        % MIN_SPREAD_REPEATS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None,
                   help="merge the rows into this JSON file (one list per --attn; the docs "
                        "render their table from it)")
    a = p.parse_args(argv)
    config, dtype = load_config(a.model), DTYPES[a.dtype]
    L = config.num_hidden_layers
    print(f"activation memory per decoder layer, {a.model} ({L} layers, h "
          f"{config.hidden_size}), micro-batch {a.batch} x {a.length} tokens, {a.dtype}, "
          f"attention {a.attn}, {torch.get_num_threads()} CPU threads")
    mem = {m: per_layer_measured(config, m, a.attn, dtype, a.batch, a.length, a.seed, repeats=0)
           for m in MODES}
    ids = torch.randint(0, config.vocab_size, (a.batch, a.length),
                        generator=torch.Generator().manual_seed(a.seed))
    rounds = interleaved_step_times({m: _tiny_model(config, L, m, a.attn, dtype, a.seed)
                                     for m in MODES}, ids, a.repeats) if a.repeats else {}
    times = {m: statistics.median(v) for m, v in rounds.items()}
    extras = {m: extra_time(rounds, m) for m in rounds if m != "none"}
    print(f"{'mode':<10} {'measured':>12} {'formula':>12} {'ratio':>6} {'whole model':>12} "
          f"{'step':>9} {'extra':>7}")
    rows = []
    for mode in MODES:
        m, f = mem[mode], activation_bytes(config, a.batch, a.length, dtype.itemsize, mode, a.attn)
        t = times.get(mode)
        x = extras.get(mode)
        rows.append(dict(mode=mode, per_layer=m["per_layer"], total=m["total"], step_s=t,
                         formula=f["per_layer"], formula_layers=f["layers"], extra=x))
        step = "" if t is None else f"{t * 1e3:>7.1f}ms " + (
            "      -" if mode == "none" else
            f"(extra: none below --repeats {MIN_SPREAD_REPEATS})" if x is None else
            f"{x['median']:>+7.1%} (p10 {x['p10']:+.1%}, p90 {x['p90']:+.1%})")
        print(f"{mode:<10} {m['per_layer']:>12,.0f} {f['per_layer']:>12,} "
              f"{m['per_layer'] / f['per_layer']:>6.3f} {m['total']:>12,} {step}")
    gpt = {m: korthikanti_bytes(config, a.batch, a.length, m) for m in MODES}
    print("Korthikanti's GPT layer of this h, a, b, s (16-bit, GELU MLP, dropout): "
          + ", ".join(f"{m} {v:,}" for m, v in gpt.items()))
    if a.out:
        _write(a, rows)
    return rows


def _write(a, rows):
    """--out: this --attn's rows, merged with the file's rows of the other attention."""
    import json
    import os
    import platform
    old = json.load(open(a.out))["rows"] if os.path.exists(a.out) else []
    new = [dict(attn=a.attn, mode=r["mode"], measured_bytes_per_layer=r["per_layer"],
                formula_bytes_per_layer=r["formula"], whole_model_bytes=r["total"],
                step_ms=None if r["step_s"] is None else round(r["step_s"] * 1e3, 1),
                extra=None if r["extra"] is None else
                {k: round(v, 4) for k, v in r["extra"].items()}) for r in rows]
    with open(a.out, "w") as f:
        json.dump(dict(command=f"python -m harness.recompute --model {a.model} --batch {a.batch} "
                               f"--length {a.length} --dtype {a.dtype} --attn eager|sdpa "
                               f"--repeats {a.repeats}",
                       machine=f"{platform.machine()} CPU, {torch.get_num_threads()} threads, "
                               f"one process", dtype=a.dtype, world=1,
                       rows=[r for r in old if r["attn"] != a.attn] + new), f, indent=1)


if __name__ == "__main__":
    main()
