"""zeropp.py: ZeRO++ on zero.py's engine: int8 weight gathers, a secondary parameter shard per
node, and an int8 hierarchical all-to-all in place of the gradient reduce-scatter.

The idea (Wang et al., "ZeRO++: Extremely Efficient Collective Communication for Giant Model
Training", 2023)
    ZeRO-3 moves 3 Psi per step over the world group, all of it across nodes. W = M N: M nodes
    of N consecutive ranks; each rank has two groups, "node" (its N node-mates) and "cross" (the
    M ranks with its local index, one per node). Tricks (any subset: --zeropp qwz,hpz,qgz):
    qwZ  stage 3's all-gathers move int8 blocks of BLOCK = 256 elements + one float32 scale
         (absmax / 127) per block; the shards (the optimizer's masters) stay exact.
    hpZ  after the forward gather each rank keeps slice `local` of N of the full buffer (its
         secondary shard, Psi/N); the backward all-gathers those inside the node, exactly.
    qgZ  the reduce-scatter becomes a hierarchical int8 all-to-all (in the node, then across
         nodes; dequantize + sum after each), reduce_scatter_tensor's shard layout. Any stage.
    ZeroPP is a zero.Zero whose stage-3 gather hooks and reduce_scatter are replaced.

Bytes per step per rank (logical buffers as the meter counts them; per unit u, P_u padded,
s_u = P_u / W, c(x) = ceil(x / 256), 4 B per scale; b the model dtype's bytes)
    qwZ fwd   all_gather world  sum_u P_u + 4 W c(s_u)            (vs P_u b)
    bwd       hpZ: all_gather node  sum_u P_u b; else qwZ's again (world)
    qgZ       all_to_all node   sum_u P_u + 4 N c(M s_u)          (N > 1)
              all_to_all cross  sum_u P_u / N + 4 M c(s_u)        (M > 1)
              (vs reduce_scatter world P_u b_reduce); N = 1 or N = W: one all-to-all
    hpZ memory: + sum_u P_u / N * b resident per rank (the secondary shards)
More (the paper's 4x, the correctness checks): docs/internals.md, 'zeropp.py'.

Public API
    engine = ZeroPP(model, ("qwz", "hpz", "qgz"), node_size=N, stage=3)   collective: builds the
        node and cross groups; over the world group. Then, as for zero.Zero:
    opt = zero.ZeroOptimizer(model.parameters(), torch.optim.AdamW, engine=engine, lr=...)
    torchrun --nproc_per_node=4 zeropp.py --stage 3 --zeropp qwz,hpz,qgz --node-size 2

Run:  torchrun --nproc_per_node=2 zeropp.py --mode correctness   (benchmark, plants)
"""

import torch
import torch.distributed as dist

from harness import name_group, planted
from zero import Zero

BLOCK = 256          # elements per quantization block (one float32 scale each)
TRICKS = ("qwz", "hpz", "qgz")


# ----------------------------------------------------------------------------------------------
# Block quantization and the quantized collectives
# ----------------------------------------------------------------------------------------------
def n_blocks(n: int) -> int:
    return -(-n // BLOCK)


def quantize(x: torch.Tensor):
    """x: [P, L] -> (int8 [P, L], float32 scales [P, ceil(L/BLOCK)]): each row cut into blocks
    of BLOCK from its start (the last one partial), symmetric, scale = absmax / 127, so
    |dequantize - x| <= scale / 2 = absmax / 254 per element."""
    P, L = x.shape
    nb = n_blocks(L)
    xb = torch.nn.functional.pad(x, (0, nb * BLOCK - L)).view(P, nb, BLOCK)  # -> (P, nb, BLOCK)
    scale = xb.abs().amax(-1).float() / 127                      # [P, nb]
    safe = torch.where(scale > 0, scale, torch.ones_like(scale)).to(x.dtype)
    q = torch.round(xb / safe[..., None]).clamp_(-127, 127).to(torch.int8)
    return q.view(P, nb * BLOCK)[:, :L], scale   # (P, nb, BLOCK) -> [P, L]; [P, nb]


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype) -> torch.Tensor:
    """The inverse of quantize, up to the rounding: [P, L] in `dtype`."""
    P, L = q.shape
    nb = scale.shape[1]
    qb = torch.nn.functional.pad(q, (0, nb * BLOCK - L)).view(P, nb, BLOCK)  # -> (P, nb, BLOCK)
    return (qb.to(dtype) * scale[..., None].to(dtype)).view(P, nb * BLOCK)[:, :L]   # -> [P, L]


def half_steps(scale: torch.Tensor, L: int, dtype) -> torch.Tensor:
    """Each element's quantization bound scale / 2, [P, L] (the checks' bookkeeping)."""
    P, nb = scale.shape
    h = (scale.to(dtype) / 2)[..., None].expand(P, nb, BLOCK)   # [P, nb] -> (P, nb, BLOCK)
    return h.reshape(P, nb * BLOCK)[:, :L]                       # -> [P, L]


def pack(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[P, L + 4 nb] int8: each row's payload, then its scales' bytes, so one collective moves
    both (an all-gather's or an all-to-all's rows are then equal-sized, as the ops need)."""
    return torch.cat([q, scale.contiguous().view(torch.int8)], dim=1)  # -> [P, L + 4 nb]


def unpack(buf: torch.Tensor, L: int):
    return buf[:, :L], buf[:, L:].contiguous().view(torch.float32)   # [P, L], [P, nb] float32


def quantized_all_gather(u) -> torch.Tensor:
    """qwZ: the full buffer of u (a zero_units.FlatUnit) from every rank's shard, as int8 blocks +
    float32 scales in one all_gather_into_tensor of W * (s + 4 ceil(s / BLOCK)) bytes, returned
    dequantized (this rank's own slice too: every rank must compute with the same weights).
    The shard itself, the optimizer's master, is untouched."""
    s, W = u.shard_numel, u.world
    q, scale = quantize(u.shard.detach().view(1, s))   # flat [s] -> [1, s]; scales [1, c(s)]
    send = pack(q, scale).view(-1)                      # [1, s + 4 c(s)] -> flat [s + 4 c(s)]
    recv = torch.empty(W * send.numel(), dtype=torch.int8, device=send.device)
    dist.all_gather_into_tensor(recv, send, group=u.group)   # flat [W * (s + 4 c(s))] int8
    q_all, scales = unpack(recv.view(W, -1), s)              # [W, s] int8, [W, c(s)] float32
    if planted("qwz-local-dequant"):   # plant: every block dequantized with our own scales
        scales = scale.expand(W, -1)   # [1, c(s)] -> [W, c(s)]
    return dequantize(q_all, scales, u.full.dtype).reshape(-1)   # [W, s] -> flat [W * s]


def quantized_all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """Row p of x [P, L] goes to rank p of `group`, int8 + scales in one all_to_all_single of
    P (L + 4 ceil(L / BLOCK)) bytes. Returns the received rows, dequantized, [P, L]."""
    P, L = x.shape
    send = pack(*quantize(x))                          # [P, L] -> [P, L + 4 c(L)] int8
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)    # row p to rank p: [P, L + 4 c(L)]
    return dequantize(*unpack(recv, L), x.dtype)       # [P, L]


def make_groups(node_size: int):
    """(node, cross) for this rank; collective (every rank builds every group, one order)."""
    W = dist.get_world_size()
    node, _ = dist.new_subgroups_by_enumeration(
        [list(range(m * node_size, (m + 1) * node_size)) for m in range(W // node_size)])
    cross, _ = dist.new_subgroups_by_enumeration(
        [list(range(i, W, node_size)) for i in range(node_size)])
    return name_group(node, "node"), name_group(cross, "cross")


def fill(u, write):
    """Re-allocate u's full buffer and write(full) into it, not bumping the version counter of
    the views autograd saved in the forward."""
    u.full.untyped_storage().resize_(u.padded * u.full.element_size())
    with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(u.full):
        write(u.full)
    u.gathered = True


DONE = torch.futures.Future()   # the handle of a reduction already complete (qgZ's all-to-alls)
DONE.set_result(None)


# ----------------------------------------------------------------------------------------------
# The engine: zero.Zero with ZeRO++'s gathers and reduce-scatter
# ----------------------------------------------------------------------------------------------
class ZeroPP(Zero):
    """zero.Zero over the world group with ZeRO++'s `tricks` (a subset of TRICKS, in the order
    given): qwZ and hpZ replace stage 3's gathers (synchronous, no prefetch), qgZ the
    reduce-scatter; everything else (units, accumulation, the optimizer's shards) is the
    engine's. node_size: N, ranks per node (hpZ, qgZ); **kw: zero.Zero's options."""

    def __init__(self, model, tricks, node_size: int = 1, **kw):
        if kw.get("group") is not None:
            raise ValueError("ZeroPP runs over the world group: its node and cross groups tile it")
        self.tricks = tuple(tricks)
        self.qwz, self.hpz, self.qgz = (t in self.tricks for t in TRICKS)
        W = dist.get_world_size()
        self.N, self.M, self.local = node_size, W // node_size, dist.get_rank() % node_size
        # every rank creates every group, in one order
        self.node, self.cross = make_groups(node_size) if self.hpz or self.qgz else (None, None)
        super().__init__(model, **kw)
        for u in self.units if self.hpz else []:   # padded / N, refreshed by every forward
            u.secondary = torch.zeros(u.padded // node_size, dtype=u.full.dtype,
                                      device=u.full.device)   # flat [W * s / N]

    # -- stage 3: ZeRO++'s gathers in place of the engine's (qgZ alone keeps the engine's) --
    def _pre_forward(self, u):
        if not (self.qwz or self.hpz):
            return super()._pre_forward(u)
        if not u.gathered:
            self.gather_forward(u)

    def _pre_backward(self, u):
        if not (self.qwz or self.hpz):
            return super()._pre_backward(u)
        if not u.gathered:
            self.gather_backward(u)

    def gather_forward(self, u):
        """qwZ: the quantized all-gather (else the exact one); hpZ: then keep this rank's
        secondary shard, slice `local` of N of the full buffer, for the backward."""
        if self.qwz:
            fill(u, lambda full: full.copy_(quantized_all_gather(u)))
        else:
            # flat [s] from each of W -> flat [W * s]
            fill(u, lambda full: dist.all_gather_into_tensor(full, u.shard, group=u.group))
        if self.hpz:
            n = u.secondary.numel()
            stale = False
            if planted("hpz-stale-secondary"):   # plant: the secondary copied once only
                stale = bool(u.secondary.any())
            if not stale:
                u.secondary.copy_(u.full[self.local * n:(self.local + 1) * n])  # flat [W * s / N]

    def gather_backward(self, u):
        """hpZ: all-gather the secondary shards inside the node (exact copies of the forward's
        weights, in the model dtype); without hpZ, qwZ's quantized gather again: deterministic,
        so the backward differentiates exactly the weights the forward used."""
        if self.hpz:
            # flat [W * s / N] from each of N node-mates -> flat [W * s]
            fill(u, lambda full: dist.all_gather_into_tensor(full, u.secondary, group=self.node))
        else:
            fill(u, lambda full: full.copy_(quantized_all_gather(u)))

    # -- qgZ: the gradient reduce-scatter --
    def reduce_scatter(self, src, like, group):
        if not self.qgz:
            return super().reduce_scatter(src, like, group)
        return self.quantized_reduce_scatter(src), DONE   # synchronous all-to-alls

    exchange = staticmethod(quantized_all_to_all)   # one hop (ZeroPPChecks observes it)

    def quantized_reduce_scatter(self, src: torch.Tensor) -> torch.Tensor:
        """qgZ: the paper's hierarchical all-to-all in place of reduce_scatter_tensor. src [W s]
        is this rank's full (pre-divided) gradient; chunk r = src[r s:(r+1) s] belongs to rank
        r = m N + l (node m, local index l). Returns chunk `rank` summed over the W ranks, as
        reduce_scatter_tensor would give it:
          1. inside the node (N > 1): local peer l gets, from every node-mate, the M chunks
             whose owners have local index l, [m' N + l for m' < M] (src viewed [M, N, s],
             transposed to [N, M, s]); quantize, all_to_all, dequantize, sum the N rows: a
             [M s] partial sum;
          2. across nodes (M > 1): re-quantize the partial's M chunks, chunk m' to node m' (the
             rank with local index l there, its owner), all_to_all, dequantize, sum the M rows.
        N = 1 skips step 1 (every rank is a node) and N = W skips step 2 (one node): either
        way one all-to-all over all ranks."""
        N, M = self.N, self.M
        s = src.numel() // (N * M)
        part = src
        if N > 1:
            # flat [W * s] -> (M, N, s) -> (N, M, s) -> [N, M s]: row l to local peer l
            rows = src.view(M, N, s).transpose(0, 1).reshape(N, M * s)
            if planted("qgz-chunk-order"):   # plant: chunks sent in rank order, not by owner
                rows = src.view(N, M * s)   # flat [W * s] -> [N, M s]
            part = self.exchange(rows, self.node).sum(0)   # [N, M s] received -> [M s]
        if M > 1:
            part = self.exchange(part.view(M, s), self.cross).sum(0)   # [M, s] -> [s]
        return part


if __name__ == "__main__":   # torchrun zeropp.py --mode ...: the test rig runs it
    from rig.zeropp import main
    main()
