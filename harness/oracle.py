"""oracle.py: the optimizers the correctness mode's references step with, sharing no code with
the strategies' (harness/precision.py's masters, muon.py): OracleAdamW, and OracleMuon, which is
torch.optim.Muon itself. A noise source that shared the optimizer under test would share its
bugs."""
import contextlib

import torch

from .models import hidden_matrix
from .precision import LOW_PRECISION, adamw_kwargs, ns_dtype


class _OracleMasters:
    """The references' fp32 masters (a mixin over a torch optimizer class; this file's own,
    not harness.precision's): the optimizer steps the masters, the module's parameters get
    their rounding after each step."""

    def _keep_masters(self, params) -> list:
        self.model_params = list(params)
        self.masters = [p.detach().float().clone() if p.dtype in LOW_PRECISION else p
                        for p in self.model_params]
        return self.masters

    def zero_grad(self, set_to_none: bool = True):
        for p in self.model_params + self.masters:
            p.grad = None

    @torch.no_grad()
    def step(self, closure=None):
        pairs = [(p, m) for p, m in zip(self.model_params, self.masters) if m is not p]
        for p, m in pairs:
            m.grad = None if p.grad is None else p.grad.float()
        super().step()
        for p, m in pairs:
            p.copy_(m)
            m.grad = None


class OracleAdamW(_OracleMasters, torch.optim.AdamW):
    """The optimizer of every reference the correctness mode runs (the float64 target and the
    noise sources): torch.optim.AdamW over fp32 masters kept here, sharing no
    code with harness/precision.py's MasterAdamW, which the strategies use. A noise source
    that shared the optimizer under test would share its bugs: a MasterAdamW that never copied
    its masters back froze the bf16 noise sources as it froze the strategy, so the measured
    noise equalled the error and the run PASSed. A torch optimizer (lr schedulers drive it)."""

    def __init__(self, params, args):
        masters = self._keep_masters(params)
        # (the strategies' hyper-parameters and kernel: torch's fused AdamW where it runs, so
        # a float64 DDP at W=1 stays bit-identical to the reference)
        super().__init__(masters, **adamw_kwargs(masters, args))


class _OracleTorchMuon(_OracleMasters, torch.optim.Muon):
    """torch.optim.Muon over fp32 masters kept here (OracleMuon's matrices)."""

    def __init__(self, params, args):
        super().__init__(self._keep_masters(params), lr=args.muon_lr,
                         weight_decay=args.weight_decay, momentum=0.95, nesterov=True)


class OracleMuon:
    """The references' optimizer under --optimizer muon: torch.optim.Muon itself on the hidden
    matrices (harness.models.hidden_matrix; fp32 masters of a bf16 model kept here) and
    OracleAdamW on the rest. It shares no code with muon.py. torch's Newton-Schulz casts to
    bfloat16; for a float32/float64 model (precision.ns_dtype's rule) the step runs torch's own
    code with that one cast changed (torch_ns_in; tests/test_muon.py proves the two equal where
    they coincide)."""

    def __init__(self, named, args):
        named = [(n, p) for n, p in named if p.requires_grad]
        mats = [p for n, p in named if hidden_matrix(n, p.shape)]
        self.adamw = OracleAdamW([p for n, p in named if not hidden_matrix(n, p.shape)], args)
        self.muon = _OracleTorchMuon(mats, args)
        self.ns = ns_dtype(args, mats[0].dtype) if mats else torch.bfloat16

    @property
    def param_groups(self):
        return self.muon.param_groups + self.adamw.param_groups

    @property
    def state(self):
        return {**self.muon.state, **self.adamw.state}

    def zero_grad(self, set_to_none: bool = True):
        self.muon.zero_grad()
        self.adamw.zero_grad()

    @torch.no_grad()
    def step(self, closure=None):
        with torch_ns_in(self.ns):
            self.muon.step()
        self.adamw.step()


@contextlib.contextmanager
def torch_ns_in(dtype: torch.dtype):
    """torch.optim.Muon's Newton-Schulz (torch/optim/_muon.py) with its bfloat16 cast replaced
    by `dtype` for the duration; bfloat16 leaves torch's untouched."""
    import torch.optim._muon as tm
    if dtype == torch.bfloat16:
        yield
        return
    torch_ns = tm._zeropower_via_newtonschulz

    def ns(grad, ns_coefficients, ns_steps, eps):    # torch's, line for line, but the cast
        a, b, c = ns_coefficients
        ortho_grad = grad.to(dtype, copy=True)       # (torch: grad.bfloat16(), a copy)
        if grad.size(0) > grad.size(1):
            ortho_grad = ortho_grad.T
        ortho_grad.div_(ortho_grad.norm().clamp(min=eps))
        for _ in range(ns_steps):
            gram_matrix = ortho_grad @ ortho_grad.T
            gram_update = torch.addmm(gram_matrix, gram_matrix, gram_matrix, beta=b, alpha=c)
            ortho_grad = torch.addmm(ortho_grad, gram_update, ortho_grad, beta=a)
        if grad.size(0) > grad.size(1):
            ortho_grad = ortho_grad.T
        return ortho_grad
    tm._zeropower_via_newtonschulz = ns
    try:
        yield
    finally:
        tm._zeropower_via_newtonschulz = torch_ns
