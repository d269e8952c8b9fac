"""comm.py: compose4d's communication per optimizer step and rank, by group: the rows its
benchmark mode compares with the metered traffic (compose4d.py's docstring states the formulas;
compose_moe.py adds a MoE model's ep, count and edp rows)."""
from harness import DTYPES, Expect, kv_heads
from harness.lora_setup import no_grad_inputs, regathered_regions
import compose_moe
import cp_ring
import muon
import sp
import tp
import zero
import zero_units
from pp_schedule import boundary_messages


def expected_comm(self) -> list[Expect]:
    """compose4d.Parallel4D's communication per step and rank, by group (its docstring's formulas;
    compose_moe.py's rows for a MoE model). `self`: the compose4d.Parallel4D."""
    a, cfg = self.args, self.model.config
    T, P, C, M = a.tp, a.pp, a.cp, a.grad_accum
    D = self.grid.size["dp"]
    b = DTYPES[a.dtype].itemsize
    H = cfg.hidden_size
    n_tok = a.batch // D * a.length // C          # tokens per rank per step
    L_st = sum(len(self.pipe.chunk_layers[c]) for c in self.pipe.my_chunks)
    z = self.zero
    rows = []
    # (a group of one reduces nothing and, at stages 1 and 2, gathers nothing: its shard is the
    # buffer itself; stage 3's gathers restore freed buffers, a group of one's too)
    rs, ag = zero.collectives_per_unit(a.zero, M)
    rb = z.units[0].grad_shard.element_size()   # the reduce dtype's (fp32 for bf16)
    dense = "shard" if a.replicate > 1 else "dpcp"    # (HSDP: dp x cp / R ranks)
    for group, what in ((dense, "Psi_r"), ("edp", "experts' Psi_e,r")):   # (edp: MoE)
        units = [u for u in z.units if (u.group is z.group) == (group == dense)]
        one = bool(units) and units[0].world == 1
        if not units or (one and a.zero < 3):
            continue
        padded = sum(u.padded for u in units)
        n_rs, p_rs = zero_units.reduce_scattered(units)   # (--lora: the adapters only)
        rows += [] if one else [Expect(
            "reduce_scatter_tensor", group, n_rs * rs, p_rs * rb * rs,
            f"ZeRO-{a.zero}: {what}*b_reduce = {p_rs * rb:,} B, one per unit"
            + (" with gradients" if n_rs < len(units) else "")
            + (f", x{M} micro-batches" if rs > 1 else ""))]
        rows += [Expect("all_gather_into_tensor", group, len(units) * ag, padded * b * ag,
                        f"parameters per unit, forward and backward x{M} micro-batches"
                        if a.zero == 3 else "updated parameters, one per unit")]
        if a.zero == 3:   # (--lora: no backward gather before the first unit that trains)
            nb, fb = zero_units.backward_gathers(units, self.model, self.first)
            rows[-1] = Expect("all_gather_into_tensor", group, (len(units) + nb) * M,
                              (padded + fb) * b * M, rows[-1].formula)
    if a.replicate > 1:
        shard = sum(u.shard_numel for u in z.units if u.group is z.group and u.n_grads)
        rows.append(Expect("all_reduce", "replicate", 1, shard * rb,
                           "HSDP: the dense gradient shards summed over the R replicas, once "
                           "per step"))
    if self.env.world > 1:   # (a world of one sums nothing)
        rows.append(Expect("all_reduce", "world", 1, 8, "global gradient norm (fp64)"))
    rows += _muon_rows(self, dense, T)
    rows += compose_moe.expected_comm(self, self.blocks)
    if P > 1:
        act = (a.batch // D // M) * (a.length // C // (T if a.sp else 1)) * H * b
        V = a.virtual_stages if a.schedule == "interleaved" else 1
        n = M * boundary_messages(a.schedule, P, V, self.me["pp"])
        rows += [Expect("isend", "pp", n, n * act, f"M activations out + gradients back per "
                        f"boundary, {act:,} B each"),
                 Expect("irecv", "pp", n, n * act, "the mirror of the sends")]
        if self.pipe.tie_trains():   # (--lora freezes the pair: nothing summed)
            rows.append(Expect("all_reduce", "tied", 1, z.units[0 if self.first else -1]
                               .shard_numel * rb, "tied embedding gradient shard"))
    if C > 1:
        hd = getattr(cfg, "head_dim", None) or H // cfg.num_attention_heads
        kv_local = max(kv_heads(cfg) // T, 1)         # (T > kv heads: one replicated head)
        blk = (a.batch // D // M) * (a.length // C) * 2 * kv_local * hd * b
        per = cp_ring.ring_bytes(C, blk, blk * max(b, 4) // b)   # dK, dV travel in >= fp32
        rows += [Expect(op, "cp", M * L_st * cp_ring.ring_messages(C), M * L_st * per,
                        "ring attention per layer and micro-batch: (C-1) K,V hops forward, "
                        "(C-1) K,V,dK,dV hops backward, dK,dV home") for op in ("isend", "irecv")]
    if T > 1:
        nhb = n_tok * H * b
        n = sp.region_collectives(L_st, self.first, self.last, a.async_tp,
                                  regathered=regathered_regions(self.model, self.last),
                                  no_grad_inputs=no_grad_inputs(self.model))
        if a.sp and a.async_tp:   # async_tp.py: every region collective a ring of T-1 hops
            rings = M * n["ring"]
            hop = nhb // M // T
            if self.first:
                rows.append(Expect("all_gather_into_tensor", "tp", M, nhb,
                                   "SP: the first layer's split (bwd)"))
            rows += [Expect(op, "tp", rings * (T - 1), rings * (T - 1) * hop,
                            f"async TP: M (10 L_r + 3 l) rings x (T-1) hops of {hop:,} B")
                     for op in ("isend", "irecv")]
        elif a.sp:
            ag, rs_ = M * n["all_gather_into_tensor"], M * n["reduce_scatter_tensor"]
            rows += [Expect("all_gather_into_tensor", "tp", ag, ag * nhb // M,
                            "SP: region entries (fwd), re-gathers and row exits (bwd)"),
                     Expect("reduce_scatter_tensor", "tp", rs_, rs_ * nhb // M,
                            "SP: row exits (fwd), region entries (bwd)")]
    return rows + (_tp_allreduce_rows(self, M, b, n_tok, L_st) if T > 1 else [])


def owner_comm(plan, b: int) -> tuple[int, int]:
    """muon.OwnerPlan's (all_to_alls, bytes this rank sends) per step: its pieces of every matrix
    to their owners, then the owned matrices' pieces back to their holders."""
    mine = sum(e - a for d in plan.sends for _, a, e in d)
    owned = sum(e - a for r in plan.recvs for _, a, e in r)
    return 2, (mine + owned) * b


def _muon_rows(self, dense: str, T: int) -> list[Expect]:
    """--optimizer muon (muon.OwnerPlan over dp x cp): two all-to-alls, and under TP one
    all-gather over tp per owned split matrix (muon.tp_gather_comm)."""
    plan = getattr(self.optimizer.inner, "orthogonalize", None)
    if not isinstance(plan, muon.OwnerPlan):
        return []
    b = self.optimizer.masters[0].element_size()
    rows = [Expect("all_to_all_single", dense, *owner_comm(plan, b),
                   "Muon's owner mode: this rank's pieces of each matrix to its owner, the "
                   "owned matrices' results back")]
    if T > 1:
        tpm = self.tp       # (a matrix tp keeps whole, e.g. a MoE router, is not gathered)
        owned = [m for m, r in zip(plan.mats, plan.owner) if r == plan.me]   # NS runs here
        split = [m for m in owned if m.name in tpm.split_dim or m.name in tpm.kv_split]
        calls, nbytes = muon.tp_gather_comm([m.param.numel() for m in split], T, b)
        rows.append(Expect("all_gather", "tp", calls, nbytes,
                           f"Muon's owned matrices whole over tp: one per split matrix "
                           f"({calls}), T shards x {b} B"))
    return rows


def _tp_allreduce_rows(self, M, b, n_tok, L_st) -> list[Expect]:
    a, cfg = self.args, self.model.config
    H = cfg.hidden_size
    nhb_mb = n_tok // M * H * b
    b_ce = 4 if a.dtype == "bfloat16" else b
    calls = nbytes = 0
    if self.last:
        loss = tp.LOSS_ALL_REDUCES * M
        calls, nbytes = calls + loss, nbytes + loss * n_tok // M * b_ce
    # f and g of attention (and of a dense MLP), the embedding's sum, the head's f; under SP
    # only the embedding's stays an all-reduce
    regions = (tp.region_all_reduces(L_st, self.first, self.last, L_st if self.moe else 0,
                                     no_grad_inputs=no_grad_inputs(self.model))
               if not a.sp else int(self.first))
    calls, nbytes = calls + M * regions, nbytes + M * regions * nhb_mb
    psl = sum(b_ - a_ for sl in self.partial_slices for a_, b_ in sl)
    if psl:   # slices of the gradient shards: the reduce dtype's bytes
        rb = self.zero.units[0].grad_shard.element_size()
        calls, nbytes = calls + 1, nbytes + psl * rb
    return [Expect("all_reduce", "tp", calls, nbytes,
                   "TP: embedding + loss (3 x N b) per micro-batch"
                   + ("" if a.sp else " + f and g per attention and dense MLP (+ the "
                                      "head's f)")
                   + (" + partial (norm) gradient shards" if psl else ""))]
