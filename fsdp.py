"""fsdp.py: fully sharded data parallel with prefetch, from raw torch.distributed primitives.

The idea (Zhao et al., "PyTorch FSDP: Experiences on Scaling Fully Sharded Data Parallel",
VLDB 2023)
    FSDP is ZeRO-3 organised for overlap. Parameters, gradients and optimizer states are sharded
    over the W ranks. The model is cut into units, and a unit's full parameters exist only while
    it computes:
      forward    pre-forward hook: all-gather the unit, and *prefetch* (launch asynchronously)
                 the next --prefetch units' all-gathers, so communication overlaps compute;
                 post-forward: free the full parameters (reshard), unless
                 --no-reshard-after-forward (ZeRO-2 behaviour: keep them until the backward);
      backward   pre-backward hook (on the unit's output): all-gather again, prefetching the
                 units the backward reaches next; after the unit's backward: reduce-scatter its
                 gradients into the shard (async), free the full gradients and parameters;
      step       AdamW on the local shards only (zero.ZeroOptimizer).

Units
    The user names the submodules that become units (`fully_shard(module, units=[...])`; by
    default an HF model's decoder layers). Every parameter outside them forms the root unit
    (for an LLM: embeddings, final norm, LM head). The root's parameters are used at both ends
    of the forward and first in the backward, so it is gathered once at the start of the
    forward and freed after the backward, as FSDP2 does for the root.

Sharding: flat buffers (FSDP1 style), not per-parameter dim-0 shards (FSDP2 style)
    A unit's parameters are views into one flat buffer padded to a multiple of W (zero.FlatUnit),
    and rank r owns a contiguous 1/W of it. Then one all-gather and one reduce-scatter per unit
    move one contiguous buffer, with no copy-in or copy-out, and the parameters stay plain
    tensors that HF's modules use unchanged. FSDP2 shards each parameter along dim 0 as a
    DTensor instead. That costs a copy into and out of the communication buffer, but every shard
    is a well-formed piece of one parameter: per-parameter optimizers, frozen parameters and
    sharded state dicts are then straightforward. This reference suite uses plain AdamW and
    reassembles full tensors for checkpoints, so the flat layout's simplicity wins here.
    `--compare-native` runs FSDP2's `fully_shard` with the same units and data, and
    tests/library_oracles.py compares `fully_shard` with FSDP2 on a plain module.

Public API
    fs = fully_shard(module, units=[...], group=None, prefetch=1, reshard_after_forward=True)
    opt = zero.ZeroOptimizer(module.parameters(), torch.optim.AdamW, engine=fs, lr=...)
    a standard loop: loss.backward(); opt.step(); opt.zero_grad(); opt.clip_grad_norm_(c)

Communication per step (b = bytes per element, Psi padded, Psi_root the root unit's share)
    all_gather     forward: every unit once (Psi*b); backward: every layer again, not the root,
                   which stays gathered ((Psi - Psi_root)*b). Without resharding after the
                   forward (--no-reshard-after-forward) the backward gathers nothing.
    reduce_scatter one per unit: Psi*b
    total          3 Psi - Psi_root (ZeRO-3's 3 Psi, less the root's backward gather); 2 Psi
                   without resharding. --clip adds one 8-byte all_reduce; --grad-accum K
                   multiplies everything by K.
Model-state bytes per rank: 16 Psi / N in fp32 (params, grads, Adam m and v, all sharded),
plus the gathered working set: the root and at most 1 + prefetch layers.

HSDP (hybrid sharding, --replicate R; Zhao et al. 2023, section 3.2.2)
    Shard over S = W / R ranks (a node) and replicate the shards R times (across nodes). The
    all-gathers and reduce-scatters above stay inside a shard group (fast links), and each unit's
    reduced shard is all-reduced over its replicate group (the R ranks holding that shard):
        inside a shard group   3 Psi b - root, as above, with Psi padded to a multiple of S
        across replicas        Psi b_reduce / S per rank per step: all_reduce of each shard
    Model states per rank grow to 16 Psi / S: R times FSDP's over W. A ring all-reduce of
    Psi/S over R ranks moves 2 (R-1)/R of it per rank. Public API: fully_shard(module,
    group=shard, replicate_group=rep) with (shard, rep) = hsdp_groups(R).
"""
import warnings

import torch
import torch.distributed as dist

from harness import (Expect, Plant, main, name_group, parts, planted, ranks_per_node,
                     spread_across_ranks, uneven_nodes)
from harness.precision import grad_reduce_dtype
import ddp
import zero


def resolve_units(module: torch.nn.Module, units) -> list[torch.nn.Module]:
    """The submodules that become units, in forward order: modules, or their names in
    module.named_modules(). Default: an HF causal LM's decoder layers."""
    if units is None:
        layers = parts(module).layers if hasattr(module, "config") else None
        if layers is None:
            raise ValueError("fully_shard: name the submodules that become units (units=[...] "
                             "modules or names, in forward order); only an HF causal LM's "
                             "decoder layers are found without help")
        return list(layers)
    named = dict(module.named_modules())
    out = []
    for u in units:
        if isinstance(u, str):
            if u not in named:
                raise ValueError(f"fully_shard: no submodule named {u!r}")
            u = named[u]
        if u is module or not any(u is m for m in named.values()):
            raise ValueError(f"fully_shard: units must be proper submodules of the module "
                             f"(got {type(u).__name__})")
        out.append(u)
    return out


class FullyShard(zero.Zero):
    """ZeRO-3's engine (zero.Zero, stage 3) with FSDP's schedule: prefetch in both directions,
    optional resharding after the forward, and a root unit (every parameter outside the named
    units, e.g. embeddings, final norm and head) gathered at the start of the forward and kept
    until the end of the backward; with `replicate` (HSDP), each reduced shard is averaged over
    the replicas too. Build it with fully_shard()."""

    def __init__(self, model, units: list[torch.nn.Module], group=None, prefetch: int = 1,
                 reshard_after_forward=True, average=True, reduce_dtype=None, replicate=None):
        names = {id(p): n for n, p in model.named_parameters()}
        inside = {id(p) for u in units for p in u.parameters()}
        root = [p for p in model.parameters() if id(p) not in inside]
        by_name = {id(m): n for n, m in model.named_modules()}
        spec = [("root", root, [model])] + [(by_name[id(u)], list(u.parameters()), [u])
                                            for u in units]
        if not root:
            raise ValueError("fully_shard: every parameter is inside a unit; leave the "
                             "module's own (or one top-level) parameters to the root unit")
        super().__init__(model, group, stage=3, average=average, units=spec,
                         reduce_dtype=reduce_dtype, names=names)
        self.prefetch, self.reshard = prefetch, reshard_after_forward
        self.replicate = replicate
        self.R = dist.get_world_size(replicate) if replicate is not None else 1
        self.root, self.layers = self.units[0], self.units[1:]
        self.position = {u: i for i, u in enumerate(self.layers)}

    def _prefetch(self, order: list):
        for u in order[:self.prefetch]:
            if not u.gathered:
                u.gather_params(async_op=True)  # same order on every rank

    def _pre_forward(self, u):
        u.wait()
        if u is self.root:   # the start of the forward
            self._prefetch(self.layers)
        else:
            self._prefetch(self.layers[self.position[u] + 1:])

    def _post_forward(self, u, out):
        if u is not self.root and self.reshard:
            u.free_params()
        self._hook_backward(u, out)

    def _post_backward(self, u):
        """After u's backward: free its parameters, the root's too (it is gathered again by the
        next forward, after the optimizer has updated its shard)."""
        if u is self.root and planted("root-stays-gathered"):   # plant: stale root next step
            return
        u.free_params()

    def _pre_backward(self, u):
        u.wait()
        if u is self.root:  # the backward starts at the root's output, then the last unit
            self._prefetch(self.layers[::-1])
        else:
            self._prefetch(self.layers[:self.position[u]][::-1])

    def _reduced(self, out):
        """HSDP: the shard group's reduced shard, averaged over the R replicas (one all_reduce
        of Psi/S elements per unit over the replicate group: the only traffic that leaves a
        shard group, so it is the one that crosses nodes)."""
        if self.replicate is None or planted("replicas-not-averaged"):   # plant: not averaged
            return
        if self.average:
            out.div_(self.R)
        dist.all_reduce(out, group=self.replicate)


def fully_shard(module: torch.nn.Module, units=None, group=None, prefetch: int = 1,
                reshard_after_forward: bool = True, reduce_dtype="auto",
                average: bool = True, replicate_group=None) -> FullyShard:
    """Shard `module` in place over the ranks of `group`; returns the engine, which
    zero.ZeroOptimizer steps:

        fs = fully_shard(model, units=[model.block1, model.block2])
        opt = zero.ZeroOptimizer(model.parameters(), torch.optim.AdamW, engine=fs, lr=1e-3)
        loss.backward(); opt.step(); opt.zero_grad()

    units: the submodules (or their names) that become units, in forward order (default: an
    HF causal LM's decoder layers); everything else is the root unit. The module's parameters
    stay ordinary tensors (views into the gathered flat buffers), so the module's own forward
    runs unchanged. Ranks start from rank 0's parameters and buffers. reduce_dtype: the
    reduce-scatter's and the gradient shards' dtype, "auto" = fp32 for bf16/fp16 gradients.
    replicate_group: HSDP (hybrid sharding): `group` is this rank's shard group (inside a
    node), replicate_group the ranks holding the same shard in the other replicas; each unit's
    reduced shard is then averaged over it (hsdp_groups() builds both)."""
    ddp.check_devices(list(module.named_parameters()) + list(module.named_buffers()), group,
                      "fully_shard")
    units = resolve_units(module, units)
    state = list(module.parameters()) + list(module.buffers())
    ddp.broadcast_coalesced(state, group)
    if replicate_group is not None:    # then replica 0's (every rank of a shard group agrees)
        ddp.broadcast_coalesced(state, replicate_group)
    if reduce_dtype == "auto":
        reduce_dtype = grad_reduce_dtype(next(module.parameters()).dtype)
    return FullyShard(module, units, group, prefetch, reshard_after_forward, average,
                      reduce_dtype, replicate_group)


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


# ----------------------------------------------------------------------------------------------
# Harness adapter
# ----------------------------------------------------------------------------------------------
def fsdp_constraints(args, world, config) -> list[str]:
    errs = ddp.batch_constraints(args, world)
    if args.prefetch < 0:
        errs.append(f"--prefetch must be >= 0 (got {args.prefetch})")
    if args.replicate is not None and (args.replicate < 1 or world % args.replicate):
        errs.append(f"--replicate {args.replicate}: the replicas must divide world size {world} "
                    f"(HSDP shards over W / R ranks)")
    if args.replicate is None and uneven_nodes(world):
        errs.append(f"HSDP's default --replicate (one per node): {uneven_nodes(world)}; give "
                    f"--replicate R")
    return errs


def replicas(args, world: int) -> tuple[int, str | None]:
    """(R, a line saying where it came from): --replicate, or one replica per node of the
    launcher's layout (torchrun --nnodes M: R = M, each shard group one node's ranks)."""
    if args.replicate is not None:
        return args.replicate, None
    n = ranks_per_node(world)
    if n is None:
        return 1, None
    return world // n, (f"HSDP: --replicate {world // n} from the launcher's layout ({world // n} "
                        f"nodes of {n} ranks, LOCAL_WORLD_SIZE)")


class FSDP(zero.ZeRO):
    name = "fsdp"
    syncs_initial_params = True   # fully_shard broadcasts rank 0's parameters and buffers
    # One configuration catches all three: float32 + --clip for the scale, --grad-accum 2 for
    # the accumulation; the stale root shows from the second step on.
    _ACCUM_CLIP = ("--grad-accum", "2", "--dtype", "float32", "--clip", "0.5")
    plants = {
        "no-average": Plant("the reduce-scatter sums the gradients instead of averaging "
                                   "them (2x at W=2; clipping would hide it)", _ACCUM_CLIP),
        "overwrite-accum": Plant("the reduced gradient shard is overwritten by each "
                                        "micro-batch's instead of accumulated", _ACCUM_CLIP),
        "root-stays-gathered": Plant("the root is not freed after the backward, so the "
                                            "next forward skips its all-gather and uses stale "
                                            "embeddings and head", _ACCUM_CLIP),
        "replicas-not-averaged": Plant("HSDP: the reduced shards are not all-reduced over the "
                                       "replicas, so each replica steps on its own half of the "
                                       "batch", ("--replicate", "2"), world=4),
    }

    @staticmethod
    def add_args(p):
        p.add_argument("--prefetch", type=int, default=1,
                       help="units whose all-gather is launched ahead of use")
        p.add_argument("--no-reshard-after-forward", action="store_true",
                       help="keep full parameters from the forward to the backward (ZeRO-2)")
        p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step")
        p.add_argument("--replicate", type=int, default=None,
                       help="HSDP: R replicas, each sharded over W / R ranks (default: one per "
                            "node of the launcher's layout, so 1 on one node)")

    constraints = staticmethod(fsdp_constraints)

    def __init__(self, model, args, env):
        self.args, self.env, self.model = args, env, model
        args.stage = 3  # zero.ZeRO's reporting: FSDP's model states are stage 3's
        group = replicate = None
        args.replicate, line = replicas(args, env.world)
        if line and env.is_main:
            print(line, flush=True)
        if args.replicate > 1:
            group, replicate = hsdp_groups(args.replicate)
        self.zero = fully_shard(model, group=group, replicate_group=replicate,
                                prefetch=args.prefetch,
                                reshard_after_forward=not args.no_reshard_after_forward,
                                reduce_dtype=grad_reduce_dtype(next(model.parameters()).dtype,
                                                               args))
        self.optimizer = zero.adamw_on_shards(model, self.zero, args)

    def extra_checks(self):
        """HSDP: the replicas must hold the same shards (the reference sees replica 0 only)."""
        z = self.zero
        if z.replicate is None:
            return []
        spread = spread_across_ranks([u.shard for u in z.units], z.replicate)
        return [("HSDP replicas hold identical shards", spread == 0.0, f"max spread {spread:.1e}")]

    def expected_comm(self):
        z, K = self.zero, self.args.grad_accum
        g = "shard" if z.replicate is not None else "world"   # HSDP: inside a shard group
        b = z.root.full.element_size()
        rb = z.root.grad_shard.element_size()   # the reduce dtype's
        root, layers = z.root.padded * b, sum(u.padded for u in z.layers) * b
        n, L = len(z.units), len(z.layers)
        regather = L if z.reshard else 0
        rows = [Expect("all_gather_into_tensor", g, (n + regather) * K,
                       (root + layers + (layers if z.reshard else 0)) * K,
                       "forward: every unit; backward: " + ("each layer again"
                                                            if z.reshard else "none")
                       + (f"; x{K} micro-batches" if K > 1 else "")),
                Expect("reduce_scatter_tensor", g, n * K, (root + layers) * K * rb // b,
                       f"Psi*b_reduce = {(root + layers) * rb // b:,} B, one per unit"
                       + (f"; x{K} micro-batches" if K > 1 else ""))]
        if z.replicate is not None:
            shard = sum(u.shard_numel for u in z.units) * rb
            rows.append(Expect("all_reduce", "replicate", n * K, shard * K,
                               f"HSDP: each reduced shard over the {z.R} replicas, "
                               f"Psi*b_reduce/S = {shard:,} B"
                               + (f"; x{K} micro-batches" if K > 1 else "")))
        if self.args.clip:
            rows.append(Expect("all_reduce", g, 1, 8, "clip: squared-norm sum (fp64)"))
        return rows


FSDP.native = [zero.TorchFSDP2, ddp.DDP]   # PyTorch's FSDP2 on the same units, and our DDP

if __name__ == "__main__":
    warnings.filterwarnings("ignore", message=".*FSDP.*")
    main(FSDP)
