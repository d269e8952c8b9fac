"""selfcheck.py: before training, prove on the user's own config that the code which re-implements
part of a model's forward computes what HF's forward computes.

Why. A strategy that only replicates or shards whole tensors (ddp, zero, fsdp) calls the
model's own forward and cannot change the function. One that runs the layers itself (pp.py's
stage loop, which compose4d runs too) re-implements what the family's forward does around
them: the embedding's scale, a rotary pair per layer type, the final norm, the logits' scale
and cap. A family doing something it does not know (a new multiplier, a new rotary) trains
another function silently: every verdict then FAILs, or, worse, a learning run just learns.

How. On a truncated copy of the run's config (the layers of one period of its layer_types, at
least two so the loop crosses a chunk boundary; the vocabulary capped at 512), with random
weights in float64 (float32 above 1e8 parameters) and one 2 x S batch (S the run's length,
at most the sliding window + 16 or 64), on this process's CPU, without collectives:
  ref = HF's forward of the copy;  got = the strategy's forward of a deep copy of it
Forward hooks record the output of every module in order (the embedding, each decoder layer,
the final norm, the head): the first whose output differs by more than `RTOL` of its scale,
or that the strategy's forward never ran, is named in one line, and the run ends with exit 2
before its first collective. Measured cost on the CPU test models: 0.1-0.3 s per run.
`--skip-self-check` skips it, with a warning.

A strategy opts in with `self_check = ("what it checks", build)`, build(model, args) ->
fn(input_ids) -> logits (pp.stage_loop)."""
from __future__ import annotations

import copy
import time

import torch

from .anatomy import parts
from .models import ConfigError, model_kwargs

RTOL = {torch.float64: 1e-9, torch.float32: 1e-4}
_DONE: dict = {}   # (model, attn, length, check) -> the error line or None (--runs repeats)


def truncated(config, vocab: int = 512):
    """The config cut to one period of its layer types (at least 2 layers), vocab <= 512."""
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
    cfg = truncated(config)
    torch.manual_seed(0)
    kw = model_kwargs(cfg, args.attn)
    with torch.device("cpu"):
        ref = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), **kw)
    n = sum(t.numel() for t in ref.parameters())
    dtype = torch.float64 if n < 1e8 else torch.float32
    from .models import finish_model
    a = copy.copy(args)
    a.dtype = {torch.float64: "float64", torch.float32: "float32"}[dtype]
    ref = finish_model(ref.to(dtype), a).eval()
    mine = copy.deepcopy(ref)
    window = getattr(cfg, "sliding_window", None) or 0
    S = min(args.length, max(64, window + 16) if window and window < args.length else 64)
    ids = torch.randint(0, cfg.vocab_size, (2, S), generator=torch.Generator().manual_seed(1))
    family = type(ref).__name__
    want, got = [], []
    order, hooks = _record(ref, want)
    _, hooks2 = _record(mine, got)
    try:
        with torch.no_grad():
            logits_ref = ref(input_ids=ids).logits
            fn = build(mine, a)
            logits = fn(ids)
    except Exception as e:   # (a re-implementation that cannot run the family at all)
        return (f"{what} cannot run {family} (self-check on a {cfg.num_hidden_layers}-layer "
                f"copy of the config: {type(e).__name__}: {str(e).splitlines()[0][:120]})")
    finally:
        for h in hooks + hooks2:
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
    key = (args.model, args.attn, args.length, what)
    if key not in _DONE:
        t0 = time.perf_counter()
        _DONE[key] = compare(config, args, what, build)
        if rank == 0 and _DONE[key] is None:
            print(f"self-check: {what} equals {config.model_type}'s own forward "
                  f"({time.perf_counter() - t0:.2f} s; --skip-self-check skips it)", flush=True)
    if _DONE[key]:
        raise ConfigError(_DONE[key])
