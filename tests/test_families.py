"""Models beyond Llama: every strategy on one small random model per HF decoder family passes
against one device, or refuses the model in one line before any collective (exit 2); none
trains it silently wrong or ends in a traceback. scripts/families.py prints the whole table.

Families (harness.models' tiny-* presets): Mistral (a sliding window on every layer), Qwen2
(q/k/v biases), Qwen3 (per-head q/k norms), OLMo2 (full-width q/k norms, norms after the
sublayers), Gemma2 ((1 + w) norms computed in float32, scaled embedding, soft-capping, sliding
window on alternate layers, eager attention only), Phi3 (fused qkv_proj and gate_up_proj); and
beyond them, with HF's own pad ids: Gemma3 (a rope base per layer type), OLMo3 (sliding layers,
pad id 1), Cohere (parallel block, logit_scale), Granite (multipliers), GPT-NeoX (other module
names, per-head fused qkv), GPT-2 (learned positions, Conv1D), OPT (model.decoder.layers, a
key bias with no gradient in exact arithmetic), StarCoder2 (c_fc / c_proj, biases), GLM (a
fused gate_up_proj HF's plan gathers), Phi-2 (parallel block, fc1 / fc2, a biased LM head),
Nemotron (squared ReLU, LayerNorm1P) and StableLM (no plan in its config): 18 families; any
causal LM under the
strategies that need no architecture, the self-check (harness/selfcheck.py) where one
re-implements the forward around the layers."""
import os
import sys
import types

import pytest
import torch
import torch.nn as nn

import harness
import tp
from conftest import ROOT, Runs, assert_config_error, assert_resume_continues, launch, torchrun

sys.path.insert(0, os.path.join(ROOT, "scripts"))
import realistic  # noqa: E402  (make_checkpoint's trained twins)

FAMILIES = ["tiny-mistral", "tiny-qwen2", "tiny-qwen3", "tiny-olmo2", "tiny-gemma2", "tiny-phi3"]
ARGS = ["--mode", "correctness", "--dtype", "float64", "--batch", "4", "--length", "16"]
# What each strategy runs (the rest of the families it must refuse, tested below): the
# strategies that split the model's modules (tp, sp, pp, compose4d) on every family; those
# that only replicate or shard whole tensors on the two that broke them (Gemma2's SDPA and
# float32 norms, Phi3's fused projections); ring attention and Ulysses on the ones whose
# attention they implement.
RUNS_ON = {
    ("ddp.py", 2, ()): ["tiny-gemma2", "tiny-phi3"],
    ("zero.py", 2, ("--stage", "3")): ["tiny-gemma2", "tiny-phi3"],
    ("fsdp.py", 2, ()): ["tiny-gemma2", "tiny-phi3"],
    ("tp.py", 2, ()): FAMILIES,
    ("sp.py", 2, ("--variant", "megatron")): FAMILIES,
    ("sp.py", 2, ("--variant", "ulysses")): ["tiny-qwen3", "tiny-olmo2", "tiny-phi3"],
    ("pp.py", 2, ()): FAMILIES,
    ("cp_ring.py", 2, ()): ["tiny-qwen3", "tiny-olmo2", "tiny-phi3"],
    ("compose4d.py", 4, ("--tp", "2", "--pp", "2")): FAMILIES,
    # Phi3's attention reads a per-rank config view: the ring installed after TP reaches it
    ("compose4d.py", 4, ("--tp", "2", "--cp", "2")): ["tiny-qwen3", "tiny-phi3"],
    # selective recompute renames the attention: pp still builds the eager / sliding masks
    ("pp.py", 2, ("--recompute", "selective")): ["tiny-mistral", "tiny-gemma2"],
}
BATCHES = {key: Runs(key[0], key[1], {f: [*ARGS, "--model", f, *key[2]] for f in fams},
                     tier="slow") for key, fams in RUNS_ON.items()}

# The families beyond those (harness.models: Gemma 3, OLMo 3, Cohere, Granite, GPT-NeoX, GPT-2,
# OPT, StarCoder2, GLM, Phi-2, Nemotron, StableLM): every PASS cell of
# results/families-cpu.json in the heavy tier, a few in `make test` (slow). Each strategy that
# needs no architecture runs every family; pp and compose4d run those whose forward around the
# layers they know (the self-check refuses GPT-2's and OPT's position embeddings), tp those
# whose modules its plan classifies (HF's base_model_tp_plan, else tp.PLAN; the learned
# positions refused), Ulysses and ring attention those without a sliding window shorter than
# the sequence.
NEW = ["tiny-gemma3", "tiny-olmo3", "tiny-cohere", "tiny-granite", "tiny-neox", "tiny-gpt2",
       "tiny-opt", "tiny-starcoder2", "tiny-glm", "tiny-phi", "tiny-nemotron", "tiny-stablelm"]
UNSPLIT = ["tiny-gpt2", "tiny-opt"]   # learned position embeddings: tp and pp refuse them
KNOWN_AROUND = [f for f in NEW if f not in UNSPLIT]
NO_SHORT_WINDOW = [f for f in NEW if f not in ("tiny-gemma3", "tiny-olmo3")]
NEW_RUNS_ON = {
    ("ddp.py", 2, ()): NEW, ("zero.py", 2, ("--stage", "3")): NEW, ("fsdp.py", 2, ()): NEW,
    ("tp.py", 2, ()): KNOWN_AROUND, ("sp.py", 2, ("--variant", "megatron")): KNOWN_AROUND,
    ("sp.py", 2, ("--variant", "ulysses")): NO_SHORT_WINDOW,
    ("pp.py", 2, ()): KNOWN_AROUND,
    ("cp_ring.py", 2, ()): NO_SHORT_WINDOW,
    ("compose4d.py", 4, ("--tp", "2", "--pp", "2")): KNOWN_AROUND,
}
IN_MAKE_TEST = {("pp.py", 2, ()): ["tiny-cohere", "tiny-granite", "tiny-gemma3"],
                ("ddp.py", 2, ()): ["tiny-neox"], ("tp.py", 2, ()): ["tiny-olmo3", "tiny-neox"],
                ("sp.py", 2, ("--variant", "megatron")): ["tiny-starcoder2"]}


def _tier(key, family):
    return "slow" if family in IN_MAKE_TEST.get(key, ()) else "heavy"


NEW_BATCHES = {(key, tier): Runs(key[0], key[1], {f: [*ARGS, "--model", f, *key[2]]
                                                  for f in fams if _tier(key, f) == tier},
                                 tier=tier)
               for key, fams in NEW_RUNS_ON.items() for tier in ("slow", "heavy")}


@pytest.mark.parametrize("key,family", [
    pytest.param(k, f, id=f"{k[0][:-3]}{''.join(k[2])}-{f}",
                 marks=getattr(pytest.mark, _tier(k, f)))
    for k, fams in NEW_RUNS_ON.items() for f in fams])
def test_any_causal_lm_passes(runs, key, family):
    r = runs(NEW_BATCHES[key, _tier(key, family)], family)
    assert r.rc == 0 and "\nPASS " in "\n" + r.stdout, r


@pytest.mark.slow
@pytest.mark.parametrize("key,family", [pytest.param(k, f, id=f"{k[0][:-3]}{''.join(k[2])}-{f}")
                                        for k, fams in RUNS_ON.items() for f in fams])
def test_family_passes(runs, key, family):
    r = runs(BATCHES[key], family)
    assert r.rc == 0 and "\nPASS " in "\n" + r.stdout, r


# -- refusals: one line naming the constraint, before any process group (in-process) --------
def constraints(script, cls_name, world, family, *extra):
    import importlib
    cls = getattr(importlib.import_module("rig." + script), cls_name)
    p = harness.base_parser(script)
    cls.add_args(p)
    args = p.parse_args(["--model", family, "--batch", "4", "--length", "16", *extra])
    cfg = harness.load_config(family)
    args.attn = harness.resolve_attn(cfg, args.attn)[0]
    return harness.common_constraints(args, world, cfg) + cls.constraints(args, world, cfg)


REFUSED = [
    # (script, class, world, family, extra args, the refusal's start)
    ("cp_ring", "CP", 2, "tiny-gemma2", (), "context parallelism's ring attention does not "
     "implement attention logit soft-capping"),
    ("cp_ring", "CP", 2, "tiny-mistral", (), "context parallelism's ring attention does not "
     "implement a sliding window of 8 tokens, shorter than --length 16"),
    ("sp", "SP", 2, "tiny-gemma2", ("--variant", "ulysses"), "ulysses attends with SDPA's "
     "causal mode, which does not implement attention logit soft-capping"),
    ("sp", "SP", 2, "tiny-mistral", ("--variant", "ulysses"), "ulysses attends with SDPA's "
     "causal mode, which does not implement a sliding window"),
    ("tp", "TP", 4, "tiny-olmo2", (), "model.layers.0.self_attn.k_norm.weight (Olmo2RMSNorm): a "
     "full-width k_norm with more ranks (4) than kv heads (2) is not supported"),
    ("tp", "TP", 4, "tiny-phi3", (), "model.layers.0.self_attn.qkv_proj.weight (Linear): a fused "
     "projection with more ranks (4) than kv heads (2) is not supported"),
    ("compose4d", "Compose4D", 4, "tiny-gemma2", ("--cp", "2", "--length", "16"),
     "--cp 2: context parallelism's ring attention does not implement attention logit"),
    # learned position embeddings: no kind in the plan (GPT-2's config ships no tp plan)
    ("tp", "TP", 2, "tiny-gpt2", (), "transformer.wpe.weight (Embedding): not a module tensor "
     "parallelism knows how to split"),
    ("tp", "TP", 2, "tiny-opt", (), "model.decoder.embed_positions.weight "
     "(OPTLearnedPositionalEmbedding): not a module tensor parallelism knows how to split"),
    ("sp", "SP", 2, "tiny-gemma3", ("--variant", "ulysses"), "ulysses attends with SDPA's "
     "causal mode, which does not implement a sliding window"),
    ("cp_ring", "CP", 2, "tiny-olmo3", (), "context parallelism's ring attention does not "
     "implement a sliding window of 8 tokens, shorter than --length 16"),
]


@pytest.mark.parametrize("script,cls,world,family,extra,msg", REFUSED,
                         ids=[f"{r[0]}-W{r[2]}-{r[3]}" for r in REFUSED])
def test_family_refused(script, cls, world, family, extra, msg):
    errs = constraints(script, cls, world, family, *extra)
    assert errs and errs[0].startswith(msg), errs


def test_refusal_is_one_line_exit_2():
    r = launch("cp_ring.py", 2, "--mode", "correctness", "--model", "tiny-gemma2", "--length",
               "16", as_rank0=True)
    assert_config_error(r, "context parallelism's ring attention does not implement",
                        torchrun=False)


def test_sdpa_asked_where_there_is_none():
    with pytest.raises(harness.ConfigError, match="Gemma2ForCausalLM has no SDPA"):
        harness.resolve_attn(harness.load_config("tiny-gemma2"), "sdpa")
    assert harness.resolve_attn(harness.load_config("tiny-gemma2"), "auto")[0] == "eager"
    assert harness.resolve_attn(harness.load_config("tiny-qwen3"), "auto") == ("sdpa", None)


# -- the classification itself -------------------------------------------------------------
@pytest.mark.parametrize("family", ["tiny", *FAMILIES, *(f for f in NEW if f not in UNSPLIT)])
def test_every_parameter_has_a_kind(family):
    model = tp.meta_model(harness.load_config(family))
    kinds, errs = tp.classify(model, 2)
    assert not errs and all(kinds.get(n) for n, _ in model.named_parameters()), (errs, kinds)
    want = {"tiny-qwen3": ("self_attn.q_norm.weight", "partial"),
            "tiny-olmo2": ("self_attn.k_norm.weight", "norm-sharded"),
            "tiny-phi3": ("self_attn.qkv_proj.weight", "fused"),
            "tiny-gemma2": ("pre_feedforward_layernorm.weight", "replicated")}.get(family)
    if want:
        assert kinds["model.layers.1." + want[0]] == want[1], kinds


@pytest.mark.parametrize("family", ["tiny", *FAMILIES, "tiny-starcoder2", "tiny-glm"])
def test_hf_plan_and_the_canonical_table_agree(family):
    """A config's base_model_tp_plan (transformers' own) decides a layer's kinds; where the
    project's table (tp.PLAN) also names the modules, both give every parameter the same kind
    (HF's "colwise_gather_output" on Phi3's and GLM's fused projections is fused, on OLMo2's
    q/k/v a column before the norm over all heads); StarCoder2's MLP only HF's plan names."""
    config = harness.load_config(family)
    hf = config.base_model_tp_plan
    assert hf, family
    kinds, errs = tp.classify(tp.meta_model(config), 2)
    assert not errs, errs
    config.base_model_tp_plan = None
    table, errs_table = tp.classify(tp.meta_model(config), 2)
    if family == "tiny-starcoder2":     # its MLP's c_fc / c_proj: named by HF's plan only
        assert errs_table[0].startswith("model.layers.0.mlp.c_fc.weight (Linear)"), errs_table
    else:
        assert table == kinds and not errs_table, {n: (k, table.get(n)) for n, k in kinds.items()
                                                   if table.get(n) != k}


def test_the_hf_plan_is_read_not_the_names():
    """The kinds follow the config's plan: a plan that calls down_proj column-parallel makes it
    one; a word of HF's this project does not implement is refused, naming the word, and so is
    an output HF gathers for something not split here; a model without its head is refused."""
    config = harness.load_config("tiny")
    config.base_model_tp_plan = {**config.base_model_tp_plan,
                                 "layers.*.mlp.down_proj": "colwise",
                                 "layers.*.mlp.up_proj": "local_colwise"}
    kinds, errs = tp.classify(tp.meta_model(config), 2)
    assert kinds["model.layers.0.mlp.down_proj.weight"] == "column"
    assert errs[0] == ("model.layers.0.mlp.up_proj.weight (Linear): HF's 'local_colwise' (in its "
                       "config's base_model_tp_plan) is not implemented here"), errs
    # a gathered output this project would not split whole (no norm over all heads follows)
    config.base_model_tp_plan["layers.*.mlp.up_proj"] = "colwise_gather_output"
    _, errs = tp.classify(tp.meta_model(config), 2)
    assert errs[0].startswith("model.layers.0.mlp.up_proj.weight (Linear): HF's plan gathers"), errs
    # a decoder without its LM head (AutoModel's): refused, not split half-way
    from transformers import AutoModel
    with torch.device("meta"):
        bare = AutoModel.from_config(harness.load_config("tiny"))
    assert tp.classify(bare, 2)[1][0].startswith("LlamaModel is not an HF decoder whose layers")


class Gate(nn.Module):
    """A module the code has never seen: a learned scalar gate on the attention output."""
    def __init__(self):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1))


def test_an_unknown_module_is_refused_by_name(group):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_config(harness.load_config("tiny-qwen3"))
    model.model.layers[1].self_attn.gate = Gate()
    before = {n: p.clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=r"^tp.parallelize: model.layers.1.self_attn.gate.alpha "
                                         r"\(Gate\): not a module tensor parallelism knows how"):
        tp.parallelize(model)
    after = dict(model.named_parameters())   # refused before anything was split
    assert before.keys() == after.keys() and all(torch.equal(before[n], after[n]) for n in before)
    # and a model that is not an HF decoder at all
    with pytest.raises(ValueError, match="is not an HF decoder"):
        tp.parallelize(types.SimpleNamespace(config=model.config, named_modules=lambda **kw: []))


def test_float64_runs_keep_float64_inside_the_model():
    """Gemma2's norms and eager attention compute in float32 by design: in a float64 run they
    stay float64 (what the float64 verdict needs); in bfloat16 the model is unchanged."""
    import copy
    from transformers import AutoModelForCausalLM
    cfg = harness.load_config("tiny-gemma2")
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    ids = torch.randint(0, cfg.vocab_size, (2, 16))
    plain = copy.deepcopy(m).double()
    kept = harness.keep_float64(copy.deepcopy(m).double())

    def float32_ops(model):
        from torch.utils._python_dispatch import TorchDispatchMode

        class Dtypes(TorchDispatchMode):
            seen, on = set(), True

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in (out if isinstance(out, (tuple, list)) else (out,)):
                    if self.on and isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                        self.seen.add(str(func))
                return out
        mode = Dtypes()
        # (the rotary table is float32 by design: a function of the positions only, the same
        # numbers in every run and layout)
        rot = model.model.rotary_emb
        hooks = [rot.register_forward_pre_hook(lambda *a: setattr(mode, "on", False)),
                 rot.register_forward_hook(lambda *a: setattr(mode, "on", True))]
        with mode:
            model(input_ids=ids).logits.sum().backward()
        for h in hooks:
            h.remove()
        return mode.seen
    assert float32_ops(plain)             # HF's own casts: norms, eager softmax
    assert not float32_ops(kept)          # none left, forward or backward
    assert (plain(input_ids=ids).logits - kept(input_ids=ids).logits).abs().max() > 1e-8
    bf = copy.deepcopy(m).bfloat16()
    a = bf(input_ids=ids).logits
    assert torch.equal(harness.keep_float64(bf)(input_ids=ids).logits, a)


@pytest.mark.slow
def test_tp_in_a_plain_loop_matches_one_device():
    """Through the library API, not the harness: tp.parallelize, the vocab-parallel loss,
    reduce_partial_grads and AdamW, per family; a Qwen3 loop without the partial-gradient sum
    must FAIL (tests/families_check.py)."""
    p = torchrun(os.path.join(ROOT, "tests", "families_check.py"), 2,
                 env=dict(PYTHONPATH=ROOT))
    lines = [l for l in p.stdout.splitlines() if l.startswith(("PASS", "FAIL"))]
    assert [l.split()[:2] for l in lines] == [
        ["PASS", f] for f in ("tiny-qwen3", "tiny-olmo2", "tiny-phi3", "tiny-gemma2")] + [
        ["FAIL", "control"]], p.stdout + p.stderr[-3000:]


# A Qwen3 twin of the realistic checkpoint (trained, massive activations, sharp attention, 12
# heads / 6 kv heads, tied, vocabulary 250): its per-head q/k norms are trained weights whose
# gradients sum over heads with heavy cancellation, the case a random init is kind to.
def qwen3_checkpoint(base):
    return realistic.checkpoint(os.path.join(os.path.dirname(str(base)), "ckpt"), "qwen3")


QWEN3_REAL = {script: Runs(script, 2, {"qwen3-real": [
    "--mode", "correctness", "--model", qwen3_checkpoint, "--dtype", "float64,float32",
    *realistic.DATA, *extra]}, tier="slow")
    for script, extra in (("tp.py", []), ("sp.py", ["--variant", "megatron"]))}


@pytest.mark.slow
@pytest.mark.parametrize("script", list(QWEN3_REAL))
def test_qwen3_realistic_checkpoint(runs, script):
    r = runs(QWEN3_REAL[script], "qwen3-real")
    assert r.rc == 0 and r.last_line.startswith("PASS"), r
    results = r.json("correctness.json")
    assert [x["dtype"] for x in results] == ["float64", "float32"], results
    assert all(x["ok"] and x["tensors"] == x["grads_compared"] for x in results), results


# compose4d's train mode on the families: --export-hf reloads in HF with the checkpoint's logits,
# and a Phi3 checkpoint written at tp 2 (its fused projections stored segment by segment)
# resumes at dp 2 on the uninterrupted curve.
TRAIN = ["--mode", "train", "--dtype", "float64", "--log-every", "1", "--batch", "4",
         "--length", "16"]
EXPORTED = ["tiny-qwen3", "tiny-olmo2", "tiny-gemma2", "tiny-phi3"]


def _dir(name):
    return lambda base: os.path.join(str(base), name)


TRAIN_RUNS = Runs("compose4d.py", 2, tier="slow", runs={
    **{f"export-{f}": [*TRAIN, "--steps", "2", "--tp", "2", "--model", f, "--save",
                       _dir(f"ck-{f}"), "--export-hf", _dir(f"hf-{f}")] for f in EXPORTED},
    "phi3-full": [*TRAIN, "--steps", "4", "--tp", "2", "--model", "tiny-phi3"],
    "phi3-first": [*TRAIN, "--steps", "4", "--tp", "2", "--model", "tiny-phi3", "--stop-at", "2",
                   "--save", _dir("ck-phi3-resume")],
    "phi3-second": [*TRAIN, "--steps", "4", "--dp", "2", "--model", "tiny-phi3", "--resume",
                    _dir("ck-phi3-resume"), "--save", _dir("ck-phi3-resume")],
})


@pytest.mark.slow
@pytest.mark.parametrize("family", EXPORTED)
def test_compose4d_exports_each_family(runs, family):
    from transformers import AutoModelForCausalLM
    from trainer4d import checkpoint
    r = runs(TRAIN_RUNS, f"export-{family}")
    assert r.rc == 0, r
    base = os.path.dirname(r.out)
    model = AutoModelForCausalLM.from_pretrained(os.path.join(base, f"hf-{family}"),
                                                 dtype=torch.float64)
    meta, tensors = checkpoint.load_checkpoint(os.path.join(base, f"ck-{family}"))
    cfg = harness.load_config(family)
    ref = AutoModelForCausalLM.from_config(
        cfg, attn_implementation=harness.resolve_attn(cfg, "auto")[0]).double()
    missing, unexpected = ref.load_state_dict(tensors["param"], strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    x = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    assert torch.equal(model(x).logits, ref(x).logits)


@pytest.mark.slow
def test_phi3_checkpoint_resumes_on_another_layout(runs):
    assert_resume_continues(runs, TRAIN_RUNS, "phi3-full", "phi3-first", "phi3-second", cut=2,
                            steps=4)


# == Any causal LM (the families beyond the seven, docs/strategies.md "Model families") =========


def _model(family):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(harness.load_config(family))


@pytest.mark.parametrize("family", ["tiny", *FAMILIES, *NEW])
def test_the_parts_are_found_by_hf_accessors(family):
    """Every family's embedding, layers, final norm and head, whatever it names them
    (gpt_neox.embed_in, transformer.h, ...): each parameter in exactly one part."""
    m = _model(family)
    p = harness.parts(m)
    assert p.embed is m.get_input_embeddings() and p.head is m.get_output_embeddings()
    assert len(p.layers) == m.config.num_hidden_layers and p.norm is not None
    assert all(harness.attention_of(layer) is not None for layer in p.layers)
    owned = {id(t) for mod in (p.embed, *p.layers, p.norm, p.head) for t in mod.parameters()}
    rest = [n for n, t in m.named_parameters() if id(t) not in owned]
    assert rest == {"tiny-gpt2": ["transformer.wpe.weight"],
                    "tiny-opt": ["model.decoder.embed_positions.weight"]}.get(family, []), rest
    assert p.tied == m.config.tie_word_embeddings


def _selfcheck_args(family, *extra):
    p = harness.base_parser("pp.py")
    args = p.parse_args(["--model", family, "--length", "16", *extra])
    args.attn = harness.resolve_attn(harness.load_config(family), args.attn)[0]
    return args


@pytest.mark.parametrize("family", ["tiny", *FAMILIES, *KNOWN_AROUND])
def test_the_stage_loop_computes_each_familys_forward(family):
    from harness import selfcheck
    import rig.pp
    cfg = harness.load_config(family)
    assert selfcheck.compare(cfg, _selfcheck_args(family), "pp's stage loop",
                             rig.pp.stage_loop) is None


def test_the_self_check_refuses_what_the_loop_does_not_do(monkeypatch):
    """Each thing pp's stage loop does for a family, undone, is refused by name: GPT-2's learned
    position embeddings (never done), Cohere's logit scale, Gemma 3's rope base per layer type,
    and the planted skip of the final norm."""
    from harness import selfcheck
    import pp
    import rig.pp

    def refusal(family):
        return selfcheck.compare(harness.load_config(family), _selfcheck_args(family),
                                 "pp's stage loop", rig.pp.stage_loop)
    assert refusal("tiny-gpt2").startswith(
        "pp's stage loop does not compute GPT2LMHeadModel's forward: the output of "
        "transformer.h.0 differs (transformer.wte agrees: the step between them)")
    with harness.planting("pp-skips-final-norm"):
        assert "model.norm never runs" in refusal("tiny-gemma3")
    monkeypatch.setattr(pp, "head_output", lambda logits, config: logits)
    assert "the logits differ after lm_head" in refusal("tiny-cohere")
    monkeypatch.undo()
    one_pair = harness.models.rotary_by_type

    def one_rope(p, h, pos, types):   # the sliding layers' pair for every layer
        pairs = one_pair(p, h, pos, types)
        return {t: pairs["sliding_attention"] for t in pairs}
    monkeypatch.setattr(pp, "rotary_by_type", one_rope)
    assert "the output of model.layers.1 differs (model.layers.0 agrees" in refusal("tiny-gemma3")


def test_the_self_check_refusal_is_one_line_before_any_collective():
    r = launch("pp.py", 2, "--mode", "correctness", "--model", "tiny-gpt2", "--length", "16",
               "--batch", "4", as_rank0=True)
    assert_config_error(r, "pp's stage loop does not compute GPT2LMHeadModel's forward",
                        torchrun=False)


def test_skip_self_check_warns(capsys):
    from harness import selfcheck
    import rig.pp
    args = _selfcheck_args("tiny-gpt2", "--skip-self-check")
    selfcheck.check(rig.pp.PP, args, harness.load_config("tiny-gpt2"), rank=0)
    assert capsys.readouterr().out.startswith("warning: --skip-self-check: pp's stage loop")


def test_a_dropout_outside_the_layers_is_refused_in_one_line(tmp_path):
    """GPT-2's HF defaults drop after the embeddings (embd_pdrop 0.1): the layout-independent
    masks cover the decoder layers only, so the run is refused before any collective."""
    import json
    path = tmp_path / "gpt2.json"
    path.write_text(json.dumps(dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4,
                                    vocab_size=256, n_positions=64, bos_token_id=1,
                                    eos_token_id=2)))
    r = launch("ddp.py", 2, "--mode", "correctness", "--model", str(path), "--length", "16",
               "--batch", "4", as_rank0=True)
    assert_config_error(r, "dropout: transformer.drop (p=0.1) sits outside the decoder layers",
                        torchrun=False)


class _OneRank(tp.TPRegion):
    """The vocab-parallel lookup's shards composed on one rank: the sum is done by the test."""
    def embedding_out(self, x):
        return x


@pytest.mark.parametrize("pad", [None, 0, 3, 7])
def test_the_vocab_parallel_embedding_keeps_padding_idx(pad):
    """The rebuilt module equals HF's nn.Embedding(padding_idx=...), forward and gradient, the
    shards summed as the all-reduce would; with the plant the pad row trains."""
    torch.manual_seed(0)
    emb = nn.Embedding(10, 4, padding_idx=pad).double()
    ids = torch.tensor([[1, 7, 3, 0, 9, 7], [3, 3, 5, 6, 0, 2]])
    g = torch.randn(2, 6, 4, dtype=torch.float64)

    def shards():
        mods = [tp.VocabParallelEmbedding(emb, lo, 5, _OneRank(None)) for lo in (0, 5)]
        sum(m(ids) for m in mods).backward(g)
        return torch.cat([m.weight.grad for m in mods])
    emb(ids).backward(g)
    assert torch.equal(shards(), emb.weight.grad)
    if pad is not None:
        with harness.planting("embed-drops-padding-idx"):
            assert shards()[pad].abs().sum() > 0 and emb.weight.grad[pad].abs().sum() == 0


def test_the_correctness_data_attends_to_the_pad_token():
    """A model with a pad token gets it as the first input of each ignored span, where later
    tokens attend to it (a right-padded tail alone gives its row no gradient)."""
    from harness.data import MarkovLanguage, make_batch, pad_id
    lang = MarkovLanguage(256, 0, 4)
    b = make_batch(lang, 0, 8, 32, "cpu", ignore=True, pad_id=5)
    rows, cols = (b.input_ids == 5).nonzero(as_tuple=True)
    attended = [(r, c) for r, c in zip(rows.tolist(), cols.tolist())
                if (b.labels[r, c + 1:] != harness.IGNORE_INDEX).any()]
    assert attended, b.input_ids
    assert pad_id(harness.load_config("tiny-olmo2")) == 1
    assert pad_id(harness.load_config("tiny")) is None
