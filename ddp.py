"""ddp.py: data parallelism from raw torch.distributed primitives.

The idea (Li et al., "PyTorch Distributed", VLDB 2020)
    Every rank holds a full replica of the model and optimizer and runs forward/backward on its
    own 1/W of the global batch. Before the optimizer step the gradients are averaged over the
    W ranks with all_reduce, so every replica applies the same update and stays identical.
    Overlap: parameters are packed in reverse order into buckets of --bucket-mb, each .grad a
    view of its bucket's flat buffer; a bucket's all_reduce launches async once all its
    gradients are in (in index order on every rank), so late layers' communication overlaps
    early layers' backward. --grad-accum K: only the K-th backward communicates.

Who talks to whom
    Once, at start: broadcast every parameter and buffer from rank 0.
    Every optimizer step: all_reduce of the gradients, in buckets, over the whole group. Each
    rank backpropagates W * CE_sum(local) / N (N: the global batch's target tokens), so the
    average is exactly d(CE_sum(global) / N).

Communication per optimizer step (Psi = parameter count, b = bytes per element)
    all_reduce bytes  = Psi * b                    exactly, whatever K (b: the reduce dtype's
                                                   bytes, fp32 for bf16 gradients by default)
    all_reduce calls  = number of buckets
    ring traffic/rank = 2 (W-1)/W * Psi * b       (reduce-scatter + all-gather phases)
Memory per rank: the full model states (params + grads + AdamW's 2 moments = 4 Psi b) plus the
activations of B/(W K) sequences. More: docs/internals.md, 'ddp.py'.

Public API
    model = NaiveDataParallel(module); ...backward...; model.sync_gradients()   the idea in 15
        lines (--variant naive): one all_reduce per parameter after the backward, no overlap
    model = DataParallel(module, group=None, bucket_mb=25)   a drop-in for torch DDP: rank 0's
        parameters and buffers broadcast, gradients averaged by the end of backward (set_to_none
        either way), no_sync(), find_unused_parameters=; examples/ddp_train.py

Run:  torchrun --nproc_per_node=2 ddp.py --mode correctness   (learning, benchmark, plants)
"""
import contextlib

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_unflatten

from harness import Batch, lm_loss_sum, phase, planted
from harness import dropout
from harness.loss import chunked_loss_sum


# ----------------------------------------------------------------------------------------------
# The naive version first: one all_reduce per parameter, after the backward
# ----------------------------------------------------------------------------------------------
class NaiveDataParallel(torch.nn.Module):
    """DDP in its simplest correct form (--variant naive): rank 0's parameters broadcast once;
    after the step's last backward, sync_gradients() all-reduces every gradient on its own and
    divides it by W. The same Psi * b bytes as DataParallel below, but in one call per
    parameter, none of it overlapping the backward, in the gradients' own dtype (a parameter
    without a gradient sends zeros). (HF's buffers are constants: not sent.)"""

    def __init__(self, module, group=None):
        super().__init__()
        self.module, self.group = module, group
        src = dist.get_global_rank(group, 0) if group is not None else 0
        with torch.no_grad():
            for p in module.parameters():
                dist.broadcast(p.data, src, group=group)          # [p.shape] from rank 0

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def sync_gradients(self):
        W = dist.get_world_size(self.group)
        for p in self.module.parameters():
            if not p.requires_grad:     # (a frozen parameter, LoRA's base: nothing to reduce)
                if not planted("lora-base-reduced"):   # plant: frozen sent
                    continue
            if p.grad is None:          # (every rank sends every parameter: same calls)
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=self.group)              # [p.shape], summed over W
            if not planted("naive-no-average"):   # plant: the sum, not the average
                p.grad.div_(W)


# ----------------------------------------------------------------------------------------------
# Buckets: the same reduction in a few large calls, launched during the backward
# ----------------------------------------------------------------------------------------------
def plan_buckets(params: list[torch.nn.Parameter], cap_bytes: int) -> list[list[int]]:
    """Indices of `params` packed in reverse order into buckets of at most cap_bytes
    (a parameter larger than the cap gets a bucket of its own)."""
    buckets, cur, cur_bytes = [], [], 0
    for i in reversed(range(len(params))):
        nbytes = params[i].numel() * params[i].element_size()
        if cur and cur_bytes + nbytes > cap_bytes:
            buckets.append(cur)
            cur, cur_bytes = [], 0
        cur.append(i)
        cur_bytes += nbytes
    if cur:
        buckets.append(cur)
    return buckets


class Bucket:
    def __init__(self, params: list[torch.nn.Parameter]):
        self.params = params
        p0 = params[0]
        self.buffer = torch.zeros(sum(p.numel() for p in params), dtype=p0.dtype,
                                  device=p0.device)   # flat [sum of the params' numels]
        self.slots, offset = [], 0
        for p in params:  # .grad becomes a view: autograd accumulates straight into the buffer
            # flat [numel] of the buffer -> p.shape
            self.slots.append(self.buffer[offset:offset + p.numel()].view_as(p))
            if p.grad is not None:
                self.slots[-1].copy_(p.grad)
            p.grad = self.slots[-1]
            offset += p.numel()
        self.ready = 0
        self.handle = None
        self.wire = None   # what the all_reduce sums: the buffer, or its fp32 copy

    def settle(self):
        """Every trainable parameter's .grad into its slot (settle_slots), before a reduction."""
        settle_slots(self.params, self.slots)


def take_fresh_grad(p: torch.nn.Parameter, slot: torch.Tensor):
    """p's gradient arrived (a post-accumulate-grad hook): make it live in `slot`, p's view of
    a flat gradient buffer. After a set-to-None (zero_grad's default, or ZeRO's own free)
    autograd hands a fresh tensor, whose values are p's whole accumulated gradient; later
    backwards then accumulate into the slot in place. (torch keeps one Python object per
    tensor, so `is` tells the slot from a fresh tensor.)"""
    if p.grad is not slot:
        slot.copy_(p.grad)
        p.grad = slot


def settle_slots(params, slots):
    """Before a flat gradient buffer is reduced: a gradient set outside autograd's hooks
    (p.grad = ...) moves into its slot, and the slot of a parameter whose .grad is None (set to
    None, and no gradient since) holds an old step's values and is zeroed. Afterwards every
    trainable parameter's .grad is its slot."""
    for p, slot in zip(params, slots):
        if p.requires_grad and p.grad is not slot:
            if p.grad is None:
                slot.zero_()
            else:
                slot.copy_(p.grad)
            p.grad = slot


def broadcast_coalesced(tensors: list[torch.Tensor], group=None, cap_bytes: int = 25 * 2**20):
    """Broadcast `tensors` from the group's rank 0, packed into flat buffers of at most
    cap_bytes per dtype (one call per buffer, not one per tensor), and unpacked in place."""
    src = dist.get_global_rank(group, 0) if group is not None else 0
    by_dtype: dict = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    with torch.no_grad():
        for ts in by_dtype.values():
            for idx in reversed(plan_buckets(ts, cap_bytes)):   # forward order
                chunk = [ts[i] for i in reversed(idx)]
                flat = torch.cat([t.detach().reshape(-1) for t in chunk])   # t.shape -> flat [sum]
                dist.broadcast(flat, src=src, group=group)   # flat [sum of the chunk's numels]
                for t, part in zip(chunk, flat.split([t.numel() for t in chunk])):  # [t.numel()]
                    t.copy_(part.view_as(t))   # flat [t.numel()] -> t.shape


def check_devices(tensors, group, what: str) -> torch.device | None:
    """The one device every tensor lives on, and one a collective of `group` can use, each a
    plain tensor (ValueError naming the first tensor that is not)."""
    device = None
    for name, t in tensors:
        if hasattr(t, "to_local"):   # a DTensor (tp.parallelize's label): its numel is global
            raise ValueError(f"{what}: {name} is a DTensor, and {what} reads plain tensors; "
                             f"split with tp.parallelize(..., dtensor=False) under it")
        if t.device.type == "meta":
            raise ValueError(f"{what}: {name} is on the meta device; materialise the module "
                             f"(to_empty() and load its weights) before wrapping it")
        device = device or t.device
        if t.device != device:
            raise ValueError(f"{what}: {name} is on {t.device}, other tensors on {device}; "
                             f"move the whole module to one device first")
    if device is not None:
        backend = dist.get_backend(group)
        if backend == "nccl" and device.type != "cuda":
            raise ValueError(f"{what}: the module is on {device} but the process group uses "
                             f"nccl, which needs CUDA tensors; call module.to('cuda') first")
    return device


class _SyncAtEnd(torch.autograd.Function):
    """Identity on a forward's outputs. Its backward runs first, on the outermost backward's
    graph task, and queues DataParallel.finish for the end of that task: under reentrant
    activation checkpointing the recomputed blocks run backwards of their own, and a callback
    queued from inside one of them would finish in the middle of the outer backward."""

    @staticmethod
    def forward(ctx, dp, *tensors):   # each output's own shape -> the same shape
        ctx.dp = dp
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):   # grads shaped as the outputs, passed through
        ctx.dp.queue_finish()
        return (None, *grads)


class DataParallel(torch.nn.Module):
    """A drop-in for torch.nn.parallel.DistributedDataParallel, built from broadcast and
    all_reduce. In a standard loop

        model = DataParallel(module)          # rank 0's parameters and buffers win
        loss_fn(model(x), y).backward()        # gradients are averaged by the end of backward
        optimizer.step(); optimizer.zero_grad()            # set_to_none either way

    and `with model.no_sync(): ...backward()` accumulates locally with no communication."""

    def __init__(self, module: torch.nn.Module, group=None, bucket_mb: float = 25.0,
                 broadcast: bool = True, broadcast_buffers: bool = True,
                 find_unused_parameters: bool = False, average: bool = True, params=None,
                 reduce_dtype: torch.dtype | None = None):
        """broadcast: send rank 0's parameters (trainable and frozen) and buffers to every
        rank now. broadcast_buffers: and the buffers again before every forward, as torch DDP
        does (a BatchNorm's running statistics then follow rank 0). find_unused_parameters:
        one extra all_reduce of a used-parameter map per step, so that a parameter no rank
        used keeps .grad None (the optimizer skips it, as under torch DDP); without it such a
        parameter gets a zero gradient. Either way an unused parameter never hangs a step.
        average: divide the sum by W (False: the loss on each rank is already its share of a
        global objective). params: the replicated parameters to synchronise (default all of
        the module's; expert parallelism passes the non-expert ones). reduce_dtype: the dtype
        the all-reduce sums in (harness.precision.grad_reduce_dtype; default the gradients'):
        a bf16 bucket is copied to fp32, reduced, and rounded back to bf16 once."""
        super().__init__()
        self.module, self.group, self.average = module, group, average
        self.reduce_dtype = reduce_dtype
        self.world = dist.get_world_size(group)
        names = {id(p): n for n, p in module.named_parameters()}
        replicated = list(module.parameters()) if params is None else list(params)
        self.device = check_devices(
            [(names.get(id(p), "a parameter"), p) for p in replicated]
            + list(module.named_buffers()), group, "DataParallel")
        cap = int(bucket_mb * 2**20)
        if broadcast:
            if not planted("no-broadcast"):   # plant: each keeps its own init
                broadcast_coalesced(replicated + list(module.buffers()), group, cap)  # rank 0's
        self.broadcast_buffers = broadcast_buffers and any(True for _ in module.buffers())
        self.forward_sync = True
        params = [p for p in replicated if p.requires_grad]
        self.buckets = []
        for dtype in dict.fromkeys(p.dtype for p in params):   # one dtype per bucket
            same = [p for p in params if p.dtype == dtype]
            self.buckets += [Bucket([same[i] for i in idx]) for idx in plan_buckets(same, cap)]
        self.params = [p for b in self.buckets for p in b.params]
        self.bucket_of, self.slot_of = {}, {}
        for b in self.buckets:
            for p, slot in zip(b.params, b.slots):
                self.bucket_of[p], self.slot_of[p] = b, slot
                p.register_post_accumulate_grad_hook(self._on_grad_ready)
        self.find_unused = find_unused_parameters
        self.sync = True      # False inside no_sync() (the first K-1 micro-steps)
        self.next_launch = 0  # buckets launch in index order on every rank
        self.used: set = set()   # parameters with a gradient since the last reduction (the
                                 # find_unused_parameters map)
        self.callback_queued = False

    def forward(self, *args, **kwargs):
        if torch.is_grad_enabled() and (self.callback_queued or self.next_launch):
            self._reset()   # a backward that raised left a step half-reduced
        # As torch DDP: buffers follow rank 0 before a forward whose previous forward was a
        # synchronising one (not inside no_sync, not under no_grad).
        if self.broadcast_buffers and self.forward_sync:
            broadcast_coalesced(list(self.module.buffers()), self.group)
        self.forward_sync = self.sync and torch.is_grad_enabled()
        out = self.module(*args, **kwargs)
        if not (self.sync and torch.is_grad_enabled()):
            return out
        leaves, spec = tree_flatten(out)
        at = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
        if at:
            for i, t in zip(at, _SyncAtEnd.apply(self, *[leaves[i] for i in at])):
                leaves[i] = t
        return tree_unflatten(leaves, spec)

    def _reset(self):
        for b in self.buckets:
            if b.handle is not None:
                b.handle.wait()
            b.handle, b.ready, b.wire = None, 0, None
        self.next_launch, self.callback_queued, self.used = 0, False, set()

    def queue_finish(self):
        """Have finish() run when the current backward's graph task ends (once)."""
        if self.sync and not self.callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)
            self.callback_queued = True

    def set_sync(self, sync: bool):
        """sync=False: the following backwards only accumulate (torch DDP's
        require_backward_grad_sync); no_sync() is the context-manager form."""
        self.sync = sync

    @contextlib.contextmanager
    def no_sync(self):
        before = self.sync
        self.sync = False
        try:
            yield
        finally:
            self.sync = before

    def _on_grad_ready(self, p):
        take_fresh_grad(p, self.slot_of[p])
        self.used.add(p)
        if not self.sync:
            return
        self.queue_finish()   # (called through forward(), _SyncAtEnd has queued it already)
        b = self.bucket_of[p]
        b.ready += 1
        while (self.next_launch < len(self.buckets)
               and self.buckets[self.next_launch].ready == len(self.buckets[self.next_launch].params)):
            self._launch(self.buckets[self.next_launch])

    @property
    def reduce_itemsize(self) -> int:
        """Bytes per gradient element on the wire."""
        if not self.buckets:
            return 0
        return (self.reduce_dtype or self.buckets[0].buffer.dtype).itemsize

    def _launch(self, b: Bucket):
        b.settle()
        b.wire = (b.buffer if self.reduce_dtype in (None, b.buffer.dtype)
                  else b.buffer.to(self.reduce_dtype))
        # Pre-divide by W (as torch DDP does) so the sum is the average and stays in range.
        if self.average:
            if not planted("no-average"):   # plant: the sum, W x the mean
                b.wire.div_(self.world)
        b.handle = dist.all_reduce(b.wire, group=self.group, async_op=True)  # flat [bucket numel]
        self.next_launch += 1

    def finish(self):
        """End of a synchronising backward (queued by the first gradient hook, so it runs
        without being called): launch the buckets whose parameters got no gradient, wait for
        every bucket, and bind each .grad to its averaged slot. Idempotent."""
        if not self.callback_queued:
            return
        self.callback_queued = False
        while self.next_launch < len(self.buckets):
            self._launch(self.buckets[self.next_launch])
        unused = None
        if self.find_unused:   # which parameters did no rank use?
            used = torch.tensor([p in self.used for p in self.params], dtype=torch.int32,
                                device=self.device)
            dist.all_reduce(used, group=self.group)   # [n_params] int32, summed over W
            unused = {p for p, n in zip(self.params, used.tolist()) if n == 0}
        for b in self.buckets:
            b.handle.wait()
            if b.wire is not b.buffer:
                b.buffer.copy_(b.wire)   # the fp32 sum, rounded once
            b.handle, b.ready, b.wire = None, 0, None
            for p, slot in zip(b.params, b.slots):
                p.grad = None if unused is not None and p in unused else slot
        self.next_launch = 0
        self.used = set()


def forward_backward(model, batch: Batch, rank: int, world: int, accum: int,
                     set_sync=lambda sync: None, ce_chunk: int = 0) -> torch.Tensor:
    """The data-parallel micro-step loop: this rank's 1/W of the batch in `accum` micro-batches,
    each backpropagating W * CE_sum / N (docs/internals.md, 'ddp.py': loss scaling).
    set_sync(k == accum-1) tells the gradient machinery which backward is the last. ce_chunk:
    the loss ce_chunk tokens of logits at a time (harness.loss.chunked_loss_sum). Returns the
    local CE sum (float64)."""
    local_sum = torch.zeros((), dtype=torch.float64, device=batch.input_ids.device)
    for k, mb in enumerate(batch.shard(rank, world).split(accum)):  # (B, S) -> (B/(W K), S)
        last = 0 if planted("sync-first-microbatch") else accum - 1   # plant: syncs the first
        set_sync(k == last)
        pos = mb.doc_positions   # packed documents (--doc-mask): their position ids, or None
        if planted("doc-positions-dropped"):   # plant: the documents attend across boundaries
            pos = None
        with phase("forward"), dropout.at(mb):
            ce = (chunked_loss_sum(model, mb.input_ids, mb.labels, ce_chunk, position_ids=pos)
                  if ce_chunk else
                  lm_loss_sum(model(input_ids=mb.input_ids, position_ids=pos).logits, mb.labels))
        with phase("backward"):
            if planted("mean-of-means"):   # plant: each micro-batch's own mean, averaged
                (ce / mb.n_tokens / accum).backward()
            else:
                (ce * world / batch.n_tokens).backward()
        local_sum += ce.detach().double()
    return local_sum


if __name__ == "__main__":   # torchrun ddp.py --mode ...: the test rig runs it
    from rig.ddp import main
    main()
