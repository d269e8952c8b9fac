"""anatomy.py: the parts of any HF causal LM (embedding, decoder layers, final norm, head) found
through HF's own accessors, so the harness and the strategies that need no knowledge of the
architecture run on every family, whatever it names its modules."""
from __future__ import annotations

import types

import torch


def parts(model) -> types.SimpleNamespace:
    """The parts of an HF causal LM (or a wrapper holding one at .module) that the harness and
    the strategies name, found through HF's own accessors rather than Llama's attribute names
    (GPT-NeoX has gpt_neox.layers, embed_in, final_layer_norm, embed_out):
      base    the decoder, model.base_model (model.model, model.gpt_neox, ...)
      embed   model.get_input_embeddings()
      head    model.get_output_embeddings() (None: the model has no separate head)
      layers  the decoder's nn.ModuleList of config.num_hidden_layers blocks (a pipeline stage
              keeps nn.Identity where it dropped one)
      norm    the final norm: the decoder's norm module registered after its layers (None
              where there is none)
      tied    the head's weight is the embedding's
      names   {"embed"|"head"|"norm"|"layers"|"base": the part's qualified module name}
    A part that cannot be found is None: a caller that needs it says so in one line."""
    m = getattr(model, "module", model)
    base = getattr(m, "base_model", m)
    get = lambda f: (getattr(m, f)() if hasattr(m, f) else None)   # noqa: E731
    embed, head = get("get_input_embeddings"), get("get_output_embeddings")
    # the layers: the shallowest list of num_hidden_layers blocks (OPT's sit one level down,
    # at model.decoder.layers); the final norm: a norm beside them, the one registered after
    # them, or the only one (OPT registers its final_layer_norm before its layers)
    n_layers = getattr(getattr(m, "config", None), "num_hidden_layers", None)
    lists = [(name.count("."), name, mod) for name, mod in base.named_modules()
             if isinstance(mod, torch.nn.ModuleList) and len(mod) == n_layers]
    layers, norm = None, None
    if lists:
        _, name, layers = min(lists, key=lambda x: x[0])
        parent = base.get_submodule(name.rpartition(".")[0]) if "." in name else base
        kids = list(parent.children())
        norms = [c for c in kids if "norm" in type(c).__name__.lower()]
        after = [c for c in kids[kids.index(layers) + 1:] if c in norms]
        norm = after[0] if after else norms[0] if len(norms) == 1 else None
    # tied: the head's weight is the embedding's (0: a default no weight is)
    tied = (head is not None and embed is not None
            and getattr(head, "weight", None) is getattr(embed, "weight", 0))
    found = dict(base=base, embed=embed, head=head, layers=layers, norm=norm)
    where = {id(mod): n for n, mod in m.named_modules(remove_duplicate=False)}
    names = {k: where[id(v)] for k, v in found.items() if v is not None and id(v) in where}
    return types.SimpleNamespace(**found, tied=tied, names=names)


def set_part(model, name: str, module) -> None:
    """Replace the submodule at qualified name `name` (parts().names) by `module` (None drops
    it: a pipeline stage that does not run it)."""
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, module)


def attention_of(layer) -> torch.nn.Module | None:
    """A decoder layer's attention module (Llama's self_attn, GPT-NeoX's attention): the child
    whose class name ends in Attention."""
    return next((c for c in layer.children() if type(c).__name__.endswith("Attention")), None)


def mlp_width(config) -> int:
    """The MLP's inner width: intermediate_size (Llama's name), n_inner (GPT-2's), ffn_dim
    (OPT's), else 4 x hidden."""
    for k in ("intermediate_size", "n_inner", "ffn_dim"):
        if getattr(config, k, None):
            return getattr(config, k)
    return 4 * config.hidden_size


def kv_heads(config) -> int:
    """The key/value heads of a config: num_key_value_heads, or (GPT-NeoX and other
    pre-GQA families, which have no such field) one per attention head."""
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


# peft's LoRA layers (harness/lora_setup.py, lora.py): a target `q_proj` becomes a module holding
# `base_layer` (the frozen nn.Linear) and `lora_A.default`, `lora_B.default`
ADAPTERS = ("lora_A", "lora_B")


def base_name(name: str) -> tuple[str, str | None]:
    """(the module peft wrapped, which part) for a module or parameter name inside a LoRA layer:
    'l.q_proj.base_layer' -> ('l.q_proj', 'base_layer'); 'l.q_proj.lora_A.default' ->
    ('l.q_proj', 'lora_A'); a name outside one -> (name, None)."""
    pieces = name.split(".")
    for i, p in enumerate(pieces):
        if p in ("base_layer",) + ADAPTERS:
            return ".".join(pieces[:i]), p
    return name, None
