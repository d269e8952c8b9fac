"""models.py: The model side: dtypes, presets (tiny for CPU tests, Llama 3 / Mixtral shapes for
planning), HF configs from a preset name, a config.json or a local checkpoint directory, and the
reference model built from them (with weights when the directory has them)."""
from __future__ import annotations

import copy
import json
import os
import types

import torch




DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}


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
    "mixtral-8x7b": dict(model_type="mixtral", vocab_size=32000, hidden_size=4096,
                         intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
                         max_position_embeddings=32768, tie_word_embeddings=False,
                         rms_norm_eps=1e-5, rope_theta=1e6, router_jitter_noise=0.0),
}


class ConfigError(Exception):
    """A violated configuration constraint: one line, exit code 2, before any collective."""


def load_config(spec: str):
    """The HF config for `--model`: preset name, model directory, or config.json path."""
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


def _promoting_rmsnorm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """HF's RMSNorm with `.to(float32)` replaced by promotion to at least float32: identical
    for bf16/fp32, and truly float64 in float64 runs (HF's cast would round every norm to
    float32, so a loss scaled by a non-power-of-two W shows 1e-7 errors in a float64 run)."""
    dtype = hidden_states.dtype
    h = hidden_states.to(torch.promote_types(dtype, torch.float32))
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return self.weight * h.to(dtype)


def promote_norms(model: torch.nn.Module) -> torch.nn.Module:
    for m in model.modules():
        if type(m).__name__.endswith("RMSNorm") and hasattr(m, "variance_epsilon"):
            m.forward = types.MethodType(_promoting_rmsnorm_forward, m)
    return model


def model_kwargs(config, attn: str) -> dict:
    """The implementation choices every model build makes (from_config / from_pretrained)."""
    kw = dict(attn_implementation=attn)
    if getattr(config, "num_local_experts", None):
        # HF's reference expert loop; its grouped_mm kernel takes no float64
        kw["experts_implementation"] = "eager"
    return kw


def build_model(args, config, device) -> torch.nn.Module:
    """The full reference model in args.dtype on `device`: loaded weights when --model is a
    checkpoint directory, otherwise a seeded random init (identical on every rank)."""
    from transformers import AutoModelForCausalLM
    dtype = DTYPES[args.dtype]
    kw = model_kwargs(config, args.attn)
    if has_weights(args.model):
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, **kw)
    else:
        torch.manual_seed(args.seed)
        # (a copy: from_config shares the object, and strategies edit their model's config)
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config), **kw)
    return promote_norms(model.to(device=device, dtype=dtype)).train()


def param_count(model) -> int:
    return sum(p.numel() for p in model.parameters())


def common_constraints(args, world, config) -> list[str]:
    errs = []
    if args.batch < 1 or args.length < 2:
        errs.append(f"--batch ({args.batch}) must be >= 1 and --length ({args.length}) >= 2")
    drop = getattr(config, "attention_dropout", 0.0) or 0.0
    if drop > 0:
        errs.append(f"attention_dropout={drop}: dropout is not reproducible across layouts; "
                    "set it to 0")
    if getattr(args, "recompute", "none") != "none" and args.mode in ("benchmark", "peak"):
        errs.append(f"--recompute {args.recompute}: the benchmark's communication formulas "
                    f"assume none (a recomputed forward repeats its collectives); measure "
                    f"recompute with python -m harness.recompute")
    if args.clip < 0:
        errs.append(f"--clip must be >= 0 (got {args.clip})")
    if args.branching > config.vocab_size:
        errs.append(f"--branching {args.branching} exceeds vocab_size {config.vocab_size}")
    return errs
