"""make_checkpoint.py: write a small local HF checkpoint that behaves like a trained one.

    python scripts/make_checkpoint.py DIR            # Llama: 12 layers, 12 heads / 6 kv, tied
    python scripts/make_checkpoint.py DIR --moe      # a 4-layer Mixtral twin (6 experts, top 2)
    python scripts/make_checkpoint.py DIR --family qwen3   # a Qwen3 twin (per-head q/k norms)

Random-init models are kind to numerics: activations are O(1), attention is nearly uniform and
no sum cancels much. Trained checkpoints are not, and a correctness verdict tuned on random
weights gives false FAILs on them (see the README's numerics policy). This checkpoint has what
makes trained models hard, at a size the CPU tests can afford (1.4M parameters):

  - massive activations: two residual channels carry values ~30x the rest (Sun et al. 2024,
    "Massive Activations in Large Language Models"), so RMSNorm gradients cancel heavily;
  - sharp attention: q and k scaled so logits reach tens (large exp() ranges in softmax and in
    ring attention's merges);
  - trained weights: AdamW on the synthetic language for --steps steps, so weights are
    correlated with the data and the loss is well below uniform;
  - tied embeddings and a head count that is not a power of two (12 heads, 6 kv heads; tensor,
    Ulysses and expert parallel sizes 2 and 3 all divide it), vocabulary 250 (padded under TP).

The weights are a pure function of --seed; the tests build it into a temporary directory.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import harness  # noqa: E402

CONFIG = dict(vocab_size=250, hidden_size=96, intermediate_size=192, num_hidden_layers=12,
              num_attention_heads=12, num_key_value_heads=6, max_position_embeddings=4096,
              tie_word_embeddings=True, rms_norm_eps=1e-5)
# the Mixtral twin: 4 layers (HF's eager expert loop runs every expert in Python: the 12-layer
# twin took 100 s per correctness run on 2 cores)
MOE = dict(num_local_experts=6, num_experts_per_tok=2, router_jitter_noise=0.0,
           intermediate_size=96, num_hidden_layers=4)
MASSIVE = (7, 61)       # residual channels given massive activations
MASSIVE_SCALE = 30.0
QK_SCALE = 3.0


def build(path: str, moe: bool = False, steps: int = 40, seed: int = 0,
          family: str = "llama") -> str:
    """Write the checkpoint to `path` (config.json + model.safetensors); returns path.
    `family`: another HF decoder of the same shape (qwen3: its per-head q/k norms trained too)."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM
    kw = dict(CONFIG, **(MOE if moe else {}))
    if family == "qwen3":
        kw["head_dim"] = kw["hidden_size"] // kw["num_attention_heads"]
    config = CONFIG_MAPPING["mixtral" if moe else family](**kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, **harness.model_kwargs(config, "sdpa"))
    model = model.float().train()
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb[:, list(MASSIVE)] *= MASSIVE_SCALE
        for layer in model.model.layers[:2]:       # early layers write into the same channels
            mlp = getattr(layer, "mlp", None)
            if mlp is not None and hasattr(mlp, "down_proj"):
                mlp.down_proj.weight[list(MASSIVE), :] *= MASSIVE_SCALE
            layer.self_attn.o_proj.weight[list(MASSIVE), :] *= MASSIVE_SCALE
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight *= QK_SCALE
            layer.self_attn.k_proj.weight *= QK_SCALE
    lang = harness.MarkovLanguage(config.vocab_size, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    first = last = None
    for s in range(steps):
        b = harness.make_batch(lang, 10_000 + s, 8, 64, "cpu")
        loss = harness.lm_loss_sum(model(input_ids=b.input_ids).logits, b.labels) / b.n_tokens
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        first = loss.item() if first is None else first
        last = loss.item()
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    with open(os.path.join(path, "TRAINING.txt"), "w") as f:
        f.write(f"scripts/make_checkpoint.py seed={seed} steps={steps} moe={moe} "
                f"family={family}: "
                f"loss {first:.3f} -> {last:.3f}\n")
    return path


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("path")
    ap.add_argument("--moe", action="store_true", help="a Mixtral of the same shape")
    ap.add_argument("--family", default="llama", choices=["llama", "qwen3"])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    build(a.path, a.moe, a.steps, a.seed, a.family)
    print(open(os.path.join(a.path, "TRAINING.txt")).read().strip())


if __name__ == "__main__":
    main()
