"""lora_setup.py: `--lora R`: the run trains the HF model wrapped by peft (LoraConfig +
get_peft_model, the library users already use), on the reference and on every rank alike.

peft replaces each target nn.Linear with a `peft.tuners.lora.Linear` that holds the frozen
`base_layer` and the trainable `lora_A.default` [r, in] and `lora_B.default` [out, r]:

    y = base_layer(x) + (alpha / r) * lora_B(lora_A(dropout(x)))

so the parameters are named `...q_proj.base_layer.weight`, `...q_proj.lora_A.default.weight`,
and every parameter outside the adapters is frozen (requires_grad False). The strategy gets the
inner HF model (peft's `base_model.model`, which carries `peft_config`), so its layout code
sees an HF decoder as before; lora.py holds what a parallelism must do about the adapters.

The correctness mode initialises lora_B randomly (peft's init_lora_weights=False): peft's
default, B = 0, makes the adapters' product zero at step 0 and hides lora_A's gradient, so a bug
in it would pass the first step. The other modes use peft's default (training starts from the
base model's function). Each adapter is drawn from a generator keyed by --seed and its name
(adapter_init), as peft draws it (A ~ U(+-1/sqrt(in)), B zero or ~ U(+-1/sqrt(r))): the same on
every rank, whether the model was built whole or on the meta device and loaded shard by shard.
"""
from __future__ import annotations

import zlib

import torch

from .anatomy import ADAPTERS, base_name  # noqa: F401  (peft's names inside a LoRA layer)

# --lora-targets auto: the attention and MLP projections of the families the presets cover
# (Phi3's fused qkv_proj and gate_up_proj included); the ones the model has are targeted
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
               "qkv_proj", "gate_up_proj")


def targets(args, model) -> list[str]:
    """The module names (leaves) --lora-targets selects on `model`."""
    names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    if args.lora_targets == "auto":
        return [t for t in PROJECTIONS if t in names]
    return [t.strip() for t in args.lora_targets.split(",") if t.strip()]


def lora_config(args, model, random_b: bool):
    import peft   # (imported on use: a run without --lora does not need peft loaded)
    return peft.LoraConfig(r=args.lora, lora_alpha=alpha(args), lora_dropout=args.lora_dropout,
                           target_modules=targets(args, model), bias="none",
                           init_lora_weights=not random_b)


def alpha(args) -> float:
    """--lora-alpha, default 2 R (the scale alpha / r = 2 at every rank R)."""
    return args.lora_alpha if args.lora_alpha is not None else 2.0 * args.lora


def random_b(args) -> bool:
    return args.mode in ("correctness", "plants")


def wrap(model, args):
    """The model with peft's LoRA layers injected, in place (the inner HF model is returned:
    peft's wrapper is model.peft_config's owner, not needed to train). Adapters are made in the
    model's dtype (autocast_adapter_dtype=False: bf16 adapters keep fp32 masters in the
    optimizer like every other bf16 parameter), drawn by adapter_init; on the meta device
    (loading.meta_model) they are drawn when the shards are read (loading.load_shards)."""
    import peft
    devices = [model.device] if model.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):   # (peft's own draws, overwritten below)
        peft.get_peft_model(model, lora_config(args, model, random_b(args)),
                            autocast_adapter_dtype=False)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.requires_grad and not p.is_meta:
                p.copy_(adapter_init(n, p.shape, args))
    if args.lora_dropout > 0:
        keyed_dropout(model, args.seed)
    return model


def adapter_init(name: str, shape, args) -> torch.Tensor:
    """The full adapter `name` ([r, in] for lora_A, [out, r] for lora_B) at the start of a run,
    in float32 on the host: peft's draws (nn.Linear's kaiming_uniform(a=sqrt(5)), i.e.
    U(-1/sqrt(fan_in), 1/sqrt(fan_in)); B zero unless random_b) from a generator keyed by
    (--seed, name), so the values depend on neither the order of the draws nor the device."""
    if "lora_B" in name.split(".") and not random_b(args):
        return torch.zeros(shape)
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + zlib.crc32(name.encode()))
    bound = shape[1] ** -0.5                                   # fan_in: in (A), r (B)
    return (torch.rand(shape, generator=g, dtype=torch.float64) * 2 - 1).mul_(bound).float()


def adapter_shape(part: str, base_shape, local_shape) -> tuple[int, int]:
    """The full shape of adapter `part` ("lora_A" [r, in] or "lora_B" [out, r]) over a base
    weight of full shape [out, in], r read from this rank's piece (never split along r)."""
    if part == "lora_A":
        return local_shape[0], base_shape[1]
    return base_shape[0], local_shape[1]


def recorded(args) -> dict | None:
    """What a checkpoint records of the adapters (None without --lora): a resume must train the
    same ones over the same frozen base (resume_refusal)."""
    if not getattr(args, "lora", 0):
        return None
    return dict(r=args.lora, alpha=alpha(args), targets=args.lora_targets,
                dropout=args.lora_dropout, seed=args.seed, model=args.model,
                base=base_fingerprint(args))


def base_fingerprint(args) -> str:
    """The frozen base a LoRA checkpoint's adapters were trained on, cheaply: for a directory,
    each safetensors file's size and a BLAKE2b of its header and 16 blocks of 4 KiB spread over
    it (another checkpoint under the same path changes them); for a random init, the device
    type that drew it (the same seed draws other values on CUDA)."""
    import hashlib
    import os
    if os.path.isdir(args.model):
        h = hashlib.blake2b(digest_size=8)
        for fn in sorted(f for f in os.listdir(args.model) if f.endswith(".safetensors")):
            path = os.path.join(args.model, fn)
            size = os.path.getsize(path)
            h.update(f"{fn}:{size}".encode())
            with open(path, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                h.update(f.read(n))
                for i in range(16):
                    f.seek(8 + n + (size - 8 - n) * i // 16)
                    h.update(f.read(4096))
        return h.hexdigest()
    device = getattr(args, "device", None) or ("cuda" if torch.cuda.is_available() else "cpu")
    return f"random init on {torch.device(device).type}"


def resume_refusal(meta: dict, args) -> str | None:
    """Why `args` cannot resume the checkpoint `meta` (None: it can). A LoRA checkpoint holds
    the adapters and their optimizer state only: the frozen base is --model again (or, for a
    random init, the same --seed), and the adapters must be the same ones."""
    saved, now = meta.get("lora"), recorded(args)
    if saved == now:
        return None
    if saved is None or now is None:
        return (f"the checkpoint was saved {'with' if saved else 'without'} --lora and this run "
                f"has {'it' if now else 'none'}: a LoRA checkpoint holds the adapters only")
    diff = [f"{k} {saved.get(k)!r} (now {now[k]!r})" if k != "base" else
            "another base under --model (its fingerprint differs)"
            for k in now if saved.get(k) != now[k]]
    return (f"the checkpoint's adapters were trained with {', '.join(diff)}: a LoRA checkpoint "
            f"holds the adapters only, over the same base (--model, --seed) and --lora options")


LORA_SITE = 1000   # the adapters' dropout sites: LORA_SITE + the target's index in its layer


def keyed_dropout(model, seed: int):
    """peft's lora_dropout modules (torch's masks) become harness.dropout.InputDropout: masks
    keyed by (seed, step, layer, site, sample, position, feature), the same at every layout."""
    from .anatomy import parts
    from .dropout import InputDropout
    for i, layer in enumerate(parts(model).layers):
        site = LORA_SITE
        for _, m in layer.named_modules():
            for a, d in list(getattr(m, "lora_dropout", {}).items()):
                if isinstance(d, torch.nn.Dropout):
                    m.lora_dropout[a] = InputDropout(d.p, seed, i, site)
                    site += 1


def constraints(args, config) -> list[str]:
    """The --lora options' own refusals (one line each), checked on a meta-device model before
    any process group exists: the targets must name modules the model has and peft can wrap."""
    if not getattr(args, "lora", 0):
        return []
    if args.lora < 0:
        return [f"--lora {args.lora}: the adapters' rank must be >= 1 (0: no LoRA)"]
    if not 0.0 <= args.lora_dropout < 1.0:
        return [f"--lora-dropout {args.lora_dropout}: must be in [0, 1)"]
    if args.optimizer != "adamw":
        return [f"--optimizer {args.optimizer} with --lora: the adapters train with AdamW"]
    if args.lora_dropout > 0 and args.mode in ("benchmark", "peak", "all"):
        return [f"--mode {args.mode} with --lora-dropout: the benchmark's communication and "
                f"memory formulas are for the adapters without dropout (its masks and dropped "
                f"copies are kept whole-sequence inside a Megatron-SP region)"]
    import copy

    import peft
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config))
    wanted = targets(args, model)
    if not wanted:
        return ["--lora: the model has none of the projections --lora-targets auto looks for "
                f"({', '.join(PROJECTIONS)}); name the targets with --lora-targets"]
    try:
        peft.get_peft_model(model, lora_config(args, model, True))
    except Exception as e:   # peft's own refusal (no such module; a module it cannot wrap)
        return [f"--lora-targets {','.join(wanted)}: peft refuses it: {e}"]
    return []


def no_grad_inputs(model) -> int:
    """How many of TP's regions (attention, then MLP, layer by layer) take an input that carries
    no gradient: none when something before the first layer trains (the embedding); else the
    regions up to and including the first that holds a trainable parameter (its norm or its
    projections). LoRA freezes the embedding: the first region's f (TP), and SP's split, entry
    and exits before it, then have no backward to run (tp.region_all_reduces,
    sp.region_collectives)."""
    from .anatomy import parts
    p = parts(model)
    if p.embed is None or any(q.requires_grad for q in p.embed.parameters()):
        return 0
    n = 0
    for layer in p.layers or []:
        names = [x for x, q in layer.named_parameters() if q.requires_grad]
        for attn in (True, False):   # (attention: its input norm and self_attn's projections)
            n += 1
            if any(x.startswith(("input_layernorm", "self_attn")) == attn for x in names):
                return n
    return n


COLUMN_BY_REGION = (("q_proj", "k_proj", "v_proj", "qkv_proj"), ("gate_proj", "up_proj",
                                                                 "gate_up_proj"))


def regathered_regions(model, last: bool = True) -> int:
    """Megatron SP's regions whose input is kept for the backward (and re-gathered there):
    those where a trainable weight reads it (attention's q/k/v, the MLP's gate/up, the head).
    Every one (2L + 1) when the whole model trains; under LoRA the targeted ones."""
    from .anatomy import parts
    p = parts(model)
    n = 0
    for layer in p.layers or []:
        names = [n for n, q in layer.named_parameters() if q.requires_grad]
        n += sum(any(c in x.split(".") for x in names for c in cols) for cols in COLUMN_BY_REGION)
    return n + int(last and p.head is not None and p.head.weight.requires_grad)
