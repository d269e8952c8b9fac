"""ep_moe.py: expert parallelism for a Mixture-of-Experts model (HF Mixtral), from raw primitives.

The idea (Lepikhin et al. "GShard" 2020; Fedus et al. "Switch" 2021)
    A MoE layer replaces the MLP with E experts and a router sending each token to its top-k.
    EP puts E/W experts on each of W ranks and brings the tokens to them (an expert's gradient
    needs no sum); the rest (attention, norms, embeddings, routers) is data-parallel (B/W each).

Who talks to whom, per MoE layer (N tokens on this rank, k choices each)
    1. route: p = softmax(x W_g^T) in fp32, top-k, weights renormalised (HF's MixtralTopKRouter)
    2. sort the N k (token, choice) rows by expert = by destination (rank d owns experts
       [d E/W, (d+1) E/W)); 3. all_to_all_single of the per-expert counts (E int64), read to
       the host once (the splits); 4. dispatch: an uneven all_to_all_single of the rows;
    5. the local experts as one grouped computation (torch._grouped_mm, or a padded bmm);
    6. combine: the reverse all-to-all, then out[t] = sum_j w[t, j] y[t, j]. AllToAll's
    backward is the same exchange with the splits swapped: 4 token all-to-alls per layer.

Communication per layer per step, dropless (N tokens per rank, H hidden, b bytes/element)
    logical send bytes, summed over ranks:  4 k (W N) H b     (dispatch + combine, fwd + bwd)
    per-rank wire, forward dispatch+combine: 2 k N H b (W-1)/W under uniform routing
    replicated gradients: all_reduce of Psi_dense b per step, as DDP; experts: none.
Capacity (--capacity-factor c): at most C = ceil(c k N_g / E) rows per expert and layer (N_g =
    W N, the global batch's tokens), first choices first, then global token order.
Router losses: Switch's aux = E sum_e f_e P_e (f_e: share of top-k assignments, P_e: of router
    probability, over L layers and N_g tokens; one all_reduce of the (L, E) counts per step);
    ST-MoE's z = mean logsumexp(logits)^2; DeepSeek-V3's aux-free bias b_e += rate *
    sign(mean load - load_e). More: docs/internals.md, 'ep_moe.py'.

Public API
    blocks = parallelize(model, group, capacity_factor=None, ..., experts_impl="auto"): E/W
        experts per rank in every MoE block of an HF Mixtral-family model (the rest replicated
        under ddp.DataParallel); experts_impl "auto" | "grouped_mm" | "bmm" | "loop"

Run:  torchrun --nproc_per_node=2 ep_moe.py --mode correctness   (learning, benchmark)
"""
import math
import types

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from harness import planted, refuse_state_dict


# ----------------------------------------------------------------------------------------------
# Communication: the uneven all-to-all and its mirror
# ----------------------------------------------------------------------------------------------
class AllToAll(torch.autograd.Function):
    """Rows x (sum(send_splits), ...) -> (sum(recv_splits), ...): send_splits[d] rows go to rank
    d, recv_splits[s] rows arrive from rank s. Backward: the same exchange with splits swapped."""

    @staticmethod
    def forward(ctx, x, recv_splits, send_splits, group):   # (sum(send), H) -> (sum(recv), H)
        ctx.splits, ctx.group = (recv_splits, send_splits), group
        out = x.new_empty((sum(recv_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):                  # (sum(recv), H) -> (sum(send), H)
        recv_splits, send_splits = ctx.splits
        gx = grad.new_empty((sum(send_splits),) + tuple(grad.shape[1:]))
        dist.all_to_all_single(gx, grad.contiguous(), send_splits, recv_splits, group=ctx.group)
        return gx, None, None, None


# ----------------------------------------------------------------------------------------------
# Routing, capacity and the router losses (shared by the reference and the parallel block)
# ----------------------------------------------------------------------------------------------
def route(weight, x, top_k, bias=None):
    """HF MixtralTopKRouter's math, its float32 softmax included: (logits (N,E), probs (N,E)
    float32, weights (N,k), experts (N,k)). The bias, if any, only changes which experts are
    selected."""
    logits = F.linear(x, weight)                        # (N, H) -> (N, E)
    probs = F.softmax(logits.float(), dim=-1)
    if bias is None:
        top, idx = torch.topk(probs, top_k, dim=-1)
    else:
        idx = torch.topk(probs + bias, top_k, dim=-1).indices
        top = probs.gather(-1, idx)
    if planted("router-no-renorm"):   # plant: the top-k weights no longer sum to 1
        return logits, probs, top, idx
    return logits, probs, top / top.sum(dim=-1, keepdim=True), idx


def expert_counts(flat_idx, n: int):
    """(n,) int64 occurrences of each value of flat_idx: torch.bincount's result without its
    host sync (on CUDA bincount reads the maximum to size its output)."""
    return torch.zeros(n, dtype=torch.long, device=flat_idx.device).scatter_add_(
        0, flat_idx, torch.ones_like(flat_idx))


def expert_capacity(factor: float, n_global: int, top_k: int, n_experts: int) -> int:
    return math.ceil(factor * top_k * n_global / n_experts)


def capacity_keep(idx, counts_all, rank: int, capacity: int):
    """Which of this rank's choices idx (N, k) fit, and the kept counts of every rank.

    counts_all (W, k, E): choices per (rank, slot, expert). The queue of expert e is ordered by
    slot, then rank, then local token order (= slot, then global token order). The choice
    (t, j) -> e sits at  sum_{j'<j} counts[:, j', e] + sum_{r'<r} counts[r', j, e]
    + #{t' < t : idx[t', j] = e}, and is kept when that is < capacity.
    Returns keep (N, k) bool and kept_all (W, k, E)."""
    glob = counts_all.sum(0)                                         # (k, E)
    ahead_all = (glob.cumsum(0) - glob)[None] + (counts_all.cumsum(0) - counts_all)  # (W, k, E)
    kept_all = (capacity - ahead_all).clamp(min=0).minimum(counts_all)
    onehot = F.one_hot(idx, counts_all.shape[-1])                    # (N, k, E)
    before = (onehot.cumsum(0) - onehot).gather(-1, idx[..., None])[..., 0]   # (N, k)
    pos = before + ahead_all[rank].gather(1, idx.T).T    # (k, E) at idx.T (k, N) -> (N, k)
    return pos < capacity, kept_all


def router_losses(stats: list[dict], n_global: int, n_experts: int, reduce=None):
    """(counts (L,E) global top-k assignments, aux, z) from the per-layer records of one forward.
    aux (Switch / HF load_balancing_loss_func) and z (ST-MoE) are this rank's share: summed over
    ranks they are the global values. reduce: all_reduce of the counts (None on one device)."""
    counts = torch.stack([s["counts"] for s in stats])              # (L, E)
    if reduce is not None:
        counts = reduce(counts)
    rows = len(stats) * n_global
    prob_sum = torch.stack([s["prob_sum"] for s in stats]).sum(0)   # (L, E) -> (E,)
    f = counts.sum(0).to(prob_sum.dtype) / rows
    aux = n_experts * (f * prob_sum / rows).sum()
    z = sum(s["z_sum"] for s in stats) / rows if "z_sum" in stats[0] else None
    return counts, aux, z


def update_bias(blocks, counts, rate: float):
    """Aux-loss-free balancing: b_e += rate * sign(mean load - load_e), per layer."""
    with torch.no_grad():
        for blk, load in zip(blocks, counts.to(blocks[0].bias.dtype)):
            blk.bias += rate * torch.sign(load.mean() - load)


# ----------------------------------------------------------------------------------------------
# MoE blocks: a common routing front, then either HF's experts (reference) or the all-to-all
# ----------------------------------------------------------------------------------------------
class MoEBlock(nn.Module):
    """Replaces a MixtralSparseMoeBlock, keeping its `gate` (router) so parameter names stay
    HF's. Subclasses implement dispatch_combine(x, weights, experts)."""

    def __init__(self, hf_block, stats: list, opts):
        super().__init__()
        self.gate = hf_block.gate
        self.top_k, self.num_experts = hf_block.top_k, hf_block.gate.num_experts
        self.stats, self.opts = stats, opts
        w = self.gate.weight
        self.register_buffer("bias", torch.zeros(self.num_experts, device=w.device,
                                                 dtype=torch.promote_types(w.dtype, torch.float32))
                             if opts.aux_free_bias else None)
        self.world, self.rank = 1, 0

    def forward(self, hidden):
        b, s, h = hidden.shape
        x = hidden.reshape(-1, h)                                  # (B, S, H) -> (N, H)
        logits, probs, w, idx = route(self.gate.weight, x, self.top_k, self.bias)
        # the router losses in the model's precision (probs is float32, as HF routes)
        wide = logits.to(torch.promote_types(logits.dtype, torch.float32))
        p = probs if wide.dtype == probs.dtype else F.softmax(wide, dim=-1)
        rec = dict(counts=expert_counts(idx.reshape(-1), self.num_experts),   # (N*k,) -> (E,)
                   prob_sum=p.sum(0), choices=idx.numel() * self.world)
        if self.opts.z_coef:
            rec["z_sum"] = torch.logsumexp(wide, dim=-1).pow(2).sum()
        self.stats.append(rec)
        keep = None
        if self.opts.capacity_factor:
            cap = expert_capacity(self.opts.capacity_factor, x.shape[0] * self.world,
                                  self.top_k, self.num_experts)
            local = F.one_hot(idx, self.num_experts).sum(0)         # (k, E)
            keep, kept_all = capacity_keep(idx, self.gather_counts(local), self.rank, cap)
            # kept: a device scalar, read by the statistics after the step, not here
            rec.update(kept_all=kept_all, kept=kept_all.sum(), capacity=cap)
        return self.dispatch_combine(x, w, idx, keep, rec).reshape(b, s, h)   # (N, H) -> (B, S, H)

    def gather_counts(self, local):
        return local[None]


class ReferenceMoE(MoEBlock):
    """Single device, where HF has no equivalent (the aux-free bias): route() and the global
    batch's drops applied as zero weights, then HF's own experts. A bug planted in
    route() reaches it too, as a real one would."""

    def __init__(self, hf_block, stats, opts):
        super().__init__(hf_block, stats, opts)
        self.experts = hf_block.experts

    def dispatch_combine(self, x, w, idx, keep, rec):
        if keep is not None:
            w = w * keep
        return self.experts(x, idx, w)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient (torch._grouped_mm's backward
    rejects an expanded one, e.g. the gradient of a .sum())."""

    @staticmethod
    def forward(ctx, x):                 # any shape, unchanged: (R, 2I) or (R, H) here
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):             # x's shape
        return grad.contiguous()


_GROUPED_MM_OK: dict = {}


def grouped_mm_works(device, dtype, dims) -> bool:
    """Whether torch._grouped_mm (a private op: CPU and CUDA in torch 2.11-2.13, float32 /
    bfloat16 / float16, no float64; rows strided in multiples of 16 bytes) runs forward and
    backward here. Probed once per (device, dtype, dims) on a tiny problem with an empty group."""
    key = (torch.device(device).type, dtype, tuple(dims))
    if key not in _GROUPED_MM_OK:
        ok = hasattr(torch, "_grouped_mm") and all(d * dtype.itemsize % 16 == 0 for d in dims)
        if ok:
            h, o = dims[0], dims[1]
            try:       # (with gradients even when called under no_grad / inference_mode)
                with torch.inference_mode(False), torch.enable_grad():
                    a = torch.ones(3, h, dtype=dtype, device=device, requires_grad=True)
                    b = torch.ones(3, o, h, dtype=dtype, device=device, requires_grad=True)
                    offs = torch.tensor([1, 1, 3], dtype=torch.int32, device=device)
                    y = torch._grouped_mm(a, b.transpose(1, 2), offs=offs)   # (3, h) -> (3, o)
                    _ContiguousGrad.apply(y).sum().backward()
            except (RuntimeError, NotImplementedError):
                ok = False
        _GROUPED_MM_OK[key] = ok
    return _GROUPED_MM_OK[key]


class LocalExperts(nn.Module):
    """This rank's slice [first, first + n) of HF's fused expert weights, under HF's names and
    layout (gate_up_proj (n, 2I, H), down_proj (n, H, I): full_grads()/full_params() gather them
    back into HF's (E, ...) tensors), applied to rows grouped by expert (counts[e] rows each).

    The n experts run as one grouped computation, not a Python loop of 2n matmuls (impl):
      grouped_mm  torch._grouped_mm over the ragged groups (offsets = cumsum(counts), no
                  padding): CPU and CUDA, float32/bfloat16/float16, where grouped_mm_works();
      bmm         portable (float64 included): the rows packed into an (n, C, H) buffer, C =
                  max(counts), each expert's rows first and zero padding after; two
                  torch.bmm; the padded rows are never read back, so they add nothing to the
                  output, and their zero gradients add nothing to the weights' (sum of
                  x_pad^T g_pad over rows). Cost n C instead of sum(counts) rows;
      loop        the per-expert loop (the oracle the tests compare the grouped paths with);
      auto        grouped_mm where it works, else bmm."""
    IMPLS = ("auto", "grouped_mm", "bmm", "loop")

    def __init__(self, hf_experts, first: int, n: int, impl: str = "auto"):
        super().__init__()
        if impl not in self.IMPLS:
            raise ValueError(f"experts impl {impl!r} not in {self.IMPLS}")
        # (E, 2I, H) -> [n, 2I, H] and (E, H, I) -> [n, H, I]: experts first .. first + n
        self.gate_up_proj = nn.Parameter(hf_experts.gate_up_proj.detach()[first:first + n].clone())
        self.down_proj = nn.Parameter(hf_experts.down_proj.detach()[first:first + n].clone())
        self.act_fn = hf_experts.act_fn
        self.impl = impl
        if impl == "auto" and not self.down_proj.is_meta:
            self.which(self.down_proj)   # grouped_mm_works's probe now, not inside a step

    def which(self, x) -> str:
        if self.impl != "auto":
            return self.impl
        two_i, h = self.gate_up_proj.shape[1:]
        return ("grouped_mm" if grouped_mm_works(x.device, x.dtype, (h, two_i, two_i // 2))
                else "bmm")

    def forward(self, x, counts: list[int], device_counts: torch.Tensor | None = None):
        """x (R, H) -> (R, H): R = sum(counts) rows grouped by expert. counts: rows per local
        expert as host ints (the shapes); device_counts: the same on x's device, where the
        caller has them (the grouped paths' offsets and slots are then computed there: a tensor
        built from the host list is a host-to-device copy per layer)."""
        if not sum(counts):                      # no rows at all: keep the weights in the graph
            return self._loop(x, counts)
        if device_counts is None:
            device_counts = torch.tensor(counts, device=x.device)
        return getattr(self, "_" + self.which(x))(x, counts, device_counts)

    def _loop(self, x, counts, device_counts=None):
        outs, off = [], 0
        for e, n in enumerate(counts):          # x: rows grouped by local expert, counts[e] each
            # x's n rows (n, H) -> (n, 2I) -> 2 x (n, I) (n = counts[e] here)
            gate, up = F.linear(x[off:off + n], self.gate_up_proj[e]).chunk(2, dim=-1)
            outs.append(F.linear(self.act_fn(gate) * up, self.down_proj[e]))
            off += n
        return torch.cat(outs)                  # (R, H)

    def _grouped_mm(self, x, counts, device_counts):
        # (R, H) x (n, H, 2I) -> (R, 2I), row block e through expert e (offs: block ends)
        offs = device_counts.cumsum(0).to(torch.int32)
        gu = torch._grouped_mm(x.contiguous(), self.gate_up_proj.transpose(1, 2), offs=offs)
        gate, up = _ContiguousGrad.apply(gu).chunk(2, dim=-1)            # 2 x (R, I)
        # (R, I) x (n, I, H) -> (R, H)
        y = torch._grouped_mm(self.act_fn(gate) * up, self.down_proj.transpose(1, 2), offs=offs)
        return _ContiguousGrad.apply(y)

    def _bmm(self, x, counts, device_counts):
        n, C, H = len(counts), max(counts), x.shape[-1]      # C: the most rows of an expert
        # row r of expert e -> slot e C + r of the padded buffer
        cnt = device_counts
        e_of_row = torch.repeat_interleave(torch.arange(n, device=x.device), cnt,
                                           output_size=x.shape[0])
        slot = (torch.arange(x.shape[0], device=x.device) + e_of_row * C
                - (cnt.cumsum(0) - cnt)[e_of_row])
        xp = x.new_zeros(n * C, H).index_copy(0, slot, x).view(n, C, H)     # (n, C, H)
        # (n, C, H) x (n, H, 2I) -> (n, C, 2I) -> 2 x (n, C, I)
        gate, up = torch.bmm(xp, self.gate_up_proj.transpose(1, 2)).chunk(2, dim=-1)
        y = torch.bmm(self.act_fn(gate) * up, self.down_proj.transpose(1, 2))  # (n, C, H)
        return y.reshape(n * C, H).index_select(0, slot)   # (n*C, H) -> (R, H): padding dropped


class ExpertParallelMoE(MoEBlock):
    def __init__(self, hf_block, stats, opts, group):
        super().__init__(hf_block, stats, opts)
        self.group = group
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.local = self.num_experts // self.world
        self.experts = LocalExperts(hf_block.experts, self.rank * self.local, self.local,
                                    getattr(opts, "experts_impl", "auto"))

    def gather_counts(self, local):
        out = local.new_empty((self.world * local.shape[0],) + tuple(local.shape[1:]))
        dist.all_gather_into_tensor(out, local.contiguous(), group=self.group)  # (k, E) -> (W*k, E)
        return out.view((self.world,) + tuple(local.shape))                   # (W, k, E)

    def dispatch_combine(self, x, w, idx, keep, rec):
        N, k = idx.shape
        W, El, E = self.world, self.local, self.num_experts
        flat_e, flat_w = idx.reshape(-1), w.reshape(-1)          # (N, k) -> (N*k,)
        flat_t = torch.arange(N, device=x.device).repeat_interleave(k)   # (N*k,) token of each
        if keep is not None:   # a dropped choice goes to "expert E": sorted last, never sent
            flat_e = flat_e.masked_fill(~keep.reshape(-1), E)
        # 2. sort by expert = by destination rank (stable: token order inside each expert)
        order = torch.argsort(flat_e, stable=True)
        e_s, t_s, w_s = flat_e[order], flat_t[order], flat_w[order]
        send = expert_counts(e_s, E + 1)[:E]                        # rows per expert, (E,)
        # 3. counts: recv[s, e] rows from rank s for my local expert e
        if keep is None:
            recv = torch.empty_like(send)
            dist.all_to_all_single(recv, send, group=self.group)   # (E,): W blocks of E/W
            recv = recv.view(W, El)                                # (E,) -> (W, E/W)
        else:
            recv = rec["kept_all"].sum(1)[:, self.rank * El:(self.rank + 1) * El]   # (W, E/W)
        # The layer's one host read: all_to_all_single takes its splits as Python ints (the
        # backward reuses them). Everything below is sized from this one list.
        sizes = torch.cat([send.view(W, El).sum(1), recv.reshape(-1)]).tolist()   # (W + E,)
        send_splits, recv_m = sizes[:W], [sizes[W + s * El:W + (s + 1) * El] for s in range(W)]
        recv_splits = [sum(r) for r in recv_m]
        per_expert = [sum(r[e] for r in recv_m) for e in range(El)]
        n_sent = sum(send_splits)                 # < N k with capacity: the dropped rows last
        e_s, t_s, w_s = e_s[:n_sent], t_s[:n_sent], w_s[:n_sent]   # (N*k,) -> (n_sent,)
        # 4. dispatch: n_sent rows out, R = sum(recv_splits) rows in
        xr = self.exchange(x[t_s], recv_splits, send_splits)   # (n_sent, H) -> (R, H)
        # 5. local experts on expert-major rows (arrivals are source-major)
        expert_of_row = torch.arange(El, device=x.device).repeat(W).repeat_interleave(
            recv.reshape(-1), output_size=sum(recv_splits))          # (R,)
        perm = torch.argsort(expert_of_row, stable=True)
        y = self.experts(xr[perm], per_expert, recv.sum(0))   # (R, H); (E/W,) on the device too
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(perm.numel(), device=x.device)
        if planted("combine-wrong-order"):   # plant: un-sorts with perm, not its inverse
            inv = perm
        # 6. combine: back to the senders, weighted, each row to its (token, choice) slot (the
        # slots are distinct: no atomic adds, the same bits on every run), summed over the k
        yb = self.exchange(y[inv], send_splits, recv_splits)   # (R, H) -> (n_sent, H)
        slots = x.new_zeros(N * k, x.shape[-1]).index_copy(0, order[:n_sent],   # (N*k, H)
                                                           (yb * w_s[:, None]).to(x.dtype))
        return slots.view(N, k, -1).sum(1)                     # (N*k, H) -> (N, k, H) -> (N, H)

    def exchange(self, rows, out_splits: list[int], in_splits: list[int]):
        """The all-to-all of rows: in_splits[r] of `rows` go to rank r, out_splits[r] come
        from rank r (differentiable: the backward is the reverse exchange)."""
        return AllToAll.apply(rows, out_splits, in_splits, self.group)


def install(model, make_block) -> list[MoEBlock]:
    """Swap every decoder layer's MixtralSparseMoeBlock for make_block(hf_block), in place."""
    blocks = []
    for layer in model.model.layers:
        layer.mlp = make_block(layer.mlp)
        blocks.append(layer.mlp)
    return blocks


class _NoStats(list):
    """Routing statistics nobody reads: not kept (a plain list would grow every forward)."""
    def append(self, rec):
        pass


def parallelize(model, group, capacity_factor: float | None = None, aux_free_bias=False,
                z_coef: float = 0.0, stats: list | None = None, experts_impl: str = "auto"):
    """Expert parallelism for an HF Mixtral-family model over the ranks of `group`, in place
    (the entry the harness and users call): each rank keeps E/W experts, every MoE block
    dispatches its rows to the experts' ranks and combines them back (all_to_all_single).
    Returns the blocks; `stats` collects each block's routing counts per forward (the router
    losses: router_losses(stats, ...)). Everything else stays replicated: wrap the model in
    ddp.DataParallel(model, dp_group, params=[non-expert parameters], average=False) with
    each rank's loss its share of the global objective (see ExpertParallel.step).
    experts_impl: how the local experts run (LocalExperts: auto, grouped_mm, bmm, loop)."""
    opts = types.SimpleNamespace(capacity_factor=capacity_factor, aux_free_bias=aux_free_bias,
                                 z_coef=z_coef, experts_impl=experts_impl)
    stats = _NoStats() if stats is None else stats
    blocks = install(model, lambda b: ExpertParallelMoE(b, stats, opts, group))
    if dist.get_world_size(group) > 1:   # E/W experts under each expert tensor's name
        refuse_state_dict(model, "ep: each rank holds E/W experts under every expert tensor's "
                          "name, which torch.distributed.checkpoint would save as all E; save "
                          "gather_experts(dict(model.named_parameters()), group)")
    return blocks


def is_expert(name: str) -> bool:
    return ".experts." in name


def gather_experts(tensors: dict, group, to_first: bool = False) -> dict:
    """Full (n_experts, ...) expert tensors from every ep rank's slice (collective over the ep
    group; the other tensors as they are); to_first: on the group's first rank only (a
    checkpoint's writer: the others keep their slices, and no other rank holds E times its
    experts' state)."""
    W, me = dist.get_world_size(group), dist.get_rank(group)
    out = {}
    for n, t in tensors.items():
        if is_expert(n) and W > 1:
            t = t.contiguous()
            if to_first:
                parts = [torch.empty_like(t) for _ in range(W)] if me == 0 else None
                dist.gather(t, parts, group_dst=0, group=group)   # [E/W, ...] from each rank
                t = torch.cat(parts) if me == 0 else t           # W x [E/W, ...] -> [E, ...]
            else:
                full = t.new_empty((W * t.shape[0],) + tuple(t.shape[1:]))
                dist.all_gather_into_tensor(full, t, group=group)   # [E/W, ...] -> [E, ...]
                t = full
        out[n] = t
    return out


# ----------------------------------------------------------------------------------------------
# Formulas (rig/ep_moe.py, compose_moe.py and trainer4d/plan.py count with these)
# ----------------------------------------------------------------------------------------------
# per MoE layer and micro-batch: the token rows' dispatch and combine, forward and backward,
# k N H b each when dropless (N: the rank's tokens); and the (W, E) counts' one exchange
TOKEN_ALL_TO_ALLS, COUNT_ALL_TO_ALLS = 4, 1

if __name__ == "__main__":   # torchrun ep_moe.py --mode ...: the test rig runs it
    from rig.ep_moe import main
    main()
