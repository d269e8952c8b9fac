"""LoRA (lora.py, harness/lora_setup.py): peft's adapters under the strategies, against the
single-device peft model; the TP kinds of the adapters; merge and export; the formulas."""
import copy
import os

import pytest
import torch

import lora
import tp
from conftest import Runs, launch, assert_config_error
from harness.models import load_config

peft = pytest.importorskip("peft")


def peft_model(name="tiny", targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                     "up_proj", "down_proj"), meta=False, seed=0):
    from transformers import AutoModelForCausalLM
    cfg = load_config(name)
    torch.manual_seed(seed)
    with torch.device("meta") if meta else torch.device("cpu"):
        m = AutoModelForCausalLM.from_config(copy.deepcopy(cfg))
    lc = peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(targets), init_lora_weights=False)
    return cfg, lc, peft.get_peft_model(m, lc)


def test_tp_classifies_each_adapter_by_its_base():
    """A column base (q, k, v, gate, up) splits B like W's rows and keeps A whole with a partial
    gradient; a row base (o, down) splits A like W's columns, B partial; Phi3's fused
    projections split B by segment; the frozen base keeps its own kind."""
    _, _, pm = peft_model(meta=True)
    kinds, errs = tp.classify(pm.base_model.model, 2)
    assert not errs
    p = "model.layers.0."
    for proj, base, a, b in (("self_attn.q_proj", "column", "partial", "column"),
                             ("self_attn.v_proj", "column", "partial", "column"),
                             ("mlp.up_proj", "column", "partial", "column"),
                             ("self_attn.o_proj", "row", "row", "partial"),
                             ("mlp.down_proj", "row", "row", "partial")):
        assert kinds[f"{p}{proj}.base_layer.weight"] == base
        assert (kinds[f"{p}{proj}.lora_A.default.weight"],
                kinds[f"{p}{proj}.lora_B.default.weight"]) == (a, b)
    _, _, phi = peft_model("tiny-phi3", targets=("qkv_proj", "gate_up_proj", "o_proj"), meta=True)
    kinds, errs = tp.classify(phi.base_model.model, 2)
    assert not errs
    assert kinds["model.layers.0.self_attn.qkv_proj.lora_B.default.weight"] == "fused"
    assert kinds["model.layers.0.mlp.gate_up_proj.lora_A.default.weight"] == "partial"
    # more ranks than kv heads: k/v's B follows its base, one kv head per rank
    kinds, _ = tp.classify(peft_model(meta=True)[2].base_model.model, 4)
    assert kinds["model.layers.0.self_attn.k_proj.lora_B.default.weight"] == "kv-copy"


def test_tp_refuses_a_lora_layer_on_the_vocabulary():
    _, _, pm = peft_model(targets=("q_proj", "lm_head"), meta=True)
    _, errs = tp.classify(pm.base_model.model, 2)
    assert errs and errs[0].startswith("lm_head.base_layer.weight") and "vocabulary" in errs[0]


def test_merge_and_export_reload_with_the_same_logits(tmp_path):
    """lora.merged (W + s B A, by hand) equals peft's merge_and_unload exactly; the exported
    HF directory reloads with equal logits (float32: 1e-5 relative), and peft loads the adapter
    directory over the base with equal logits."""
    from transformers import AutoModelForCausalLM
    cfg, lc, pm = peft_model(targets=("q_proj", "v_proj", "o_proj", "down_proj"))
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = pm(input_ids=ids).logits
    full = {n: p.detach() for n, p in pm.base_model.model.named_parameters()}
    ref = copy.deepcopy(pm).merge_and_unload().state_dict()
    mine = lora.merged(full, lc.lora_alpha / lc.r)
    assert set(mine) == set(ref) and all(torch.equal(mine[k], ref[k]) for k in ref)
    lora.export(full, cfg, lc, str(tmp_path))
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    base = AutoModelForCausalLM.from_config(copy.deepcopy(cfg))
    base.load_state_dict({k.replace(".base_layer", ""): v for k, v in full.items()
                          if not lora.base_name(k)[1] in lora.ADAPTERS})
    adapter = peft.PeftModel.from_pretrained(base, tmp_path / "adapter")
    with torch.no_grad():
        for m in (merged, adapter):
            got = m(input_ids=ids).logits
            assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5
    # the check can fail: a merge that forgets the scale is far off
    wrong = lora.merged(full, 1.0)
    assert any(not torch.equal(wrong[k], ref[k]) for k in ref)


def test_a_bf16_export_reloads_within_the_dtype_noise(tmp_path):
    """bf16: the merged directory rounds W + s B A once; its logits stay as close to float64's
    as peft's own bf16 model (base and adapters apart) does: within 2x its error."""
    from transformers import AutoModelForCausalLM
    cfg, lc, pm = peft_model(targets=("q_proj", "v_proj", "o_proj", "down_proj"))
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        truth = copy.deepcopy(pm).double()(input_ids=ids).logits
        full = {n: p.detach().bfloat16() for n, p in pm.base_model.model.named_parameters()}
        lora.export(full, cfg, lc, str(tmp_path))
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.bfloat16)
        ref = copy.deepcopy(pm).bfloat16()
        err = lambda m: ((m(input_ids=ids).logits.double() - truth).abs().max()   # noqa: E731
                         / truth.abs().max()).item()
        e_merged, e_peft = err(merged), err(ref)
    assert 0 < e_peft < 0.05 and e_merged <= 2 * e_peft, (e_merged, e_peft)
    # the check can fail: the adapters left out of the merge are far beyond the noise
    wrong = AutoModelForCausalLM.from_config(copy.deepcopy(cfg)).bfloat16()
    wrong.load_state_dict(lora.merged(full, 0.0))
    with torch.no_grad():
        assert err(wrong) > 2 * e_peft


def test_the_state_formula_by_hand():
    """Psi = 1,000 parameters, Psi_a = 100 of them trainable: bf16 with fp32 masters keeps 2 B
    per parameter and 2 + 4 + 8 B more per trainable one; float32 4 and 4 + 8."""
    assert lora.state_bytes(1000, 100, 2) == 2000 + 100 * 14
    assert lora.state_bytes(1000, 1000, 2) == 16 * 1000   # full fine-tuning: 16 Psi
    assert lora.state_bytes(1000, 100, 4) == 4000 + 100 * 12
    assert lora.adapter_numel([(64, 64), (128, 64)], 8) == 8 * 128 + 8 * 192
    assert lora.tp_partial_numel([(64, 64)], [(64, 128)], 8) == 8 * 64 + 8 * 64


# the done-when command and its peers, in their scripts' slow launches (float64 unless named)
CORRECT = ["--mode", "correctness", "--lora", "4"]
SLOW = {
    "tp": Runs("tp.py", 2, {"lora": ["--mode", "correctness", "--lora", "8",
                                     "--dtype", "float64,bfloat16"]}, tier="slow"),
    "ddp": Runs("ddp.py", 2, {"lora": CORRECT}, tier="slow"),
    "fsdp": Runs("fsdp.py", 2, {"lora": CORRECT}, tier="slow"),
    # (--lora-dropout: the adapters' masks keyed by global token and feature, the same at every
    # layout: a Megatron-SP region's whole sequence, a row base's columns, CP's zig-zag tokens)
    "sp-megatron": Runs("sp.py", 2, {"lora": [*CORRECT, "--variant", "megatron",
                                              "--lora-dropout", "0.1"]}, tier="slow"),
    "sp-ulysses": Runs("sp.py", 2, {"lora-ulysses": [*CORRECT, "--variant", "ulysses"]},
                       tier="slow"),
    "zero": Runs("zero.py", 2, {"lora": [*CORRECT, "--stage", "1"],
                                "lora-zero3": [*CORRECT, "--stage", "3"]}, tier="slow"),
    "cp": Runs("cp_ring.py", 2, {"lora": [*CORRECT, "--lora-dropout", "0.1"]}, tier="slow"),
    # (tied embeddings: the last stage's head copy frozen like the embedding, no tie summed)
    "pp": Runs("pp.py", 2, {"lora": [*CORRECT, "--model", "configs/tiny-tied.json"]},
               tier="slow"),
    "compose4d": Runs("compose4d.py", 4, {"lora": [*CORRECT, "--tp", "2", "--dp", "2", "--sp",
                                                   "--zero", "2"]}, tier="slow"),
}
# the other world sizes (tp W=4: k and v's B replicated per kv head; fsdp W=3: rows cut
# unevenly), Phi3's fused projections and Qwen3's per-head norms, bf16 beyond tp
HEAVY = {
    "tp-W4": Runs("tp.py", 4, {"lora": [*CORRECT, "--dtype", "float64,bfloat16"],
                               "lora-dropout": [*CORRECT, "--lora-dropout", "0.1"]},
                  tier="heavy"),
    "dropout-plant": Runs("ddp.py", 2, {"lora-dropout-plant": [
        *CORRECT, "--lora-dropout", "0.1", "--plant-bug", "dropout-rank-local"]}, tier="heavy"),
    "tp-phi3": Runs("tp.py", 2, {"lora-phi3": [*CORRECT, "--model", "tiny-phi3"]}, tier="heavy"),
    "tp-qwen3": Runs("tp.py", 2, {"lora-qwen3": [*CORRECT, "--model", "tiny-qwen3"]},
                     tier="heavy"),
    "fsdp-W3": Runs("fsdp.py", 3, {"lora": [*CORRECT, "--batch", "6",
                                            "--dtype", "float64,bfloat16"]}, tier="heavy"),
    "zero-W3": Runs("zero.py", 3, {"lora": [*CORRECT, "--stage", "3", "--batch", "6",
                                            "--grad-accum", "2", "--dtype", "float64,bfloat16"],
                                   "lora-zero2": [*CORRECT, "--stage", "2", "--batch", "6"]},
                    tier="heavy"),
    "compose4d-pp": Runs("compose4d.py", 4, {"lora-pp": [*CORRECT, "--tp", "2", "--pp", "2",
                                                         "--dtype", "float64,bfloat16"]},
                         tier="heavy"),
    "pp-bf16": Runs("pp.py", 2, {"lora-bf16": [*CORRECT, "--dtype", "bfloat16"]},
                    tier="heavy"),
    "cp-bf16": Runs("cp_ring.py", 2, {"lora-bf16": [*CORRECT, "--dtype", "bfloat16"]},
                    tier="heavy"),
}


def check_lora_run(r):
    assert r.rc == 0, r
    rows = r.json("correctness.json")
    for row in rows:
        assert row["ok"] and "+lora" in row["strategy"], row
        assert row["grads_compared"] == row["tensors"] == row["params_compared"]
        frozen = [n for n in row["rows"] if lora.base_name(n)[1] not in lora.ADAPTERS]
        assert frozen and all(row["rows"][n]["param"]["err"] == 0.0 for n in frozen)
    return rows


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SLOW))
def test_lora_passes_against_the_single_device_peft_model(runs, name):
    batch = SLOW[name]
    for key in batch.runs:
        rows = check_lora_run(runs(batch, key))
        assert len(rows) == (2 if name == "tp" else 1)


@pytest.mark.heavy
def test_rank_local_adapter_masks_fail(runs):
    """The adapters' dropout keyed by local rows and positions (harness's dropout-rank-local
    plant) FAILs under ddp (each rank's rows), as a row base's local columns do under tp
    (tp's lora-dropout-local-columns, tests/test_plants.py)."""
    r = runs(HEAVY["dropout-plant"], "lora-dropout-plant")
    assert r.rc != 0 and r.last_line.startswith("FAIL ddp+lora4"), r


# (grad-accum 2: the base's last frozen unit is freed when the backward ends, so every
# micro-batch gathers it again; kept gathered, the second one gathered one unit fewer)
BENCH = {st: Runs("zero.py", 2, {f"lora-bench{st}": ["--mode", "benchmark", "--lora", "4",
                                                     "--stage", st, "--grad-accum", "2",
                                                     "--bench-iters", "2", "--warmup", "1"]},
                  tier="slow")
         for st in ("3",)}
BENCH["compose4d"] = Runs("compose4d.py", 4, {"lora-bench": [
    "--mode", "benchmark", "--lora", "4", "--dp", "2", "--cp", "2", "--zero", "3",
    "--bench-iters", "2", "--warmup", "1"]}, tier="heavy")
BENCH["sp"] = Runs("sp.py", 2, {"lora-bench": ["--mode", "benchmark", "--lora", "4",
                                               "--bench-iters", "2", "--warmup", "1"]},
                   tier="slow")
BENCH["fsdp"] = Runs("fsdp.py", 2, {"lora-bench": ["--mode", "benchmark", "--lora", "4",
                                                   "--bench-iters", "2", "--warmup", "1"]},
                     tier="slow")


@pytest.mark.parametrize("name", [pytest.param(n, marks=getattr(pytest.mark, b.tier))
                                  for n, b in BENCH.items()])
def test_only_the_adapters_are_reduced(runs, name):
    """The benchmark's communication equals the formulas: the reduce-scatter over the
    trainable parameters only (rig/zero.py and trainer4d/comm.py count them apart from the
    units, so frozen parameters mixed into a reduced unit MISMATCH; shown by hand), SP's
    re-gathers only where a trainable weight reads the region's input, and no backward before
    the first layer (a frozen embedding). ZeRO's measured model states equal its formula,
    whose gradients and AdamW moments are the adapters' by hand: tiny's 4 layers hold
    r (in + out) = 4 x 1,024 adapter parameters each, Psi_a = 16,384 (stage 3, float32, W=2)."""
    r = runs(BENCH[name], next(iter(BENCH[name].runs)))
    assert r.rc == 0 and "communication matches the formulas" in r.last_line, r
    rs = [l for l in r.stdout.splitlines() if l.strip().startswith("reduce_scatter_tensor")]
    assert rs and all(" ok " in l for l in rs), rs
    if name not in ("3",):   # (the comm rows above; ZeRO's memory by hand below)
        return
    b = r.json("benchmark.json")
    cfg = load_config("tiny")
    H, I, kv = cfg.hidden_size, cfg.intermediate_size, 32
    psi_a = cfg.num_hidden_layers * lora.adapter_numel(
        [(H, H), (kv, H), (kv, H), (H, H), (I, H), (I, H), (H, I)], 4)
    assert psi_a == 16_384
    for m in b["ours"]["memory"]:
        assert m["model_states"] == b["memory_formula"]["model_states"], (m, b["memory_formula"])
    f = b["memory_formula"]
    assert f["optimizer"] == 2 * psi_a // 2 * 4                # m and v of this rank's half
    assert f["grads"] == psi_a // 2 * 4                         # this rank's gradient shard


@pytest.mark.heavy
@pytest.mark.parametrize("name", [n for n in HEAVY if n != "dropout-plant"])
def test_lora_at_other_sizes_families_and_bf16(runs, name):
    batch = HEAVY[name]
    for key in batch.runs:
        check_lora_run(runs(batch, key))


def test_a_strategy_without_lora_refuses_it():
    r = launch("zeropp.py", 1, "--mode", "correctness", "--lora", "4", as_rank0=True)
    assert_config_error(r, "--lora: zero++ does not train LoRA adapters", torchrun=False)


def test_tp_refuses_an_adapter_on_the_head():
    r = launch("tp.py", 1, "--mode", "correctness", "--lora", "4", "--lora-targets",
               "q_proj,lm_head", as_rank0=True)
    assert_config_error(r, "lm_head.base_layer.weight (Linear): a LoRA layer on the vocabulary", torchrun=False)


def test_unknown_targets_are_refused():
    r = launch("ddp.py", 1, "--mode", "correctness", "--lora", "4", "--lora-targets", "nope",
               as_rank0=True)
    assert_config_error(r, "--lora-targets nope: peft refuses it", torchrun=False)


def test_async_tp_refuses_lora():
    r = launch("sp.py", 2, "--mode", "correctness", "--lora", "4", "--variant", "megatron",
               "--async-tp", as_rank0=True)
    assert_config_error(r, "--async-tp with --lora", torchrun=False)


LEARN = Runs("tp.py", 2, {"lora-learning": ["--mode", "learning", "--lora", "8",
                                            "--steps", "120"]}, tier="slow")


@pytest.mark.slow
def test_lora_learns_beside_the_reference(runs):
    """120 steps at tp 2: the curve equals the single-device peft model's (float32) and falls
    an eighth of the way to the floor (adapters on a frozen random-init model)."""
    r = runs(LEARN, "lora-learning")
    assert r.rc == 0 and r.last_line.startswith("PASS tp+lora8"), r


# -- compose4d's train mode: a local HF directory loaded shard by shard under peft's names, a
# checkpoint of the adapters only, resumed on another layout, exported merged and as an adapter
from test_train_text import TEXT, TRAIN, fixtures, path   # noqa: E402  (its text, models)


def lck(base):
    return str(base) + "/ck-lora"


def lhf(base):
    return str(base) + "/hf-lora"


L64 = ["--dtype", "float64", "--lora", "4", "--lora-dropout", "0.1"]
TRAIN_LORA = Runs("compose4d.py", 2, tier="slow", runs={
    # the same steps from the shards each rank reads (adapters drawn, cut like their base)
    # and from the whole model: uninterrupted on tp 2, 4 steps
    "lora-whole": [*TEXT, *L64, "--tp", "2", "--steps", "4"],
    "lora-full": [*TEXT, *L64, "--tp", "2", "--steps", "2", "--load", "full"],
    # stopped at 2 on tp 2, resumed on dp 2 (ZeRO-3: the base sharded in frozen units)
    "lora-first": [*TEXT, *L64, "--tp", "2", "--steps", "4", "--stop-at", "2", "--save", lck],
    "lora-second": [*TEXT, *L64, "--dp", "2", "--zero", "3", "--steps", "4", "--resume", lck,
                    "--save", lck, "--export-hf", lhf],
    # tied embeddings over two stages: the last stage's head copy frozen, nothing tied summed
    "lora-tied-pp": [*TRAIN, "--model", path("tied"), "--data", path("corpus"), *L64, "--pp",
                     "2", "--steps", "2", "--zero", "3"],
})


def losses(r):
    import json
    import os
    assert r.rc == 0, r
    with open(os.path.join(r.out, "train.jsonl")) as f:
        return {x["step"]: x["loss"] for x in map(json.loads, f) if "loss" in x}


@pytest.mark.slow
def test_train_mode_loads_resumes_on_another_layout_and_exports(runs):
    """float64: the shards each rank reads give the whole model's losses (the adapters drawn
    by name, the same either way); a run stopped at step 2 on tp 2 and resumed on dp 2 (ZeRO-3)
    equals the uninterrupted one; its checkpoint holds the adapters and their AdamW moments
    only; the merged export and peft's adapter directory over the base give equal logits."""
    import os
    from transformers import AutoModelForCausalLM
    whole, full = losses(runs(TRAIN_LORA, "lora-whole")), losses(runs(TRAIN_LORA, "lora-full"))
    assert all(abs(full[s] - whole[s]) <= 1e-12 * whole[s] for s in full), (full, whole)
    got = {**losses(runs(TRAIN_LORA, "lora-first")), **losses(runs(TRAIN_LORA, "lora-second"))}
    assert sorted(got) == [0, 1, 2, 3] and whole[3] < whole[0]
    assert all(abs(got[s] - whole[s]) <= 1e-12 * whole[s] for s in whole), (got, whole)
    base = os.path.dirname(runs(TRAIN_LORA, "lora-first").out)
    rec = torch.load(os.path.join(lck(base), "step-2", "pp0-tp0.pt"), weights_only=True)
    names = set(rec["tensors"]["param"])
    assert names and all(lora.base_name(n)[1] in lora.ADAPTERS for n in names), names
    assert set(rec["tensors"]) == {"param", "exp_avg", "exp_avg_sq"}
    ids = torch.randint(0, 320, (2, 16), generator=torch.Generator().manual_seed(0))
    merged = AutoModelForCausalLM.from_pretrained(os.path.join(lhf(base), "merged"),
                                                  dtype=torch.float64)
    over = peft.PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(fixtures(base)["llama"], dtype=torch.float64),
        os.path.join(lhf(base), "adapter"))
    plain = AutoModelForCausalLM.from_pretrained(fixtures(base)["llama"], dtype=torch.float64)
    with torch.no_grad():
        a, b, c = (m(input_ids=ids).logits for m in (merged, over, plain))
    assert ((a - b).abs().max() / a.abs().max()).item() < 1e-10
    assert ((a - c).abs().max() / a.abs().max()).item() > 1e-6     # the adapters trained
    tied = losses(runs(TRAIN_LORA, "lora-tied-pp"))
    assert sorted(tied) == [0, 1] and tied[1] == tied[1]


@pytest.mark.slow
@pytest.mark.parametrize("args,msg", [
    ([], "--resume {ck}: the checkpoint was saved with --lora and this run has none"),
    (["--lora", "8"], "--resume {ck}: the checkpoint's adapters were trained with r 4 (now 8)"),
])
def test_a_lora_checkpoint_resumes_only_the_same_adapters(runs, args, msg):
    runs(TRAIN_LORA, "lora-first")
    base = os.path.dirname(runs(TRAIN_LORA, "lora-first").out)
    model = fixtures(base)["llama"]
    r = launch("compose4d.py", 2, *TRAIN, "--model", model, "--data", fixtures(base)["corpus"],
               "--val-fraction", "0.1", "--dtype", "float64", "--dp", "2", "--steps", "4",
               "--resume", lck(base), *args, as_rank0=True)
    assert_config_error(r, msg.format(ck=lck(base)), torchrun=False)


def test_a_resume_over_another_base_is_refused(tmp_path):
    """The checkpoint holds the adapters only: the base's fingerprint (safetensors sizes,
    header and sampled blocks) must be the one they were trained on."""
    import argparse
    import shutil
    from harness import lora_setup
    base = fixtures(tmp_path)
    other = str(tmp_path / "other")
    shutil.copytree(base["llama"], other)
    a = argparse.Namespace(lora=4, lora_alpha=None, lora_targets="auto", lora_dropout=0.0,
                           seed=0, model=other, device="cpu")
    meta = {"lora": lora_setup.recorded(a)}
    assert lora_setup.resume_refusal(meta, a) is None
    path = os.path.join(other, "model.safetensors")
    with open(path, "r+b") as f:   # the same header, other weights in the middle of the file
        f.seek(os.path.getsize(path) // 2 - 32768)
        f.write(bytes(65536))
    why = lora_setup.resume_refusal(meta, a)
    assert why and "another base under --model" in why, why
