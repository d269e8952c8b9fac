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
    layers, norm, after = None, None, False
    n_layers = getattr(getattr(m, "config", None), "num_hidden_layers", None)
    for child in base.children():
        if layers is None and isinstance(child, torch.nn.ModuleList) and len(child) == n_layers:
            layers, after = child, True
        elif after and norm is None and "norm" in type(child).__name__.lower():
            norm = child
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


def kv_heads(config) -> int:
    """The key/value heads of a config: num_key_value_heads, or (GPT-NeoX and other
    pre-GQA families, which have no such field) one per attention head."""
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads
