"""tp.parallelize in a plain training loop, per model family, against one device (float64).

    torchrun --nproc_per_node=2 tests/families_check.py [--families tiny-qwen3,...]

For each family: the same random model trained 2 AdamW steps on one batch of 2 x 16 tokens
(with ignored labels) on one device, and through tp.parallelize with the loop its docstring
shows. Prints one line per family: `PASS <family> ...` when the loss, every gradient of the
first step and every parameter after the last agree to 1e-9 relative (float64: the measured
difference is about 1e-15, a bug's is 1e-3 or more), otherwise `FAIL ...`. The control runs
Qwen3 without reduce_partial_grads() (its per-head q/k norms keep each rank's share), which
must FAIL: the comparison can see what it guards.
"""
import argparse
import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

import tp
from harness import IGNORE_INDEX, load_config, keep_float64, resolve_attn

TOL = 1e-9


def build(family):
    cfg = load_config(family)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=resolve_attn(cfg, "auto")[0])
    model = keep_float64(model.double())
    with torch.no_grad():   # away from the init's symmetries (zero biases, unit norms)
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=g)
    labels = torch.roll(ids, -1, 1)
    labels[0, -5:] = IGNORE_INDEX
    return model, ids, labels


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def check(family, reduce=True):
    ref, ids, labels = build(family)
    model = copy.deepcopy(ref)
    n = (labels != IGNORE_INDEX).sum()
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    tpm = tp.parallelize(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    errs = {}
    for step in range(2):
        logits = ref(input_ids=ids).logits
        loss_ref = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                   ignore_index=IGNORE_INDEX, reduction="sum") / n
        loss_ref.backward()
        loss = tpm.loss_sum(model(input_ids=ids).logits, labels) / n
        loss.backward()
        if reduce:
            tpm.reduce_partial_grads()
        errs[f"loss{step}"] = rel(loss.detach(), loss_ref.detach())
        if step == 0:
            full = tpm.full({k: p.grad for k, p in model.named_parameters()})
            errs["grad"] = max(rel(full[k], p.grad) for k, p in ref.named_parameters())
        opt_ref.step(), opt.step()
        opt_ref.zero_grad(), opt.zero_grad()
    full = tpm.full({k: p.detach() for k, p in model.named_parameters()})
    errs["param"] = max(rel(full[k], p.detach()) for k, p in ref.named_parameters())
    worst = max(errs, key=errs.get)
    ok = errs[worst] <= TOL
    return ok, f"worst {worst} {errs[worst]:.1e} (tol {TOL:.0e})"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--families", default="tiny-qwen3,tiny-olmo2,tiny-phi3,tiny-gemma2")
    a = p.parse_args()
    dist.init_process_group("gloo")
    for fam in a.families.split(","):
        ok, line = check(fam)
        if dist.get_rank() == 0:
            print(f"{'PASS' if ok else 'FAIL'} {fam} tp.parallelize, 2 AdamW steps: {line}",
                  flush=True)
    ok, line = check("tiny-qwen3", reduce=False)
    if dist.get_rank() == 0:
        print(f"{'PASS' if ok else 'FAIL'} control tiny-qwen3 without reduce_partial_grads: "
              f"{line}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
