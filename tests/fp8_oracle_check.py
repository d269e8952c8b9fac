"""fp8.py's Float8Linear against torchao's Float8 training (convert_to_float8_training), run
by tests/test_fp8.py in its own process with PYTHONPATH=.oracles (scripts/setup.sh puts
torchao there, out of the environment). One linear layer, the same weights and batch: the
output, the input's, weight's and bias's gradients, each as the largest absolute difference; one JSON line per case.

    PYTHONPATH=.oracles python tests/fp8_oracle_check.py [--plant NAME]

Cases: tensorwise in float32 and bfloat16, rowwise in bfloat16 (torchao's rowwise computes a
float32 layer's GEMM in bfloat16, a CUDA kernel's limit, so float32 rowwise is not compared)."""
import argparse
import copy
import json
import os
import sys
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: E402

import fp8  # noqa: E402
from harness import planting  # noqa: E402


def case(recipe, dtype, plant):
    g = torch.Generator().manual_seed(0)
    lin = nn.Linear(64, 48).to(dtype)                # (the bias added after the GEMM)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(48, 64, generator=g))
        lin.bias.copy_(torch.randn(48, generator=g))
    ours, theirs = copy.deepcopy(lin), nn.Sequential(copy.deepcopy(lin))
    convert_to_float8_training(theirs, config=Float8LinearConfig.from_recipe_name(recipe))
    ours = fp8.Float8Linear(ours, recipe)
    x = torch.randn(4, 10, 64, generator=g).to(dtype)   # (B, S, in): 40 tokens, padded to 48
    dy = torch.randn(4, 10, 48, generator=g).to(dtype)  # in dW's GEMM
    out = {}
    for name, m in (("ours", ours), ("torchao", theirs)):
        xi = x.clone().requires_grad_()
        with planting(plant if name == "ours" else None):
            y = m(xi)
            y.backward(dy)
        lin_ = m if name == "ours" else m[0]
        out[name] = (y.detach().float(), xi.grad.float(), lin_.weight.grad.float(),
                     lin_.bias.grad.float())
    diff = [float((a - b).abs().max()) for a, b in zip(out["ours"], out["torchao"])]
    scale = [float(b.abs().max()) for b in out["torchao"]]
    return dict(recipe=recipe, dtype=str(dtype).split(".")[1], y=diff[0], dx=diff[1],
                dw=diff[2], db=diff[3], y_max=scale[0], dx_max=scale[1], dw_max=scale[2],
                torchao_class=type(theirs[0]).__name__)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--plant", default=None)
    a = p.parse_args()
    for recipe, dtype in (("tensorwise", torch.float32), ("tensorwise", torch.bfloat16),
                          ("rowwise", torch.bfloat16)):
        print(json.dumps(case(recipe, dtype, a.plant)), flush=True)
