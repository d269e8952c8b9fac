"""compose_moe.py: expert parallelism inside compose4d (--ep E), the fifth dimension.

    torchrun --nproc_per_node=8 compose4d.py --model tiny-moe --ep 2 --tp 2 --pp 2

ep_moe.py's blocks in a model that compose4d also splits by TP, PP and CP; here is what only
exists once they compose: the groups, the router losses across stages and micro-batches, the
reference.

Groups (Megatron-core's "parallel folding", expert-TP 1): in each (pp, tp) slice, blocks of E
    consecutive dp x cp ranks form an ep group (the all-to-all), the ranks at the same place in
    their blocks an edp group of D C / E (they hold the same experts). Dense parameters: ZeRO
    over dp x cp; experts [e E_l, (e+1) E_l) on ep rank e (E_l = n / E, n experts), ZeRO over edp.
    TP: every tp rank routes the same tokens through the same experts; PP: a stage's MoE layers.

The router losses, per layer and micro-batch (as Megatron-core): a pipeline cannot know the
    global batch's f_e before its first backward, so each MoE layer adds, at its forward for
    micro-batch m, its own term from that micro-batch's global counts (one all_reduce of n
    int64 over dp x cp per layer and micro-batch), through the layer's output (AddLoss):
        aux = 1/(L M) sum_{l,m} n sum_e f_{l,m,e} P_{l,m,e},   f, P over micro-batch m's
        N_m = B S / M tokens (m = every dp rank's m-th micro-batch, all their cp chunks)

Communication per step, added to compose4d's (T_r tokens per rank per micro-batch, k top-k,
    H hidden, b bytes, M micro-batches), per layer and micro-batch:
    ep group     4 token all-to-alls, 4 k T_r H b per rank, + one all-to-all of the n counts (8n B)
    dp x cp      one all_reduce of the n counts (8n B) when the aux loss or the bias needs them
    edp          the experts' ZeRO reduce-scatter and all-gather (their units)
Model states per rank: dense Psi_d / (T P) over dp x cp as compose4d's ZeRO stage says; experts
    Psi_e / (E P) (whole across tp), their ZeRO shard over edp = D C / E.
API (compose4d calls it): make_ep_groups(dpcp_groups, E), parallelize(model, args, ep_group,
    count_group) -> blocks, after_step(blocks, args), logged_terms(blocks), expected_comm.
More: docs/internals.md, 'compose_moe.py'.
"""
import torch
import torch.distributed as dist

from harness import Expect, is_moe, planted
import ep_moe
import fsdp


# ----------------------------------------------------------------------------------------------
# Groups
# ----------------------------------------------------------------------------------------------
def make_ep_groups(dpcp_groups, E: int) -> dict:
    """The ep groups (blocks of E consecutive ranks of each dp x cp group) and the edp groups
    (the ranks at the same place in their blocks)."""
    ep, edp = fsdp.new_block_groups(dpcp_groups, E, ("ep", "edp"))
    return {"ep": ep, "edp": edp}


# ----------------------------------------------------------------------------------------------
# A loss term added inside a layer
# ----------------------------------------------------------------------------------------------
class AddLoss(torch.autograd.Function):
    """x -> x; the backward also hands `loss` the gradient 1: a loss term computed inside a
    layer joins the objective through the layer's output, once per forward (Megatron's
    MoEAuxLossAutoScaler)."""

    @staticmethod
    def forward(ctx, x, loss):     # x: the block's output (B, S, H), loss () -> x unchanged
        ctx.loss_like = (loss.shape, loss.dtype, loss.device)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):       # (B, S, H) -> (B, S, H), and 1 of the loss's shape ()
        shape, dtype, device = ctx.loss_like
        return grad, torch.ones(shape, dtype=dtype, device=device)


class ComposedMoE(ep_moe.ExpertParallelMoE):
    """ep_moe's block over the ep group, adding this layer's router-loss terms for the
    micro-batch it runs (the docstring's per-layer, per-micro-batch aux and the z loss)."""

    def __init__(self, hf_block, opts, ep_group, count_group, layers: int, micro_batches: int):
        super().__init__(hf_block, [], opts, ep_group)
        self.count_group, self.L, self.M = count_group, layers, micro_batches
        self.logged = []        # this rank's share of each term (detached), for the loss line
        self.step_counts = None  # the global loads of this step (aux-free bias)

    def forward(self, hidden):
        out = super().forward(hidden)
        rec = self.stats.pop()
        if not torch.is_grad_enabled():     # evaluation: no router losses, no collective
            return out
        o = self.opts
        term = None
        n = hidden.shape[0] * hidden.shape[1] * dist.get_world_size(self.count_group)  # N_m
        if o.aux_coef or o.aux_free_bias:
            counts = rec["counts"].clone()
            dist.all_reduce(counts, group=self.count_group)   # (n_experts,) int64
            self.step_counts = counts if self.step_counts is None else self.step_counts + counts
            if o.aux_coef:
                f = counts.to(rec["prob_sum"].dtype) / n
                layers = self.L
                if planted("aux-per-stage"):   # plant: normalised by this stage's layers
                    layers = self.stage_layers
                term = o.aux_coef * self.num_experts * (f * rec["prob_sum"] / n).sum() \
                    / (layers * self.M)
        if o.z_coef:
            z = o.z_coef * rec["z_sum"] / (self.L * self.M * n)
            term = z if term is None else term + z
        if term is None:
            return out
        self.logged.append(term.detach())
        return AddLoss.apply(out, term)


def parallelize(model, args, ep_group, count_group) -> list[ComposedMoE]:
    """Every decoder layer's MoE block replaced by a ComposedMoE (before the pipeline cut)."""
    L = model.config.num_hidden_layers
    return ep_moe.install(model, lambda b: ComposedMoE(b, args, ep_group, count_group, L,
                                                       args.grad_accum))


def expert_local(name: str, t: torch.Tensor, E: int, rank: int) -> torch.Tensor:
    """This ep rank's experts of a full (n_experts, ...) tensor (other tensors unchanged)."""
    if not ep_moe.is_expert(name):
        return t
    n = t.shape[0] // E
    return t[rank * n:(rank + 1) * n]      # [n_experts, ...] -> [n_experts / E, ...]


def after_step(blocks: list[ComposedMoE], args):
    """The aux-free bias from the step's global loads (each stage its own layers); reset."""
    if args.aux_free_bias and blocks:
        # (L_r, n_experts): this stage's layers' loads
        ep_moe.update_bias(blocks, torch.stack([b.step_counts for b in blocks]), args.bias_rate)
    for b in blocks:
        b.step_counts = None


def logged_terms(blocks: list[ComposedMoE]) -> torch.Tensor | float:
    """This rank's share of the router losses of the step (device scalar), then cleared."""
    terms = [t for b in blocks for t in b.logged]
    for b in blocks:
        b.logged = []
    return sum(terms) if terms else 0.0


def expected_comm(strat, blocks: list[ComposedMoE]) -> list[Expect]:
    """The ep and count rows for this rank's stage (the edp ZeRO rows are compose4d's)."""
    a, cfg = strat.args, strat.model.config
    if not blocks:
        return []
    L_r, M, W = len(blocks), a.grad_accum, strat.env.world
    L, n, k, H = cfg.num_hidden_layers, cfg.num_local_experts, cfg.num_experts_per_tok, \
        cfg.hidden_size
    b = blocks[0].gate.weight.element_size()
    D, C, P = strat.grid.size["dp"], strat.grid.size["cp"], strat.grid.size["pp"]
    T_r = a.batch // D // M * (a.length // C)      # tokens per rank per micro-batch
    rows = []
    if a.capacity_factor:
        rows.append(Expect("all_gather_into_tensor", "ep", L_r * M, L_r * M * a.ep * k * n * 8,
                           "L_r M x E k n_experts x 8: every rank's (slot, expert) counts"))
    else:   # summed over the world: each layer on the W / P ranks of its stage
        tok, cnt = ep_moe.TOKEN_ALL_TO_ALLS, ep_moe.COUNT_ALL_TO_ALLS
        per = tok * k * T_r * H * b + cnt * n * 8
        rows.append(Expect("all_to_all_single", "ep", (tok + cnt) * L * M * W // P,
                           L * M * W // P * per,
                           f"per layer, micro-batch and rank 4 k T_r H b (dispatch + combine, fwd "
                           f"+ bwd) + n_experts x 8 (counts) = {per:,} B, 5 calls; L M W / P = "
                           f"{L} x {M} x {W} / {P}", ranks="sum"))
    if a.aux_coef or a.aux_free_bias:
        rows.append(Expect("all_reduce", "dpcp", L_r * M, L_r * M * n * 8,
                           "the layer's global expert counts, per layer and micro-batch"))
    return rows


# ----------------------------------------------------------------------------------------------
# The reference: HF's own MoE model, the aux loss per layer and micro-batch
# ----------------------------------------------------------------------------------------------
def micro_batch_sets(B: int, D: int, M: int) -> list[list[int]]:
    """The global rows of each micro-batch m: dp rank d's contiguous share of the sequences,
    its m-th of M contiguous pieces, for every d (compose4d's split). The auxiliary loss is a
    function of these sets: a resume or re-plan that changes them changes the objective."""
    per, mb = B // D, B // D // M
    return [[d * per + m * mb + i for d in range(D) for i in range(mb)] for m in range(M)]


def objective_per_micro_batch(config, args) -> bool:
    """Whether the objective depends on which rows share a micro-batch: a MoE model with the
    auxiliary loss (the z loss is a plain sum; --aux-free-bias sums the step's loads)."""
    return is_moe(config) and bool(getattr(args, "aux_coef", 0))


def micro_batch_rows(B: int, S: int, D: int, M: int, device) -> list[torch.Tensor]:
    """The flattened (row, position) indices of each micro-batch (micro_batch_sets)."""
    # (rows, S) -> (rows * S,) per micro-batch
    return [(torch.tensor(rows)[:, None] * S + torch.arange(S)).reshape(-1).to(device)
            for rows in micro_batch_sets(B, D, M)]
