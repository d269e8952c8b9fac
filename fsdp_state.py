"""fsdp_state.py: fsdp.py's shards seen whole, around the training loop: clipping by the
global norm, full tensors and state dicts, the full parameters for a read.

The shards are fsdp.py's: each unit (fsdp.FSDPUnit, on a module as `_fsdp`) holds its
parameters (fsdp.ShardedParam: `sharded`, this rank's dim-0 rows; `unsharded`, the full compute
copy while gathered). fsdp.py imports these functions into its own namespace (fsdp.full_state_dict
...); this file imports nothing from it.

    torch.nn.utils.clip_grad_norm_ on shards would clip each rank by its own shards' norm:
    clip_grad_norm_(model, c) sums the squared norms over the shard group first (8 bytes).
    full_tensors(model) / full_state_dict(model): one all-gather per unit, every rank gets all.
    load_full_state_dict(model, sd): each rank copies its rows, no communication.
    hsdp_groups(R), block_groups, new_block_groups: HSDP's shard and replicate groups.
    MixedPrecisionPolicy, FSDPModule (the methods a wrapped module gains), and the check that
    refuses a matrix optimizer over shards: what fully_shard hands the user (fsdp.py re-exports).
"""
import contextlib
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils._pytree import tree_map

import ddp
import zero
from harness import all_reduce_flat, name_group
from harness.collectives import clip_by_norm


def units(model: nn.Module) -> list:
    """The units (fsdp.FSDPUnit) inside `model`, in module order (the same on every rank)."""
    return [m._fsdp for m in model.modules() if hasattr(m, "_fsdp")]


def clip_grad_norm_(model: nn.Module, max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ for a sharded model, its one collective in view (torch's
    own reaches the same norm through the DTensor shards, but not with ignored parameters): the
    squared norm of the shards summed over the shard group (one 8-byte all_reduce) plus the
    ignored parameters' (whole on every rank, counted once); returns the total norm (a device
    tensor, no host read)."""
    us = units(model)
    sharded = [p.grad_shard for u in us for p in u.params if p.sharded.grad is not None]
    whole = [p.grad for u in us for p in u.ignored if p.grad is not None]
    device = next(t.device for u in us for t in [p.full for p in u.params] + u.ignored)
    sq = torch.zeros(1, dtype=torch.float64, device=device)
    for g in sharded:
        sq += g.double().pow(2).sum()
    dist.all_reduce(sq, group=us[0].group)   # [1] float64, summed over the shard group
    for g in whole:
        sq += g.double().pow(2).sum()
    return clip_by_norm(sq, sharded + whole, max_norm)


def named_params(model: nn.Module) -> dict:
    """{name: ShardedParam, or the parameter itself when it is kept whole}, as
    model.named_parameters() names them between steps, whether or not a unit is gathered."""
    out, seen = {}, set()
    for mname, m in model.named_modules():
        for attr, p in m._parameters.items():
            p = getattr(p, "_fsdp_param", p)
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                out[f"{mname}.{attr}" if mname else attr] = p
    return out


def full_tensors(model: nn.Module, what: str = "param") -> dict[str, torch.Tensor]:
    """{name: full parameter (or gradient)} in the shards' dtype, on every rank (collective: one
    all-gather per unit). A gradient that is None reads as zeros."""
    full_of = {}
    for u in units(model):
        if u.params:
            dtype = u.params[0].sharded.dtype
            flat, _, _ = u.all_gather([p.sharded if what == "param" else p.sharded.grad
                                       for p in u.params], dtype, async_op=False)
            pieces = flat.view(dtype).view(u.world, u.shard_numel).split(   # [W, N]
                [p.padded for p in u.params], dim=1)
            for p, piece in zip(u.params, pieces):   # [W, c rest] -> the first numel
                full_of[p] = piece.reshape(-1)[:math.prod(p.shape)].view(p.shape)
    out = {}
    for name, p in named_params(model).items():
        t = full_of.get(p) if hasattr(p, "sharded") else (p if what == "param" else p.grad)
        out[name] = (t if t is not None else torch.zeros_like(p)).detach()
        q = getattr(p, "sharded", p)   # a frozen parameter without a gradient: None
        if what == "grad" and not q.requires_grad and q.grad is None:
            out[name] = None
    return out


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded state dict (full parameters in their own dtype, and the buffers), on every
    rank: save it on rank 0. model.state_dict() is the sharded one (save it per rank)."""
    sd = full_tensors(model, "param")
    sd.update({n: b.detach() for n, b in model.named_buffers()})
    return sd


@torch.no_grad()
def load_full_state_dict(model: nn.Module, sd: dict[str, torch.Tensor]):
    """Each rank copies its rows of every full parameter into its shard (no communication)."""
    for u in units(model):   # (a gathered unit's copies would be stale)
        u.reshard()
    for name, p in named_params(model).items():
        if hasattr(p, "sharded"):
            p.shard.copy_(sd[name][p.lo:p.lo + p.shard.shape[0]])
        else:
            p.copy_(sd[name])
    for name, b in model.named_buffers():
        b.copy_(sd[name])


@contextlib.contextmanager
def summon_full_params(model: nn.Module):
    """Every unit's full parameters (param_dtype copies) in the module for the body: read
    them, run a forward without gradients. Writes are not kept (the shards are the state)."""
    us = units(model)
    for u in us:
        u.unshard(cast=False)
    try:
        yield model
    finally:
        for u in us:
            u.reshard()


# -- HSDP's groups --
def block_groups(groups: list[list[int]], size: int) -> tuple[list, list]:
    """(blocks, strided): each of `groups` cut into blocks of `size` consecutive ranks, and the
    ranks at the same place in every block of a group. HSDP's shard and replicate groups here
    and in compose4d; compose4d's ep and edp groups (compose_moe.py)."""
    blocks = [g[i:i + size] for g in groups for i in range(0, len(g), size)]
    strided = [g[j::size] for g in groups for j in range(size)]
    return blocks, strided


def new_block_groups(groups: list[list[int]], size: int, names=("shard", "replicate")):
    """This rank's two groups of block_groups (collective: every rank creates every group, in
    one order), named for the meter."""
    blocks, strided = block_groups(groups, size)
    mine_b, _ = dist.new_subgroups_by_enumeration(blocks)
    mine_s, _ = dist.new_subgroups_by_enumeration(strided)
    return name_group(mine_b, names[0]), name_group(mine_s, names[1])


def hsdp_groups(replicas: int):
    """HSDP's two groups for this rank (collective). Shard groups are S = W / R consecutive
    ranks (a node's GPUs when S is the GPUs per node); replicate groups are the ranks with the
    same index in each shard group:
        shard      [0 .. S-1], [S .. 2S-1], ...     reduce-scatter and all-gather inside
        replicate  [i, S + i, 2S + i, ...]          one all-reduce of each reduced shard
    Returns (shard group, replicate group), named "shard" and "replicate" for the meter."""
    W = dist.get_world_size()
    return new_block_groups([list(range(W))], W // replicas)


def all_reduce_ignored(unit):
    """A unit's (an fsdp.FSDPUnit) parameters kept whole (ignored_params): their
    gradients averaged over every rank, as DDP does (a missing one as zeros, so every rank
    reduces the same buffer)."""
    ps = [p for p in unit.ignored if p.requires_grad]
    for p in ps:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in ps]
    for g in grads:   # averaged first: fp16's range
        g.div_(unit.world * unit.replicas)
    for group in (unit.group, unit.replicate) if unit.replicate is not None else (unit.group,):
        all_reduce_flat(grads, group)                      # one flat [sum of numels] each


def claim(module, ignored_params, mp, group) -> tuple[dict, list, list]:
    """fully_shard's bookkeeping before it shards: (slots: id(parameter) -> (parameter,
    [(module, attr)]) in module order, the parameters this call shards, the ignored ones it
    keeps whole), refusing in one line what it cannot shard (a tie to an inner call's shard, a
    0-dimensional parameter, mixed dtypes without param_dtype, a parameter off the device)."""
    slots: dict = {}   # id(parameter) -> (parameter, [(module, attr)]), in module order
    for m in module.modules():
        for attr, p in m._parameters.items():
            if p is not None:
                slots.setdefault(id(p), (p, []))[1].append((m, attr))
    ignored = {id(p) for p in ignored_params or ()}
    mine, new_ignored = [], []
    for p, holders in slots.values():
        if getattr(p, "_fsdp_claimed", False):   # an inner call sharded it: a tie across units
            m, attr = holders[0]
            raise ValueError(f"fully_shard: {type(m).__name__}.{attr} is tied to a parameter an "
                             f"inner fully_shard call already sharded; wrap the modules that "
                             f"share it in one call")
        if id(p) in ignored and not hasattr(p, "_fsdp_ignored"):
            new_ignored.append(p)
        elif not hasattr(p, "_fsdp_param") and not hasattr(p, "_fsdp_ignored"):
            mine.append(p)   # (ignored by an inner call: ignored here too)
    ddp.check_devices([(f"parameter of shape {tuple(p.shape)}", p) for p in mine], group,
                      "fully_shard")
    if any(p.dim() == 0 for p in mine):
        raise ValueError("fully_shard: a 0-dimensional parameter has no dim 0 to shard; pass it "
                         "in ignored_params")
    if mp.param_dtype is None and len({p.dtype for p in mine}) > 1:
        raise ValueError(f"fully_shard: the unit mixes parameter dtypes "
                         f"{sorted({str(p.dtype) for p in mine})}; one all-gather carries one "
                         f"dtype: set mp_policy's param_dtype or cast the module")
    return slots, mine, new_ignored


# ----------------------------------------------------------------------------------------------
# What fully_shard gives the user: the policy, the module's methods, the optimizer check
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """FSDP2's policy. param_dtype: the gathered compute copies' (None: the parameters' own);
    reduce_dtype: the reduce-scatter's (None: param_dtype's); output_dtype: the unit's floating
    outputs are cast to it (None: left as computed); cast_forward_inputs: the unit's floating
    inputs are cast to param_dtype."""
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


_CLASSES: dict = {}


def as_fsdp_module(module: nn.Module, unit) -> None:
    """fully_shard's last act: `module`'s class becomes FSDP<its class>, with FSDPModule's
    methods (as FSDP2 swaps it), and the module keeps its unit."""
    cls = type(module)
    if not isinstance(module, FSDPModule):
        if cls not in _CLASSES:
            _CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
        module.__class__ = _CLASSES[cls]
    module._fsdp = unit


def refuse_late_gradients(u) -> None:
    """A unit's full parameters hold no gradient once its post-backward has run: one that
    did arrive later was used outside the module it was sharded with."""
    late = [p for p in u.params if p.unsharded.grad is not None]
    if late:
        raise RuntimeError(f"fully_shard: a gradient of a {tuple(late[0].shape)} parameter "
                           f"arrived after its unit's backward had finished; is it used outside "
                           f"the module it was sharded with?")


class FSDPModule:
    """Mixed into each module fully_shard wraps (as FSDP2's FSDPModule): the methods a user
    calls on it."""

    def unshard(self):
        """Gather this unit's full parameters (not its children's) until reshard()."""
        self._fsdp.unshard(cast=False)

    def reshard(self):
        self._fsdp.reshard()

    def set_requires_gradient_sync(self, requires: bool, recurse: bool = True):
        """False: the following backwards accumulate unreduced gradients; the first backward
        with True reduces them with its own (gradient accumulation with one reduction)."""
        for m in (self.modules() if recurse else [self]):
            if isinstance(m, FSDPModule):
                m._fsdp.sync = requires

    @contextlib.contextmanager
    def no_sync(self):
        self.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.set_requires_gradient_sync(True)


def _cast(tree, dtype):
    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor)
                    and t.is_floating_point() else t, tree)


# -- a matrix optimizer over shards would be silently wrong: refuse it --
_HOOK = []


def refuse_matrix_optimizers():
    if not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(_check_optimizer))


def _check_optimizer(optimizer, args, kwargs):
    n = len(optimizer.param_groups)   # (checked again after an add_param_group)
    if isinstance(optimizer, zero.ELEMENTWISE) or getattr(optimizer, "_fsdp_checked", 0) == n \
            or getattr(optimizer, "shard_aware", False):   # (muon.build's: whole matrices)
        return
    for g in optimizer.param_groups:
        for p in g["params"]:
            sp = getattr(p, "_fsdp_param", None)
            if sp is not None and sp.sharded._fsdp_unit.world > 1:
                raise ValueError(
                    f"fsdp: {type(optimizer).__name__} would update a shard of a "
                    f"{tuple(sp.shape)} parameter as if it were the whole tensor (it is not "
                    f"known to update elementwise); use one of "
                    f"{', '.join(c.__name__ for c in zero.ELEMENTWISE)}, or keep such "
                    f"parameters whole with fully_shard(..., ignored_params=...)")
    optimizer._fsdp_checked = n


# ----------------------------------------------------------------------------------------------
# Formulas (rig/fsdp.py counts with this; fsdp.collectives_per_unit)
# ----------------------------------------------------------------------------------------------
def collectives_per_unit(reshard_after_forward: bool, micro_batches: int) -> tuple[int, int]:
    """(reduce-scatters, all-gathers) of one unit per optimizer step of M micro-batches, the
    gradient sync off on all but the last (zero.collectives_per_unit's order): one
    reduce-scatter, in the last backward; a gather before every forward and, resharded after
    it, again before every backward."""
    return 1, micro_batches * (1 + int(reshard_after_forward))
