"""muon.py: Muon when the matrices are sharded, from raw torch.distributed primitives.

The idea (Jordan et al. 2024, "Muon: an optimizer for hidden layers in neural networks"; Liu et
al. 2025, "Muon is Scalable for LLM Training")
    For each hidden weight matrix W [A, B] with gradient G (torch.optim.Muon's update, read from
    its code): M = lerp(M, G, 1 - mu)  (an EMA);  U = lerp(G, M, mu)  (nesterov);
    O = NS5(U) ~ the orthogonal factor of U's SVD;  W -= lr wd W;  W -= lr sqrt(max(1, A/B)) O.
    Newton-Schulz: X = U / |U|_F, turned wide (m <= n); 5 times A = X X^T, X = aX + (bA + cA^2)X.
    Embeddings, the LM head, norms, biases and 3-D expert stacks take AdamW (harness's
    hidden_matrix: one split rule for the reference and every strategy).
    Everything but NS is elementwise, so it shards like AdamW. NS needs the whole matrix: the
    question each layout must answer is who holds it.
      replicated  DDP, Ulysses: every rank holds every matrix: NS duplicated W times, no comm.
      owner       ZeRO's flat shards (FSDP's dim-0 shards) cut matrices: each matrix has one
                  owner (balanced by NS FLOPs); an all_to_all sends the pieces of its update to
                  the owner, which runs NS; a second sends them back (OwnerPlan): 2 calls,
                  ~2 Psi_m / W elements per rank. compose4d: owners over dp x cp, each owned
                  matrix then tp-gathered by the tp ranks that own its other shards.
      gather      each unit's update all-gathered (flat [s] -> [W s]), NS on every matrix the
                  rank's shard touches: one all_gather per unit, Psi_m per rank.
      tp-gather   TP's shards: each matrix's update all-gathered over the tp group (tp.full),
                  NS on the whole, this rank's shard kept (tp.local). NS duplicated T times.
      blockwise   NS on each shard as if it were the matrix: not Muon (plant muon-blockwise).
    NS costs steps (4 m^2 n + 2 m^3) FLOPs per matrix, m <= n (ns_flops). It runs in bfloat16 for
    bf16 models (torch's), in the parameter's dtype for float32 and float64 ones (the exact mode
    the float64 proofs need). More: docs/internals.md, 'muon.py'; docs/muon.md.

Public API
    opt = build(model, lr=1e-3, muon_lr=0.02, tpm=None)   a torch optimizer: Muon on the hidden
        matrices, torch's AdamW on the rest (MuonAdamW; MasterMuon's fp32 masters for bf16);
        tpm = tp.parallelize(...)'s: tp-gather; a model after fsdp.fully_shard: owner.
    zero.ZeroOptimizer(param_groups(model.named_parameters(), lr, muon_lr), MuonAdamW,
                       stage=1|2, shard_mode="owner"|"gather")   on ZeRO's flat shards

Run:  torchrun --nproc_per_node=2 muon.py --mode correctness   (zero.py's rig, --optimizer muon)
"""
import math
from typing import NamedTuple

import torch
import torch.distributed as dist

from harness import like, local_part, planted
from harness.models import hidden_matrix
from harness.precision import Masters, adamw_update

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)   # torch.optim.Muon's (Keller Jordan's) quintic
NS_STEPS, NS_EPS = 5, 1e-7


def newton_schulz(G: torch.Tensor, steps: int = NS_STEPS, dtype=torch.bfloat16,
                  eps: float = NS_EPS) -> torch.Tensor:
    """torch.optim.Muon's orthogonalisation of a 2-D G [A, B], computed in `dtype`: 5 quintic
    iterations on X = G / |G|_F, taken wide (A > B: on G^T). Returns [A, B] in `dtype`."""
    a, b, c = NS_COEFFICIENTS
    X = G.to(dtype)
    if G.size(0) > G.size(1):
        X = X.T                                        # [A, B] -> [B, A], m <= n
    X = X / X.norm().clamp(min=eps)
    for _ in range(steps):
        gram = X @ X.T                                 # [m, n] @ [n, m] -> [m, m]
        X = torch.addmm(X, torch.addmm(gram, gram, gram, beta=b, alpha=c), X, beta=a)  # [m, n]
    return X.T if G.size(0) > G.size(1) else X


def lr_scale(shape) -> float:
    """torch's 'original' adjustment: sqrt(max(1, A/B)) of the *whole* matrix's shape."""
    return math.sqrt(max(1.0, shape[0] / shape[1]))


def ns_flops(shape, steps: int = NS_STEPS) -> int:
    """Newton-Schulz FLOPs for one matrix: per step X X^T (2 m^2 n), the m x m polynomial
    (2 m^3), its product with X (2 m^2 n); m <= n."""
    m, n = sorted(shape[:2])
    return steps * (4 * m * m * n + 2 * m ** 3)


def param_groups(named, lr: float, muon_lr: float):
    """Two groups by the one split rule (harness.models.hidden_matrix): the hidden matrices
    (muon=True, lr muon_lr) and the rest (AdamW, lr). Named parameters -> torch groups."""
    named = [(n, p) for n, p in named if p.requires_grad]
    mats, rest = ([p for n, p in named if hidden_matrix(n, p.shape) == m] for m in (True, False))
    return [dict(params=mats, muon=True, lr=muon_lr), dict(params=rest, muon=False, lr=lr)]


class MuonAdamW(torch.optim.Optimizer):
    """torch.optim.Muon's update on the groups marked muon=True, torch's AdamW on the others,
    one torch optimizer (schedulers, state_dict). Its states are elementwise: momentum_buffer;
    step, exp_avg, exp_avg_sq (torch's names). NS sees whole matrices through
    `self.orthogonalize(opt, params, updates, group) -> [(O, lr scale)]` (default: each
    parameter is a whole matrix, `local`); a sharded layout swaps it (on_shards for ZeRO and
    compose4d, tp_gather for TP, fsdp_owner for FSDP: `build` picks). ns_dtype:
    Newton-Schulz's (torch's bfloat16; None: the parameters' own, the exact mode). eps is
    AdamW's (torch.optim.Muon's eps is Newton-Schulz's, NS_EPS here)."""

    def __init__(self, params, lr=1e-3, weight_decay=0.1, momentum=0.95, nesterov=True,
                 ns_steps=NS_STEPS, ns_dtype=torch.bfloat16, betas=(0.9, 0.95), eps=1e-8,
                 shard_mode="owner"):
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, momentum=momentum,
                                      nesterov=nesterov, ns_steps=ns_steps, ns_dtype=ns_dtype,
                                      betas=betas, eps=eps, muon=False, shard_mode=shard_mode))
        self.orthogonalize = local
        self.names = {}     # parameter -> the model's name (tp_gather; the harness's checks)

    @torch.no_grad()
    def step(self, closure=None):
        with torch.enable_grad():
            loss = closure() if closure is not None else None
        for g in self.param_groups:
            ps = [p for p in g["params"] if p.grad is not None]
            if g["muon"]:
                self._muon(g, ps)
            elif ps:
                adamw_update(self.state, g, ps)   # torch's AdamW (harness.precision)
        return loss

    def _muon(self, g, ps):
        mu, updates = g["momentum"], []
        for p in ps:
            if "momentum_buffer" not in self.state[p]:
                self.state[p]["momentum_buffer"] = torch.zeros_like(p)
            buf = self.state[p]["momentum_buffer"]
            buf.lerp_(p.grad, 1 - mu)
            updates.append(p.grad.lerp(buf, mu) if g["nesterov"] else buf)
        for p, (o, scale) in zip(ps, self.orthogonalize(self, ps, updates, g)):
            p.mul_(1 - g["lr"] * g["weight_decay"])       # (torch's: the unadjusted lr)
            p.add_(o, alpha=-g["lr"] * scale)

    @staticmethod
    def ns_dtype(g, t):
        """Newton-Schulz's dtype for the group g's matrices held in t's dtype."""
        return g["ns_dtype"] or t.dtype

    def on_shards(self, zopt, tpm=None):
        """zero.ZeroOptimizer calls this once built: this optimizer's parameters are then flat
        runs of ZeRO's shards; shard_mode "owner" (each matrix to one rank: OwnerPlan) or
        "gather" (every unit's updates to every rank: zero_gather). Called again with tpm
        (compose4d: ZeRO's shards of tp.parallelize's shards): owner, each owned matrix then
        gathered whole over the tp group."""
        mode = self.param_groups[0]["shard_mode"]
        if mode not in ("owner", "gather") or (tpm is not None and mode != "owner"):
            raise ValueError(f"MuonAdamW on ZeRO's shards: shard_mode {mode!r} "
                             f"({'owner' if tpm is not None else 'owner, gather'})")
        if sum(g["muon"] for g in self.param_groups) > 1:   # (one plan covers all the matrices)
            raise ValueError("MuonAdamW on ZeRO's shards: one parameter group with muon=True")
        self.orthogonalize = zero_owner(zopt, tpm) if mode == "owner" else zero_gather(zopt)


class MasterMuon(Masters, MuonAdamW):
    """MuonAdamW over fp32 masters of low-precision parameters (momentum and AdamW states fp32)."""


def build(model, lr: float, muon_lr: float, tpm=None, **kw) -> MuonAdamW:
    """The optimizer for a module this rank holds whole (replicated: DDP), split by
    tp.parallelize (tpm: tp-gather), or sharded by fsdp.fully_shard (its dim-0 shards: the
    owner mode, fsdp_owner): MuonAdamW, or MasterMuon for a bf16/fp16 module; `kw` MuonAdamW's
    settings. ZeRO's flat shards: zero.ZeroOptimizer(param_groups(...), MuonAdamW)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    low = any(p.dtype in (torch.bfloat16, torch.float16) for _, p in named)
    opt = (MasterMuon if low else MuonAdamW)(param_groups(named, lr, muon_lr), **kw)
    held = [q for g in opt.param_groups for q in g["params"]]         # (the masters, if any)
    model_of = dict(zip(held, getattr(opt, "model_params", held)))    # held -> the module's
    name_of = {id(p): n for n, p in named}
    opt.names = {q: name_of[id(p)] for q, p in model_of.items()}
    if tpm is not None:
        opt.orthogonalize = tp_gather(tpm, opt.names)
    mats = [q for g in opt.param_groups if g["muon"] for q in g["params"]]
    sharded = [getattr(model_of[q], "_fsdp_param", None) for q in mats]
    if any(sp is not None for sp in sharded):          # fsdp.py's shards (or their masters)
        if tpm is not None or any(sp is None for sp in sharded):
            raise ValueError("muon.build: Muon's matrices must be all sharded by fsdp.fully_shard "
                             "(none ignored) and not split by tp as well")
        opt.orthogonalize = fsdp_owner(mats, opt.names, sharded)
        opt.shard_aware = True   # (fsdp.py refuses a matrix optimizer that is not)
    return opt


def local(opt, ps, updates, g):
    """Each parameter is a whole matrix (replicated, or one owner's): NS on it, scaled."""
    return [(newton_schulz(u, g["ns_steps"], opt.ns_dtype(g, p)), lr_scale(p.shape))
            for p, u in zip(ps, updates)]


def tp_gather(tpm, names: dict):
    """tp-gather: each matrix's update all-gathered over the tp group (tpm.full), NS on the
    whole, this rank's shard kept (tpm.local). names: parameter -> the model's name."""
    def orthogonalize(opt, ps, updates, g):
        keys = [names[p] for p in ps]
        if planted("muon-blockwise"):   # plant: NS on each (local) shard as if the matrix
            return [(like(p, o), c) for p, (o, c) in zip(ps, local(
                opt, [local_part(p) for p in ps], [local_part(u) for u in updates], g))]
        full = tpm.full(dict(zip(keys, updates)))     # T x [A/T, B] -> [A, B] (or columns)
        shape = {k: (local_part(u).shape if planted("muon-lr-by-shard") else full[k].shape)
                 for k, u in zip(keys, updates)}   # (plant: the shard's)
        return [(like(p, tpm.local(k, newton_schulz(full[k], g["ns_steps"], opt.ns_dtype(g, p)))),
                 lr_scale(shape[k])) for k, p in zip(keys, ps)]   # (like p: tp's DTensor labels)
    return orthogonalize


def muon_params(zopt) -> set:
    """The parameters of zopt's groups with muon=True."""
    return {p for g in zopt.param_groups if g["muon"] for p in g["params"]}


def matrix_units(zopt) -> list:
    """[(index, unit)] of ZeRO's units that hold a Muon matrix (every rank: the same list)."""
    mats = muon_params(zopt)
    return [(ui, u) for ui, u in enumerate(zopt.engine.units) if any(p in mats for p in u.params)]


def zero_gather(zopt):
    """gather, on ZeRO's flat units: the update shard of each unit holding matrices, flat [s],
    all-gathered to [W s]; NS on each matrix this rank's shard touches; its slice kept."""
    mats, units = muon_params(zopt), matrix_units(zopt)

    def orthogonalize(opt, views, updates, g):
        shards = zopt.runs_to_shards([ui for ui, _ in units], views, updates)   # flat [s] each
        out = {}
        for ui, u in units:
            full = shards[ui].new_zeros(u.padded)
            if planted("muon-no-gather"):   # plant: NS on this rank's shard, zeros elsewhere
                full[u.lo:u.lo + u.shard_numel] = shards[ui]
            else:
                dist.all_gather_into_tensor(full, shards[ui], group=u.group)   # [s] -> [W s]
            mine = torch.zeros_like(shards[ui])                            # flat [s]
            for p, off in zip(u.params, u.offsets):
                a, b = max(off, u.lo), min(off + p.numel(), u.lo + u.shard_numel)
                if p in mats and a < b:     # a matrix this shard touches
                    o = newton_schulz(full[off:off + p.numel()].view(p.shape), g["ns_steps"],
                                      opt.ns_dtype(g, full))               # [A, B]
                    mine[a - u.lo:b - u.lo] = (o.reshape(-1)[a - off:b - off].to(mine.dtype)
                                               * lr_scale(p.shape))
            out[ui] = mine
        return zopt.shards_to_runs(views, out)
    return orthogonalize


class Matrix(NamedTuple):
    """A Muon matrix that the ranks hold in pieces: its name, its parameter (tp-local under
    compose4d; FSDP: a meta tensor of the whole shape), and `held`, the flat range [a, b) of it
    (row-major) that each rank of the group holds (empty: a == b). ZeRO: where the flat shards
    cut its unit (unit_index, unit, offset: its place in the unit's flat [W s] buffer); FSDP:
    each rank's rows."""
    name: str
    param: torch.Tensor
    held: list
    unit_index: int = -1
    unit: object = None
    offset: int = 0


class OwnerPlan:
    """owner (one rank per matrix, as Megatron's LayerWiseDistributedOptimizer and nanochat's
    DistMuon assign them; they align buffers to whole matrices, so need no all-to-all): each
    matrix whole to one rank, balanced by Newton-Schulz FLOPs (largest first, to the least loaded
    rank). Per step: one all_to_all sends every rank's pieces of each matrix's update to its
    owner, the owner runs NS on its matrices, a second all_to_all sends each piece of the result
    back to the rank that holds it. Every rank computes the same plan. Built for ZeRO's flat
    units (zero_owner) and fsdp.py's dim-0 shards (fsdp_owner); called as an orthogonalize hook.
    tpm (compose4d): the parameters are tp.parallelize's shards too; an owner then holds its
    matrices' tp shards, and the tp ranks that hold the other shards own the same matrices (the
    same plan on every tp rank): each owned update is all-gathered over the tp group (tpm.full),
    NS runs on the whole, each keeps its tp shard (tpm.local). NS duplicated T times."""

    def __init__(self, mats: list[Matrix], group, rank: int, like: torch.Tensor, pieces, place,
                 tpm=None):
        self.mats, self.group, self.me, self.like, self.tpm = mats, group, rank, like, tpm
        self.pieces = pieces    # (params, updates) -> {i: flat [b - a]}: this rank's pieces
        self.place = place      # (params, {i: flat [b - a]}) -> [(O, lr scale)] per parameter
        W = dist.get_world_size(group)
        for m in mats:   # the ranks' pieces tile the matrix, in rank order
            spans = [(a, b) for a, b in m.held if a < b]
            starts, stops = [a for a, _ in spans], [b for _, b in spans]
            if len(m.held) != W or starts != [0] + stops[:-1] or stops[-1:] != [m.param.numel()]:
                raise ValueError(f"muon owner mode: {m.name}'s pieces do not tile it: {m.held}")
        self.flops = [0] * W                # each rank's Newton-Schulz FLOPs per step
        self.owner = [0] * len(mats)
        cost = [ns_flops(self.shape(m)) for m in mats]
        for i in sorted(range(len(mats)), key=lambda i: -cost[i]):   # largest first,
            r = min(range(W), key=lambda r: self.flops[r])              # least loaded rank
            self.owner[i] = r
            self.flops[r] += cost[i]
        self.sends = [[] for _ in range(W)]   # to owner d: [(matrix i, a, b)] of mine
        self.recvs = [[] for _ in range(W)]   # from rank r: [(matrix i, a, b)] I own
        for i, m in enumerate(mats):
            for r, (a, b) in enumerate(m.held):
                if a < b and r == rank:
                    self.sends[self.owner[i]].append((i, a, b))
                if a < b and self.owner[i] == rank:
                    self.recvs[r].append((i, a, b))

    def __call__(self, opt, params, updates, g):
        mine, like = self.pieces(params, updates), self.like            # {i: flat [b - a]}
        send = torch.cat([mine[i] for d in self.sends for i, _, _ in d]
                         or [like.new_zeros(0)])                        # [my matrix elements]
        received = self._exchange(send, self.sends, self.recvs)         # [elements I own]
        assembled, k = {}, 0        # each owned matrix from its holders' pieces (tp-local)
        for r in self.recvs:
            for i, a, b in r:
                if i not in assembled:
                    assembled[i] = like.new_empty(self.mats[i].param.numel())   # [A B]
                assembled[i][a:b] = received[k:k + b - a]
                k += b - a
        out, owned = {}, sorted(assembled)   # Newton-Schulz on the matrices this rank owns
        whole = {self.mats[i].name: assembled[i].view(self.mats[i].param.shape) for i in owned}
        tpm = None if planted("muon-blockwise") else self.tpm   # plant: NS on the tp shards
        if tpm is not None:
            whole = tpm.full(whole)      # T x [A/T, B] -> [A, B] (or columns), over tp
        for i in owned:
            name = self.mats[i].name
            # (plant muon-lr-by-shard: the scale from the tp shard's shape, not the matrix's)
            shape = self.mats[i].param.shape if planted("muon-lr-by-shard") else \
                whole[name].shape
            o = newton_schulz(whole[name], g["ns_steps"], opt.ns_dtype(g, assembled[i]))
            if tpm is not None:
                o = tpm.local(name, o)                              # [A, B] -> this tp shard
            out[i] = (o.to(like.dtype) * lr_scale(shape)).reshape(-1)   # -> flat [A B / T]
        back = torch.cat([out[i][a:b] for r in self.recvs for i, a, b in r]
                         or [like.new_zeros(0)])
        returned = self._exchange(back, self.recvs, self.sends)         # [my matrix elements]
        result, k = {}, 0
        for d in self.sends:
            for i, a, b in d:
                result[i] = returned[k:k + b - a]
                k += b - a
        return self.place(params, result)

    def shape(self, m: Matrix) -> tuple:
        """m's whole shape (the tp group's, under tpm)."""
        return tuple(m.param.shape) if self.tpm is None else self.tpm.full_shape(m.name,
                                                                                m.param.shape)

    def _exchange(self, send, out_plan, in_plan):
        """One all_to_all: [pieces for rank 0 | rank 1 | ...] -> [pieces from rank 0 | ...]."""
        out_splits = [sum(b - a for _, a, b in d) for d in out_plan]
        in_splits = [sum(b - a for _, a, b in r) for r in in_plan]
        recv = send.new_empty(sum(in_splits))
        dist.all_to_all_single(recv, send, in_splits, out_splits,           # [sum of splits]
                               group=self.group)
        if planted("muon-owner-keeps-update"):   # plant: the update not sent back
            recv = recv.zero_() if in_plan is self.sends else recv
        return recv


def cut(off: int, n: int, a: int, b: int) -> tuple[int, int]:
    """[off, off + n) intersected with [a, b), relative to off (empty: start == stop)."""
    start = min(max(off, a), off + n) - off
    return start, max(min(off + n, b) - off, start)


def zero_owner(zopt, tpm=None) -> OwnerPlan:
    """owner on ZeRO's flat units: matrix i's piece on rank r is where r's shard [r s, (r+1) s)
    of its unit's flat buffer cuts it."""
    mats = muon_params(zopt)
    ms = [Matrix(n, p, [cut(off, p.numel(), r * u.shard_numel, (r + 1) * u.shard_numel)
                        for r in range(u.world)], ui, u, off)
          for ui, u in enumerate(zopt.engine.units)
          for p, off, n in zip(u.params, u.offsets, u.names) if p in mats]
    if len({id(m.unit.group) for m in ms}) > 1:
        raise ValueError("muon owner mode: the matrices are sharded over different groups")
    units = sorted({m.unit_index for m in ms})

    def pieces(views, updates):               # the runs' updates -> each matrix's piece
        shards = zopt.runs_to_shards(units, views, updates)              # flat [s] each
        out = {}
        for i, m in enumerate(ms):
            a, b = m.held[m.unit.rank]
            if a < b:
                at = m.offset - m.unit.lo         # the matrix's start, in this rank's shard
                out[i] = shards[m.unit_index][at + a:at + b]
        return out

    def place(views, result):                 # each piece back into its unit's shard
        shards = {ui: torch.zeros_like(zopt.masters[ui]) for ui in units}
        for i, o in result.items():
            m = ms[i]
            a, b = m.held[m.unit.rank]
            at = m.offset - m.unit.lo
            shards[m.unit_index][at + a:at + b] = o
        return zopt.shards_to_runs(views, shards)
    group = ms[0].unit.group if ms else zopt.engine.units[0].group
    return OwnerPlan(ms, group, dist.get_rank(group), zopt.masters[0], pieces, place, tpm)


def fsdp_owner(params, names: dict, sharded) -> OwnerPlan:
    """owner on fsdp.py's shards: rank r's piece of a matrix is its rows [r c, (r+1) c), flat
    (c = ceil(rows / W), torch.chunk's cut), over the units' shard group. params: the DTensors
    the optimizer steps (shards or fp32 masters; their local rows are the pieces, each result
    labelled again); sharded: their fsdp.ShardedParam (the whole shape, the cut, the unit)."""
    units = {id(sp.sharded._fsdp_unit.group): sp.sharded._fsdp_unit for sp in sharded}
    if len(units) > 1:
        raise ValueError("muon owner mode: the matrices are sharded over different groups")
    unit = next(iter(units.values()))
    group, W, me = unit.group, unit.world, unit.rank
    ms = []
    for p, sp in zip(params, sharded):
        whole = torch.empty(sp.shape, device="meta")     # (only its shape and numel are read)
        held = [(min(r * sp.rows, sp.shape[0]) * sp.rest,
                 min((r + 1) * sp.rows, sp.shape[0]) * sp.rest) for r in range(W)]
        ms.append(Matrix(names[p], whole, held))
    index, sp_of = {p: i for i, p in enumerate(params)}, dict(zip(params, sharded))
    rows = {p: p.to_local() for p in params}   # (rows_r, B): each DTensor's local rows

    def pieces(ps, updates):                   # (rows_r, B) -> flat [rows_r B]; no gradient
        got = {p: u.to_local() for p, u in zip(ps, updates)}   # no gradient this step: zeros
        return {i: (got[p] if p in got else torch.zeros_like(rows[p])).reshape(-1)
                for p, i in index.items() if rows[p].numel()}

    def place(ps, result):
        return [(sp_of[p].label(result[index[p]].view(rows[p].shape) if rows[p].numel()
                                else torch.zeros_like(rows[p])), 1.0) for p in ps]
    return OwnerPlan(ms, group, me, rows[params[0]], pieces, place)


# ----------------------------------------------------------------------------------------------
# Formulas (rig/zero.py and rig/tp.py count with these)
# ----------------------------------------------------------------------------------------------
def gather_comm(unit_numels, b: int) -> tuple[int, int]:
    """gather's extra traffic per optimizer step under ZeRO: (all_gathers, gathered bytes) = one
    per unit holding a matrix, its W s padded elements of b bytes (the masters' dtype)."""
    return len(unit_numels), sum(unit_numels) * b


def tp_gather_comm(shard_numels, T: int, b: int) -> tuple[int, int]:
    """tp-gather's extra traffic per optimizer step: (all_gathers, gathered bytes) = one per
    T-split matrix, T shards of b bytes per element arriving at every tp rank (A B elements;
    T/kv_heads copies of each kv head when T > kv heads)."""
    return len(shard_numels), T * sum(shard_numels) * b


def tp_distributed_comm(shape, split_dim: int, T: int, b: int,
                        steps: int = NS_STEPS) -> tuple[int, int]:
    """(tp-distributed, tp-gather): the bytes each rank moves (a ring's wire traffic) per step
    for one matrix [A, B] split T ways along split_dim. tp-distributed is not built: this
    formula says it never pays on these models. Newton-Schulz works on the wide X [m, n]
    (m <= n; X = G^T when A > B). tp-gather: one all-gather of X, (T-1)/T m n b. Split along n
    (the Gram X X^T = sum_i X_i X_i^T's contracted dimension): one all-reduce of the m x m Gram
    per iteration, 2 (T-1)/T m^2 b, the update X_i <- a X_i + (bA + cA^2) X_i stays local.
    Split along m, the Gram needs every row of X: nothing better than gathering X once (which
    is tp-gather). So the distributed way is cheaper only when split along n and
    2 steps m < n: a matrix over 10 times wider than tall."""
    m, n = sorted(shape[:2])
    gather = m * n * b * (T - 1) // T
    along_n = (split_dim == 1) == (shape[0] <= shape[1])   # the split dim is X's n
    return (steps * 2 * m * m * b * (T - 1) // T if along_n else gather), gather


if __name__ == "__main__":   # torchrun muon.py --mode ...: the test rig runs it
    from rig.muon import main
    main()
