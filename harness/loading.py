"""loading.py: each rank reads only its own shard of an HF checkpoint.

Building the whole model and slicing it costs every rank the full model (twice, with the
float32 load before the cast): 14 GB per rank for a 135M-parameter model in float64 under pp.py.
Instead:

    model = meta_model(config, args)            # the architecture, no storage (meta device)
    ... tp.parallelize / pp.Pipeline on it ...   # slicing and dropping meta tensors is free
    load_shards(model, args.model, device, ranges)

`load_shards` allocates the parameters this rank kept (`materialize`), then fills each from the
checkpoint's safetensors with `safe_open(...).get_slice`, reading only the range this rank
holds (`ranges(name, full_shape) -> (dim, start, stop)`, tp.TensorParallel.local_range), one
tensor at a time. The peak during the load is this rank's shard plus one slice in flight.
Non-persistent buffers (the rotary inverse frequencies) are recomputed on the device.

Measured with Linux's peak resident set (VmHWM, reset by `rss_reset` through
/proc/self/clear_refs) minus the resident set before (`rss_now`); scripts/load_memory.py.
"""
from __future__ import annotations

import copy
import json
import os

import torch

from .models import ConfigError, DTYPES, finish_model, model_kwargs, parts



def tied_source(model) -> dict[str, str]:
    """{the head's weight name: the embedding's} when they are tied (a checkpoint of a tied
    model may hold the embedding only), else {}: HF's own map (_tied_weights_keys), which a
    pipeline stage that dropped the embedding keeps."""
    keys = getattr(model, "_tied_weights_keys", None)
    if not getattr(model.config, "tie_word_embeddings", False) or not isinstance(keys, dict):
        return {}
    return dict(keys)


def meta_model(config, args) -> torch.nn.Module:
    """The model in args.dtype on the meta device: shapes and structure, no storage. It gets a
    copy of `config`: strategies edit their model's config (cp_ring installs its attention
    there), and from_config would share the caller's object."""
    from transformers import AutoModelForCausalLM
    config = copy.deepcopy(config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, **model_kwargs(config, args.attn))
    model = finish_model(model.to(DTYPES[args.dtype]), args)
    if getattr(args, "lora", 0):   # peft's layers, on the meta device too (load_shards fills)
        from .lora_setup import wrap
        wrap(model, args)
    return model


def checkpoint_files(directory: str) -> dict[str, str]:
    """tensor name -> safetensors file, from model.safetensors or its index (sharded)."""
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            wmap = json.load(f)["weight_map"]
        return {n: os.path.join(directory, fn) for n, fn in wmap.items()}
    single = os.path.join(directory, "model.safetensors")
    if not os.path.isfile(single):
        raise ConfigError(f"--model {directory}: no model.safetensors (or its index); "
                          f"shard-by-shard loading reads safetensors only (use --load full)")
    return {n: single for n in SafetensorsFile(single).header}


def has_safetensors(directory: str) -> bool:
    return os.path.isdir(directory) and (
        os.path.isfile(os.path.join(directory, "model.safetensors"))
        or os.path.isfile(os.path.join(directory, "model.safetensors.index.json")))


ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16,
             "F16": torch.float16, "I64": torch.int64, "I32": torch.int32, "U8": torch.uint8}


class SafetensorsFile:
    """A safetensors file read with plain positioned reads (os.preadv into the destination
    tensor's memory), not a memory map: mapped pages a slice touches stay in the process's
    resident set, so a mapped load looks twice its size, and a column slice maps every row.
    Format: an 8-byte little-endian header length N, N bytes of JSON {name: {dtype, shape,
    data_offsets: [begin, end]}}, then the data (row-major)."""

    def __init__(self, path: str):
        self.path = path
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            self.header = json.loads(f.read(n))
        self.header.pop("__metadata__", None)
        self.base = 8 + n

    def shape(self, name: str) -> list[int]:
        return self.header[name]["shape"]

    def read(self, name: str, r=None) -> torch.Tensor:
        """The tensor, or its range r = (dim, start, stop) along one dimension; rows past the
        end (the vocabulary padding) are zeros."""
        info = self.header[name]
        shape, dtype = info["shape"], ST_DTYPES[info["dtype"]]
        if r is None:
            r = (0, 0, shape[0]) if shape else None
        if r is None:                                   # a scalar
            out = torch.empty((), dtype=dtype)
            self._pread(out, info["data_offsets"][0])
            return out
        d, a, b = r
        out_shape = [b - a if i == d else n for i, n in enumerate(shape)]
        out = torch.zeros(out_shape, dtype=dtype)
        stop = max(a, min(b, shape[d]))
        if stop == a:
            return out
        esz = out.element_size()
        outer = 1
        for n in shape[:d]:
            outer *= n
        inner = esz
        for n in shape[d + 1:]:
            inner *= n
        # each of the `outer` blocks holds shape[d] runs of `inner` bytes; ours: runs a..stop
        view = out.view(outer, b - a, inner // esz)
        start = self.base + info["data_offsets"][0]
        with open(self.path, "rb", buffering=0) as f:
            for o in range(outer):
                dst = view[o, :stop - a]
                self._pread(dst, start + (o * shape[d] + a) * inner, f)
        return out

    def _pread(self, t: torch.Tensor, offset: int, f=None):
        buf = memoryview(t.view(torch.uint8).numpy()).cast("B") if t.dim() else \
            memoryview(t.reshape(1).view(torch.uint8).numpy()).cast("B")
        if f is None:
            with open(self.path, "rb", buffering=0) as g:
                return self._pread(t, offset, g)
        fd, got = f.fileno(), 0
        while got < len(buf):
            k = os.preadv(fd, [buf[got:]], offset + got)
            if k <= 0:
                raise OSError(f"{self.path}: short read")
            got += k


def load_shards(model: torch.nn.Module, directory: str, device,
                ranges=lambda name, shape: None, args=None) -> dict:
    """Allocate the parameters `model` (on the meta device) still has on `device` and fill each
    with its range of the checkpoint tensor of the same name (the tied head from the embedding
    when the file has no head), one tensor at a time. `ranges(name, shape)`: None (all of it),
    (dim, start, stop), or a list of those to concatenate (tp.TensorParallel.local_range).
    peft's LoRA layers (--lora, `args`): `q_proj.base_layer.weight` reads the file's
    `q_proj.weight`, and each adapter, which no base checkpoint holds, is drawn whole
    (lora_setup.adapter_init) and cut the same way. Returns counts for the log."""
    from .lora_setup import ADAPTERS, adapter_init, adapter_shape, base_name  # (peft's names)
    files = checkpoint_files(directory)
    materialize(model, device)
    opened: dict[str, SafetensorsFile] = {}
    tied = tied_source(model)
    loaded = nbytes = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            layer, part = base_name(name)
            hf = name.replace(".base_layer.", ".") if part == "base_layer" else name
            if part in ADAPTERS:                  # an adapter: over its base's full shape
                hf = f"{layer}.weight"
            src = hf if hf in files else tied.get(hf)
            if src not in files:
                raise ConfigError(f"--model {directory}: the checkpoint has no tensor {hf}")
            st = opened.setdefault(files[src], SafetensorsFile(files[src]))
            if part in ADAPTERS:
                whole = adapter_init(name, adapter_shape(part, st.shape(src), p.shape), args)
                t = cut(whole, ranges(name, list(whole.shape))).to(p.dtype)
            else:
                r = ranges(name, st.shape(src))
                if isinstance(r, list):   # a fused projection (Phi3's qkv_proj): each segment's
                    t = torch.cat([st.read(src, x) for x in r], dim=r[0][0])   # range, joined
                else:
                    t = st.read(src, r)
            if tuple(t.shape) != tuple(p.shape):
                raise ConfigError(f"--model {directory}: {name} has shape {st.shape(src)} in "
                                  f"the checkpoint; this layout expects a {tuple(p.shape)} shard")
            p.copy_(t)
            loaded, nbytes = loaded + 1, nbytes + p.numel() * p.element_size()
            del t
    reinit_buffers(model, device)
    return dict(tensors=loaded, bytes=nbytes)


def cut(t: torch.Tensor, r) -> torch.Tensor:
    """The range `r` (as load_shards' ranges give it) of a tensor in memory."""
    if r is None:
        return t
    if isinstance(r, list):
        return torch.cat([t.narrow(d, a, b - a) for d, a, b in r], dim=r[0][0])
    d, a, b = r
    return t.narrow(d, a, b - a)


def materialize(model, device):
    """Uninitialised storage on `device` for every meta parameter, in place: each Parameter
    object keeps its identity (torch.utils.swap_tensors), so tied weights stay one tensor and
    the references strategies keep (tp's partial gradients, pp's stage lists) stay valid.
    (Module.to_empty makes new Parameters where the device type changes, untying them.)"""
    seen = set()
    for m in model.modules():
        for p in m._parameters.values():
            if p is None or id(p) in seen or not p.is_meta:
                continue
            seen.add(id(p))
            torch.utils.swap_tensors(p, torch.nn.Parameter(
                torch.empty_like(p, device=device), requires_grad=p.requires_grad))


def reinit_buffers(model, device):
    """Non-persistent buffers are not in a checkpoint: rebuild the rotary embedding's."""
    base = parts(model).base
    rot = getattr(base, "rotary_emb", None)
    if rot is not None:   # inverse frequencies in at least float32 (float64 in float64 runs)
        dtype = torch.promote_types(next(model.parameters()).dtype, torch.float32)
        base.rotary_emb = type(rot)(model.config).to(device=device, dtype=dtype)
    left = [n for n, b in model.named_buffers() if b.is_meta]
    if left:
        raise RuntimeError(f"buffers still on the meta device after loading: {left}")


# -- measuring the load: peak resident memory (Linux) ------------------------------------------
def _status_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def rss_reset() -> int | None:
    """Reset the peak resident set to the current one; returns the current RSS in bytes."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    kb = _status_kb("VmRSS")
    return None if kb is None else kb * 1024


def load_layout_shards(strat) -> dict:
    """compose4d's rank's shard of --model's safetensors (load_shards): its tp shard of each
    tensor (strat.tp.local_range) and, under --ep, its ep rank's experts (whole over tp); the
    report gains `grow`, the resident bytes the load added."""
    import torch.distributed as dist
    tp_range = strat.tp.local_range if strat.tp is not None else (lambda name, shape: None)

    def ranges(name, shape):
        if strat.moe and ".experts." in name:     # an expert tensor (ep_moe.is_expert)
            n, r = shape[0] // strat.args.ep, dist.get_rank(strat.groups["ep"])
            return 0, r * n, (r + 1) * n
        return tp_range(name, shape)
    before = rss_now()
    rep = load_shards(strat.model, strat.args.model, strat.env.device, ranges, strat.args)
    peak = rss_peak()     # (VmHWM: the caller resets it before the build)
    rep["grow"] = None if before is None or peak is None else peak - before
    return rep


def rss_now() -> int | None:
    kb = _status_kb("VmRSS")
    return None if kb is None else kb * 1024


def release_memory():
    """Free what Python no longer references and hand the C heap's free pages back to the OS
    (glibc's malloc_trim), so that the next model built does not add to the resident set what
    the last one freed: CPU tensors below glibc's mmap threshold live on the heap, where a
    freed float32 model's chunks are too small for the next float64 one's (measured: +0.9 GiB
    of rank 0's peak in a correctness run of a 46M-parameter model). No-op off glibc."""
    import ctypes
    import gc
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def rss_peak() -> int | None:
    """The peak resident set since the last rss_reset(), in bytes (Linux)."""
    kb = _status_kb("VmHWM")
    return None if kb is None else kb * 1024
