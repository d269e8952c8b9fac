"""A user's own training loop over a sharded model, with PyTorch's utilities (issue: a sharded
model keeps PyTorch's own promises), run by tests/test_torch_utils.py under torchrun:

    torch.compile(model); loss.backward(); torch.nn.utils.clip_grad_norm_(model.parameters());
    AdamW.step(); torch.distributed.checkpoint save of get_state_dict(model, opt) after step 2,
    and a load into a fresh model at another world size (1: unsharded), then steps 3 and 4.

--impl ours: fsdp.fully_shard (per decoder layer, then the root); torch: PyTorch's FSDP2
fully_shard, the same calls. ours-tp: tp.parallelize (every rank the whole batch, the
vocab-parallel loss, reduce_partial_grads after the backward); ours-sp: sp.parallelize (Megatron
SP), the same loop; torch-tp: PyTorch's DTensor TP
(parallelize_module, Megatron's plan; the layers it leaves whole, the norms, replicated as
DTensors by distribute_module, so that torch's clip sees no plain gradient).
--phase save (any W): steps 1-4, the checkpoint after step 2, and rank 0 writes the full
tensors it saved (full.pt, through DTensor.full_tensor); also the single-device run of the same
loop (reference.json). --phase load: a fresh model (other
weights) sharded over this W (W = 1: not sharded), the checkpoint loaded, every full tensor
compared with full.pt (largest absolute difference), then steps 3-4. --plant-bug NAME (save):
the loop once more from the same weights with the bug on ("planted"). Each writes
<dir>/<impl>-<phase>-W<W>.json: the global losses per step."""
import argparse
import json
import os
import sys
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict  # noqa: E402

import harness  # noqa: E402
from harness import planting  # noqa: E402

B, S, STEPS, CUT, CLIP = 4, 16, 4, 2, 0.5


def build(seed: int, impl: str, W: int, name: str = "tiny"):
    """(model, loss(model, ids) -> the mean loss over this rank's view, after_backward)."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(harness.load_config(name))   # float32
    hf = lambda m, ids: m(input_ids=ids, labels=ids).loss   # noqa: E731
    if W == 1:
        return model, hf, lambda: None
    if impl in ("ours-tp", "ours-sp"):
        import sp
        import tp
        tpm = (tp.parallelize if impl == "ours-tp" else sp.parallelize)(model)
        return (model, lambda m, ids: tpm.loss_sum(m(input_ids=ids).logits[:, :-1], ids[:, 1:])
                / ids[:, 1:].numel(), tpm.reduce_partial_grads)
    if impl == "torch-tp":
        torch_tp(model, W)
        return model, hf, lambda: None
    if impl == "ours":
        import fsdp
        shard = fsdp.fully_shard
    else:
        from torch.distributed.fsdp import fully_shard as shard
    for layer in model.model.layers:
        shard(layer)
    shard(model)
    return model, hf, lambda: None


def torch_tp(model, W: int):
    """PyTorch's DTensor TP with Megatron's plan (rig/tp.py's DTensorTP); every other module
    with parameters replicated as DTensors (distribute_module: plain in and out)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, distribute_module
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    mesh = init_device_mesh("cpu", (W,))
    plan = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Replicate())}
    for i in range(len(model.model.layers)):
        p = f"model.layers.{i}."
        plan.update({p + f"self_attn.{n}_proj": ColwiseParallel() for n in "qkv"})
        plan.update({p + f"mlp.{n}_proj": ColwiseParallel() for n in ("gate", "up")})
        plan.update({p + "self_attn.o_proj": RowwiseParallel(),
                     p + "mlp.down_proj": RowwiseParallel()})
    parallelize_module(model, mesh, plan)
    into = lambda mod, args, mesh: tuple(   # noqa: E731
        DTensor.from_local(a, mesh, [Replicate()]) if torch.is_tensor(a) else a for a in args)
    out = lambda mod, y, mesh: y.to_local()   # noqa: E731
    for name, mod in model.named_modules():
        if any(not isinstance(p, DTensor) for p in mod.parameters(recurse=False)):
            distribute_module(mod, mesh, input_fn=into, output_fn=out)


def batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, 256, (B, S), generator=g)


def steps(model, opt, first: int, last: int, W: int, r: int, impl: str, loss_of,
          after_backward) -> dict:
    """The user's loop, steps first..last-1: each rank its rows (TP: every rank the whole
    batch); the global mean loss logged."""
    fwd = torch.compile(model)
    data_parallel = W > 1 and impl in ("ours", "torch")
    out = {}
    for step in range(first, last):
        ids = batch(step).chunk(W)[r] if data_parallel else batch(step)
        loss = loss_of(fwd, ids)              # the mean over this rank's tokens
        loss.backward()
        after_backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        logged = loss.detach().clone()
        if data_parallel:
            dist.all_reduce(logged)
        out[step] = logged.item() / (W if data_parallel else 1)
    return out


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def full_state(model, opt) -> dict:
    """{key: full tensor} of the model's and optimizer's state dicts (DTensors gathered)."""
    msd, osd = get_state_dict(model, opt)
    full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t   # noqa: E731
    out = {f"model.{k}": full(v).detach().clone() for k, v in msd.items()}
    for fqn, st in osd["state"].items():
        for k, v in st.items():
            out[f"optim.{fqn}.{k}"] = full(v).detach().clone()
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--impl", required=True,
                   choices=["ours", "torch", "ours-tp", "ours-sp", "torch-tp"])
    p.add_argument("--phase", choices=["save", "load"], required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--plant-bug", default=None, help="save: the loop again with this bug")
    p.add_argument("--model", default="tiny", help="save: another model is only checked for "
                   "DCP's refusal (exit 2)")
    a = p.parse_args()
    dist.init_process_group("gloo")
    W, r = dist.get_world_size(), dist.get_rank()
    ckpt = os.path.join(a.dir, f"{a.impl}-ckpt")
    res = {}
    if a.phase == "save":
        model, loss_of, after = build(0, a.impl, W, a.model)
        opt = adamw(model)
        if a.model != "tiny":   # a model DCP cannot take: refused before anything is written
            try:
                get_state_dict(model, opt)
            except ValueError as e:   # (tp_dtensor.py's one line)
                print(e, file=sys.stderr)
                sys.exit(2)
        res["losses"] = steps(model, opt, 0, CUT, W, r, a.impl, loss_of, after)
        msd, osd = get_state_dict(model, opt)
        t0 = time.perf_counter()
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt)
        res["save_s"] = time.perf_counter() - t0
        state = full_state(model, opt)
        if r == 0:
            torch.save(state, os.path.join(a.dir, f"{a.impl}-full.pt"))
        res["losses"].update(steps(model, opt, CUT, STEPS, W, r, a.impl, loss_of, after))
        if r == 0:   # one device, the same loop, the whole batch
            ref, lo, af = build(0, a.impl, 1)
            res["reference"] = steps(ref, adamw(ref), 0, STEPS, 1, 0, a.impl, lo, af)
        if a.plant_bug:   # the loop again, the planted bug on
            with planting(a.plant_bug):
                bad, lo, af = build(0, a.impl, W)
                res["planted"] = steps(bad, adamw(bad), 0, STEPS, W, r, a.impl, lo, af)
    else:
        model, loss_of, after = build(1, a.impl, W)   # other weights: the load replaces them
        opt = adamw(model)
        msd, osd = get_state_dict(model, opt)   # (initialises the optimizer's state)
        t0 = time.perf_counter()
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=ckpt)
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
        res["load_s"] = time.perf_counter() - t0
        saved = torch.load(os.path.join(a.dir, f"{a.impl}-full.pt"))
        got = full_state(model, opt)
        res["keys_differ"] = sorted(set(saved) ^ set(got))
        res["max_abs_diff"] = max(((g.double() - saved[k].double()).abs().max().item()
                                   if g.shape == saved[k].shape else float("inf"))
                                  for k, g in got.items() if k in saved)
        res["losses"] = steps(model, opt, CUT, STEPS, W, r, a.impl, loss_of, after)
    if r == 0:
        with open(os.path.join(a.dir, f"{a.impl}-{a.phase}-W{W}.json"), "w") as f:
            json.dump(res, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
