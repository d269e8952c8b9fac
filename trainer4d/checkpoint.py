"""checkpoint.py: compose4d's checkpoints, layout-independent and atomic, and the HF export.

Layout-independent: the ranks with dp x cp rank 0 each write their (pp, tp) slice as
per-parameter TP-local tensors (parameters, or fp32 masters under mixed precision, and AdamW's
two moments) with the split dimension of each; a run at any other (dp, tp, pp, cp) reads all
slices, rebuilds full tensors, and slices them its own way. The data position is the number of
samples consumed (`samples`; sample i is a pure function of the seed and i), recorded with the
data's fingerprint and the sequence length.
Atomic: everything is written into DIR/.tmp-step-N, renamed to DIR/step-N, and only then does
DIR/latest (replaced with os.replace) name it, so a crash never leaves a half-written "latest".
Checked: meta.json records each file's size and BLAKE2b digest, taken by its writer from the bytes
on their way to the file (no second copy in memory); a resume verifies them (`find_checkpoint`,
each directory hashed once per process) and falls back, with one warning line naming the bad
file, to the newest step that is complete and intact; with none, one line and exit 2.
Leftover .tmp-step-N directories (a crash mid-save) are ignored and removed by the next save.
Retention: `keep` newest complete steps, older ones deleted only after a newer one is named.
`export_hf` writes the full model with save_pretrained; AutoModelForCausalLM.from_pretrained
loads it and gives the same logits. `strat` below is a compose4d.Parallel4D (passed in by the train
mode; this module does not import the trainer, so the trainer can import it).
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import time

import torch
import torch.distributed as dist

from harness import DTYPES, METER, dropout, lora_setup, resolve_attn
import ep_moe
import lora
import tp


def _tp_split(strat, name):
    return None if strat.tp is None else strat.tp.split_dim.get(name)


def _write_synced(path: str, text: str):
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def state_kinds(args) -> tuple[str, ...]:
    """The optimizer's elementwise states a checkpoint holds: AdamW's moments, and under
    --optimizer muon the Muon matrices' momentum (muon.MuonAdamW)."""
    muon = ("momentum_buffer",) if args.optimizer == "muon" else ()
    return ("exp_avg", "exp_avg_sq") + muon


def save_checkpoint(strat, root: str, step: int, extra: dict | None = None,
                    grads: bool = False, keep: int | None = None) -> str:
    """Collective. Returns the step directory. `extra` goes into meta.json (data position,
    restarts, a cut step's position); `grads`: also the reduced gradients of a cut step; `keep`:
    how many complete steps to keep (None: all)."""
    env, z, opt = strat.env, strat.zero, strat.optimizer
    t0 = time.time()
    kinds = {k: opt.shard_state(k) for k in ("param",) + state_kinds(strat.args)}
    if grads:
        kinds["grad"] = [u.grad_shard for u in z.units]
    with METER.paused():   # (--lora: the adapters' units only; the frozen base is --model's)
        local = {k: z.gather_flat(v, trained(z)) for k, v in kinds.items()}   # this stage, TP-local
        if strat.moe and dist.get_rank(strat.groups["edp"]) == 0:   # the writer's ep group:
            local = {k: ep_moe.gather_experts(v, strat.groups["ep"], to_first=True)
                     for k, v in local.items()}   # every expert on the writer, only there
    tmp, final = os.path.join(root, f".tmp-step-{step}"), os.path.join(root, f"step-{step}")
    if env.is_main:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    with METER.paused():
        dist.barrier()
    if dist.get_rank(strat.groups["dpcp"]) == 0:
        drop = "lm_head.weight" if strat.tied else None     # the tied copy: saved once, as embed
        rec = {"tp_rank": strat.me["tp"], "tp": strat.args.tp,
               "split": {n: _tp_split(strat, n) for n in local["param"] if n != drop},
               "segments": ({} if strat.tp is None else   # fused projections (Phi3)
                            {n: list(s) for n, s in strat.tp.segments.items() if n in local["param"]}),
               "tensors": {k: {n: t.detach().cpu().clone() for n, t in v.items() if n != drop}
                           for k, v in local.items()},
               # the MoE routers' selection biases (--aux-free-bias: state, not parameters)
               "buffers": {n: b.detach().cpu().clone() for n, b in strat.model.named_buffers()
                           if n.endswith(".mlp.bias")}}
        path = os.path.join(tmp, f"pp{strat.me['pp']}-tp{strat.me['tp']}.pt")
        written = _write_checked(path, rec)
    else:
        written = None
    if strat.args.test_crash_in_save:      # test hook: die mid-save, before anything is renamed
        os._exit(1)
    with METER.paused():
        dist.barrier()
    with METER.paused():
        files = [None] * env.world   # each writer's (name, size, digest), AdamW's step count
        dist.all_gather_object(files, (written, opt.steps_taken))   # (a rank may hold no AdamW)
    if env.is_main:
        adam_t, files = max(t for _, t in files), [w for w, _ in files]
        meta = dict(step=step, adam_t=adam_t, optimizer=strat.args.optimizer,
                    lora=lora_setup.recorded(strat.args),
                    layout=strat.grid.size, model=strat.args.model,
                    dtype=strat.args.dtype, vocab=strat.model.config.vocab_size,
                    seconds=time.time() - t0, **(extra or {}),
                    dropout=dropout.recorded(strat.model.config, strat.args.seed),
                    files={n: dict(size=s, blake2b=d) for n, s, d in filter(None, files)})
        _write_synced(os.path.join(tmp, "meta.json"), json.dumps(meta))
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)                               # the step is complete ...
        _write_synced(os.path.join(root, "latest.tmp"), os.path.basename(final))
        os.replace(os.path.join(root, "latest.tmp"), os.path.join(root, "latest"))  # ... named
        prune(root, keep, step)
    with METER.paused():
        dist.barrier()
    return final


class _Hashing(io.RawIOBase):
    """A write-only file that hashes and counts the bytes on their way to the real one (no
    second copy of a shard in memory)."""

    def __init__(self, f):
        self.f, self.size, self.h = f, 0, hashlib.blake2b(digest_size=16)

    def writable(self):
        return True

    def write(self, b):
        self.h.update(b)
        self.size += len(b)
        return self.f.write(b)


def _write_checked(path: str, rec: dict) -> tuple[str, int, str]:
    """torch.save `rec` to `path`, synced; (file name, size, BLAKE2b digest of the bytes)."""
    with open(path, "wb") as f:
        out = _Hashing(f)
        torch.save(rec, out)
        f.flush()
        os.fsync(f.fileno())
    return os.path.basename(path), out.size, out.h.hexdigest()


def _steps(root: str) -> list[int]:
    """The complete step directories under root (renamed from .tmp), newest first."""
    found = [re.fullmatch(r"step-(\d+)", n) for n in (os.listdir(root) if os.path.isdir(root)
                                                       else [])]
    return sorted((int(m.group(1)) for m in found if m), reverse=True)


def prune(root: str, keep: int | None, step: int):
    """Called by rank 0 once `latest` names step-`step`, the one just saved: delete leftover
    .tmp-step-N directories and, with `keep`, all but the `keep` newest complete steps up to
    this one. Steps numbered above it belong to a timeline this run abandoned (it resumed from
    an older step because they were damaged) and never count as newer; the step `latest` names
    is never deleted."""
    for n in os.listdir(root):
        if n.startswith(".tmp-step-"):
            shutil.rmtree(os.path.join(root, n), ignore_errors=True)
    if keep:
        ours = [s for s in _steps(root) if s <= step]
        for s in [s for s in _steps(root) if s > step] + ours[keep:]:
            if s != step:
                shutil.rmtree(os.path.join(root, f"step-{s}"), ignore_errors=True)


_VERIFIED: dict = {}   # (directory, its files' sizes and times) -> verify's answer


def verify(d: str) -> str | None:
    """None when step directory `d` is complete and intact, else why not (one line). Each
    process hashes a directory once (the configuration check, the load and the elastic planner
    all ask); a file changed since is a new question."""
    try:
        key = (os.path.realpath(d), tuple(sorted(
            (e.name, e.stat().st_size, e.stat().st_mtime_ns) for e in os.scandir(d))))
    except FileNotFoundError:
        key = None
    if key is None or key not in _VERIFIED:
        why = _verify(d)
        if key is None:
            return why
        _VERIFIED[key] = why
    return _VERIFIED[key]


def _verify(d: str) -> str | None:
    name = os.path.basename(d)
    try:
        with open(os.path.join(d, "meta.json")) as f:
            meta = json.load(f)
    except FileNotFoundError:
        return f"{name}/meta.json is missing"
    except ValueError:
        return f"{name}/meta.json is not valid JSON"
    for fn, want in meta.get("files", {}).items():
        path = os.path.join(d, fn)
        if not os.path.isfile(path):
            return f"{name}/{fn} is missing"
        size = os.path.getsize(path)
        if size != want["size"]:
            return f"{name}/{fn} has {size:,} bytes, meta.json recorded {want['size']:,}"
        h = hashlib.blake2b(digest_size=16)
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
        if h.hexdigest() != want["blake2b"]:
            return f"{name}/{fn} does not match its checksum (altered after it was written)"
    return None


def find_checkpoint(root: str | None) -> tuple[str | None, list[str]]:
    """(the step directory to resume from, the problems found on the way): the one `latest`
    names when it is intact, otherwise the newest intact complete step. (None, [...]) when a
    checkpoint exists but none is intact; (None, []) when there is none. Every rank reads the
    same files, so every rank decides the same."""
    if not root or not os.path.isdir(root):
        return None, []
    named = None
    if os.path.isfile(os.path.join(root, "latest")):
        with open(os.path.join(root, "latest")) as f:
            named = f.read().strip()
    order = ([named] if named else []) + [f"step-{s}" for s in _steps(root)
                                          if f"step-{s}" != named]
    problems = []
    for n in order:
        d = os.path.join(root, n)
        why = verify(d) if os.path.isdir(d) else f"latest names {n}, which does not exist"
        if why is None:
            if not _meta(d).get("files"):   # written before checksums were recorded
                problems.append(f"{n} records no checksums (an older checkpoint): not verified")
            return d, problems
        problems.append(why)
    return None, problems


def dropout_of(d: str | None) -> dict:
    """The dropout a step directory was trained with (dropout.recorded; {}: none, or a
    checkpoint from before it was recorded)."""
    return _meta(d).get("dropout", {}) if d else {}


def _meta(d: str) -> dict:
    with open(os.path.join(d, "meta.json")) as f:
        return json.load(f)


def latest_dir(root: str | None) -> str | None:
    """The step directory to resume from (find_checkpoint), or None when there is none."""
    return find_checkpoint(root)[0]


def load_checkpoint(root: str, d: str | None = None) -> tuple[dict, dict[str, dict[str, torch.Tensor]]]:
    """(meta, {kind: {name: full tensor}}) from the step directory `d` (default: the one
    find_checkpoint picks under root), whatever layout wrote it."""
    d = d or latest_dir(root)
    with open(os.path.join(d, "meta.json")) as f:
        meta = json.load(f)
    by_stage: dict[str, list] = {}
    for fn in sorted(os.listdir(d)):
        if fn.endswith(".pt"):
            rec = torch.load(os.path.join(d, fn), weights_only=True)
            by_stage.setdefault(fn.split("-")[0], []).append(rec)
    full: dict[str, dict] = {}
    for recs in by_stage.values():
        recs.sort(key=lambda r: r["tp_rank"])
        for kind in recs[0]["tensors"]:
            for n, dim in recs[0]["split"].items():
                parts = [r["tensors"][kind][n] for r in recs]
                t = parts[0] if dim is None else tp.join_shards(
                    parts, dim, recs[0].get("segments", {}).get(n))
                if n in ("model.embed_tokens.weight", "lm_head.weight"):
                    t = t[:meta["vocab"]]             # drop the TP vocabulary padding
                full.setdefault(kind, {})[n] = t
        if recs[0].get("buffers"):   # (a MoE model's aux-free biases)
            full.setdefault("buffers", {}).update(recs[0]["buffers"])
    return meta, full


def trained(z) -> list:
    """The units a checkpoint holds: those with gradients (all of them, unless --lora freezes
    the base: its units are rebuilt from --model, not saved)."""
    return [u for u in z.units if u.n_grads]


def restore(strat, meta: dict, full: dict):
    """Parameters, the optimizer's moments (AdamW's; Muon's momentum) and step counters from
    full tensors, sliced for this layout."""
    z, opt = strat.zero, strat.optimizer

    units = trained(z)   # (--lora: the adapters'; the frozen base was built from --model)

    def local(kind):
        out = {}
        for u in units:
            for n in u.names:
                src = "model.embed_tokens.weight" if (strat.tied and n == "lm_head.weight") else n
                out[n] = strat.local(n, full[kind][src].to(u.full.device))
        return out
    with torch.no_grad():
        # "param" holds the fp32 masters in a mixed-precision run: restored as they were saved,
        # and the parameter shards rounded from them as the optimizer step rounds them
        saved = z.flat_shards(local("param"), units)
        for u, m, new in zip(z.units, opt.masters, saved):
            if new is not None:
                u.shard.copy_(new)
                if m is not u.shard:
                    m.copy_(new)
        for kind in state_kinds(strat.args):   # (Muon's state in its groups, AdamW's in theirs)
            muon_state = kind == "momentum_buffer"
            opt.load_shard_state(kind, z.flat_shards(local(kind), units),
                                 where=lambda group: bool(group.get("muon")) == muon_state)
        for n, b in strat.model.named_buffers():   # (the MoE routers' selection biases)
            if n in full.get("buffers", {}):
                b.copy_(full["buffers"][n])
    if z.stage < 3:   # (stage 3 gathers the shards where they are used)
        with METER.paused():
            z.all_gather_params()
    opt.steps_taken, strat.t = meta["adam_t"], meta["step"]


def lora_config(strat):
    """peft's LoraConfig of a --lora run (None without adapters)."""
    return getattr(strat.model, "peft_config", {}).get("default")


def hf_config(strat):
    """The run's model config with HF's own attention (not the strategy's), for a plain model."""
    cfg = strat.model.config
    attn, _ = resolve_attn(cfg, "auto")
    return type(cfg).from_dict({**cfg.to_dict(), "_attn_implementation": attn})


def hf_model(strat, full: dict[str, torch.Tensor]):
    """A plain HF model (CPU, the run's dtype, HF's own modules) holding the full tensors (a
    --lora run's adapters merged into their bases: lora.merged)."""
    from transformers import AutoModelForCausalLM
    lc = lora_config(strat)
    if lc is not None:
        full = lora.merged(full, lc.lora_alpha / lc.r)
    model = AutoModelForCausalLM.from_config(hf_config(strat))
    model.to(DTYPES[strat.args.dtype])            # saved in the run's dtype
    missing, unexpected = model.load_state_dict({n: t.cpu() for n, t in full.items()},
                                                strict=False)
    assert not unexpected and all(m == "lm_head.weight" for m in missing), (missing, unexpected)
    return model.eval()


def export_hf(strat, out: str, tokenizer: str | None = None,
              full: dict[str, torch.Tensor] | None = None):
    """Collective (unless `full`, the gathered tensors, is given): the full trained model as an
    HF model directory, with the tokenizer's files when there is one (rank 0 writes). A --lora
    run writes `out`/merged (the adapters merged: an HF model directory) and `out`/adapter
    (peft's adapter directory over the base), lora.export's pair."""
    full = strat.full_params() if full is None else full
    if strat.env.is_main:
        tmp = out.rstrip("/") + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        lc = lora_config(strat)
        if lc is not None:
            lora.export({n: t.cpu() for n, t in full.items()}, hf_config(strat), lc, tmp)
        else:
            hf_model(strat, full).save_pretrained(tmp)
        if tokenizer:
            from transformers import AutoTokenizer
            AutoTokenizer.from_pretrained(tokenizer).save_pretrained(
                os.path.join(tmp, "merged") if lc is not None else tmp)
        shutil.rmtree(out, ignore_errors=True)
        os.rename(tmp, out)
    with METER.paused():
        dist.barrier()
