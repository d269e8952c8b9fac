"""tp_dtensor.py: a tensor-parallel model's parameters as DTensors, so torch's own utilities
see whole tensors (tp.parallelize labels every model it splits).

The problem: after tp.parallelize each parameter is a plain tensor holding this rank's rows or
columns. torch.nn.utils.clip_grad_norm_ then takes each rank's own norm, and
torch.distributed.checkpoint saves one rank's rows under every key as if replicated: both
silently wrong. PyTorch's DTensor TP (and FSDP2) avoid it by making every parameter a DTensor:
a local tensor plus its placement on a device mesh, from which a global norm or a chunk of the
whole tensor follows.

The design (FSDP2's, for fsdp.py's shards too): the registered nn.Parameter is a DTensor whose
local part is the shard tp.py computes with, a label only. Every collective stays explicit in
tp.py, on local tensors; none moves into DTensor's redistribution. The modules compute on
plain tensors: a forward pre-hook on each module that holds a parameter puts the local part
(`p.to_local()`, differentiable) in the module's __dict__, where attribute lookup finds it
before nn.Module's _parameters; the forward hook takes it out again. Autograd then hands each
DTensor parameter a DTensor gradient of the same placement: clip_grad_norm_ reduces the norms
over the mesh (a sharded tensor's squares summed, a replicated one counted once) and an
optimizer over model.parameters() steps the local parts.

Placements over the tp group (tp_plan.PLACEMENTS), a 1-D mesh of its T ranks:
    split along dim d (column 0, row 1, vocab 0, norm-sharded 0)    Shard(d)
    replicated, partial (their gradients summed by reduce_partial_grads)   Replicate()
With more ranks than kv heads (T = m n_kv) the kv projections hold one head on m ranks,
which no 1-D placement says: the mesh is then 2-D, (n_kv, m), rank r at (r // m, r % m), its
groups made by every rank (so the tp group must be the whole world; else refused):
    kv-copy (Shard(0), Replicate())    split (Shard(d), Shard(d))    replicated (Replicate(),)*2
What a DTensor cannot say, DCP refuses in one line (model.state_dict() raises): a fused
projection (Phi3's qkv_proj: this rank's rows of each segment, not one chunk) and a vocabulary
padded to a multiple of T (its padded rows would be saved). torch's clip is right for both
(a norm does not depend on the rows' order; the padding rows' gradients are zero).

Public API
    label(tpm)          every parameter of tpm.model a DTensor (tp.parallelize calls it)
    mesh_of(tpm)        the device mesh of the labels
    PLAIN               what model.state_dict() raises after parallelize(..., dtensor=False)
"""
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DeviceMesh, DTensor, Replicate, Shard

from harness import planted

# what model.state_dict() raises after tp.parallelize(..., dtensor=False)
PLAIN = ("tp: parallelize(..., dtensor=False) keeps plain shards, which "
         "torch.distributed.checkpoint would save as whole tensors; parallelize with "
         "dtensor=True, or save with tpm.full(...) or trainer4d's checkpoints")


def mesh_of(tpm) -> DeviceMesh:
    """1-D over the tp group; (n_kv, m) when each kv head sits on m = T / n_kv ranks. (Built
    outside any fake-tensor mode: oom_search simulates the step under one.)"""
    from torch.utils._python_dispatch import _disable_current_modes
    with _disable_current_modes():
        return _mesh(tpm)


def _mesh(tpm) -> DeviceMesh:
    group = tpm.group or dist.group.WORLD
    device = tpm.device().type
    if tpm.kv_copies == 1:
        return DeviceMesh.from_group(group, device)
    ranks = dist.get_process_group_ranks(group)
    m, n_kv = tpm.kv_copies, tpm.world // tpm.kv_copies
    grid = torch.tensor(ranks).view(n_kv, m)           # grid[i, j]: group rank i m + j
    # every rank creates every group of both dimensions, in the same order (new_group's
    # contract, which NCCL's communicator split enforces): the tp group is the whole world
    heads = [dist.new_group(grid[:, j].tolist()) for j in range(m)]
    copies = [dist.new_group(grid[i].tolist()) for i in range(n_kv)]
    return DeviceMesh.from_group([heads[tpm.rank % m], copies[tpm.rank // m]], device,
                                 mesh=grid, mesh_dim_names=("kv_head", "kv_copy"))


def placements(tpm, name: str, mesh: DeviceMesh) -> tuple[list, int | None]:
    """(the placements of parameter `name`, its split dim or None)."""
    d = tpm.split_dim.get(name)
    if name in tpm.kv_split:
        return [Shard(0), Replicate()], 0
    if d is None:
        return [Replicate()] * mesh.ndim, None
    return [Shard(d)] * mesh.ndim, d


def global_shape(tpm, name: str, local: torch.Tensor, d: int | None) -> tuple:
    shape = list(local.shape)
    if name in tpm.kv_split:
        shape[0] *= tpm.n_kv            # one kv head's rows -> every head's
    elif d is not None:
        shape[d] *= tpm.world           # (the vocabulary: its padded rows)
    return tuple(shape)


def label(tpm):
    """Replace every parameter of tpm.model by a DTensor nn.Parameter over the same storage,
    and let each module compute on the local parts (the hooks below)."""
    if planted("tp-unlabelled"):   # plant: plain shards, torch's utilities see one rank's rows
        return
    if tpm.kv_copies > 1 and tpm.world != dist.get_world_size():
        raise ValueError(f"tp.parallelize: kv heads replicated over a tp group of {tpm.world} "
                         f"inside a world of {dist.get_world_size()}: the 2-D mesh of the labels "
                         f"needs groups every rank creates; pass dtensor=False (then tpm.clip)")
    mesh = mesh_of(tpm)
    made = {}                         # id(plain parameter) -> its label (tied ones: one)
    for mname, module in tpm.model.named_modules():
        for n, p in list(module._parameters.items()):
            if p is not None and id(p) not in made:
                full = f"{mname}.{n}" if mname else n
                place, d = placements(tpm, full, mesh)
                shape = global_shape(tpm, full, p, d)
                stride = torch.empty(shape, device="meta").stride()
                made[id(p)] = nn.Parameter(
                    DTensor.from_local(p.detach(), mesh, place, shape=shape, stride=stride,
                                       run_check=False), requires_grad=p.requires_grad)
            if p is not None:
                module._parameters[n] = made[id(p)]
    for module in tpm.model.modules():
        # every parameter under the module (a module may read a child's parameter without
        # calling the child: peft's base_layer under tp's LoRA layers)
        module._tp_held = [(m, n) for m in module.modules() for n, p in m._parameters.items()
                           if p is not None]
        if module._tp_held:
            module._tp_views = []
            module.register_forward_pre_hook(_local_views)
            # always_call: a forward that raises (a recomputation torch's checkpoint stops
            # early, by raising) leaves no view behind
            always = True
            if planted("tp-views-linger"):   # plant: the views of a raising forward stay
                always = False
            module.register_forward_hook(_drop_views, always_call=always)
    tpm.mesh = mesh
    tpm.model.register_state_dict_post_hook(lambda m, sd, prefix, meta: _dcp_check(tpm))


def _local_views(module, args):
    """The module computes on the local parts of the parameters under it (differentiable: the
    gradient comes back to each DTensor parameter as a DTensor of its placement). The outermost
    module called sets them, for the whole of its forward; the ones inside find them set."""
    made = []
    for m, n in module._tp_held:
        if n not in m.__dict__:
            m.__dict__[n] = m._parameters[n].to_local()
            made.append((m, n))
    module._tp_views.append(made)


def _drop_views(module, args, out):
    for m, n in module._tp_views.pop():
        del m.__dict__[n]


def _dcp_check(tpm):
    """model.state_dict() refuses what DCP would save wrong (see the docstring)."""
    fused = sorted(n for n, _ in tpm.model.named_parameters() if n in tpm.segments)
    if fused:
        raise ValueError(f"tp: {fused[0]} is a fused projection (each rank holds its rows of "
                         f"every segment), which no DTensor placement says, so "
                         f"torch.distributed.checkpoint would save it wrong; save with "
                         f"tpm.full(...) or trainer4d's checkpoints")
    if tpm.vocab_padded != tpm.vocab:
        raise ValueError(f"tp: the vocabulary ({tpm.vocab}) is padded to {tpm.vocab_padded} "
                         f"rows for T={tpm.world}, which torch.distributed.checkpoint would "
                         f"save; save with tpm.full(...) or trainer4d's checkpoints")
