"""routing.py: a Mixture-of-Experts model's routing, observed and checked from outside.

`RoutingStats` wraps two methods of each of ep_moe's ExpertParallelMoE blocks: the local
experts' forward, whose group sizes are the rows each expert received (the load), and the
block's `exchange` (the all-to-all), whose splits give the rows sent off this rank. ep_moe.py's
dispatch and combine carry no counters. The adapter hands `record` the router's own per-layer
records (choices, kept rows, capacity) once per step. The balance and wire-byte lines, and the
capacity check, are computed from those observations: learning mode prints the balance lines,
benchmark mode all of them.

Nothing here reads the device inside a step: the loads and splits it observes are the Python
ints each layer read once for its all-to-all anyway, and the kept rows (capacity) stay device
scalars until a report converts them, after the steps.

`hf_moe_objective`: the single-device oracle where HF implements the feature: HF's own model,
its loss plus the router losses from the router logits it records (`hf_router_losses`:
transformers' load_balancing_loss_func and router_z_loss_func), so that the reference shares no
routing code with the strategy. `drop_over_capacity` adds capacity dropping, which HF does not
have, to HF's own blocks from outside: HF routes, and a loop written from the stated priority
(not ep_moe's vectorised capacity_keep) zeroes the weights of the choices that do not fit.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import dropout
from .loss import lm_loss_sum
from .meter import METER


class RoutingStats:
    def __init__(self, blocks, env, args, keep: int = 50):
        self.blocks, self.env, self.args, self.keep = blocks, env, args, keep
        self.history: list[dict] = []     # per step: load (L, E/W), off, choices, kept, capacity
        self.metered = dict(steps=0, kept=0)   # kept rows over the benchmark's metered steps
        self.observed = dict(load=[], off=[])
        for blk in blocks:
            blk.experts.forward = self._observe_load(blk.experts.forward)
            blk.exchange = self._observe_exchange(blk.exchange, blk.rank)

    def _observe_load(self, fn):
        def experts_forward(x, counts, *device_counts):
            self.observed["load"].append(torch.tensor(counts))
            return fn(x, counts, *device_counts)
        return experts_forward

    def _observe_exchange(self, fn, rank: int):
        def exchange(rows, out_splits, in_splits):
            self.observed["off"].append(sum(in_splits) - in_splits[rank])
            return fn(rows, out_splits, in_splits)
        return exchange

    def start_step(self):
        self.observed = dict(load=[], off=[])

    def record(self, router_stats: list[dict]):
        """Close a step: its observations and the router's per-layer records into history."""
        s, obs = router_stats, self.observed
        # kept: with capacity a device scalar (summed on the device), read by the reports
        rec = dict(load=torch.stack(obs["load"]),          # (L, E/W) rows received per expert
                   off=sum(obs["off"]),                    # rows sent off-rank: dispatch+combine
                   choices=sum(r["choices"] for r in s),
                   kept=sum(r.get("kept", r["choices"]) for r in s),
                   capacity=s[0].get("capacity"))
        self.start_step()
        self.history.append(rec)
        del self.history[:-self.keep]
        if METER.active:               # the benchmark's metered window (the comm formula's)
            self.metered["steps"] += 1
            self.metered["kept"] += rec["kept"]

    def loads(self, last: int):
        """Global rows per expert (L, E) summed over the last `last` steps (collective)."""
        local = torch.stack([h["load"] for h in self.history[-last:]]).sum(0)
        with METER.paused():
            parts = [None] * self.env.world
            dist.all_gather_object(parts, local)
        return torch.cat(parts, dim=1).double(), len(self.history[-last:])

    def balance_lines(self, last: int) -> list[str]:
        loads, n = self.loads(last)
        imb = loads.max(1).values / loads.mean(1)
        h = self.history[-last:]
        drop = 1 - float(sum(r["kept"] for r in h)) / sum(r["choices"] for r in h)
        lines = [f"expert load (rows received) over the last {n} steps: imbalance max/mean per layer "
                 + ", ".join(f"{x:.2f}" for x in imb.tolist())
                 + f" (mean {imb.mean():.2f}); dropped choices {100 * drop:.2f}%"]
        if self.args.aux_free_bias:
            b = torch.stack([blk.bias for blk in self.blocks])
            lines.append(f"aux-free bias range [{b.min():.4f}, {b.max():.4f}]")
        return lines

    def report_lines(self, cfg, elem: int) -> list[str]:
        W, El = self.env.world, cfg.num_local_experts // self.env.world
        last = min(len(self.history), self.args.bench_iters)
        loads, n = self.loads(last)
        per_step = loads.sum(0) / n                                  # (E,) rows per step
        lines = ["tokens per expert per step (summed over layers), by rank:"]
        for r in range(W):
            lines.append(f"  rank {r}: " + "  ".join(
                f"e{r * El + e}={per_step[r * El + e]:.0f}" for e in range(El))
                + f"   rank total {per_step[r * El:(r + 1) * El].sum():.0f}")
        lines += self.balance_lines(last)
        # wire bytes: rows that leave their rank, forward dispatch + combine, per layer
        T = self.args.batch * self.args.length // W
        H, k, L = cfg.hidden_size, cfg.num_experts_per_tok, cfg.num_hidden_layers
        off = torch.tensor([float(sum(x["off"] for x in self.history[-last:]))],
                           device=self.env.device)
        with METER.paused():
            dist.all_reduce(off)
        measured = off.item() / (W * last * L) * H * elem
        formula = 2 * k * T * H * elem * (W - 1) / W
        lines.append(f"dispatch + combine wire bytes per layer per rank (forward, rank mean): "
                     f"{measured:,.0f} vs 2 k T H b (W-1)/W = {formula:,.0f} "
                     f"(uniform routing; ratio {measured / formula if formula else 0:.3f})")
        return lines

    def capacity_check(self, group, factor: float) -> tuple[str, bool, str]:
        """The check that no expert took more than its capacity C rows in any layer of the
        steps kept (collective over `group`: the maximum over the experts' ranks)."""
        h = self.history
        top = torch.tensor([float(max(int(r["load"].max()) for r in h))], device=self.env.device)
        with METER.paused():
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        cap = h[-1]["capacity"]
        drop = 1 - float(sum(r["kept"] for r in h)) / max(1, sum(r["choices"] for r in h))
        return ("expert capacity respected", top.item() <= cap,
                f"max rows per expert per layer {top.item():.0f} <= C = {cap}; "
                f"dropped choices {100 * drop:.2f}% over {len(h)} steps (factor {factor})")


def hf_router_losses(out, n_experts: int, top_k: int):
    """(aux, z) from the router logits HF records (`out = model(..., output_router_logits=True)`,
    one (N, E) tensor per layer), in their dtype (at least float32, as the strategy's).

    aux: transformers' load_balancing_loss_func (Mixtral) formula, E * sum_e f_e P_e over all
        L N rows (padding included: HF's model is called without an attention mask). HF's function
        accumulates in float32, and its backward therefore rounds the aux gradient to float32,
        which would cap a float64 target at float32 precision; so the same sums are taken here in
        the logits' dtype, and checked against HF's own value (out.aux_loss, when HF computed
        it) at every call. The normalisation is the same as ep_moe.router_losses' (global counts
        and rows). f counts the router's choices (top-k of HF's float32 probabilities; HF's
        function re-selects from probabilities in the logits' dtype, different only at float32
        ties).
    z: transformers' ST-MoE router_z_loss_func (Switch Transformers; Mixtral has none): the mean
        of logsumexp^2 over each layer's tokens, averaged over the layers (= over all L N rows).
    `out` may also be the tuple of router logits itself (no check then)."""
    from transformers.models.switch_transformers.modeling_switch_transformers import (
        router_z_loss_func)
    logits = out if isinstance(out, (tuple, list)) else out.router_logits
    router_logits = [lg.to(torch.promote_types(lg.dtype, torch.float32)) for lg in logits]
    rows = sum(lg.shape[0] for lg in router_logits)
    counts = sum(torch.bincount(torch.topk(F.softmax(lg.float(), -1), top_k, -1).indices
                                .reshape(-1), minlength=n_experts) for lg in router_logits)
    prob_sum = sum(F.softmax(lg, dim=-1).sum(0) for lg in router_logits)
    aux = n_experts * ((counts.to(prob_sum.dtype) / rows) * (prob_sum / rows)).sum()
    z = sum(router_z_loss_func(lg[None]) for lg in router_logits) / len(router_logits)
    hf = getattr(out, "aux_loss", None)   # load_balancing_loss_func itself (bf16 softmax in bf16)
    if hf is not None:
        rtol = 3e-2 if logits[0].dtype == torch.bfloat16 else 1e-4
        if abs(aux.item() - hf.item()) > rtol * abs(hf.item()):
            raise RuntimeError(f"reference aux loss {aux.item()} disagrees with HF's "
                               f"load_balancing_loss_func {hf.item()}")
    return aux, z


def kept_in_queue_order(idx: torch.Tensor, n_experts: int, capacity: int) -> torch.Tensor:
    """idx (N, k): each token's chosen experts, the rows of the global batch in order. An
    expert takes choices in its queue order, first choices of every token before any second
    choice, then token order, until it holds `capacity`; the rest are dropped. (N, k) bool."""
    filled = [0] * n_experts
    keep = [[False] * idx.shape[1] for _ in range(idx.shape[0])]
    choices = idx.tolist()
    for j in range(idx.shape[1]):
        for t, row in enumerate(choices):
            if filled[row[j]] < capacity:
                filled[row[j]] += 1
                keep[t][j] = True
    return torch.tensor(keep, device=idx.device)


def drop_over_capacity(model, factor: float):
    """HF's MixtralSparseMoeBlocks with capacity ceil(factor k N / E) rows per expert: each
    block's experts get HF's routing weights with the dropped choices' weights zeroed (a dropped
    choice then adds nothing to its token's output, and no gradient to its expert)."""
    for block in model.modules():
        if type(block).__name__ != "MixtralSparseMoeBlock":
            continue
        k, E = block.top_k, block.gate.num_experts

        def forward(x, idx, w, inner=block.experts.forward, k=k, E=E):
            capacity = math.ceil(factor * k * x.shape[0] / E)
            return inner(x, idx, w * kept_in_queue_order(idx, E, capacity).to(w.dtype))
        block.experts.forward = forward
    return model


def hf_moe_objective(model, batch, aux_coef: float, z_coef: float) -> torch.Tensor:
    """HF's own MoE model (MixtralSparseMoeBlock: HF's router, top-k renormalisation and
    experts) on the whole batch: mean token CE + aux_coef aux + z_coef z (hf_router_losses)."""
    cfg = model.config
    with dropout.at(batch):
        out = model(input_ids=batch.input_ids, position_ids=batch.doc_positions,
                    output_router_logits=True)
    loss = lm_loss_sum(out.logits, batch.labels) / batch.n_tokens
    aux, z = hf_router_losses(out, cfg.num_local_experts, cfg.num_experts_per_tok)
    if aux_coef:
        loss = loss + aux_coef * aux
    if z_coef:
        loss = loss + z_coef * z
    return loss
