"""models.py: The model side: dtypes, presets (tiny for CPU tests, Llama 3 / Mixtral shapes for
planning), HF configs from a preset name, a config.json or a local checkpoint directory, and the
reference model built from them (with weights when the directory has them)."""
from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import json
import os
import types

import torch

from .anatomy import ADAPTERS, attention_of, base_name, kv_heads, parts, set_part  # noqa: F401
from .dropout import IMPL as DROPOUT_IMPL, install as install_dropout
from .dropout import rates, set_rates as set_dropout




DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}
LOW_PRECISION = ("bfloat16", "float16")   # the --dtype names of 16-bit runs


_TINY_FAMILY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                    tie_word_embeddings=False, rms_norm_eps=1e-6, bos_token_id=1,
                    eos_token_id=2)   # (pad_token_id: HF's default per family, see below)

PRESETS = {
    "tiny": dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128,
                 num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=4096, tie_word_embeddings=False, rms_norm_eps=1e-6),
    "small": dict(model_type="llama", vocab_size=8192, hidden_size=384, intermediate_size=1024,
                  num_hidden_layers=8, num_attention_heads=6, num_key_value_heads=2,
                  max_position_embeddings=8192, tie_word_embeddings=False, rms_norm_eps=1e-6),
    "llama3.2-1b": dict(model_type="llama", vocab_size=128256, hidden_size=2048,
                        intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                        num_key_value_heads=8, max_position_embeddings=131072,
                        tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=500000.0,
                        rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                                          high_freq_factor=4.0,
                                          original_max_position_embeddings=8192)),
    "llama3-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096,
                      intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, max_position_embeddings=8192,
                      tie_word_embeddings=False, rms_norm_eps=1e-5, rope_theta=500000.0),
    # Mixture-of-Experts (HF Mixtral): `tiny-moe` for CPU tests, Mixtral 8x7B's shape for planning.
    "tiny-moe": dict(model_type="mixtral", vocab_size=256, hidden_size=64, intermediate_size=64,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     num_local_experts=8, num_experts_per_tok=2, router_jitter_noise=0.0,
                     max_position_embeddings=4096, tie_word_embeddings=False, rms_norm_eps=1e-6),
    # One small model per HF decoder family beyond Llama (tests/test_families.py): what each adds
    # is what a strategy must classify or refuse (docs/strategies.md, "Model families").
    **{f"tiny-{t}": {**_TINY_FAMILY, "model_type": t, **extra} for t, extra in {
        "mistral": dict(sliding_window=8),                  # a window on every layer
        "qwen2": dict(),                                   # q/k/v biases
        "qwen3": dict(head_dim=16),                        # per-head q_norm / k_norm
        "olmo2": dict(),                                   # full-width q/k norms, post-norms
        "gemma2": dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                       layer_types=["sliding_attention", "full_attention"],
                       tie_word_embeddings=True),          # (1+w) norms in float32, embedding
                                                           # scale, soft-capping, sliding window
        "phi3": dict(original_max_position_embeddings=4096,   # fused qkv_proj / gate_up_proj
                     pad_token_id=5),   # (HF's default, 32000, is outside the tiny vocabulary)
        # Gemma2's, plus q/k norms and two rope bases (one per layer type)
        "gemma3": dict(model_type="gemma3_text", head_dim=16, query_pre_attn_scalar=16,
                       sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                       tie_word_embeddings=True),
        # OLMo2's, plus sliding layers (and HF's pad id 1)
        "olmo3": dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
        # attention and MLP in parallel on one LayerNorm, logits scaled by logit_scale 0.0625
        "cohere": dict(tie_word_embeddings=True),
        # Granite 3's multipliers on the embedding, residuals, attention scores and logits
        "granite": dict(embedding_multiplier=12.0, logits_scaling=8.0,
                        residual_multiplier=0.22, attention_multiplier=0.0078125),
        # GPT-NeoX/Pythia: gpt_neox.layers, embed_in / embed_out, qkv fused per head, parallel
        # residual, LayerNorms with biases, rotary on a quarter of each head
        # StarCoder2: a non-gated MLP (c_fc, c_proj), LayerNorms and every projection with
        # biases, a sliding window longer than the tests' sequences (HF's default 4096)
        "starcoder2": dict(),
        # GLM: a fused gate_up_proj that HF's plan gathers ("colwise_gather_output"), partial
        # rotary
        "glm": dict(head_dim=16, pad_token_id=0),
        # Phi-2: attention and MLP in parallel on one LayerNorm, non-gated fc1 / fc2, "dense"
        # output projection, biases everywhere, partial rotary; its dropouts off
        "phi": dict(resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0),
        # Nemotron: squared-ReLU non-gated MLP (up, down), LayerNorm1P ((1 + w) with a bias)
        "nemotron": dict(head_dim=16),
        # StableLM: no tp plan in its config (the canonical table classifies it), LayerNorms
        # with biases, partial rotary
        "stablelm": dict(),
        "neox": dict(model_type="gpt_neox", intermediate_size=256, num_key_value_heads=None),
        # GPT-2: transformer.h, learned position embeddings (wpe), Conv1D projections, biases;
        # its dropouts (0.1, one outside the layers) off, as --dropout 0 sets them
        "gpt2": dict(n_inner=128, num_key_value_heads=None, attn_pdrop=0.0, embd_pdrop=0.0,
                     resid_pdrop=0.0),
        # OPT: model.decoder.layers, learned positions (offset 2), a key bias whose gradient
        # is zero in exact arithmetic; its dropout (0.1) off
        "opt": dict(ffn_dim=128, word_embed_proj_dim=64, num_key_value_heads=None, dropout=0.0),
    }.items()},
    "mixtral-8x7b": dict(model_type="mixtral", vocab_size=32000, hidden_size=4096,
                         intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
                         max_position_embeddings=32768, tie_word_embeddings=False,
                         rms_norm_eps=1e-5, rope_theta=1e6, router_jitter_noise=0.0),
}


class ConfigError(Exception):
    """A violated configuration constraint: one line, exit code 2, before any collective."""


def load_config(spec: str, dropout: float | None = None):
    """The HF config for `--model`: preset name, model directory, or config.json path;
    `dropout` (--dropout P) replaces its dropout probabilities (dropout.set_rates)."""
    config = _load_config(spec)
    if dropout is not None and 0 <= dropout < 1:
        set_dropout(config, dropout)
    return config


def _load_config(spec: str):
    from transformers import AutoConfig, CONFIG_MAPPING
    if spec in PRESETS:
        kw = dict(PRESETS[spec])
        return CONFIG_MAPPING[kw.pop("model_type")](**kw)
    if os.path.isdir(spec):
        if not os.path.isfile(os.path.join(spec, "config.json")):
            raise ConfigError(f"--model {spec}: directory has no config.json")
        return AutoConfig.from_pretrained(spec)
    if os.path.isfile(spec) and spec.endswith(".json"):
        with open(spec) as f:
            kw = json.load(f)
        return CONFIG_MAPPING[kw.pop("model_type", "llama")](**kw)
    raise ConfigError(f"--model {spec}: not a preset ({', '.join(PRESETS)}), "
                      f"a model directory or a config.json")


def has_weights(spec: str) -> bool:
    return os.path.isdir(spec) and any(
        f.endswith((".safetensors", ".bin")) for f in os.listdir(spec))


class Float64Kept(torch.overrides.TorchFunctionMode):
    """A float64 run kept float64 inside modules that compute in float32 by design: HF's norms
    (`hidden.to(torch.float32)`, Gemma's `x.float()` and `(1 + w.float())`), eager attention's
    `softmax(..., dtype=torch.float32)`. Under this mode a cast of a float64 tensor down to
    float32 keeps float64. Nothing changes in bf16/fp32 runs; in float64 runs the model
    computes what it computes in float32, exactly, so the float64 verdict judges the strategy
    and not the model's own rounding (a loss scaled by a non-power-of-two W showed 1e-7 errors
    through Llama's float32 norm, 2e-8 through Gemma2's)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        f64 = any(isinstance(a, torch.Tensor) and a.dtype == torch.float64 for a in args)
        if f64:
            if func is torch.Tensor.float:
                return args[0]
            if func is torch.Tensor.to:
                args = tuple(torch.float64 if a is torch.float32 else a for a in args)
            if kwargs.get("dtype") is torch.float32:
                kwargs = {**kwargs, "dtype": torch.float64}
        return func(*args, **kwargs)


def _kept_forward(self, *args, **kwargs):
    """The module's own forward, under Float64Kept when its parameters are float64. Only the
    forward's body runs under the mode: the hooks a strategy registers on the module (a
    ZeRO-3 unit's gather, ZeRO++'s int8 quantization) run outside it, in their own dtypes."""
    forward = type(self).forward
    p = next(self.parameters(), None)
    if p is None or p.dtype != torch.float64:
        return forward(self, *args, **kwargs)
    with Float64Kept():
        return forward(self, *args, **kwargs)


def keep_float64(model: torch.nn.Module) -> torch.nn.Module:
    """In a float64 model, every module that rounds to float32 by design (its norms and
    attention) computes its forward under Float64Kept; a no-op in other dtypes. (A MoE router's
    float32 softmax is left as it is: the expert-parallel verdicts are measured with it.)"""
    for m in model.modules():
        if type(m).__name__.endswith(("Norm", "Attention")) and "forward" not in vars(m):
            m.forward = types.MethodType(_kept_forward, m)
    return model


def resolve_attn(config, attn: str) -> tuple[str, str | None]:
    """(the attention implementation for --attn, a line to print or None): `auto` takes SDPA
    where the model's HF class supports it and eager otherwise (Gemma2); asking for SDPA where
    there is none is a configuration error, not a traceback from inside transformers."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
    try:
        cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        raise ConfigError(f"--model: {type(config).__name__} has no causal-LM class in "
                          f"transformers")
    sdpa = getattr(cls, "_supports_sdpa", False)
    if attn == "auto":
        return ("sdpa", None) if sdpa else ("eager", f"attention: eager ({cls.__name__} has no "
                                                     f"SDPA implementation)")
    if attn == "sdpa" and not sdpa:
        raise ConfigError(f"--attn sdpa: {cls.__name__} has no SDPA implementation "
                          f"(--attn eager, or auto)")
    return attn, None


def n_experts(config) -> int:
    """A Mixture-of-Experts config's routed experts (0: dense): Mixtral's num_local_experts,
    Qwen-MoE's and OLMoE's num_experts, DeepSeek's n_routed_experts."""
    return next((getattr(config, k) for k in ("num_local_experts", "num_experts",
                                              "n_routed_experts") if getattr(config, k, None)), 0)


def is_moe(config) -> bool:
    """A Mixture-of-Experts config (n_experts)."""
    return bool(n_experts(config))


def model_kwargs(config, attn: str) -> dict:
    """The implementation choices every model build makes (from_config / from_pretrained)."""
    kw = dict(attn_implementation=resolve_attn(config, attn)[0] if attn == "auto" else attn)
    if getattr(config, "num_local_experts", None):
        # HF's reference expert loop; its grouped_mm kernel takes no float64
        kw["experts_implementation"] = "eager"
    return kw


_LOADED: dict | None = None   # inside loaded_once(): (checkpoint, attention) -> float32 model


@contextlib.contextmanager
def loaded_once(enabled: bool = True):
    """Inside the block build_model reads each checkpoint from disk once and copies it from
    memory after that (rank 0 of the correctness mode builds the reference, the strategy and
    the noise sources from the same weights): one float32 copy of the model stays resident
    meanwhile."""
    global _LOADED
    outer = _LOADED
    if enabled and _LOADED is None:
        _LOADED = {}
    try:
        yield
    finally:
        _LOADED = outer


def build_model(args, config, device) -> torch.nn.Module:
    """The full reference model in args.dtype on `device`: loaded weights when --model is a
    checkpoint directory, otherwise a seeded random init (identical on every rank)."""
    from transformers import AutoModelForCausalLM
    dtype = DTYPES[args.dtype]
    kw = model_kwargs(config, args.attn)
    if has_weights(args.model):
        key = (os.path.realpath(args.model), repr(sorted(kw.items())), repr(getattr(args, "dropout", None)))
        if _LOADED is not None and key in _LOADED:
            model = copy.deepcopy(_LOADED[key])
        else:   # (the run's config: --dropout may have changed the checkpoint's)
            model = AutoModelForCausalLM.from_pretrained(
                args.model, config=copy.deepcopy(config), dtype=torch.float32, **kw)
            if _LOADED is not None:
                _LOADED[key] = copy.deepcopy(model)
    else:
        torch.manual_seed(args.seed)
        # (a copy: from_config shares the object, and strategies edit their model's config)
        # On CUDA the random init runs on the device: a 1B model's init takes seconds there
        # and about a minute on the host (its values differ from a CPU build's: same seed,
        # another generator).
        with (torch.device(device) if torch.device(device).type == "cuda"
              else contextlib.nullcontext()):
            model = AutoModelForCausalLM.from_config(copy.deepcopy(config), **kw)
    model = finish_model(model.to(device=device, dtype=dtype), args)
    if getattr(args, "lora", 0):   # peft's adapters on the targets, the rest frozen
        from .lora_setup import wrap
        wrap(model, args)
    return model


def _no_kv_cache(module, args, kwargs):
    """A training forward builds no KV cache: HF's forward makes a DynamicCache whenever
    use_cache is on (the config's default), from host data, every step. An explicit use_cache
    (generate's) is kept, and the config is left alone (an exported model keeps use_cache)."""
    if kwargs.get("use_cache") is None:
        kwargs["use_cache"] = False
    return args, kwargs


def finish_model(model, args):
    """What every built model gets (build_model, loading.meta_model): layout-independent
    dropout where its config drops (dropout.install, keyed by --seed), float64 kept inside
    its norms and attention, no KV cache in its forward, training mode."""
    install_dropout(model, parts(model).layers, getattr(args, "seed", 0))
    model.register_forward_pre_hook(_no_kv_cache, with_kwargs=True)
    return keep_float64(model).train()


# Parameters that are never hidden matrices, whatever their shape: the vocabulary (input and
# output embeddings, position tables) of the families the presets cover.
VOCAB_NAMES = ("embed_tokens", "lm_head", "wte", "wpe", "embed_positions", "embed_out")


def hidden_matrix(name: str, shape) -> bool:
    """The one rule (muon.py, the reference's OracleMuon, every strategy): Muon updates the 2-D
    hidden weight matrices; embeddings, the LM head, norms, biases and 3-D expert stacks take
    AdamW."""
    return len(shape) == 2 and not any(v in name for v in VOCAB_NAMES)


def param_count(model) -> int:
    return sum(p.numel() for p in model.parameters())


def common_constraints(args, world, config) -> list[str]:
    errs = []
    if args.batch < 1 or args.length < 2:
        errs.append(f"--batch ({args.batch}) must be >= 1 and --length ({args.length}) >= 2")
    chunk = getattr(args, "ce_chunk", 0)
    if chunk < 0:
        errs.append(f"--ce-chunk must be >= 0 (got {chunk})")
    elif chunk and logit_transforms(config):
        errs.append(f"--ce-chunk: the chunked loss does not soft-cap the logits or scale "
                    f"them ({', '.join(logit_transforms(config))})")
    if getattr(args, "dropout", None) is not None and not 0 <= args.dropout < 1:
        errs.append(f"--dropout must be in [0, 1) (got {args.dropout})")
    if rates(config) and (getattr(args, "compare_native", False) or getattr(args, "paired", 0)):
        errs.append(f"--compare-native / --paired with dropout ({rates(config)}): PyTorch's "
                    f"own implementations draw torch's masks, not the layout-independent ones")
    if rates(config) and getattr(args, "mode", None) in ("benchmark", "peak", "all"):
        errs.append(f"--mode {args.mode} with dropout ({rates(config)}): the benchmark and "
                    f"memory formulas are for the model without it (measure dropout's cost "
                    f"with the learning mode's step times)")
    if getattr(args, "recompute", "none") != "none" and args.mode == "benchmark":
        errs.append(f"--recompute {args.recompute}: the benchmark's communication formulas "
                    f"assume none (a recomputed forward repeats its collectives); measure "
                    f"recompute with python -m harness.recompute")
    if args.clip is not None and args.clip < 0:
        errs.append(f"--clip must be >= 0 (got {args.clip})")
    if args.branching > config.vocab_size:
        errs.append(f"--branching {args.branching} exceeds vocab_size {config.vocab_size}")
    return errs


# What a model's own forward does around its decoder layers, for the strategies that call the
# layers themselves (pp.Pipeline, compose4d)
def sliding_window(config, length: int) -> tuple[int | None, bool]:
    """(the window of the model's sliding layers when it is shorter than `length`, or None;
    whether every layer slides): Gemma2 alternates sliding and full layers (layer_types),
    Mistral and Phi3 slide on every layer when config.sliding_window is set."""
    w = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if not w or w >= length or (types and "sliding_attention" not in types):
        return None, False
    return w, not types


def attention_features(config, length: int) -> list[str]:
    """What an attention kernel written by hand (cp_ring's ring, sp's Ulysses) would have to do
    beyond causal softmax attention for this model: logit soft-capping, a sliding window
    shorter than the sequence. Those strategies refuse the model while the list is not empty."""
    out = []
    if getattr(config, "attn_logit_softcapping", None):
        out.append(f"attention logit soft-capping (attn_logit_softcapping="
                   f"{config.attn_logit_softcapping})")
    w, _ = sliding_window(config, length)
    if w:
        out.append(f"a sliding window of {w} tokens, shorter than --length {length}")
    return out


_MASKS: dict = {}


def _mask_impl(config) -> str:
    """The attention implementation whose mask a layer needs: the model's, through recompute's
    wrapper (recompute.py) and dropout's eager-with-masks (dropout.py)."""
    impl = (config._attn_implementation or "eager").removeprefix("recompute_")
    return "eager" if impl == DROPOUT_IMPL else impl


def attention_masks(config, length: int, dtype, device) -> dict | None:
    """The additive masks a decoder layer needs when it is called on its own over positions
    0..length-1, by attention type: none with SDPA and no sliding window (its causal mode),
    otherwise query i sees key j when j <= i (and i - j < the window on sliding layers, HF's
    convention): eager attention (Gemma2) and sliding windows, as the model's own forward would
    build them. Built once per (length, dtype, device, implementation, window), from shapes
    only (no host read in the step). A composition that installs its own attention (context
    parallelism) masks by itself: None."""
    impl = _mask_impl(config)
    if impl not in ("eager", "sdpa"):
        return None
    window, every_layer = sliding_window(config, length)
    if impl == "sdpa" and not window:
        return None
    key = (length, dtype, str(device), impl, window, every_layer)
    if key not in _MASKS:
        pos = torch.arange(length, device=device)
        d = pos[:, None] - pos[None, :]                  # (S, S): query i minus key j
        causal = d >= 0
        slide = causal & (d < window) if window else causal
        _MASKS[key] = {kind: torch.zeros(d.shape, dtype=dtype, device=device).masked_fill(
                           ~ok, torch.finfo(dtype).min)[None, None]
                       for kind, ok in (("full_attention", slide if every_layer else causal),
                                        ("sliding_attention", slide))}
    return _MASKS[key]


def document_masks(config, h: torch.Tensor, doc_positions: torch.Tensor) -> dict:
    """The masks a decoder layer called on its own needs over packed documents (--doc-mask:
    doc_positions (B, S), restarting at 0 in each document), by attention type: HF's own
    (create_causal_mask / create_sliding_window_causal_mask with those position ids, its
    packed-sequence path: causal within a document only), as the model's forward builds them.
    h (B, S, H): only its shape, dtype and device are read."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
    cfg = copy.copy(config)   # (the implementation whose mask HF builds, as attention_masks')
    cfg._attn_implementation = _mask_impl(config)
    kw = dict(config=cfg, inputs_embeds=h, attention_mask=None, cache=None,
              position_ids=doc_positions)
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    build = {"full_attention": create_causal_mask,
             "sliding_attention": create_sliding_window_causal_mask}
    return {kind: build[kind](**kw) for kind in kinds}


def soft_cap(logits: torch.Tensor, config) -> torch.Tensor:
    """Gemma2's final logit soft-capping, cap * tanh(logits / cap), as its model applies it."""
    cap = getattr(config, "final_logit_softcapping", None)
    return torch.tanh(logits / cap) * cap if cap else logits


def logit_transforms(config) -> list[str]:
    """What the families' causal-LM forwards do to the head's output, by config field: Cohere
    multiplies by logit_scale, Granite divides by logits_scaling, Gemma 2/3 soft-cap. (A
    family doing something else is caught by selfcheck.py, not trained.)"""
    return [f"{k}={getattr(config, k)}" for k in ("logit_scale", "logits_scaling",
                                                  "final_logit_softcapping")
            if getattr(config, k, None) is not None]


def head_output(logits: torch.Tensor, config) -> torch.Tensor:
    """The logits as the model's causal-LM forward returns them (logit_transforms)."""
    if getattr(config, "logit_scale", None) is not None:        # Cohere
        logits = logits * config.logit_scale
    if getattr(config, "logits_scaling", None) is not None:     # Granite
        logits = logits / config.logits_scaling
    return soft_cap(logits, config)


def embed_output(p, ids: torch.Tensor) -> torch.Tensor:
    """The decoder's input as the model's own forward makes it: the embedding (Gemma's scale
    is inside its embedding module), times Granite's embedding_multiplier (on the decoder)."""
    h = p.embed(ids)
    mult = getattr(p.base, "embedding_multiplier", None)
    return h * mult if mult is not None else h


@functools.lru_cache(maxsize=None)
def _takes_layer_type(cls) -> bool:
    """Whether a rotary embedding class's forward takes a layer type (once per class: no
    signature parsed inside a step)."""
    return "layer_type" in inspect.signature(cls.forward).parameters


def rotary_by_type(p, h: torch.Tensor, pos: torch.Tensor, layer_types) -> dict:
    """{layer type: the (cos, sin) its layers take}: one pair from the decoder's rotary
    embedding, or one per type where it takes the type (Gemma 3 and OLMo 3: a rope base per
    sliding / full layer). {} for a decoder without a shared rotary embedding."""
    rot = getattr(p.base, "rotary_emb", None)
    kinds = sorted(set(layer_types or ["full_attention"]))
    if rot is None:
        return {}
    if layer_types and _takes_layer_type(type(rot)):
        return {t: rot(h, pos, t) for t in kinds}
    cos_sin = rot(h, pos)
    return {t: cos_sin for t in kinds}
