"""zero.py: ZeRO stages 1, 2 and 3 from raw torch.distributed primitives.

The idea (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", SC 2020)
    Data parallelism keeps W identical copies of the model states. ZeRO keeps one: each rank
    owns 1/W of every state and the rest is communicated when needed.
      stage 1  optimizer states sharded: full grads accumulate; the last backward reduce-scatters
               each unit, each rank updates its 1/W, and the updated params are all-gathered;
      stage 2  + gradients sharded: reduce-scattered during every backward, full ones freed;
      stage 3  + parameters sharded: a unit's parameters are all-gathered just before it runs,
               in the forward and again in the backward, and freed right after.
    Units (embeddings, each layer, head): views into one flat buffer padded to a multiple of W;
    rank r owns elements [r s, (r+1) s), s = padded / W, of its params, grads, optimizer state.

Model-state bytes per rank (model_state_bytes below; Psi parameters, N = W): in mixed bf16
(2 + 2 + 12 bytes) stage 1 2Psi + 2Psi + 12Psi/N, stage 2 2Psi + 14Psi/N, stage 3 16Psi/N (an
fp32 gradient reduction keeps 4Psi/N more: docs/internals.md's table). Communication per
optimizer step (collectives_per_unit below; b bytes per element, the reduce-scatter's the reduce
dtype's): stages 1, 2 reduce_scatter Psi*b + all_gather Psi*b; stage 3 all_gather Psi*b forward
and backward + reduce_scatter Psi*b = 3 Psi b; one call per unit each, stages 2 and 3 on every
micro-batch (--grad-accum K), stage 1 once per step. LoRA: frozen parameters sit in no unit
(stages 1, 2) or in units of their own, gathered and never reduced (stage 3): Psi_a in the
reduce-scatter. More: docs/internals.md, 'zero.py'; examples/zero_train.py.

Public API
    opt = ZeroOptimizer(params_or_groups, torch.optim.AdamW, stage=1|2, lr=...)   any elementwise
        torch optimizer, its state sharded; clip_grad_norm_, state_dict() / load_state_dict()
        in torch's unsharded format; stage 3: ZeroOptimizer(..., engine=Zero(model, stage=3)).
    engine = Zero(model, group=None, stage=1|2|3, units=None, prefetch=0, ...)   the hooks;
    the units (FlatUnit: the flat buffer and its shard) and their bytes: zero_units.py.

Run:  torchrun --nproc_per_node=2 zero.py --mode correctness --stage 3   (learning, benchmark)
"""
import contextlib

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten

from harness import planted, refuse_state_dict
from harness.precision import grad_reduce_dtype
import ddp
from zero_state import FlatTensors, ShardedState, clip_shard_grads  # noqa: F401
from zero_units import (STAGE3_STATE_DICT, FlatUnit, decoder_units, pad_to,  # noqa: F401
                        split_frozen, state_bytes)


# ----------------------------------------------------------------------------------------------
# The engine: hooks that implement the three stages on an HF model (units: zero_units.py)
# ----------------------------------------------------------------------------------------------
class Zero(FlatTensors):
    """Installs ZeRO's hooks into `model`. `units` defaults to decoder_units(model), in
    forward order; reductions launch in its reverse. (zero_state.py: per-parameter shards.)"""

    def __init__(self, model, group=None, stage: int = 1, average: bool = True, units=None,
                 reduce_dtype: torch.dtype | None = None, names: dict | None = None,
                 prefetch: int = 0, overlap_param_gather: bool = False,
                 unit_groups: dict | None = None):
        """units: [(name, modules)] (default decoder_units(model)), [(name, parameters, hook
        modules)], or [(name, parameters)] for stages 1 and 2 with model=None (the optimizer
        wrapper's buckets; `names` maps id(parameter) to a name). reduce_dtype: the reduce-scatter's
        and the gradient shards' (default: the gradients'). prefetch (stage 3): units whose all-
        gather is launched ahead of use, the next ones in the forward, the previous ones in the
        backward. overlap_param_gather (stages 1, 2; units as modules): the all-gather of the
        updated parameters is launched async after each step, and each module waits for its own
        units' in a forward pre-hook (Megatron's), so the later units' gathers run behind the
        earlier units' forward. unit_groups: {unit name: group} for units sharded over a group other
        than `group` (compose4d's experts, over the ranks that hold the same experts); every
        collective of a unit runs on its own group."""
        self.model, self.group, self.stage, self.prefetch = model, group, stage, prefetch
        self.average = average if not planted("no-average") else False   # plant: summed
        self.overlap_param_gather = overlap_param_gather and stage < 3
        self.world = dist.get_world_size(group)
        if model is not None:
            names = {id(p): n for n, p in model.named_parameters()}
        self.units = []
        claimed: set = set()
        for entry in (units or decoder_units(model)):
            n, items = entry[0], list(entry[1])
            if len(entry) == 3:      # (name, parameters, the modules whose hooks gather them)
                params, modules = items, list(entry[2])
            elif all(isinstance(x, torch.Tensor) for x in items):
                assert stage < 3, "stage 3 gathers on module hooks: give units as modules"
                params, modules = items, []
            else:   # the modules' parameters not claimed by an earlier unit (tied ones)
                params, modules = [], items
                for p in (p for m in modules for p in m.parameters()):
                    if id(p) not in claimed:
                        claimed.add(id(p))
                        params.append(p)
            claimed.update(id(p) for p in params)
            for un, ps in split_frozen(n, params, stage):   # LoRA's frozen base: its own unit
                self.units.append(FlatUnit(un, ps, (unit_groups or {}).get(n, group), names,
                                           shard_params=stage == 3, stage=stage,
                                           reduce_dtype=reduce_dtype, modules=modules))
        if model is not None:
            assert len(claimed) == len(names), f"units hold {len(claimed)} of {len(names)}"
        self.unit_of = {p: u for u in self.units for p in u.params}
        self.unit_index = {u: i for i, u in enumerate(self.units)}
        for p in self.unit_of:
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._on_grad_ready)
                if stage > 1:
                    p.register_hook(lambda grad, u=self.unit_of[p]: self._before_grad(u))
        if stage == 3:
            for u in self.units:
                for m in u.modules:
                    m.register_forward_pre_hook(   # (the unit's first module prefetches)
                        lambda mod, args, u=u: self._pre_forward(u) if mod is u.modules[0] else u.wait())
                u.modules[-1].register_forward_hook(
                    lambda mod, args, out, u=u: self._post_forward(u, out))
                u.free_params()
            refuse_state_dict(model, STAGE3_STATE_DICT)   # freed storage: DCP would save it
        if self.overlap_param_gather:
            # every module that holds a unit's parameters waits for the gathers of the units
            # that own them (a tied parameter may belong to an earlier unit)
            for u in self.units:
                for m in u.modules:
                    deps = list(dict.fromkeys(self.unit_of[p] for p in m.parameters()
                                              if p in self.unit_of))
                    m.register_forward_pre_hook(lambda mod, args, deps=deps: self.wait_params(deps))
        for u in (self.units if stage >= 2 else []):
            u.free_grads()
        # Reduce-scatters launch in reverse unit order (the backward's order) on every rank.
        self.order = [u for u in reversed(self.units) if u.n_grads]
        self.consumed = False   # an optimizer step used the shards (ZeroOptimizer.step)
        self.next_launch, self.pending = 0, []
        # Stage 1 reduce-scatters each unit once per step: in finish(), or while `sync` is set
        # (the step's last backward: reduce_in_backward) as each unit's gradients complete. A
        # launch waits only for the reductions beyond in_flight, so the backward computes the
        # next unit's gradients while the last two reduce-scatter.
        self.sync, self.in_flight, self.end_queued = False, 2, False   # (end: end_backward)

    # -- stage 3: gather before use, free after --
    def _pre_forward(self, u: FlatUnit):
        u.wait()
        self._prefetch_units(self.ahead(u, +1))

    def _post_forward(self, u: FlatUnit, out):
        u.free_params()
        self._hook_backward(u, out)

    def _hook_backward(self, u: FlatUnit, out):
        """_pre_backward(u) when the backward reaches u's output (a frozen embedding's: never)."""
        ts = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        u.backward = bool(ts) or not torch.is_grad_enabled()
        if ts:
            ts[0].register_hook(lambda grad, u=u: self._pre_backward(u))

    def _pre_backward(self, u: FlatUnit):
        if planted("reshard-before-backward"):   # plant: re-allocated, never re-gathered
            u.full.untyped_storage().resize_(u.padded * u.full.element_size())
            u.full.zero_()
            u.gathered = True
        u.wait()
        self.free_frozen(u)   # the frozen units the backward is past (and at its end, the rest)
        self._prefetch_units(self.ahead(u, -1))

    def _prefetch_units(self, units):
        """Launch the all-gathers of `units` (async, one order on every rank): each runs while
        the current unit computes, and the unit's own hook waits."""
        for v in units:
            if not v.gathered:
                v.gather_params(async_op=True)

    # -- gradients --
    def zero_grad(self):
        """Discard this step's gradients (a reduction still in flight completes first, and its
        result is dropped with the rest)."""
        self._complete()
        self.consumed, self.next_launch, self.end_queued = False, 0, False   # (a raised backward)
        for u in self.units:
            u.launched, u.ready = False, set()
            (u.grad_full if self.stage == 1 else u.grad_shard).zero_()   # stage 1: the full one

    def _on_grad_ready(self, p):
        u = self.unit_of[p]
        if self.consumed and self.stage > 1:   # the first gradient after an optimizer step:
            self.zero_grad()                    # the reduced shards start again from zero
        u.take_grad(p)
        if self.stage == 1:
            if u.launched:
                raise RuntimeError(f"ZeRO stage 1: a gradient of unit {u.name!r} arrived after "
                                   f"its reduce-scatter in this step; the backward that reduces "
                                   f"(reduce_in_backward) must be the last before step()")
            if not self.sync:
                return  # accumulate; reduce-scattered once, in finish()
        u.ready.add(p)
        if len(u.ready) < u.n_grads:
            return
        if self.stage == 3:
            self._post_backward(u)
        self._launch_ready()

    def _before_grad(self, u: FlatUnit):
        """A gradient of u is about to be accumulated: if u's previous reduction (the last
        micro-batch's) is still in flight, it reads that buffer; finish it first."""
        if any(q is u for q, _, _ in self.pending):
            self._complete()

    def _launch_ready(self, everything: bool = False):
        """Launch reductions in the fixed order on every rank, whatever order autograd finished
        units in; everything=True (step end): units still missing gradients too (zero slots)."""
        while self.next_launch < len(self.order):
            u = self.order[self.next_launch]
            if not everything and len(u.ready) < u.n_grads:
                return
            self._launch(u)
            self.next_launch += 1
        self.next_launch = 0  # this micro-batch's reductions are all launched

    def _post_backward(self, u: FlatUnit):
        u.free_params()  # this unit's backward is done with its parameters

    def _launch(self, u: FlatUnit):
        """Reduce-scatter u's full gradient (async). Earlier launches beyond `in_flight - 1`
        complete first, so at most `in_flight` units reduce while one more is computed."""
        self._complete(keep=self.in_flight - 1)
        u.clear_stale()
        src = (u.grad_full if u.grad_full.dtype == u.grad_shard.dtype
               else u.grad_full.to(u.grad_shard.dtype))   # bf16 gradients summed in fp32
        if self.average and u.world > 1:  # pre-divide: the sum over ranks is then the average
            src.div_(u.world)
        out, handle = self.reduce_scatter(src, u.grad_shard, u.group)   # flat [W * s] -> [s]
        self.pending.append((u, out, handle))
        u.ready = set()
        u.launched = True

    def reduce_scatter(self, src: torch.Tensor, like: torch.Tensor, group):
        """Start summing src [W s] over `group` (the unit's) into a new shard shaped like
        `like`: (shard, handle). zeropp.ZeroPP replaces it with qgZ's quantized all-to-alls."""
        if dist.get_world_size(group) == 1:   # a group of one: the sum is src itself
            return src, None
        out = torch.empty_like(like)
        return out, dist.reduce_scatter_tensor(out, src, group=group, async_op=True)  # -> [s]

    def _complete(self, keep: int = 0):
        """Wait for the oldest reductions until `keep` are left in flight."""
        while len(self.pending) > keep:
            u, out, handle = self.pending.pop(0)
            if handle is not None:
                handle.wait()
            if self.stage == 1:
                if out.data_ptr() != u.grad_shard.data_ptr():   # (a group of one: in place)
                    u.grad_shard.copy_(out)   # one reduction per step
            elif planted("overwrite-accum"):   # plant: keeps only the last micro-batch
                u.grad_shard.copy_(out)
            else:
                u.grad_shard.add_(out)  # accumulates over micro-batches
            if self.stage > 1:
                u.free_grads()

    def finish(self):
        """After the last backward: every shard holds its reduced gradient. Stage 1 reduces
        every unit its last backward did not; stages 2 and 3 what the hooks could not: from a
        unit missing a gradient (a parameter no backward reached) to the end of the order, then
        every unit with gradients again (blocked behind it). One order on every rank."""
        if self.stage == 1:   # every unit the backward did not reduce, in the fixed order
            for u in self.order:
                if not u.launched:
                    self._launch(u)
            self.next_launch = 0
        elif self.next_launch or any(u.ready for u in self.units):
            self._launch_ready(everything=True)   # units with unused parameters
            for u in self.order:
                if u.ready:
                    self._launch(u)
        self._complete()
        for u in self.units:
            u.launched = False
        if self.stage == 3:   # a unit whose gradients never completed is still gathered
            self.wait_params()
            for u in self.units:
                if u.gathered:
                    self._post_backward(u)

    def all_gather_params(self, overlap: bool = False):
        """After the update (stages 1, 2): every rank's full buffer gets every updated shard;
        with overlap (and overlap_param_gather) async, waited by the forward pre-hooks or by
        anything that touches the buffers first (wait_params)."""
        self.wait_params()   # a unit no forward reached since the last launch
        if planted("no-param-gather"):   # plant: other ranks' updates never arrive
            return
        for u in self.units:
            if u.world == 1 and u.shard.data_ptr() == u.full.data_ptr():
                continue   # a group of one whose shard is the buffer itself: nothing to gather
            later = overlap and self.overlap_param_gather and bool(u.modules)
            u.handle = dist.all_gather_into_tensor(u.full, u.shard.clone(), group=u.group,
                                                   async_op=later)   # [s] x W -> flat [W * s]

    def wait_params(self, units=None):
        """Finish the in-flight parameter all-gathers of `units` (default all)."""
        for u in (self.units if units is None else units):
            if u.handle is not None:
                u.handle.wait()
                u.handle = None


# ----------------------------------------------------------------------------------------------
# The optimizer wrapper: any elementwise torch optimizer on this rank's shards
# ----------------------------------------------------------------------------------------------
ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax,
               torch.optim.NAdam, torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Adagrad)


class ZeroOptimizer(ShardedState, torch.optim.Optimizer):
    """Shards a standard torch optimizer's state over the ranks of `group` (ZeRO stages 1, 2),
    or steps the shards of a module sharded by a stage-3 engine. In a standard loop

        opt = ZeroOptimizer(param_groups, torch.optim.AdamW, stage=2, lr=1e-3)
        loss.backward(); opt.step(); opt.zero_grad()

    `step()` finishes the gradient reduce-scatter (the W ranks' gradients averaged), runs
    `optimizer_class` on this rank's 1/W of every parameter group, and all-gathers the updated
    parameters (stages 1, 2). The inner optimizer sees flat slices, so its update must be
    elementwise: SGD, Adam, AdamW, Adamax, NAdam, RAdam, RMSprop, Adagrad, and muon.py's MuonAdamW
    (`on_shards`: it assembles whole matrices); Adafactor, LBFGS, Shampoo are refused.
    `clip_grad_norm_` clips by the global norm of the averaged gradients; `state_dict()`
    (collective) is the unsharded optimizer's, which `load_state_dict` and the plain torch
    optimizer accept (ShardedState, zero_state.py). A parameter without a gradient in a step
    gets a zero one, not skipped as in torch (momentum, weight decay, Muon's update still act).

    params: tensors or parameter groups. engine: a Zero(model, stage=3) that already shards
    these parameters (fsdp.fully_shard's need no wrapper); without one, stage 1 or 2 over
    `params` packed in buckets of bucket_mb per group, rank 0's values broadcast first.
    reduce_dtype: the reduce-scatter's and gradient shards', "auto" = fp32 for bf16 gradients."""

    def __init__(self, params, optimizer_class=torch.optim.AdamW, *, group=None, stage: int = 1,
                 engine: "Zero | None" = None, bucket_mb: float = 25.0, reduce_dtype="auto",
                 broadcast: bool = True, average: bool = True, **defaults):
        if not getattr(optimizer_class, "on_shards", None) and not (
                isinstance(optimizer_class, type) and issubclass(optimizer_class, ELEMENTWISE)):
            raise ValueError(
                f"ZeroOptimizer: {getattr(optimizer_class, '__name__', optimizer_class)} is not "
                f"known to update elementwise (its state would not shard along flat slices); "
                f"use one of {', '.join(c.__name__ for c in ELEMENTWISE)} (or muon.MuonAdamW)")
        super().__init__(params, defaults)
        everything = [p for g in self.param_groups for p in g["params"]]
        if engine is None:
            if stage not in (1, 2):
                raise ValueError(f"ZeroOptimizer: stage {stage} over plain parameters; stage 3 "
                                 f"shards the module: build zero.Zero(model, stage=3) and "
                                 f"pass it as engine= (or fsdp.fully_shard and a torch optimizer)")
            ddp.check_devices([(f"parameter {i}", p) for i, p in enumerate(everything)],
                              group, "ZeroOptimizer")
            if broadcast:
                ddp.broadcast_coalesced(everything, group, int(bucket_mb * 2**20))
            if reduce_dtype == "auto" and everything:
                reduce_dtype = grad_reduce_dtype(everything[0].dtype)
            units = []
            for gi, g in enumerate(self.param_groups):   # buckets in reverse, as DDP's
                trainable = [p for p in g["params"] if p.requires_grad]
                for idx in reversed(ddp.plan_buckets(trainable, int(bucket_mb * 2**20))):
                    units.append((f"group{gi}.bucket{len(units)}",
                                  [trainable[i] for i in sorted(idx)]))
            names = {id(p): f"param{i}" for i, p in enumerate(everything)}
            engine = Zero(None, group, stage=stage, average=average, units=units,
                          reduce_dtype=reduce_dtype, names=names)
        self.engine, self.group = engine, engine.group
        group_of = {p: gi for gi, g in enumerate(self.param_groups) for p in g["params"]}
        lost = [n for u in engine.units for p, n in zip(u.params, u.names)
                if p.requires_grad and p not in group_of]
        if lost:
            raise ValueError(f"ZeroOptimizer: the engine's parameter {lost[0]} is in no "
                             f"parameter group")
        self.index = {p: i for i, p in enumerate(everything)}   # torch's state-dict numbering
        # The inner optimizer over this rank's flat [s] shard of each unit (or its fp32 master),
        # cut into runs of one group's parameters (ShardedState, zero_state.py)
        self.shard_param_groups(optimizer_class, group_of)
        getattr(self.inner, "on_shards", lambda z: None)(self)   # muon.py's: NS gathers matrices
        self.reduced = False

    # -- the loop --
    def zero_grad(self, set_to_none: bool = True):
        self.engine.zero_grad()   # the reduced shards (they accumulate micro-batches)
        if self.engine.stage == 1 and set_to_none:
            for u in self.engine.units:
                for p in u.params:
                    p.grad = None   # the hooks move the next gradient back into the buffer
        self.reduced = False

    @contextlib.contextmanager
    def reduce_in_backward(self):
        """Stage 1: the step's last backward, run inside this, reduce-scatters each unit as its
        gradients complete, overlapped with the rest of it, instead of all in step(); earlier
        backwards stay local, a later one raises. Stages 2 and 3 reduce in every backward."""
        self.engine.sync = True
        try:
            yield
        finally:
            self.engine.sync = False

    def reduce_gradients(self):
        """Finish the reduce-scatter (idempotent within a step): each shard then holds the
        average of the W ranks' gradients."""
        if not self.reduced:
            self.engine.finish()
            self.reduced = True

    @torch.no_grad()
    def step(self, closure=None):
        with torch.enable_grad():
            loss = closure() if closure is not None else None
        self.reduce_gradients()
        if self.engine.stage < 3:
            self.engine.wait_params()   # the update writes shards inside the gathered buffers
        for g, ig in zip(self.param_groups, self.inner.param_groups):   # e.g. an lr schedule
            ig.update({k: v for k, v in g.items() if k != "params"})
        shards = self.grad_shards()
        for v, (ui, a, n, _) in zip(self.views, self.runs):
            v.grad = shards[ui][a:a + n].to(v.dtype)   # run [n] of the flat [s] shard
        self.inner.step()
        for v in self.views:
            v.grad = None
        low = [(u.shard, m) for u, m in zip(self.engine.units, self.masters) if m is not u.shard]
        if low:   # the low-precision shards from the updated masters, in one pass
            torch._foreach_copy_([s for s, _ in low], [m for _, m in low])
        if self.engine.stage < 3:
            self.engine.all_gather_params(overlap=True)
        # Consumed: the next backward starts the reduced shards from zero even without
        # opt.zero_grad() (model.zero_grad() cannot reach them). Readable until then.
        self.engine.consumed = True
        self.reduced = False
        return loss


# ----------------------------------------------------------------------------------------------
# Formulas (rig/zero.py, trainer4d/comm.py and trainer4d/plan.py count with these)
# ----------------------------------------------------------------------------------------------
def model_state_bytes(psi: float, stage: int, world: int, param_bytes: float,
                      grad_bytes: float, optim_bytes: float) -> dict[str, float]:
    """ZeRO's table per rank (the paper's Fig. 1): stage 1 shards the optimizer state over the
    world, 2 also the gradients, 3 also the parameters (0: DDP). oom_search, the planners."""
    split = lambda k: psi / (world if stage >= k else 1)   # noqa: E731
    return dict(params=param_bytes * split(3), grads=grad_bytes * split(2),
                optimizer=optim_bytes * split(1))


def collectives_per_unit(stage: int, micro_batches: int) -> tuple[int, int]:
    """(reduce-scatters, all-gathers) per flat unit and optimizer step of M micro-batches:
    stage 1 reduce-scatters the accumulated gradients once and all-gathers the updated
    parameters once; stage 2 reduce-scatters every micro-batch; stage 3 also gathers the unit
    before every forward and every backward, and not after the step."""
    M = micro_batches
    return (M if stage >= 2 else 1), (2 * M if stage == 3 else 1)


if __name__ == "__main__":   # torchrun zero.py --mode ...: the test rig runs it
    from rig.zero import main
    main()
