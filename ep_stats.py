"""ep_stats.py: ep_moe's routing statistics, observed from outside the algorithm.

`RoutingStats` wraps two methods of each ExpertParallelMoE block: the local experts' forward,
whose group sizes are the rows each expert received (the load), and the block's `exchange` (the
all-to-all), whose splits give the rows sent off this rank. ep_moe.py's dispatch and combine
carry no counters. The adapter hands `record` the router's own per-layer records (choices, kept
rows, capacity) once per step. The balance and wire-byte lines are computed from those
observations: learning mode prints the balance lines, benchmark mode all of them.

Nothing here reads the device inside a step: the loads and splits it observes are the Python
ints each layer read once for its all-to-all anyway, and the kept rows (capacity) stay device
scalars until a report converts them, after the steps.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from harness import METER


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
        def experts_forward(x, counts):
            self.observed["load"].append(torch.tensor(counts))
            return fn(x, counts)
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
