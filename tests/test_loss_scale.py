"""harness/loss_scale.py: float16's dynamic loss scale and its census against bfloat16.

The scaler's distributed rule (every rank skips when any rank overflows) and its fp32
unscaling are checked across processes, each shown failing on its planted bug; the rule's
arithmetic and the census in this process. The CLI's figures are quoted and checked by
docs/interview.md's question 33 (tests/test_interview.py)."""
import argparse
import os

import pytest
import torch

from conftest import ROOT, torchrun
from harness.loss_scale import DynamicLossScaler, census, formats
from harness.precision import make_adamw

CHECK = os.path.join(ROOT, "tests", "loss_scale_check.py")


@pytest.mark.parametrize("world,plant", [(3, None), (2, "loss-scale-local-inf"),
                                         (2, "loss-scale-no-unscale")])
def test_ranks_skip_together_and_unscale_in_fp32(world, plant):
    """W=3 (the last rank alone overflows): PASS; each planted bug: FAIL (a rank that decides
    alone steps while the others skip; Adam on S g instead of g moves a small entry wrongly)."""
    r = torchrun(CHECK, world, *(["--plant-bug", plant] if plant else []), timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    verdict = [x for x in r.stdout.splitlines() if x.startswith(("PASS", "FAIL"))]
    assert verdict and verdict[0].startswith("FAIL" if plant else "PASS"), r.stdout[-2000:]


def test_the_dynamic_rule():
    """An overflow halves S and skips; growth_interval good steps in a row double it."""
    w = torch.nn.Parameter(torch.ones(3, dtype=torch.float16))
    opt = make_adamw([w], argparse.Namespace(lr=0.1, weight_decay=0.0))
    scaler = DynamicLossScaler(init_scale=8.0, growth_interval=2)
    scales, stepped = [], []
    for g in (float("nan"), 1.0, 1.0, 1.0, float("inf"), 1.0):
        w.grad = torch.full_like(w, g)
        stepped.append(scaler.step(opt))
        scales.append(scaler.scale)
    assert stepped == [False, True, True, True, False, True]
    assert scales == [4.0, 4.0, 8.0, 8.0, 4.0, 4.0]
    assert scaler.skipped == 2 and opt.grad_divisor == 1.0


def test_formats_from_finfo():
    f = {r["name"]: r for r in formats()}
    assert (f["float16"]["exponent"], f["float16"]["mantissa"]) == (5, 10)
    assert (f["bfloat16"]["exponent"], f["bfloat16"]["mantissa"]) == (8, 7)
    assert f["float16"]["max"] == 65504 and f["float16"]["normal"] == 2.0 ** -14
    assert f["float16"]["subnormal"] == 2.0 ** -24 and f["bfloat16"]["normal"] == 2.0 ** -126


def test_census_sees_float16s_range_and_not_bfloat16s():
    """On the tiny model's first step: a share of float16's gradients is subnormal without a
    scale and none at 2^16; 2^24 overflows; bfloat16 has none subnormal and no overflow."""
    from transformers import AutoModelForCausalLM
    from harness.models import load_config, model_kwargs
    config = load_config("tiny")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, **model_kwargs(config, "eager")).float()
    x = torch.randint(0, config.vocab_size, (4, 33), generator=torch.Generator().manual_seed(0))
    ids, labels = x[:, :-1], x[:, 1:]
    c = {(d, s): census(model, ids, labels, d, s)
         for d, s in ((torch.float16, 1.0), (torch.float16, 2.0 ** 16),
                      (torch.float16, 2.0 ** 24), (torch.bfloat16, 1.0))}
    low, scaled, over, bf = (c[k] for k in c)
    assert low["param_subnormal"] > 0.01 and scaled["param_subnormal"] == 0
    assert low["non_finite"] == scaled["non_finite"] == 0 and over["non_finite"] > 0
    assert over["rel_error"] is None and scaled["rel_error"] < low["rel_error"] < 1e-2
    assert bf["param_subnormal"] == bf["act_subnormal"] == 0 and bf["non_finite"] == 0
    assert bf["rel_error"] > scaled["rel_error"]      # 7 mantissa bits against 10


def test_a_float32_parameter_beside_float16_ones_is_unscaled_too():
    """A model mixing fp16 parameters with fp32 ones (a router, a norm): the fp32 parameter is
    its own master, and its gradient is divided by S as the fp16 ones' copies are (Adam feels
    S on a 1e-6 entry, where its eps is not negligible)."""
    S, g = 2.0 ** 10, torch.tensor([0.5, 1e-6])
    half = torch.nn.Parameter(torch.ones(2, dtype=torch.float16))
    full = torch.nn.Parameter(torch.ones(2))
    opt = make_adamw([half, full], argparse.Namespace(lr=0.1, weight_decay=0.0))
    half.grad, full.grad = (g * S).half(), g * S
    assert DynamicLossScaler(init_scale=S).step(opt)
    ref = torch.nn.Parameter(torch.ones(2))
    ref.grad = g.clone()
    torch.optim.AdamW([ref], lr=0.1, weight_decay=0.0, betas=(0.9, 0.95), eps=1e-8).step()
    torch.testing.assert_close(full.detach(), ref.detach(), rtol=0, atol=1e-7)
    with pytest.raises(TypeError, match="MasterAdamW"):
        DynamicLossScaler().step(torch.optim.AdamW([full]))
