"""schedule.py: compose4d's learning-rate schedule (lr_at) and its oracle for the reference
(torch_schedule: torch.optim.lr_scheduler, sharing no code with lr_at)."""
import math

from harness import Reference


def lr_at(step: int, args, base: float | None = None) -> float:
    """Linear warm-up over --lr-warmup steps, then constant or cosine down to --lr-min-ratio x lr
    at --steps; lr is --lr, or `base` (Muon's matrices: --muon-lr)."""
    lr = args.lr if base is None else base
    if step < args.lr_warmup:
        return lr * (step + 1) / args.lr_warmup
    if args.lr_schedule == "constant":
        return lr
    span = max(1, args.steps - args.lr_warmup)
    t = min(1.0, (step - args.lr_warmup) / span)
    lo = lr * args.lr_min_ratio
    return lo + (lr - lo) * 0.5 * (1 + math.cos(math.pi * t))


def torch_schedule(optimizer, args, base: float | None = None):
    """The same schedule from torch.optim.lr_scheduler, for the reference: an oracle that shares
    no code with lr_at (a bug there, e.g. the schedule one step ahead, cannot hide by appearing on
    both sides). Stepped once per optimizer step, after it, so step k runs at factor:
        warm-up   LinearLR from 1/W to 1 over W - 1 steps: (k + 1) / W for k < W
        cosine    CosineAnnealingLR from lr at step W to lr_min_ratio x lr at step --steps
        constant  LinearLR stays at its end factor 1 (no scheduler at all without warm-up)
    None when the learning rate is constant throughout."""
    from torch.optim import lr_scheduler as S
    W, phases, lr = args.lr_warmup, [], args.lr if base is None else base
    if W > 0:
        phases.append(S.LinearLR(optimizer, start_factor=1.0 / W, end_factor=1.0,
                                 total_iters=max(1, W - 1)))
    if args.lr_schedule == "cosine":
        phases.append(S.CosineAnnealingLR(optimizer, T_max=max(1, args.steps - W),
                                          eta_min=lr * args.lr_min_ratio))
    if len(phases) == 2:
        return S.SequentialLR(optimizer, phases, milestones=[W])
    return phases[0] if phases else None


class Scheduled:
    """Mixed into a reference (harness.Reference or a subclass): its learning rate scheduled by
    torch (torch_schedule), stepped after each optimizer step."""

    def __init__(self, ref_model, args, env):
        super().__init__(ref_model, args, env)
        opt = self.optimizer   # OracleMuon: torch's Muon (from --muon-lr) and AdamW, each its own
        pairs = ([(opt.muon, args.muon_lr), (opt.adamw, None)] if hasattr(opt, "muon")
                 else [(opt, None)])
        self.schedulers = [s for s in (torch_schedule(o, args, base) for o, base in pairs)
                           if s is not None]

    def step(self, batch):
        loss = super().step(batch)
        for s in self.schedulers:
            s.step()
        return loss


class ScheduledReference(Scheduled, Reference):
    """The single-device reference of a dense model, scheduled by torch."""
