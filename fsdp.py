"""fsdp.py: fully sharded data parallel as PyTorch's FSDP2 does it, from raw torch.distributed.

The idea (Zhao et al., "PyTorch FSDP", VLDB 2023; FSDP2's per-parameter sharding, PyTorch 2.4+)
    Every rank keeps 1/W of every parameter, gradient and optimizer state. Each module wrapped by
    fully_shard (bottom-up: blocks, then the model) is one unit whose full parameters exist only
    while it computes; the root (the model: its forward runs first) stays gathered from its
    forward to the end of the backward. Every rank runs the same units in the same order.
      forward   pre-hook: all-gather the unit (prefetch the next), swap the full parameters in;
                post-hook: swap the shards back, free the full ones (not the root's)
      backward  pre-hook on its outputs: all-gather again; once the gradients reach its inputs
                (_PostBackward): reduce-scatter them, averaged over W, into the shards' .grad
      step      any elementwise torch optimizer over model.parameters(): they *are* the shards
    A parameter (d0, *rest) is cut on dim 0 as torch.chunk does: rank r holds rows [r c, (r+1) c),
    c = ceil(d0 / W), as an nn.Parameter (zero.py, like FSDP1, keeps one flat buffer per unit).
    Only the buffers are padded: c rest per parameter and rank; N over a unit, N_g its trainable.

Communication per step (full buffers; Psi = sum over units of W N, Psi_g of W N_g; b, b_r:
param_dtype, reduce_dtype bytes; K micro-batches; a ring moves (W-1)/W of it per rank)
    all_gather      Psi b forward + (Psi - Psi_root) b backward (the root stays gathered), x K
    reduce_scatter  Psi_g b_r, once per step (the micro-batches before the last: no sync)
    copies          per gather Psi b / W in, Psi b out; per reduction Psi_g b_r in, rows out
    --clip adds one 8-byte all_reduce. HSDP (replicate_group: shard over S ranks, W above is S,
    R replicas): + an all-reduce of each reduced shard, Psi_g b_r / S.
Memory per rank, AdamW on fp32 shards: 16 B per shard element (~16 Psi / W) + the root's full
copy, the computing unit's and `prefetch` more. More: docs/internals.md, 'fsdp.py'.

Public API (examples/fsdp_train.py)
    for block in model.model.layers: fully_shard(block, mp_policy=MixedPrecisionPolicy(...))
    fully_shard(model)                                  # the root: embeddings, norm, head
    opt = torch.optim.AdamW(model.parameters()); loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)   # or fsdp.clip_grad_norm_(model)
    dcp.save(get_state_dict(model, opt)); torch.compile(model)  # as on FSDP2 (DTensor shards)
    model.no_sync(), unshard() / reshard(); summon_full_params(model), full_state_dict(model)
    Around the loop (full state dicts, HSDP's groups, the policy, FSDPModule, claims):
    fsdp_state.py.

Run:  torchrun --nproc_per_node=2 fsdp.py --mode correctness   (learning, benchmark, plants)
"""
import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DeviceMesh, DTensor, Shard
from torch.utils._pytree import tree_flatten, tree_unflatten

from harness import planted
from harness.collectives import local_part
import ddp
from fsdp_state import (block_groups, clip_grad_norm_, full_state_dict,  # noqa: F401
                        full_tensors, hsdp_groups, load_full_state_dict, named_params,
                        new_block_groups, summon_full_params, units)
from fsdp_state import (FSDPModule, MixedPrecisionPolicy, _cast,  # noqa: F401 (re-exported)
                        all_reduce_ignored, as_fsdp_module, claim, collectives_per_unit,
                        refuse_late_gradients, refuse_matrix_optimizers)


class ShardedParam:
    """One parameter under fully_shard: `sharded`, the nn.Parameter with this rank's dim-0 rows
    (registered on the module between forwards: what the optimizer steps), and `unsharded`, the
    full-shape compute copy in param_dtype, a view of `full`, whose storage exists only while the
    unit is gathered (autograd's saved references to it stay valid across a free and re-gather).
    `sharded` is a DTensor (Shard(0) over the group's mesh), as FSDP2's, so torch's utilities on
    model.parameters() see whole tensors in rows (clip_grad_norm_'s global norm, DCP's resharding
    save and load). Only a label: every collective here runs on the local rows (`shard`,
    `grad_shard`), none through DTensor's redistribution."""

    def __init__(self, param: nn.Parameter, slots, rank: int, W: int, param_dtype, mesh):
        self.slots = slots                      # [(module, attribute name)] that hold it
        self.shape, d0 = param.shape, param.shape[0]
        self.rest = math.prod(param.shape[1:])
        self.rows = -(-d0 // W)                 # c: rows per rank in the buffers, padded
        self.padded = self.rows * self.rest     # elements per rank, padding included
        lo = min(rank * self.rows, d0)
        if planted("shard-rows"):   # plant: rank * floor(d0 / W), overlapping rows
            lo = rank * (d0 // W)
        hi = min(lo + self.rows, d0)
        self.lo = lo                            # this rank's first row
        self.local = (hi - lo) * self.rest      # this rank's elements (rows_r = hi - lo)
        shard = param.detach()[lo:hi]                                 # (hi - lo, *rest)
        if planted("masters-rounded"):                                # plant: masters rounded
            shard = shard.to(param_dtype or shard.dtype)
        self.mesh, self.stride = mesh, param.stride()
        self.sharded = nn.Parameter(self.label(shard.to(param.dtype).clone()),
                                    requires_grad=param.requires_grad)
        self.sharded._fsdp_param = self   # the mark: a shard (the optimizer check reads it)
        # The gathered layout [W, c rest]: row r = rank r's rows, zero-padded to c. The shards
        # are whole rows in rank order, so the padding sits at the tail and the first d0 rest
        # elements are the parameter itself.
        self.full = torch.empty(W * self.padded, dtype=param_dtype or param.dtype,
                                device=param.device)          # flat [W * c * rest]
        # its first d0 rest elements -> (d0, *rest), the parameter's shape
        self.unsharded = nn.Parameter(self.full[:param.numel()].view(self.shape),
                                      requires_grad=param.requires_grad)
        self.unsharded._fsdp_param = self
        self.full.untyped_storage().resize_(0)
        self.acc = None        # the unreduced gradient accumulated without sync (reduce dtype)
        self.cast = getattr(param, "fsdp_cast", None)   # FP8 all-gather (fp8.GatherFP8), or None

    def label(self, rows: torch.Tensor) -> DTensor:   # (rows_r, *rest) -> the whole (d0, *rest)
        if planted("shard-unlabelled"):   # plant: a plain tensor, torch's utilities see rows
            return rows
        return DTensor.from_local(rows, self.mesh, [Shard(0)], shape=self.shape,
                                  stride=self.stride, run_check=False)

    shard = property(lambda self: local_part(self.sharded))          # (rows_r, *rest)
    grad_shard = property(lambda self: local_part(self.sharded.grad))   # or None

    def register(self, unsharded: bool):
        for module, attr in self.slots:   # (a tied parameter is held by several modules)
            module._parameters[attr] = self.unsharded if unsharded else self.sharded


# The unit whose forward is running at the top level (the root of this forward), if any.
_ROOT = []


def _in_backward() -> bool:
    """True inside autograd's backward (a forward run there is activation recomputation)."""
    return torch._C._current_graph_task_id() != -1


class _PostBackward(torch.autograd.Function):
    """The identity on a unit's inputs (each tensor keeps its shape). Its backward runs once the
    gradients have flowed through the whole unit to its inputs: the unit's post-backward, at the
    same point of the graph on every rank, whichever parameters got a gradient (FSDP2's trigger
    too). By then autograd has accumulated the unit's parameter gradients (it runs a ready
    AccumulateGrad before other nodes); one that arrives later raises in _finish_backward."""

    @staticmethod
    def forward(ctx, unit, *inputs):   # each input's own shape -> the same shape
        ctx.unit = unit
        return inputs

    @staticmethod
    def backward(ctx, *grads):   # grads shaped as the inputs, passed through
        ctx.unit._post_backward()
        return (None, *grads)


class FSDPUnit:
    """One fully_shard call: its parameters, its groups and policy, and the hooks."""

    def __init__(self, module, params: list[ShardedParam], ignored: list[nn.Parameter], group,
                 replicate, mp: MixedPrecisionPolicy, reshard_after_forward, prefetch: int):
        self.module, self.params, self.ignored = module, params, ignored
        self.group, self.replicate, self.mp, self.prefetch = group, replicate, mp, prefetch
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.replicas = dist.get_world_size(replicate) if replicate is not None else 1
        self.reshard_after_forward = reshard_after_forward   # None: decided at the first forward
        self.dtype = params[0].full.dtype if params else None
        self.reduce_dtype = mp.reduce_dtype or mp.param_dtype or (
            params[0].sharded.dtype if params else None)
        self.shard_numel = sum(p.padded for p in params)    # N: all-gather elements per rank
        self.gathered, self.handle, self.sync = False, None, True
        self.root = None          # the root of the forward this unit last ran in
        self.order = None         # the root's: units in their first forward's order
        self.pending: list = []   # the root's: reductions in flight
        # backward reached it; the root's callback is queued; its post-backward ran
        self.in_backward, self.queued, self.finished = False, False, False
        self.copies = {}          # {kind: [copies, bytes]} (the benchmark's copy count)
        # eager under torch.compile (graph breaks, as FSDP2's): compiled code sees gathered ones
        module.register_forward_pre_hook(torch.compiler.disable(self._pre_forward),
                                         with_kwargs=True)
        module.register_forward_hook(torch.compiler.disable(self._post_forward))

    trainable = property(lambda self: [p for p in self.params if p.sharded.requires_grad])  # live

    def _count(self, kind: str, nbytes: int):
        c = self.copies.setdefault(kind, [0, 0])
        c[0], c[1] = c[0] + 1, c[1] + nbytes

    # -- gather and free --
    def unshard(self, async_op: bool = False, cast: bool = True):
        """All-gather this unit's shards into the full parameters (launch only, with async_op:
        wait() finishes it; cast=False: FP8 weights too in param_dtype, a user's gather)."""
        if self.gathered or not self.params:
            if not async_op:
                self.wait()
            return
        for p in self.params:
            p.full.untyped_storage().resize_(p.full.numel() * p.full.element_size())
            p.unsharded.requires_grad_(p.sharded.requires_grad)   # frozen since the last step?
        if planted("no-regather"):   # plant: in the backward, re-allocated, never re-gathered
            if self.root is not None and self.root.queued:
                self.gathered = True
                return self.wait()
        out, work, wires = self.all_gather([p.sharded for p in self.params], self.dtype, cast=cast)
        self._count("all_gather copy-in", out.numel() // self.world)
        self.handle, self.gathered = (work, out, wires), True
        if not async_op:
            self.wait()

    def all_gather(self, shards, dtype, async_op=True, cast=False):
        """Launch one all-gather of these per-parameter shards (parameters or gradients; None
        reads as zeros), each copied in at its offset in `dtype`, or with `cast` in its wire
        format (p.cast: FP8 all-gather, 1 byte): (flat bytes [W * N b], work, the formats)."""
        device = self.params[0].full.device
        wires = [p.cast.fmt if cast and p.cast else dtype for p in self.params]
        nbytes = [p.padded * w.itemsize for p, w in zip(self.params, wires)]   # per rank
        inp = torch.zeros(sum(nbytes), dtype=torch.uint8, device=device)            # [N b]
        views, srcs, off = [], [], 0
        for p, t, w, n in zip(self.params, shards, wires, nbytes):
            if t is not None and p.local:
                views.append(inp[off:off + p.local * w.itemsize].view(w))  # [rows_r rest] at off
                src = local_part(t).detach().reshape(-1)    # (rows_r, *rest) -> [rows_r rest]
                srcs.append(p.cast.quantize(src, dtype) if cast and p.cast else src)
            off += n
        if views:
            torch._foreach_copy_(views, srcs)
        out = torch.empty(self.world * inp.numel(), dtype=torch.uint8,
                          device=device)                  # [N b] x W -> flat [W * N b]
        work = dist.all_gather_into_tensor(out, inp, group=self.group, async_op=async_op)
        return out, work, wires

    def wait(self):
        """Finish a launched all-gather: copy out, and put the full parameters in the module."""
        if self.handle is not None:
            work, out, wires = self.handle
            work.wait()
            # each parameter's bytes into its full buffer; an FP8 wire's into its own, dequantised
            fulls = [p.full if w == p.full.dtype else torch.empty_like(p.full, dtype=w)
                     for p, w in zip(self.params, wires)]                # [W c_i rest_i] each
            # autograd saved the full parameters in the forward: refilling them is no change
            with torch.autograd._unsafe_preserve_version_counter(
                    tuple(p.unsharded for p in self.params)):
                into = [f.view(torch.uint8).view(self.world, -1) for f in fulls]   # [W, c rest b]
                torch.split_with_sizes_copy(out.view(self.world, -1), [v.shape[1] for v in into],
                                            dim=1, out=into)                 # [W, N b] -> bytes
                for p, f in zip(self.params, fulls):
                    if f is not p.full:   # in place: q, then q / s (the layer recasts it)
                        p.cast.dequantize(f, out=p.full)
            self._count("all_gather copy-out", out.numel())
            self.handle = None
        for p in self.params:
            p.register(unsharded=True)

    def reshard(self):
        """Put the shards back in the module and free the full parameters."""
        if self.handle is not None:
            self.wait()
        for p in self.params:
            p.register(unsharded=False)
            p.full.untyped_storage().resize_(0)
        self.gathered = False

    # -- forward --
    def _pre_forward(self, module, args, kwargs):
        cast = self.mp.param_dtype is not None and self.mp.cast_forward_inputs
        if cast:
            args, kwargs = _cast((args, kwargs), self.mp.param_dtype)
        if _in_backward():   # recomputation inside the backward: gathered, nothing recorded
            self.in_backward = True   # (reentrant checkpointing: a forward with no backward
            self.unshard()            # hooks; the final callback reduces what it computes)
            return self._post_backward_at(args, kwargs)
        if not _ROOT:   # the first unit of a forward is its root
            _ROOT.append(self)
            if self.order is None:
                self.order = []
        root = self.root = _ROOT[0]
        if self.reshard_after_forward is None:   # FSDP2's default: not the root
            self.reshard_after_forward = self is not root
        recording = self not in root.order and not root.queued
        if recording:
            root.order.append(self)
        self.unshard()
        if root.order and not recording:   # prefetch: the next units of the recorded order
            i = root.order.index(self)
            for u in root.order[i + 1:i + 1 + self.prefetch]:
                u.unshard(async_op=True)
        return self._post_backward_at(args, kwargs)

    def _post_backward_at(self, args, kwargs):
        """The inputs that need a gradient, through _PostBackward."""
        flat, spec = tree_flatten((args, kwargs))
        at = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not at or not torch.is_grad_enabled():
            return args, kwargs
        for i, t in zip(at, _PostBackward.apply(self, *[flat[i] for i in at])):
            flat[i] = t
        return tree_unflatten(flat, spec)

    def _post_forward(self, module, args, out):
        if self.mp.output_dtype is not None:
            out = _cast(out, self.mp.output_dtype)
        if _in_backward():
            return out
        if torch.is_grad_enabled():   # the backward starts at these outputs
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(self._pre_backward)
        if self.reshard_after_forward or not torch.is_grad_enabled():
            self.reshard()
        if _ROOT and _ROOT[0] is self:
            _ROOT.clear()
        return out

    # -- backward --
    def _pre_backward(self, grad):
        if self.in_backward:
            return
        self.in_backward = True
        root = self.root
        if not root.queued:   # finish the whole backward once autograd is done
            root.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(root._finish_backward)
        self.unshard()
        order = root.order or []
        if self in order:   # prefetch: the units the backward reaches next
            before = [u for u in order[:order.index(self)][::-1] if u is not root]
            for u in before[:self.prefetch]:
                u.unshard(async_op=True)

    def _post_backward(self):
        """The unit's backward is done: reduce its gradients (or keep them unreduced, without
        sync), free it. A parameter without a gradient here counts as a zero one, so every rank
        reduces the same buffers."""
        self.finished = True
        rd, grads = self.reduce_dtype, []
        for p in self.trainable:
            g = p.unsharded.grad
            p.unsharded.grad = None
            if not self.sync:   # accumulate, unreduced, in the reduce dtype
                if g is not None:
                    p.acc = g.to(rd) if p.acc is None else p.acc + g.to(rd)
                continue
            if p.acc is not None:   # add the micro-batches that ran without sync
                if g is None:
                    g = p.acc
                elif not planted("sync-drops-accumulated"):   # plant: only the last one reduced
                    g = p.acc + g.to(rd)
                p.acc = None
            grads.append(g)
        if self.sync and grads:
            self._reduce_scatter(grads)
        if self.sync and any(p.requires_grad for p in self.ignored):
            all_reduce_ignored(self)   # (ignored_params: whole, averaged as DDP's)
        stays = self is self.root if planted("root-stays-gathered") else False   # plant: stale
        if not stays:
            self.reshard()

    def _reduce_scatter(self, grads):
        rd, W, ps = self.reduce_dtype, self.world, self.trainable
        device = self.params[0].full.device
        cols = []
        for p, g in zip(ps, grads):   # each gradient as its W padded shards
            g = (torch.zeros(p.shape, dtype=rd, device=device) if g is None
                 else g.to(rd)).reshape(-1)                             # (d0, *rest) -> [d0 rest]
            cols.append(F.pad(g, (0, W * p.padded - g.numel())).view(W, p.padded))  # [W, c rest]
        inp = torch.cat(cols, dim=1)                                   # [W, N_g]
        if rd == torch.float16:   # fp16's range: average before summing, not after
            inp.div_(W)
        self._count("reduce_scatter copy-in", inp.numel() * inp.element_size())
        out = torch.empty(inp.shape[1], dtype=rd, device=device)       # [N_g]
        # [W, N_g] -> [W N_g]: row r, contiguous, is the part rank r receives, summed -> [N_g]
        work = dist.reduce_scatter_tensor(out, inp.view(-1), group=self.group, async_op=True)
        root = self.root
        root.pending.append((work, lambda: self._take_reduced(out, ps)))
        while len(root.pending) > 1:   # one reduction in flight behind the backward
            w, finish = root.pending.pop(0)
            w.wait()
            finish()

    def _take_reduced(self, out, ps):
        """The reduced shards (summed over the group) into each parameter's .grad."""
        if out.dtype != torch.float16:
            if not planted("no-average"):   # plant: summed
                out.div_(self.world)
        if self.replicate is not None:
            if not planted("replicas-not-averaged"):  # plant: HSDP's replicas not reduced
                out.div_(self.replicas)
                dist.all_reduce(out, group=self.replicate)    # [N_g] over the R replicas
        off = 0
        for p in ps:
            # [N_g] -> [rows_r rest] -> (rows_r, *rest), a view when the dtypes agree
            g = out[off:off + p.local].view(p.shard.shape).to(p.sharded.dtype)
            if p.sharded.grad is None:
                p.sharded.grad = p.label(g)
            else:   # as torch accumulates onto an existing .grad
                p.grad_shard.add_(g)
            self._count("reduce_scatter copy-out", g.numel() * g.element_size())
            off += p.padded

    def _finish_backward(self):
        """The root's, once autograd has finished: the post-backward of the units whose inputs
        needed no gradient (the root's token ids), every reduction waited for, all freed."""
        for u in reversed(self.order):
            if u.in_backward and not u.finished:
                u._post_backward()
        while self.pending:
            w, finish = self.pending.pop(0)
            w.wait()
            finish()
        for u in self.order:
            refuse_late_gradients(u)   # one that arrived after its unit's post-backward
            stays = u is self if planted("root-stays-gathered") else False   # plant: stale root
            if u.gathered and not stays:
                u.reshard()
            u.in_backward, u.finished = False, False
        self.queued = False


def fully_shard(module: nn.Module, *, group=None, replicate_group=None,
                mp_policy: MixedPrecisionPolicy | None = None, reshard_after_forward=None,
                ignored_params=None, prefetch: int = 1) -> nn.Module:
    """Shard `module`'s parameters not yet claimed by an inner call over `group` (every rank
    then holds its dim-0 rows of each, as an nn.Parameter) and make it one unit; returns the
    module, whose class gains FSDPModule's methods. Apply it bottom-up (blocks, then the model)
    before building the optimizer. Every rank starts from the group's rank 0's values.

    replicate_group: HSDP; `group` is then this rank's shard group and each reduced shard is
    averaged over the replicas too (hsdp_groups() builds both). reshard_after_forward: free the
    full parameters after the forward (None: True except for the root, the unit whose forward
    runs first). ignored_params: kept whole on every rank and trained, their gradients averaged
    over all ranks like DDP's (torch's ignored_params are neither sharded nor reduced).
    prefetch: units whose all-gather is launched ahead of use, in the recorded forward order."""
    mp = mp_policy or MixedPrecisionPolicy()
    # the parameters this call shards (not an inner call's), those it keeps whole, and the
    # modules holding each (a tied one is held by several); refusals before anything changes
    slots, mine, new_ignored = claim(module, ignored_params, mp, group)
    synced = [b for b in module.buffers() if not hasattr(b, "_fsdp_synced")]
    with torch.no_grad():   # every rank from rank 0's values (replica 0's, under HSDP)
        for g in (group, replicate_group) if replicate_group is not None else (group,):
            ddp.broadcast_coalesced(mine + new_ignored + synced, g)   # each its own shape
    for b in synced:
        b._fsdp_synced = True
    for p in new_ignored:
        p._fsdp_ignored = True
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    mesh = DeviceMesh.from_group(group or dist.group.WORLD, mine[0].device.type if mine else "cpu")
    params = []
    for p in mine:
        p._fsdp_claimed = True
        sp = ShardedParam(p, slots[id(p)][1], rank, W, mp.param_dtype, mesh)
        sp.register(unsharded=False)
        params.append(sp)
    unit = FSDPUnit(module, params, new_ignored, group, replicate_group, mp,
                    reshard_after_forward, prefetch)
    for sp in params:
        sp.sharded._fsdp_unit = unit
    as_fsdp_module(module, unit)   # its class gains FSDPModule's methods
    refuse_matrix_optimizers()
    return module


if __name__ == "__main__":   # torchrun fsdp.py --mode ...: the test rig runs it
    from rig.fsdp import main
    main()
