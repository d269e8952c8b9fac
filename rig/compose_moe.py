"""The test rig for compose_moe.py: its constraints and its reference (rig/__init__.py)."""
import torch

from harness import is_moe
from harness.routing import hf_router_losses

from compose_moe import micro_batch_rows

from rig.ep_moe import MoEReference, routing_constraints


# ----------------------------------------------------------------------------------------------
# Constraints and formulas
# ----------------------------------------------------------------------------------------------
def constraints(args, config, D: int, C: int) -> list[str]:
    E, M = args.ep, args.grad_accum
    if not is_moe(config):
        return ([f"--ep {E}: --model {args.model} is not a Mixture-of-Experts config (no "
                 f"num_local_experts); use --model tiny-moe or a Mixtral config"] if E > 1 else [])
    if config.model_type != "mixtral":
        shared = any(getattr(config, k, None) for k in ("shared_expert_intermediate_size",
                                                        "n_shared_experts"))
        return [f"{config.model_type}'s MoE block" + (" (with a shared expert)" if shared else "")
                + " is not implemented; compose4d's expert parallelism installs ep_moe.py's "
                  f"blocks for HF Mixtral's MixtralSparseMoeBlock only (--model {args.model})"]
    n = config.num_local_experts
    errs = []
    if E < 1 or (D * C) % E:
        errs.append(f"--ep {E} does not divide dp x cp = {D} x {C} = {D * C} (the ep groups "
                    f"are carved out of the data ranks)")
    elif n % E:
        errs.append(f"--ep {E} does not divide num_local_experts {n}")
    errs += routing_constraints(args, config)
    if args.sp:
        errs.append("--sp with a MoE model: each tp rank would route its own tokens; not "
                    "implemented (use TP without --sp)")
    if args.capacity_factor is not None and (E != D or C != 1 or M != 1):
        errs.append(f"--capacity-factor: the global drop priority needs the whole batch in one "
                    f"ep group and one micro-batch: --ep = dp ({D}), --cp 1, --grad-accum 1 "
                    f"(got --ep {E}, --cp {C}, --grad-accum {M})")
    if args.capacity_factor is not None and args.mode == "benchmark":
        errs.append("--capacity-factor in benchmark mode: the all-to-all bytes are the kept "
                    "rows of every stage, which this rank does not see (ep_moe.py meters them)")
    if getattr(args, "recompute", "none") == "full":
        errs.append("--recompute full: a recomputed MoE layer would add its router losses and "
                    "exchange its counts twice; use selective")
    if args.mode == "train" and args.aux_free_bias and (args.export_hf or args.prompt):
        errs.append("--export-hf or --prompt with --aux-free-bias: HF's Mixtral (the export, and "
                    "the model the sample is drawn from) has no selection bias, so it would route "
                    "differently from the trained model")
    if args.mode == "train" and args.preempt_at == "micro-batch" and (
            args.aux_coef or args.z_coef or args.aux_free_bias):
        errs.append("--preempt-at micro-batch with a router loss or selection bias: a cut step "
                    "resumes in other micro-batches, and those terms are per micro-batch "
                    "(give --aux-coef 0 --z-coef 0 without --aux-free-bias, or --preempt-at step)")
    return errs[:1]


class MoEReference(MoEReference):
    """ep_moe's reference (HF's own model and blocks, capacity drops from outside, or route()
    with the aux-free bias), with the auxiliary loss of the docstring: on each layer's router
    logits of each micro-batch's rows, harness.routing.hf_router_losses (HF's formula summed in
    the logits' dtype: HF's function rounds to float32, which would cap a float64 comparison),
    checked against transformers' load_balancing_loss_func itself at every call, averaged."""

    def __init__(self, ref_model, args, env):
        super().__init__(ref_model, args, env)
        self.D = env.world // (args.tp * args.pp * args.cp)

    def objective(self, batch):
        if not (self.hf_block and self.args.aux_coef):   # no per-micro-batch term: ep_moe's
            return super().objective(batch)
        from harness import dropout, lm_loss_sum
        from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
        cfg = self.model.config
        with dropout.at(batch):
            out = self.model(input_ids=batch.input_ids, position_ids=batch.doc_positions,
                             output_router_logits=True)
        loss = lm_loss_sum(out.logits, batch.labels) / batch.n_tokens
        B, S = batch.input_ids.shape
        parts = micro_batch_rows(B, S, self.D, self.args.grad_accum, out.logits.device)
        E, k = cfg.num_local_experts, cfg.num_experts_per_tok
        aux = []
        for lg in out.router_logits:
            for rows in parts:
                mine = hf_router_losses((lg[rows],), E, k)[0]   # (in the logits' dtype)
                theirs = load_balancing_loss_func((lg[rows],), E, k)   # HF's own, float32
                rtol = 3e-2 if lg.dtype == torch.bfloat16 else 1e-4
                if abs(mine.item() - theirs.item()) > rtol * abs(theirs.item()):
                    raise RuntimeError(f"reference aux loss {mine.item()} disagrees with HF's "
                                       f"load_balancing_loss_func {theirs.item()}")
                aux.append(mine)
        loss = loss + self.args.aux_coef * sum(aux) / len(aux)
        if self.args.z_coef:
            loss = loss + self.args.z_coef * hf_router_losses(out.router_logits, E, k)[1]
        return loss
