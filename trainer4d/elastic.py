"""elastic.py: re-planning the batch when the world size changes (restart-based elasticity).

    python compose4d.py plan --params 5e9 --hidden 4096 --layers 32 --seq 4096 --world 64 \\
        --micro-batch 2 --grad-accum 4 --zero 1 --nodes 1:100 --gpus-per-node 8 --mem-gib 80

When a job restarts on a different number of GPUs, TP, PP and CP stay as the flags say and data
parallelism absorbs the change: dp = W / (tp pp cp). The global batch (sequences per optimizer
step) = dp x micro-batch x grad-accum should stay what it was, G0; the loss curve and the
learning-rate schedule were tuned for it. The planner searches

    zero stage z >= --zero, micro-batch 1 <= b <= --max-micro-batch, grad-accum a >= 1

for the global batch dp b a inside G0 (1 +- --tolerance) and estimated memory per GPU <= the
budget, and picks the smallest |dp b a - G0|, then the lower ZeRO stage (less communication),
then the larger micro-batch (fewer, larger kernels). A node count with no such choice is
infeasible ('-' in the table).

Memory model per GPU (every coefficient is a flag):
    parameters   --bytes-param (2, bf16) x Psi / (tp pp), / dp cp at ZeRO-3
    gradients    --bytes-grad  (4, fp32) x Psi / (tp pp), / dp cp from ZeRO-2
    optimizer    --bytes-adam  (8: Adam's two fp32 moments) x Psi / (tp pp), / dp cp from
                 ZeRO-1 (compose4d shards over dp x cp: CP ranks hold the same weights)
    experts      (--expert-params Psi_e of Psi, with --ep E) the same three terms for Psi_e with
                 ep in place of tp and dp cp / ep in place of dp (compose_moe.py's layout: the
                 experts whole across tp, sharded over the ranks that hold the same experts);
                 a world whose dp cp E does not divide is infeasible
    activations  with a model config (--model; compose4d's --elastic always has one):
                 harness.recompute.activation_bytes, the suite's one activation model (exact
                 against the live storage), for b sequences of seq / cp tokens in --act-bytes
                 (2) per element, its tp split, under --recompute; without one, a coarse
                 coefficient: --act-coef (16) x b x (seq / cp) x hidden x layers x --act-bytes
                 / tp. Under 1F1B the first stage holds P micro-batches of L/P layers: all L
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import sys


@dataclasses.dataclass
class MemoryModel:
    bytes_param: float = 2.0
    bytes_grad: float = 4.0
    bytes_adam: float = 8.0
    act_coef: float = 16.0
    act_bytes: float = 2.0
    config: object = None        # an HF config: the activations from harness.recompute
    recompute: str = "none"
    sp: bool = False

    def states(self, params, zero, dp, tp=1, pp=1) -> float:
        from zero import model_state_bytes      # (ZeRO's table, the one formula)
        return sum(model_state_bytes(params / (tp * pp), zero, dp, self.bytes_param,
                                     self.bytes_grad, self.bytes_adam).values())

    def activations(self, mb, seq, hidden, layers, tp=1, cp=1) -> float:
        if self.config is not None:
            from harness.recompute import activation_bytes
            return activation_bytes(self.config, mb, seq // cp, int(self.act_bytes),
                                    self.recompute, "sdpa", tp=tp, sp=self.sp)["layers"]
        return self.act_coef * mb * (seq / cp) * hidden * layers * self.act_bytes / tp


@dataclasses.dataclass
class Plan:
    nodes: int
    gpus: int
    zero: int | None = None
    micro_batch: int | None = None
    grad_accum: int | None = None
    global_batch: int | None = None
    delta: float | None = None        # (global_batch - G0) / G0
    states: float | None = None       # bytes per GPU
    activations: float | None = None
    why: str = ""

    @property
    def feasible(self) -> bool:
        return self.zero is not None

    @property
    def memory(self) -> float | None:
        return None if not self.feasible else self.states + self.activations


def plan_world(world: int, target: int, *, params, hidden, layers, seq, mem_bytes, tolerance,
               max_micro_batch, min_zero=0, max_zero=3, tp=1, pp=1, cp=1,
               model: MemoryModel | None = None, gpus_per_node=1, expert_params=0,
               ep=1, keep=None) -> Plan:
    """The planning rule for one world size (see the docstring). keep(dp, global batch,
    grad-accum) -> bool, where given, admits only the plans it accepts (a MoE run's
    micro-batch composition: trainer4d.train.replan)."""
    model = model or MemoryModel()
    out = Plan(world // gpus_per_node, world)
    if world % (tp * pp * cp):
        out.why = f"{world} GPUs are not a multiple of tp pp cp = {tp * pp * cp}"
        return out
    dp = world // (tp * pp * cp)
    if (dp * cp) % ep:
        out.why = f"ep {ep} does not divide dp x cp = {dp} x {cp} at {world} GPUs"
        return out
    lo, hi = target * (1 - tolerance), target * (1 + tolerance)
    best = None
    for z in range(min_zero, max_zero + 1):
        states = model.states(params - expert_params, z, dp * cp, tp, pp) + (
            model.states(expert_params, z, dp * cp // ep, ep, pp) if expert_params else 0)
        for b in range(1, max_micro_batch + 1):
            acts = model.activations(b, seq, hidden, layers, tp, cp)
            if states + acts > mem_bytes:
                continue
            exact = target / (dp * b)
            for a in {max(1, math.floor(exact)), max(1, math.ceil(exact))}:
                g = dp * b * a
                if not lo <= g <= hi or (keep is not None and not keep(dp, g, a)):
                    continue
                key = (abs(g - target), z, -b, a)
                if best is None or key < best[0]:
                    best = (key, z, b, a, g, states, acts)
    if best is None:
        out.why = (f"no (zero, micro-batch, grad-accum) keeps the global batch within "
                   f"{tolerance:.0%} of {target} under {mem_bytes / 2**30:g} GiB at dp={dp}"
                   + (" with every micro-batch's rows kept (the MoE auxiliary loss is per "
                      "micro-batch)" if keep is not None else ""))
        return out
    _, out.zero, out.micro_batch, out.grad_accum, out.global_batch, out.states, \
        out.activations = best
    out.delta = (out.global_batch - target) / target
    return out


def plan_table(args) -> tuple[int, list[Plan]]:
    mp = args.tp * args.pp * args.cp
    if args.world % mp:
        raise ValueError(f"--world {args.world} is not a multiple of tp pp cp = {mp}")
    target = args.world // mp * args.micro_batch * args.grad_accum
    lo, hi = (int(x) for x in args.nodes.split(":"))
    config = None
    if args.model:
        from harness.models import load_config
        config = load_config(args.model)
        args.params = count_params(config)["total"]
        args.hidden, args.layers = config.hidden_size, config.num_hidden_layers
    elif None in (args.params, args.hidden, args.layers):
        raise ValueError("give --model, or --params, --hidden and --layers")
    model = MemoryModel(args.bytes_param, args.bytes_grad, args.bytes_adam, args.act_coef,
                        args.act_bytes, config, args.recompute)
    rows = [plan_world(n * args.gpus_per_node, target, params=args.params, hidden=args.hidden,
                       layers=args.layers, seq=args.seq, mem_bytes=args.mem_gib * 2**30,
                       tolerance=args.tolerance, max_micro_batch=args.max_micro_batch,
                       min_zero=args.zero, tp=args.tp, pp=args.pp, cp=args.cp, model=model,
                       gpus_per_node=args.gpus_per_node, expert_params=args.expert_params,
                       ep=args.ep)
            for n in range(lo, hi + 1)]
    return target, rows


def format_table(target: int, rows: list[Plan]) -> list[str]:
    gib = lambda v: f"{v / 2**30:.1f}"  # noqa: E731
    lines = [f"target global batch {target} sequences; '-' = infeasible",
             f"{'nodes':>5} {'GPUs':>5} {'ZeRO':>4} {'micro':>5} {'accum':>5} {'global':>6} "
             f"{'delta%':>7} {'mem GiB':>8} {'states':>7} {'acts':>7}"]
    for r in rows:
        if not r.feasible:
            lines.append(f"{r.nodes:>5} {r.gpus:>5} {'-':>4} {'-':>5} {'-':>5} {'-':>6} {'-':>7} "
                         f"{'-':>8} {'-':>7} {'-':>7}")
            continue
        lines.append(f"{r.nodes:>5} {r.gpus:>5} {r.zero:>4} {r.micro_batch:>5} "
                     f"{r.grad_accum:>5} {r.global_batch:>6} {100 * r.delta:>+7.1f} "
                     f"{gib(r.memory):>8} {gib(r.states):>7} {gib(r.activations):>7}")
    return lines


def count_params(config) -> dict:
    """Parameters of the HF model built on the meta device (nothing allocated): total, routed
    experts (`.experts.` in the name), and the rest (dense); fp8_linear, the weights of the
    decoder layers' linears that fp8.py converts under tensorwise (what an FP8 all-gather
    sends at 1 byte). replan's and plan.py's."""
    import torch
    from transformers import AutoModelForCausalLM
    import fp8
    from harness import parts
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = experts = 0
    for name, p in model.named_parameters():
        total += p.numel()
        experts += p.numel() if ".experts." in name else 0
    lin = sum(m.weight.numel() for layer in (parts(model).layers or []) for m in layer.modules()
              if type(m) is torch.nn.Linear and fp8.eligible(m, "tensorwise"))
    return dict(total=total, experts=experts, dense=total - experts, fp8_linear=lin)


# ----------------------------------------------------------------------------------------------
# Re-planning a run (compose4d.py --mode train --elastic): before the process group exists
# ----------------------------------------------------------------------------------------------
def replan(world: int, config, args, target: int, keep=None) -> Plan:
    """plan_world for this world size: TP, PP, CP as given, DP absorbs the change, the global
    batch kept near `target` (the caller's: the checkpoint's, or --batch for a fresh run). Runs
    in compose4d's constraints, before the process group exists, so an infeasible world ends at
    once. (torch and transformers are imported in count_params: the planner's CLI does not need
    them.)"""
    params = count_params(config)
    return plan_world(
        world, target, params=params["total"], hidden=config.hidden_size,
        layers=config.num_hidden_layers, seq=args.length, mem_bytes=args.mem_gib * 2**30,
        tolerance=args.batch_tolerance, max_micro_batch=args.max_micro_batch,
        min_zero=args.zero, max_zero=1 if args.schedule == "interleaved" else 3,
        tp=args.tp, pp=args.pp, cp=args.cp, expert_params=params["experts"],
        ep=getattr(args, "ep", 1), keep=keep,
        model=MemoryModel(config=config, recompute=getattr(args, "recompute", "none"),
                          sp=bool(getattr(args, "sp", False))))


def plan_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="compose4d.py plan", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=None,
                   help="a preset or HF config: Psi, hidden and layers from it, and the "
                        "activations from harness.recompute's model")
    p.add_argument("--params", type=float, default=None, help="parameter count Psi")
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--recompute", default="none", choices=["none", "selective", "full"],
                   help="with --model: the activations under this recompute mode")
    p.add_argument("--seq", type=int, required=True, help="sequence length")
    p.add_argument("--world", type=int, required=True, help="GPUs of the run being re-planned")
    p.add_argument("--micro-batch", type=int, required=True, help="its micro-batch")
    p.add_argument("--grad-accum", type=int, required=True, help="its gradient accumulation")
    p.add_argument("--zero", type=int, default=0, help="lowest ZeRO stage to consider")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--cp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size (a MoE model)")
    p.add_argument("--expert-params", type=float, default=0.0,
                   help="the routed experts' share of --params (a MoE model)")
    p.add_argument("--nodes", default="1:8", help="MIN:MAX node counts")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--mem-gib", type=float, default=80.0, help="memory budget per GPU")
    p.add_argument("--tolerance", type=float, default=0.10, help="allowed global-batch deviation")
    p.add_argument("--max-micro-batch", type=int, default=8)
    p.add_argument("--bytes-param", type=float, default=2.0)
    p.add_argument("--bytes-grad", type=float, default=4.0)
    p.add_argument("--bytes-adam", type=float, default=8.0)
    p.add_argument("--act-coef", type=float, default=16.0,
                   help="without --model: activation bytes per token, hidden unit and layer "
                        "over --act-bytes")
    p.add_argument("--act-bytes", type=float, default=2.0)
    return p


def plan_main(argv) -> int:
    args = plan_parser().parse_args(argv)
    try:
        target, rows = plan_table(args)
    except ValueError as e:                 # one line, exit code 2, like every bad input here
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("\n".join(format_table(target, rows)))
    return 0
