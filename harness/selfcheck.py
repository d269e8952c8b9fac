"""selfcheck.py: before training, prove on the user's own config that the code which re-implements
part of a model's forward computes what HF's forward computes.

Why. A strategy that only replicates or shards whole tensors (ddp, zero, fsdp) calls the
model's own forward and cannot change the function. One that runs the layers itself (pp.py's
stage loop, which compose4d runs too) re-implements what the family's forward does around
them: the embedding's scale, a rotary pair per layer type, the final norm, the logits' scale
and cap. A family doing something it does not know (a new multiplier, a new rotary) trains
another function silently: every verdict then FAILs, or, worse, a learning run just learns.

How. On a truncated copy of the run's config (the layers of one period of its layer_types, at
least two so the loop crosses a chunk boundary; the vocabulary capped at 512; a full-size
model's heads, MLP and experts narrowed), with random weights, each perturbed (HF's init leaves
norms at 1 and biases at 0, where a skipped one is an identity), in float64 (float32 above 1e8
parameters), in eval mode, and one 2 x S batch (S the run's length, at most the sliding window
+ 16 or 64), on this process's CPU, without collectives:
  ref = HF's forward of the copy;  got = the strategy's forward of a deep copy of it
Forward hooks record the output of every module in order (the embedding, each decoder layer,
the final norm, the head): the first whose output differs by more than `RTOL` of its scale,
or that the strategy's forward never ran, is named in one line, and the run ends with exit 2
before its first collective. Measured cost on the CPU test models: 0.05-0.3 s per run.
`--skip-self-check` skips it, with a warning. Not covered: the training mode's dropout, the
modules tp/sp/cp rebuild (their own correctness verdicts and unit tests check those).

A strategy opts in with `self_check = ("what it checks", build)`, build(model, args) ->
fn(input_ids) -> logits (rig/pp.py's stage_loop)."""
from __future__ import annotations

import copy
import time

import torch

from . import plants
from .anatomy import kv_heads, mlp_width, parts
from .models import ConfigError, model_kwargs

RTOL = {torch.float64: 1e-9, torch.float32: 1e-4}
_DONE: dict = {}   # (model, attn, length, check) -> the error line or None (--runs repeats)


def truncated(config, vocab: int = 512, budget: float = 5e7):
    """The config cut to one period of its layer types (at least 2 layers), vocab <= 512; a
    large one narrowed too (`narrowed`) to about `budget` parameters."""
    c = copy.deepcopy(config)
    types = list(getattr(c, "layer_types", None) or [])
    period = next((p for p in range(1, len(types) + 1)
                   if all(t == types[i % p] for i, t in enumerate(types))), 1)
    n = min(c.num_hidden_layers, max(2, period))
    c.num_hidden_layers = n
    if types:
        c.layer_types = types[:n]
    if c.vocab_size > vocab:
        c.vocab_size = vocab
        for k in ("pad_token_id", "bos_token_id", "eos_token_id"):
            if isinstance(getattr(c, k, None), int) and getattr(c, k) >= vocab:
                setattr(c, k, None)
    return narrowed(c, budget)


def narrowed(c, budget: float):
    """A config whose layers hold more than `budget` parameters (a full-size model's), with
    fewer heads (head_dim and the q/kv ratio kept), a narrower MLP and at most 4 experts:
    the forward around the layers is what is checked, and it does not depend on the widths.
    Left as it is where it is small, or names its widths otherwise."""
    h, nh = c.hidden_size, c.num_attention_heads
    per_layer = 12 * h * h + 3 * h * mlp_width(c) * max(
        1, getattr(c, "num_local_experts", None) or getattr(c, "num_experts", None) or 1)
    if per_layer * c.num_hidden_layers <= budget or not hasattr(c, "intermediate_size"):
        return c
    d = getattr(c, "head_dim", None) or h // nh
    kv = kv_heads(c)
    keep_kv = min(kv, 2)                       # kv heads kept: 2 (or 1), each with its q heads
    f = kv // keep_kv if kv % keep_kv == 0 else 1
    if f <= 1 or nh % f or h % f or c.intermediate_size % f:
        return c
    c.head_dim = d
    c.num_attention_heads, c.hidden_size = nh // f, h // f
    if getattr(c, "num_key_value_heads", None):
        c.num_key_value_heads = keep_kv
    c.intermediate_size //= f
    for k in ("num_local_experts", "num_experts"):
        if getattr(c, k, None):
            setattr(c, k, min(4, getattr(c, k)))
    if getattr(c, "num_experts_per_tok", None):
        c.num_experts_per_tok = min(2, c.num_experts_per_tok)
    return c


def _record(model, log: list):
    """Hooks that append (module name, output) for the embedding, layers, norm and head."""
    p = parts(model)
    watched = [(p.names.get("embed"), p.embed)]
    watched += [(f"{p.names['layers']}.{i}", layer) for i, layer in enumerate(p.layers)]
    watched += [(p.names.get("norm"), p.norm), (p.names.get("head"), p.head)]
    hooks = []
    for name, m in watched:
        if m is not None:
            hooks.append(m.register_forward_hook(
                lambda mod, a, out, name=name: log.append(
                    (name, (out[0] if isinstance(out, tuple) else out).detach()))))
    return [n for n, m in watched if m is not None], hooks


def compare(config, args, what: str, build) -> str | None:
    """None when `build`'s forward equals HF's on the truncated config, else the one line."""
    from transformers import AutoModelForCausalLM
    from .models import finish_model
    cfg = truncated(config)
    family, hooks = type(config).__name__.replace("Config", ""), []
    try:
        with torch.random.fork_rng(devices=[]), torch.device("cpu"):
            torch.manual_seed(0)
            ref = AutoModelForCausalLM.from_config(copy.deepcopy(cfg),
                                                   **model_kwargs(cfg, args.attn))
            n = sum(t.numel() for t in ref.parameters())
            dtype = torch.float64 if n < 1e8 else torch.float32
            a = copy.copy(args)
            a.dtype = {torch.float64: "float64", torch.float32: "float32"}[dtype]
            ref = finish_model(ref.to(dtype), a).eval()
            with torch.no_grad():   # (HF's init: norms at 1, biases and pad rows at 0, where
                for t in ref.parameters():   # a skipped one would be an identity)
                    t.add_(torch.randn_like(t) * 0.1)
            mine = copy.deepcopy(ref)
            window = getattr(cfg, "sliding_window", None) or 0
            S = min(args.length, max(64, window + 16) if window and window < args.length
                    else 64)
            ids = torch.randint(0, cfg.vocab_size, (2, S))
        family = type(ref).__name__
        want, got = [], []
        order, hooks = _record(ref, want)
        hooks += _record(mine, got)[1]
        with torch.no_grad():
            logits_ref = ref(input_ids=ids).logits
            fn = build(mine, a)
            logits = fn(ids)
    except Exception as e:   # (a re-implementation that cannot run the family at all)
        return (f"{what} cannot run {family} (self-check on a {cfg.num_hidden_layers}-layer "
                f"copy of the config: {type(e).__name__}: {str(e).splitlines()[0][:120]})")
    finally:
        for h in hooks:
            h.remove()
    ran, before = dict(got), None
    for name, out in want:
        if name not in ran:
            return (f"{what} does not compute {family}'s forward: {name} never runs "
                    f"(self-check, {cfg.num_hidden_layers}-layer copy of the config)")
        err, scale = (ran[name] - out).abs().max().item(), out.abs().max().item()
        if ran[name].shape != out.shape or err > RTOL[dtype] * max(scale, 1e-30):
            where = f" ({before} agrees: the step between them)" if before else ""
            return (f"{what} does not compute {family}'s forward: the output of {name} differs"
                    f"{where} (max err {err:.1e} of scale {scale:.1e}; self-check, "
                    f"{cfg.num_hidden_layers}-layer copy of the config)")
        before = name
    err, scale = (logits - logits_ref).abs().max().item(), logits_ref.abs().max().item()
    if logits.shape != logits_ref.shape or err > RTOL[dtype] * scale:
        return (f"{what} does not compute {family}'s forward: the logits differ after "
                f"{order[-1]} (max err {err:.1e} of scale {scale:.1e}: a transform of the "
                f"head's output it does not apply; self-check)")
    return None


def check(cls, args, config, rank: int) -> None:
    """The strategy's self-check for this run (cls.self_check), once per model and length;
    raises ConfigError with the line. Rank 0 prints what it checked and what it cost."""
    spec = getattr(cls, "self_check", None)
    if spec is None:
        return
    what, build = spec
    if getattr(args, "skip_self_check", False):
        if rank == 0:
            print(f"warning: --skip-self-check: {what} is not checked against the model's own "
                  f"forward; a family it does not know trains another function", flush=True)
        return
    key = (config.to_json_string(), args.attn, args.length, what, plants.active())
    if key not in _DONE:
        t0 = time.perf_counter()
        _DONE[key] = compare(config, args, what, build)
        if rank == 0 and _DONE[key] is None:
            print(f"self-check: {what} equals {config.model_type}'s own forward (eval mode, "
                  f"a {truncated(config).num_hidden_layers}-layer copy, perturbed random "
                  f"weights; {time.perf_counter() - t0:.2f} s; --skip-self-check skips it)",
                  flush=True)
    if _DONE[key]:
        raise ConfigError(_DONE[key])
