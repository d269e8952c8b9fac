"""zero_units.py: ZeRO's unit, a group of modules whose parameters live as views into one flat
buffer padded to a multiple of W, and what the units hold and move.

zero.py's engine hooks the units (stage 3 gathers a unit before its modules run and frees it
after); each rank owns elements [r s, (r+1) s), s = padded / W, of a unit's parameters,
gradients and optimizer state. Here:

    FlatUnit(name, params, group, ...)        the buffer, its shard, its gradient slots
    decoder_units(model), split_frozen(...)   the default units of an HF model (embeddings, each
                                              layer, head; LoRA's frozen base apart)
    pad_to(n, w)                              n padded to a multiple of w
    state_bytes(engine, optimizer)            the model-state bytes per rank, by formula
    reduce_scattered(units), backward_gathers(units, model), outside_units(engine)
                                              what the units move per step (rig/zero.py and
                                              trainer4d/comm.py count with these)
"""
import torch
import torch.distributed as dist

import ddp
from harness import parts, planted

# what model.state_dict() raises under stage 3 (harness.refuse_state_dict)
STAGE3_STATE_DICT = ("zero: stage 3 frees every parameter's storage between uses, which "
                     "torch.distributed.checkpoint would save as the whole tensor; save with "
                     "engine.full_tensors('param') or opt.state_dict() (unsharded), or "
                     "trainer4d's checkpoints")


def pad_to(n: int, w: int) -> int:
    return -(-n // w) * w


def decoder_units(model) -> list[tuple[str, list[torch.nn.Module]]]:
    """(name, modules) for any HF causal LM (harness.parts): embeddings (and any module outside
    the parts: GPT-2's wpe), each layer, head (norm + LM head); embed+head when tied."""
    p = parts(model)
    if p.layers is None or p.embed is None:   # (no list of layers found: one unit)
        return [("model", [model])]
    layers = [(f"layers.{i}", [m]) for i, m in enumerate(p.layers)]
    head = [m for m in (p.norm, p.head) if m is not None]
    known = {id(t) for m in (p.embed, *p.layers, *head) for t in m.parameters()}
    rest = [m for m in model.modules() if any(id(t) not in known for t in m.parameters(False))]
    if p.tied:
        return [("embed+head", [p.embed, *rest, *head])] + layers
    return [("embed", [p.embed, *rest])] + layers + [("head", head)]


def split_frozen(name: str, params: list, stage: int) -> list[tuple[str, list]]:
    """A unit's parameters as zero.Zero's units: the trainable ones, and the frozen ones (LoRA's
    base) apart, so no frozen zero gradient is reduce-scattered: their own unit at stage 3
    (sharded and gathered for compute, never reduced), in no unit at stages 1 and 2 (whole on
    every rank, like the model outside ZeRO)."""
    if planted("lora-base-in-units"):   # plant: the frozen base reduced with the adapters
        return [(name, params)]
    trainable = [p for p in params if p.requires_grad]
    frozen = [p for p in params if not p.requires_grad] if stage == 3 else []
    return [(n, ps) for n, ps in ((name, trainable), (f"{name}.frozen", frozen)) if ps]


class FlatUnit:
    """One unit's parameters as views into a flat buffer padded to a multiple of W."""

    def __init__(self, name, params, group, names: dict, shard_params: bool, stage: int,
                 reduce_dtype: torch.dtype | None = None, modules=()):
        """params: the unit's parameters, in layout order; modules: those whose hooks gather
        and free them (stage 3)."""
        self.name, self.modules, self.group = name, list(modules), group
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.params = list(params)
        self.names = [names[id(p)] for p in self.params]
        if len(dtypes := {p.dtype for p in self.params}) > 1:
            raise ValueError(f"ZeRO unit {name!r} mixes parameter dtypes "
                             f"{sorted(map(str, dtypes))}: one flat buffer holds one dtype; "
                             f"cast the module to one dtype or split the unit")
        self.index = {p: i for i, p in enumerate(self.params)}
        self.n_grads = sum(p.requires_grad for p in self.params)   # gradients per backward
        self.numel = sum(p.numel() for p in self.params)
        self.padded = pad_to(self.numel, self.world)
        self.shard_numel = s = self.padded // self.world
        dtype, device = self.params[0].dtype, self.params[0].device
        self.lo = lo = self.rank * s
        if planted("shard-offset"):   # plant: the unpadded size, off when W does not divide it
            self.lo = lo = self.rank * (self.numel // self.world)
        self.full = torch.zeros(self.padded, dtype=dtype, device=device)   # flat [W * s]
        g_numel = self.padded if self.n_grads else 0   # a frozen unit (LoRA's base): no grads
        self.offsets, off = [], 0
        with torch.no_grad():
            for p in self.params:
                self.full[off:off + p.numel()].copy_(p.reshape(-1))   # p.shape -> flat [numel]
                p.data = self.full[off:off + p.numel()].view_as(p)    # flat [numel] -> p.shape
                self.offsets.append(off)
                off += p.numel()
        # this rank's parameter shard, flat [s]: a view of the full buffer, or its own (stage 3)
        self.shard = self.full[lo:lo + s].clone() if shard_params else self.full[lo:lo + s]
        # Full gradient buffer, every .grad a view into it: stage 1 keeps it; stages 2 and 3
        # allocate it at the unit's first gradient and free it once reduce-scattered.
        self.grad_full = torch.zeros(g_numel, dtype=dtype, device=device)   # flat [W * s]
        self.grads_alive = True
        # each parameter's view, made once: `p.grad is slot` tells whether autograd replaced it
        self.slots = [self.grad_full[off:off + p.numel()].view_as(p) if p.requires_grad
                      else None for p, off in zip(self.params, self.offsets)]  # -> p.shape
        for p, slot in zip(self.params, self.slots):
            p.grad = slot   # (a frozen parameter's is None)
        # The reduced gradient shard in the reduce dtype (it accumulates the micro-batches):
        # inside the full buffer for stage 1 when the dtypes agree, else its own tensor.
        rdt = reduce_dtype or dtype
        self.grad_shard = (self.grad_full[lo:lo + s] if stage == 1 and rdt == dtype
                           else torch.zeros(s if g_numel else 0, dtype=rdt, device=device))  # [s]
        self.gathered, self.handle = True, None   # handle: an in-flight (prefetched) gather
        self.backward = True   # stage 3: its output takes a backward (not a frozen embedding's)
        self.ready: set = set()   # parameters whose gradient for this micro-batch is complete
        self.launched = False     # stage 1: reduce-scattered in this step (sync backward)

    def take_grad(self, p):
        """p's gradient arrived: move it into the full gradient buffer (re-allocated if freed)."""
        if not self.grads_alive:
            self.alloc_grads()
        ddp.take_fresh_grad(p, self.slots[self.index[p]])

    def clear_stale(self):
        """Before a reduction: every trainable .grad is its slot, stale slots zeroed."""
        if not self.grads_alive:
            self.alloc_grads()
        ddp.settle_slots(self.params, self.slots)

    # -- parameter storage --
    def free_params(self):
        self.full.untyped_storage().resize_(0)
        self.gathered = False

    def gather_params(self, async_op=False):
        """All-gather the shards into the full buffer (re-allocated). Autograd saved views of it
        in the forward, so the write must not bump their version counter."""
        self.full.untyped_storage().resize_(self.padded * self.full.element_size())
        with torch.autograd._unsafe_preserve_version_counter(self.full):
            self.handle = dist.all_gather_into_tensor(self.full, self.shard, group=self.group,
                                                      async_op=async_op)   # [s] x W -> [W * s]
        self.gathered = True

    def wait(self):
        """Make sure the parameters are usable: gather now, or finish a prefetched gather."""
        if not self.gathered:
            self.gather_params()
        if self.handle is not None:
            self.handle.wait()
            self.handle = None

    # -- gradient storage (stages 2, 3) --
    def alloc_grads(self):
        """Re-allocate the flat gradient buffer, zeroed, and bind every trainable .grad that is
        None to it (a fresh gradient that just arrived is moved in by take_grad)."""
        self.grad_full.untyped_storage().resize_(self.padded * self.grad_full.element_size())
        self.grad_full.zero_()
        for p, slot in zip(self.params, self.slots):
            if p.requires_grad and p.grad is None:
                p.grad = slot
        self.grads_alive = True

    def free_grads(self):
        for p in self.params:
            p.grad = None  # the next backward hands us fresh gradients again
        self.grad_full.untyped_storage().resize_(0)
        self.grads_alive = False


def state_bytes(engine, optimizer) -> dict[str, float]:
    """ZeRO's resident model-state bytes per rank for the engine's stage and precision (the
    docstring's table, with the padding): params, grads, optimizer, model_states."""
    padded = sum(u.padded for u in engine.units)
    b = engine.units[0].full.element_size()
    rb = engine.units[0].grad_shard.element_size()   # the reduce dtype's
    # over each unit's shard group: the world, HSDP's S = W / R ranks (fsdp.py --replicate),
    # compose4d's dp x cp (or, for experts, the ranks that hold the same experts)
    shard = sum(u.shard_numel for u in engine.units)
    shard_g = sum(u.shard_numel for u in engine.units if u.n_grads)   # (--lora: trainable)
    # (master +) m + v per element; muon.py's Muon keeps one momentum on its matrices' runs
    muon = sum(n for _, _, n, gi in optimizer.runs if optimizer.param_groups[gi].get("muon"))
    opt = ((4 * shard_g if optimizer.mixed else 0)
           + (4 if optimizer.mixed else b) * (2 * shard_g - muon))
    params = padded * b if engine.stage < 3 else shard * b
    params += sum(t.numel() * t.element_size() for t in outside_units(engine))   # frozen
    grads = (padded * b + (shard * rb if rb != b else 0) if engine.stage == 1 else shard_g * rb)
    return {"params": params, "grads": grads, "optimizer": opt,
            "model_states": params + grads + opt}


def outside_units(engine) -> list[torch.Tensor]:
    """The model's parameters in no unit (stages 1, 2: LoRA's frozen base, whole on every rank)."""
    if engine.model is None:
        return []
    return [p for p in engine.model.parameters() if p not in engine.unit_of]


def reduce_scattered(units) -> tuple[int, int]:
    """(how many of `units` reduce-scatter, the padded elements they carry): those with
    trainable parameters, each padded to its group (--lora: the adapters only)."""
    trained = [sum(p.numel() for p in u.params if p.requires_grad) for u in units]
    return sum(1 for n in trained if n), sum(-(-n // u.world) * u.world
                                             for n, u in zip(trained, units))


def backward_gathers(units, model, first: bool = True) -> tuple[int, int]:
    """Stage 3: (how many of `units` are gathered again in the backward, their padded elements):
    those whose last module runs after the first trainable parameter's module (before it,
    LoRA's frozen embedding, no output takes a gradient; a tied embedding's unit, which ends
    at the head, is gathered); all of them when they are not the model's first (a pipeline
    stage after the first: its input takes a gradient)."""
    order = {id(m): i for i, m in enumerate(model.modules())}
    first_trained = min((order[id(m)] for u in units for m in u.modules
                         if any(p.requires_grad for p in m.parameters())), default=None)
    again = [u for u in units if not first or (first_trained is not None
                                               and order[id(u.modules[-1])] >= first_trained)]
    return len(again), sum(u.padded for u in again)
