"""flops.py: model FLOPs per training step and MFU (model FLOPs utilisation)."""
import torch

from .anatomy import kv_heads, mlp_width


# Dense bf16 peak FLOP/s per GPU (vendor datasheets, without sparsity), for MFU.
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


def model_flops(config, tokens: int, seq: int) -> float:
    """Training FLOPs of one step (Megatron's accounting, Narayanan et al. 2021): 6 per parameter
    per token for the matmuls (2 forward, 4 backward) + causal attention's scores and values
    12 L h s per token (counted in full, as is customary), no recomputation."""
    h, L, V, I = (config.hidden_size, config.num_hidden_layers, config.vocab_size,
                  mlp_width(config))   # (3 h I: a gated MLP's three matrices, Llama's)
    kv = kv_heads(config) * (h // config.num_attention_heads)
    matmul = L * (2 * h * h + 2 * h * kv + 3 * h * I) + V * h      # per token, forward MACs
    return tokens * (6 * matmul + 12 * L * h * seq)


def peak_flops(device) -> float | None:
    """The GPU's dense bf16 peak FLOP/s (None on CPU or for an unknown GPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_FLOPS.items() if k in name), None)


def mfu(config, tokens: int, seq: int, step_s: float, world: int, device) -> float | None:
    """Model FLOPs utilisation of a step of `tokens` tokens over `world` GPUs (None on CPU)."""
    peak = peak_flops(device)
    return None if not peak else model_flops(config, tokens, seq) / step_s / world / peak


def mfu_line(config, args, env, step_s: float) -> str:
    flops = model_flops(config, args.batch * args.length, args.length)
    achieved = flops / step_s / env.world
    line = (f"model FLOPs/step = 6 Psi_matmul T + 12 L h S T (T tokens) = {flops:.3e}; achieved "
            f"{achieved / 1e12:.3f} TFLOP/s per rank")
    if env.device.type == "cuda":
        name = torch.cuda.get_device_name(env.device)
        peak = next((v for k, v in PEAK_FLOPS.items() if k in name), None)
        line += (f"; MFU {achieved / peak:.1%} of {name}'s {peak / 1e12:.0f} TFLOP/s (bf16 dense)"
                 if peak else f"; MFU: no peak known for {name}")
    else:
        line += " (CPU: no MFU)"
    return line
