"""plan.py: a one-process calculator for a training layout at a scale this machine cannot run:
model-state bytes, activation bytes, the pipeline bubble and the communication per step of one
GPU, for a given model shape and (tp, cp, pp, dp, ep) layout. docs/interview.md uses it for the
cluster-scale questions (Llama 3 405B, a 7B model on 8 A100s, DeepSeek-V3).

    python -m trainer4d.plan --model llama3-405b --mem-gib 80 \\
        --layout tp=8,pp=16,dp=128,seq=8192,m=16 --layout tp=8,cp=16,pp=16,dp=8,seq=131072,m=16
    python -m trainer4d.plan --model llama2-7b --mem-gib 40 --layout dp=8,zero=3,recompute=full
    python -m trainer4d.plan bubble --stages 4 --microbatches 8 --virtual-stages 2
    python -m trainer4d.plan ring --ranks 4 --elements 8
    python -m trainer4d.plan tp --model tiny-qwen3 --tp 4     (each parameter's kind, as DTensor)

A layout is comma-separated key=value pairs: tp, cp, pp, dp, ep (expert-parallel ranks inside
dp; an MoE model only), seq (length), mb (sequences per micro-batch), m (micro-batches per step
per pipeline), v (virtual stages, with schedule=interleaved), schedule (1f1b, interleaved, ...),
zero (0 to 3, over dp x cp as compose4d.py does), sp (1: Megatron sequence parallelism inside
tp), recompute (none, selective, full), recompute_every (k: one layer in k recomputed),
reduce_bytes (the gradients' reduction: 4, fp32, by default); for the step time (--gpu):
tp_overlap (1: TP's collectives hidden behind the matmuls, async TP / Megatron's
--tp-comm-overlap), pp_scatter (1: each TP rank sends 1/tp of a stage boundary's activation,
Megatron's scatter/gather), dp_overlap (0: the gradients reduced after the backward), attn
(flash, or eager: the s x s scores computed whole and kept), ep_overlap (1: the expert
all-to-alls hidden behind another micro-batch's matmuls, Megatron's EP overlap or DualPipe),
pp_overlap (1: the pipeline sends hidden behind the micro-batch's compute, Megatron-core's
interleaved schedule with overlap_p2p_comm, its default there; the interleaved schedule only),
doc_min (N > 0: packed documents of the suite's length distribution floored at N tokens, each
attending within itself: attention's work by steptime.doc_work), order (the rank order, which
groups share a node: llama3, TP CP PP DP innermost first, the default; megatron, TP CP DP PP),
bwd_prefetch (zero=3: pre, each unit's all-gather issued before the gradient computation of the
unit before it, FSDP2's and FSDP1's BACKWARD_PRE, the default; post, FSDP1's BACKWARD_POST,
Composer's default: issued after it, so the backward's first unit waits for its own gather).
Bytes per element from --dtype.

Where each number comes from (imported, not copied; new here: comm_per_step and the TP split):
    parameters     counted: the HF model is built from its config on the meta device
    model states   zero.model_state_bytes with the textbook's mixed-precision bytes: 2 params +
                   2 grads + 12 optimizer (fp32 master, m, v) = 16 Psi (fp32: 4 + 4 + 8),
                   divided by tp x pp, and by dp x cp as the ZeRO stage says; and, as zero.py
                   reduces bf16 gradients in fp32 by default, its fp32 gradient shard of
                   4 Psi / N (beside the bf16 gradient at stage 1, instead of its shard at 2
                   and 3: 2 + 2 + 16/N, 2 + 16/N, 18/N bytes per parameter, zero.py's table)
    activations    harness.recompute.activation_bytes per decoder layer and micro-batch (SDPA
                   attention; equal to the live-storage measurement byte for byte in float32
                   and bf16 at tp = 1), the tokens / cp, its tp split (the heads and MLP width
                   / tp, the norms whole under TP alone, / tp with SP); 1F1B: the first stage holds
                   min(M, P) micro-batches of its layers (GPipe: M; the interleaved schedule's
                   extra in-flight chunks are not counted). Llama-family shapes only (not MLA
                   or MoE layers)
    logits         oom_search.predict_peak's logits and loss term, on the last stage
    bubble         pp_schedule.bubble_formula; in-flight micro-batches from pp_schedule.simulate
    wire bytes     harness.meter.RING_FACTOR (ring algorithms; steptime.wire_bytes)
    step time      --gpu NAME (--nics-per-node, --nic-gbps: its network): trainer4d/steptime.py's
                   model with comm_per_step's rows, for any dense HF decoder (steptime.shape_of;
                   `validate` holds it against published runs, trainer4d/published.py)
    comm per step  comm_per_step() below, counted with the formula functions of tp.py, sp.py,
                   cp_ring.py, pp_schedule.py and zero.py (the same ones the rig's expected
                   comm and trainer4d/comm.py call; ep_moe's all-to-alls), for one layout
"""
from __future__ import annotations

import argparse
import math
import sys

from .elastic import count_params

GiB = 2 ** 30

# Shapes for planning (public configs). Anything else: a preset of harness/models.py, an HF
# model directory or config.json.
PLAN_MODELS = {
    "llama3-405b": ("llama", dict(vocab_size=128256, hidden_size=16384, intermediate_size=53248,
                                  num_hidden_layers=126, num_attention_heads=128,
                                  num_key_value_heads=8, tie_word_embeddings=False)),
    "llama3-70b": ("llama", dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                                 num_hidden_layers=80, num_attention_heads=64,
                                 num_key_value_heads=8, tie_word_embeddings=False)),
    "llama2-7b": ("llama", dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                                num_hidden_layers=32, num_attention_heads=32,
                                num_key_value_heads=32, tie_word_embeddings=False)),
    # transformers' DeepseekV3Config defaults are DeepSeek-V3's (671B, 256 routed experts, top-8,
    # MLA, the first 3 layers dense)
    "deepseek-v3": ("deepseek_v3", {}),
}


def load(name: str):
    from transformers import CONFIG_MAPPING
    if name in PLAN_MODELS:
        kind, kw = PLAN_MODELS[name]
        return CONFIG_MAPPING[kind](**kw)
    from harness.models import load_config
    return load_config(name)


# ----------------------------------------------------------------------------------------------
# One layout
# ----------------------------------------------------------------------------------------------
DEFAULTS = dict(tp=1, cp=1, pp=1, dp=1, ep=1, seq=4096, mb=1, m=None, v=1, schedule="1f1b",
                zero=1, sp=0, recompute="none", recompute_every=1, tp_overlap=0, pp_scatter=0,
                dp_overlap=1, attn="flash", reduce_bytes=4, fp8=0, fp8_gather=0, ep_overlap=0,
                pp_overlap=0, doc_min=0, order="llama3", bwd_prefetch="pre")
WORDS = ("schedule", "recompute", "attn", "order", "bwd_prefetch")   # keys with word values


def refuse(line: str):
    """A layout the calculator cannot price: one line on stderr, exit code 2."""
    print(f"error: {line}", file=sys.stderr)
    raise SystemExit(2)


def parse_layout(text: str) -> dict:
    lay = dict(DEFAULTS)
    for item in filter(None, text.split(",")):
        key, _, val = item.partition("=")
        if key not in DEFAULTS:
            refuse(f"unknown layout key {key!r} (keys: {', '.join(DEFAULTS)})")
        lay[key] = val if key in WORDS else int(val)
    from .steptime import ORDERS
    if lay["order"] not in ORDERS:
        refuse(f"order={lay['order']}: one of {', '.join(ORDERS)} (the rank order, innermost "
               f"first: {'; '.join(f'{k} ' + ' '.join(v) for k, v in ORDERS.items())})")
    if lay["m"] is None:   # enough micro-batches to fill the pipeline once
        lay["m"] = lay["pp"]
    dpc = lay["dp"] * lay["cp"]
    if dpc % lay["ep"] and (lay["tp"] * dpc % lay["ep"] or not lay["sp"]):
        refuse(f"ep={lay['ep']} must divide dp x cp = {dpc} (or tp x dp x cp = "
               f"{lay['tp'] * dpc} with sp=1: MoE parallel folding, each tp rank's tokens "
               f"dispatched on their own)")
    if lay["bwd_prefetch"] not in ("pre", "post") or (lay["bwd_prefetch"] == "post"
                                                      and lay["zero"] != 3):
        refuse(f"bwd_prefetch={lay['bwd_prefetch']}: pre or post, and post (FSDP1's "
               f"BACKWARD_POST) needs zero=3 (layout {text})")
    if lay["pp_overlap"] and (lay["pp"] == 1 or lay["schedule"] != "interleaved"):
        refuse(f"pp_overlap=1: Megatron-core overlaps the pipeline's sends under the interleaved "
               f"schedule only (pp > 1, schedule=interleaved; layout {text})")
    if lay["fp8_gather"] and not (lay["fp8"] and lay["zero"] == 3):
        refuse("fp8_gather=1: the FP8 all-gather of FSDP's weights needs fp8=1 and zero=3 "
               f"(layout {text})")
    from pp_schedule import schedule_error
    err = schedule_error(lay["schedule"], lay["pp"], lay["m"]) if lay["pp"] > 1 else None
    if err:   # (before any report: the simulator would find the deadlock after the memory lines)
        refuse(f"{err} (layout {text})")
    return lay


def describe(lay) -> str:
    dims = " x ".join(f"{k}{lay[k]}" for k in ("tp", "cp", "pp", "dp", "ep")
                      if lay[k] > 1 or k in ("tp", "pp", "dp"))
    gpus = lay["tp"] * lay["cp"] * lay["pp"] * lay["dp"]
    return (f"{dims} = {gpus:,} GPUs; seq {lay['seq']:,}, micro-batch {lay['mb']}, "
            f"M {lay['m']} ({lay['schedule']}), ZeRO-{lay['zero']}"
            f"{', SP' if lay['sp'] else ''}, recompute {lay['recompute']}")


def is_llama(config) -> bool:
    return getattr(config, "model_type", "") in ("llama", "mistral", "qwen2")


def state_bytes(params: dict, lay, elem: int) -> dict:
    """Model states per GPU: dense parameters over tp x pp (ZeRO over dp x cp), routed experts
    over ep x pp (ZeRO over the dp x cp / ep replicas of each expert), by zero.model_state_bytes
    (ZeRO's table). In mixed precision zero.py reduces the gradients in fp32 and keeps that
    shard, 4 Psi / N (ZeRO-2's gradient row at 4 bytes): beside the half-precision gradient at
    stage 1, instead of its shard at stages 2 and 3."""
    from zero import model_state_bytes
    zero, dpc = lay["zero"], lay["dp"] * lay["cp"]
    fp32_shard = elem < 4 and zero >= 1
    out = {}
    from .steptime import expert_dp
    for kind, n, dp, split in (("dense", params["dense"], dpc, lay["tp"]),
                               ("experts", params["experts"], expert_dp(lay), lay["ep"])):
        psi = n / (split * lay["pp"])
        out[kind] = model_state_bytes(psi, zero, dp, elem,
                                      0 if fp32_shard and zero >= 2 else elem,
                                      12 if elem < 4 else 2 * elem)
        if fp32_shard:
            out[kind]["grads"] += model_state_bytes(psi, 2, dp, 0, 4, 0)["grads"]
        out[kind]["psi"] = psi
        out[kind]["total"] = out[kind]["params"] + out[kind]["grads"] + out[kind]["optimizer"]
    return out


def activation_bytes(config, lay, elem: int) -> dict | None:
    """Saved activations per GPU (the first pipeline stage, which holds the most under 1F1B)."""
    if not is_llama(config):
        return None
    from harness.recompute import activation_bytes as per_layer_bytes
    b, s, T = lay["mb"], lay["seq"] // lay["cp"], lay["tp"]        # s: this GPU's tokens (CP)
    local = per_layer_bytes(config, b, s, elem, lay["recompute"], "sdpa", tp=T,
                            sp=bool(lay["sp"]))["per_layer"]
    k = lay.get("recompute_every", 1)        # one layer in k recomputed, the others kept whole
    if k > 1 and lay["recompute"] != "none":
        kept = per_layer_bytes(config, b, s, elem, "none", "sdpa", tp=T, sp=bool(lay["sp"]))
        local = (local + (k - 1) * kept["per_layer"]) / k
    layers = math.ceil(config.num_hidden_layers / lay["pp"])
    in_flight = min(lay["m"], lay["pp"]) if lay["schedule"] != "gpipe" else lay["m"]
    return dict(per_layer=local, layers=layers, in_flight=in_flight,
                total=local * layers * in_flight)


def logits_bytes(config, lay, elem: int) -> float:
    """The last stage's logits, their fp32 log-softmax and gradient (vocab-parallel under TP)."""
    if not is_llama(config):
        return 0.0
    from oom_search import predict_peak
    strategy = "tp" if lay["tp"] > 1 else "ddp"
    return predict_peak(strategy, lay["tp"], lay["seq"] // lay["cp"], lay["mb"], config,
                        elem)["logits"]


def comm_per_step(config, params: dict, lay, elem: int) -> list[tuple]:
    """Communication of one GPU per optimizer step, by group: rows (group, op, calls, logical
    bytes, formula). Logical bytes follow the meter's convention (harness/meter.py: the buffer
    for all_reduce and p2p, the full tensor for all_gather and reduce_scatter, the send buffer
    for all_to_all). A middle pipeline stage with ceil(L/P) layers (its point-to-point sends:
    the busiest stage's); gradients reduced in fp32
    (4 bytes; --reduce-dtype's default), parameters gathered in the run's dtype. From the
    formula functions of tp.py (region_all_reduces), sp.py (region_collectives), cp_ring.py's
    allgather variant (ALLGATHER_COLLECTIVES; Llama 3's), pp_schedule.py (boundary_messages),
    zero.py (collectives_per_unit) and ep_moe.py (4 token all-to-alls per MoE layer)."""
    import cp_ring
    import sp
    import tp
    import zero
    from pp_schedule import boundary_messages
    T, C, P, D, E = lay["tp"], lay["cp"], lay["pp"], lay["dp"], lay["ep"]
    M, b, h = lay["m"], lay["mb"], config.hidden_size
    L = math.ceil(config.num_hidden_layers / P)
    n = b * lay["seq"] // C                       # tokens per micro-batch on this GPU
    act = n * h * elem                            # one activation of the residual stream
    rows = []
    # full recompute runs each recomputed layer's forward again, its 2 forward collectives too
    again = (2 * math.ceil(L / lay.get("recompute_every", 1))
             if lay["recompute"] == "full" else 0)
    x = again / L                                 # the recompute's collectives per layer
    num = lambda v: f"{v:g}" if v == int(v) else f"{v:.2f}"          # noqa: E731
    plus = f" + {num(x)} recomputed" if again else ""
    if T > 1:
        if lay["sp"]:     # a middle stage: no embedding, no head (sp.py's formula)
            per = sp.region_collectives(L, first=False, last=False)
            ag = M * (per["all_gather_into_tensor"] + again)
            rs = M * (per["reduce_scatter_tensor"] + again)
            rows.append(("tp", "all_gather", ag, ag * act, f"{num(6 + x)} per layer per "
                         f"micro-batch (4 + 2 backward re-gathers{plus}) of b s h e"))
            rows.append(("tp", "reduce_scatter", rs, rs * act, f"{num(4 + x)} per layer per "
                         f"micro-batch{f' (4{plus})' if again else ''} of b s h e"))
        else:
            ar = M * (tp.region_all_reduces(L, first=False, last=False) + again)
            rows.append(("tp", "all_reduce", ar, ar * act, f"{num(4 + x)} per layer per "
                         f"micro-batch (2 forward, 2 backward{plus}) of b s h e"))
    if C > 1:
        kv = config.num_key_value_heads * (getattr(config, "head_dim", None)
                                           or h // config.num_attention_heads)
        kv_local = max(kv // T, kv // config.num_key_value_heads)
        full = b * lay["seq"] * 2 * kv_local * elem
        ag, rs = (k * L * M for k in cp_ring.ALLGATHER_COLLECTIVES)
        rows.append(("cp", "all_gather", ag, ag * full,
                     "K,V per layer per micro-batch, forward and again backward: b S 2kv/T e"))
        rows.append(("cp", "reduce_scatter", rs, rs * full,
                     "dK,dV per layer per micro-batch: b S 2kv/T e"))
    if P > 1:
        split = lay["sp"] or lay.get("pp_scatter")   # Megatron's scatter/gather: 1/T each
        msg = act // (T if split else 1)
        sends = M * max(boundary_messages(lay["schedule"], P, lay["v"], r)   # (the busiest)
                        for r in range(P))
        what = ("an activation forward and a gradient back per micro-batch"
                + (" and chunk" if lay["v"] > 1 else "") + ": b s h e"
                + (" / tp" if split else ""))
        rows.append(("pp", "send", sends, sends * msg, what))
    from .steptime import expert_dp, folded
    for kind, group, ranks in (("dense", "dp", D * C), ("experts", "edp", expert_dp(lay))):
        psi = params[kind] / ((T if kind == "dense" else E) * P)
        if ranks <= 1 or psi == 0:
            continue
        r = lay.get("reduce_bytes", 4)           # the gradients' reduction dtype: fp32 by default
        z, rs, ag = lay["zero"], psi * r, psi * elem
        # fp8_gather (torchao's enable_fsdp_float8_all_gather, fsdp.py's --fp8-all-gather): the
        # decoder linears' weights gathered at 1 byte (each shard cast with the whole weight's
        # scale: one all-reduce of every amax per step, a few kB, not counted)
        lin = (params.get("fp8_linear", 0) / (T * P) if kind == "dense" and lay.get("fp8_gather")
               else 0)
        ag -= lin * (elem - 1)
        if z == 0:
            rows.append((group, "all_reduce", 1, rs, f"the gradients: Psi_r x {r}"
                         + (" (fp32)" if r == 4 else "")))
            continue
        k, g = zero.collectives_per_unit(z, M)     # ZeRO-2/3 reduce-scatter per micro-batch
        rows.append((group, "reduce_scatter", k, k * rs,
                     f"gradients, Psi_r x {r}" + (" per micro-batch" if k > 1 else "")))
        rows.append((group, "all_gather", g, g * ag, "parameters, Psi_r x e"
                     + (" (the FP8 linears' at 1 byte)" if lin else "")
                     + (" forward and backward per micro-batch" if z == 3 else "")))
    if E > 1:
        moe = sum(1 for i in range(config.num_hidden_layers)
                  if i >= getattr(config, "first_k_dense_replace", 0))
        moe_l = math.ceil(moe / P)
        k = config.num_experts_per_tok
        import ep_moe
        calls = ep_moe.TOKEN_ALL_TO_ALLS * moe_l * M
        fold = T if folded(lay) else 1    # folded: each tp rank's 1/T of the tokens (SP)
        rows.append(("ep", "all_to_all", calls, calls * k * n * h * elem / fold,
                     "dispatch + combine, forward + backward, per MoE layer: k b s h e"
                     + (" / tp (folded)" if fold > 1 else "")))
    return rows


def plan(config, params, lay, elem: int, mem_gib: float | None, out=print) -> dict:
    from .steptime import wire_bytes
    import pp_schedule as pp
    states = state_bytes(params, lay, elem)
    acts = activation_bytes(config, lay, elem)
    logits = logits_bytes(config, lay, elem)
    st = sum(v["total"] for v in states.values())
    out(f"layout {describe(lay)}")
    d, e = states["dense"], states["experts"]
    experts = f" ({params['experts']:,} in routed experts)" if params["experts"] else ""
    out(f"  parameters        {params['total']:,}{experts}; per GPU {d['psi'] + e['psi']:,.0f}")
    out(f"  model states/GPU  params {(d['params'] + e['params']) / GiB:.2f} GiB + grads "
        f"{(d['grads'] + e['grads']) / GiB:.2f} GiB + optimizer "
        f"{(d['optimizer'] + e['optimizer']) / GiB:.2f} GiB = {st / GiB:.2f} GiB")
    total = st
    if acts is None:
        out("  activations/GPU   not computed (the formula covers Llama-family layers only)")
    else:
        out(f"  activations/GPU   {acts['per_layer'] / GiB:.3f} GiB per layer per micro-batch x "
            f"{acts['layers']} layers x {acts['in_flight']} in flight = "
            f"{acts['total'] / GiB:.2f} GiB; logits (last stage) {logits / GiB:.2f} GiB")
        total += acts["total"] + logits
    # (never "fits" about a partial sum: without activations only "does not fit" can be said)
    fits = ("" if mem_gib is None else
            f" ({'fits' if total <= mem_gib * GiB else 'does not fit'} in {mem_gib:g} GiB)"
            if acts is not None or total > mem_gib * GiB else
            f" (model states alone; activations not computed: no verdict for {mem_gib:g} GiB)")
    out(f"  {'total/GPU' if acts is not None else 'states/GPU':<18}{total / GiB:.2f} GiB{fits}")
    if lay["pp"] > 1:
        name, V = lay["schedule"], lay["v"]
        out(f"  bubble            {name} P={lay['pp']} M={lay['m']}"
            + (f" V={V}" if name == "interleaved" else "")
            + f": {pp.bubble_formula(name, lay['pp'], lay['m'], V):.3f}")
    out("  comm/step/GPU     group  op              calls          bytes      wire/rank  formula")
    rows = comm_per_step(config, params, lay, elem)
    for group, op, calls, nbytes, formula in rows:
        wire = wire_bytes(group, op, nbytes, lay)
        out(f"                    {group:<6} {op:<14} {calls:>6,} {nbytes / GiB:>10.2f} GiB "
            f"{wire / GiB:>10.2f} GiB  {formula}")
    return dict(layout=lay, states=st, activations=None if acts is None else acts["total"],
                logits=logits, total=total, comm=rows, fits=fits)


# ----------------------------------------------------------------------------------------------
# The step time (trainer4d/steptime.py's model, fed this file's comm rows), and its validation
# ----------------------------------------------------------------------------------------------
def step_report(shape: dict, lay, gpu, elem: int, convention: str = "model") -> dict:
    """steptime.report for a model shape (steptime.shape_of) with comm_per_step's rows."""
    from . import steptime
    n, ex = steptime.param_count(shape), shape.get("expert_params", 0)
    rows = comm_per_step(steptime.config_of(shape), dict(total=n, dense=n - ex, experts=ex), lay,
                         elem)
    return steptime.report(shape, lay, gpu, rows, elem, convention)


def step_lines(config, params, lay, gpu, elem: int, out=print) -> dict | None:
    """The step time, tokens/s, TFLOP/s and MFU of the layout on `gpu`, and its breakdown."""
    from . import steptime
    shape = steptime.shape_of(config)
    if shape is None:
        out("  step time         not modelled (a layer whose parts were not found, or experts "
            "that are not gated h x f matrices)")
        return None
    r = step_report(shape, lay, gpu, elem)
    steptime.print_report(r, out)
    return r


# the layout families whose residuals docs/steptime.md reports (issue: the model's one-sided bias)
FAMILIES = {   # key (results/plan-validation.json's) -> (what it holds, who belongs)
    "pp8": ("PP >= 8", lambda lay: lay["pp"] >= 8),
    "pp2-7": ("PP 2-7", lambda lay: 1 < lay["pp"] < 8),
    "fsdp": ("FSDP only (ZeRO-3, no TP or PP)",
             lambda lay: lay["zero"] == 3 and lay["tp"] == lay["pp"] == 1),
    "tp8": ("TP 8 without PP", lambda lay: lay["tp"] >= 8 and lay["pp"] == 1),
    "moe": ("MoE", lambda lay: lay["ep"] > 1),
}


def validate(out=print, unpublished_v: int | None = None) -> dict:
    """Every published row (trainer4d/published.py) against the model: TFLOP/s per GPU in the
    source's convention (tokens/s converted with the same FLOPs per token on both sides).
    unpublished_v: another V for the rows whose interleaved V is the assumed 2 (sensitivity)."""
    import statistics
    from .published import ATTENTION_COUNT, ROWS, SOURCES
    from .steptime import BREAKDOWN, GPUS, constants, flops_per_token, layout_text, table
    c = constants()
    rows = []
    for rid, source, model, sh, gpu, lay, metric, value, conv, assumed in ROWS:
        if unpublished_v and lay["schedule"] == "interleaved" and "V = 2" in assumed:
            lay = dict(lay, v=unpublished_v)
            assumed = assumed.replace("V = 2", f"V = {unpublished_v}")
        r = step_report(sh, lay, gpu, 2, conv)
        per_token = flops_per_token(sh, lay["seq"], conv)
        published = value * per_token / 1e12 if metric == "tokens" else value
        rows.append(dict(id=rid, source=source, model=model, gpu=GPUS[gpu]["name"],
                         layout=layout_text(lay),
                         metric=f"TFLOP/s per GPU ({conv} FLOPs"
                                + (f"; from {value:,.0f} tokens/s/GPU)" if metric == "tokens"
                                   else ")"),
                         published=round(published, 1), predicted=round(r["tflops"], 1),
                         rel_err=round(r["tflops"] / published - 1, 4),
                         step_s=round(r["step"], 4), assumed=assumed,
                         breakdown={k: round(r[k] / r["step"], 4) for k in BREAKDOWN}))
    errs = [abs(r["rel_err"]) for r in rows]
    worst = max(rows, key=lambda r: abs(r["rel_err"]))
    lays = {rid: lay for rid, _, _, _, _, lay, *_ in ROWS}
    families = {}   # the residuals by layout family (a row may sit in two)
    for key, (name, member) in FAMILIES.items():
        e = [r["rel_err"] for r in rows if member(lays[r["id"]])]
        if e:
            families[key] = dict(name=name, rows=len(e), median=round(statistics.median(e), 4),
                                 too_fast=sum(x > 0 for x in e))
    result = dict(rows=rows, median_abs_rel_err=round(statistics.median(errs), 4),
                  mean_abs_rel_err=round(statistics.mean(errs), 4),
                  worst=dict(id=worst["id"], rel_err=worst["rel_err"]), families=families,
                  too_fast=sum(r["rel_err"] > 0 for r in rows),
                  sources=SOURCES, constants={k: (round(v, 4) if isinstance(v, float) else v)
                                              for k, v in c.items()},
                  mamf={k: round(g["mamf"] / g["peak"], 4) for k, g in GPUS.items()})
    for line in table(result).splitlines():
        out(line)
    for f in families.values():
        out(f"family {f['name']}: {f['rows']} rows, median error {f['median']:+.1%}, "
            f"{f['too_fast']} predicted too fast")
    for source in sorted({r["source"] for r in rows}):   # like with like: the count per source
        out(f"causal attention's FLOPs, {source}: {ATTENTION_COUNT[source]}")
    out(f"median |error| {result['median_abs_rel_err']:.1%} (mean "
        f"{result['mean_abs_rel_err']:.1%}) over {len(rows)} rows from "
        f"{len({r['source'] for r in rows})} sources; worst {worst['id']} {worst['rel_err']:+.1%}; "
        f"{result['too_fast']} of {len(rows)} predicted too fast")
    return result


# ----------------------------------------------------------------------------------------------
# The bubble of every schedule, and the ring all-reduce step by step
# ----------------------------------------------------------------------------------------------
def bubbles(P: int, M: int, V: int, names, target: float, out=print) -> list[dict]:
    """pp.bubble_formula beside pp.simulate's unit-cost bubble and peak in-flight micro-batches
    per rank, and the point-to-point messages per step (every cross-rank send of the schedule)."""
    import pp_schedule as pp
    rows = []
    out(f"pipeline P={P} M={M} V={V} (unit costs F=1, B=2, I=W=1)")
    out(f"{'schedule':<12} {'formula':>8} {'simulated':>9} {'p2p sends':>9}  in flight per rank")
    for name in names:
        _, _, sim, peak = pp.simulate(name, P, M, V)
        cv = pp.chunks_per_rank(name, V)
        sends = sum(1 for r in range(P) for kind, c, m in pp.schedule(name, P, M, cv, r)
                    for msg in [pp.messages(kind, c, m, P * cv)[1]]
                    if msg is not None and pp.chunk_owner(name, msg[1], P) != r)
        f = pp.bubble_formula(name, P, M, V)
        rows.append(dict(name=name, formula=f, simulated=sim, sends=sends, peak=peak))
        out(f"{name:<12} {f:>8.3f} {sim:>9.3f} {sends:>9}  {peak}")
    need = next(m for m in range(1, 100 * P) if pp.bubble_formula("1f1b", P, m) < target)
    out(f"1f1b: bubble < {target:.0%} from M = {need} = 4(P-1)+1 at P={P}; at M = 4P = {4 * P}: "
        f"{pp.bubble_formula('1f1b', P, 4 * P):.3f}")
    return rows


def tp_kinds(config, T: int, out=print) -> dict:
    """What tensor parallelism does with each parameter (tp.classify on the meta device, no
    process group) and the DTensor placement that says the same (tp_plan.PLACEMENTS); the first
    layer stands for every layer."""
    import tp
    import tp_plan
    kinds, reasons = tp.classify(tp_plan.meta_model(config), T)
    for r in reasons:
        out(f"refused: {r}")
    shown = {n: k for n, k in kinds.items() if ".layers." not in n or ".layers.0." in n}
    out(f"{getattr(config, 'model_type', '?')} at T={T}: {len(kinds)} parameters, "
        f"{len(shown)} shown (layer 0 stands for all {config.num_hidden_layers})")
    out(f"{'parameter':<46} {'kind':<13} {'DTensor placement':<52} gradient")
    nkv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    for name, kind in shown.items():   # (kv-copy's counts for this T: tp.py's kv_copies)
        param, grad = tp_plan.PLACEMENTS[kind]
        param = param.replace("T/n_kv", str(T // nkv)).replace("n_kv", str(nkv))
        out(f"{name:<46} {kind:<13} {param:<52} {grad}")
    return kinds


def ring_all_reduce(N: int, S: int, elem: int = 4, out=print) -> dict:
    """The ring all-reduce of N vectors of S elements, step by step in one process: a
    reduce-scatter (N-1 steps: rank r sends chunk (r - t) mod N to r+1, which adds it) then an
    all-gather (N-1 steps: the reduced chunks travel on). Each step moves one chunk of S/N per
    rank. Checks the result against the plain sum; returns the bytes each rank sent."""
    import torch
    g = torch.Generator().manual_seed(0)
    # integers in float64: every order of summation gives the same, exact sum
    data = [torch.randint(-1000, 1000, (S,), generator=g).double() for _ in range(N)]
    want = torch.stack(data).sum(0)
    chunks = [list(d.tensor_split(N)) for d in data]
    sent = [0] * N
    steps = 0
    for phase in ("reduce-scatter", "all-gather"):
        for t in range(N - 1):
            msgs = []
            for r in range(N):   # every rank sends one chunk to r+1 at the same time
                i = (r - t) % N if phase == "reduce-scatter" else (r + 1 - t) % N
                msgs.append(((r + 1) % N, i, chunks[r][i].clone()))
                sent[r] += chunks[r][i].numel() * elem
            for dst, i, x in msgs:
                chunks[dst][i] = chunks[dst][i] + x if phase == "reduce-scatter" else x
            steps += 1
    ok = all(torch.equal(torch.cat(c), want) for c in chunks)
    from harness.meter import RING_FACTOR
    formula = RING_FACTOR["all_reduce"](N) * S * elem
    out(f"ring all-reduce of N={N} vectors of S={S} elements ({elem} bytes each): {steps} steps "
        f"= 2(N-1), each sending one chunk of S/N = {S // N:,} elements per rank")
    out(f"bytes sent per rank: {sent[0]:,} = 2(N-1)/N x S x {elem} = {formula:,.0f}; "
        f"every rank equal: {len(set(sent)) == 1}; result equals the sum: {ok}")
    return dict(steps=steps, sent=sent, ok=ok)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bubble"]:
        p = argparse.ArgumentParser(prog="python -m trainer4d.plan bubble")
        p.add_argument("--stages", type=int, default=4)
        p.add_argument("--microbatches", type=int, default=8)
        p.add_argument("--virtual-stages", type=int, default=2)
        p.add_argument("--schedules", default="gpipe,1f1b,interleaved,zb")
        p.add_argument("--target", type=float, default=0.2)
        a = p.parse_args(argv[1:])
        return bubbles(a.stages, a.microbatches, a.virtual_stages, a.schedules.split(","),
                       a.target)
    if argv[:1] == ["validate"]:
        p = argparse.ArgumentParser(prog="python -m trainer4d.plan validate")
        p.add_argument("--out", default=None, help="write the rows as JSON here")
        p.add_argument("--unpublished-v", type=int, default=None,
                       help="another V where a source's interleaved V is unpublished (2)")
        a = p.parse_args(argv[1:])
        result = validate(unpublished_v=a.unpublished_v)
        if a.unpublished_v is None:     # the median's sensitivity to the assumption that moves it
            result["unpublished_v"] = {v: result["median_abs_rel_err"] if v == 2 else validate(
                out=lambda *_: None, unpublished_v=v)["median_abs_rel_err"] for v in (1, 2, 4)}
            print("median |error| with the unpublished V = 1, 2, 4: " + ", ".join(
                f"{m:.1%}" for m in result["unpublished_v"].values()))
        if a.out:
            import json
            with open(a.out, "w") as f:
                json.dump(result, f, indent=1)
                f.write("\n")
        return result
    if argv[:1] == ["tp"]:
        p = argparse.ArgumentParser(prog="python -m trainer4d.plan tp")
        p.add_argument("--model", default="tiny-qwen3", help="a preset or an HF config")
        p.add_argument("--tp", type=int, default=4)
        a = p.parse_args(argv[1:])
        return tp_kinds(load(a.model), a.tp)
    if argv[:1] == ["ring"]:
        p = argparse.ArgumentParser(prog="python -m trainer4d.plan ring")
        p.add_argument("--ranks", type=int, default=4)
        p.add_argument("--elements", type=int, default=1024)
        a = p.parse_args(argv[1:])
        if a.elements % a.ranks:
            raise SystemExit("error: --elements must be a multiple of --ranks")
        return ring_all_reduce(a.ranks, a.elements)
    p = argparse.ArgumentParser(prog="python -m trainer4d.plan", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="llama3-405b",
                   help=f"{', '.join(PLAN_MODELS)}, a harness preset, or an HF config")
    p.add_argument("--layout", action="append", required=True,
                   help="tp=8,pp=16,dp=128,seq=8192,m=16,... (repeatable)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--mem-gib", type=float, default=None, help="memory per GPU, for 'fits'")
    p.add_argument("--gpu", default=None, help="predict the step time and MFU on this GPU "
                   "(a100, a100-40gb, h100, h100-96gb, h800, h200, b200): trainer4d/steptime.py")
    p.add_argument("--nics-per-node", type=int, default=None,
                   help="the machine's network: NICs per node (default: one per GPU, 8)")
    p.add_argument("--nic-gbps", type=float, default=None,
                   help="Gb/s per NIC and direction (default: the GPU's system's, 200 on "
                        "A100, 400 on H100)")
    a = p.parse_args(argv)
    gpu = spec = a.gpu
    if a.gpu:
        from .steptime import gpu_spec
        spec = gpu_spec(a.gpu)                          # an unknown name ends here, in one line
        gpu = dict(spec)
        for value, key, scale, flag in ((a.nics_per_node, "nics", 1, "--nics-per-node"),
                                        (a.nic_gbps, "nic", 1e9 / 8, "--nic-gbps")):
            if value is not None:
                if value <= 0:
                    refuse(f"{flag} {value}: not a positive number")
                gpu[key] = value * scale
        if a.nics_per_node is not None or a.nic_gbps is not None:
            gpu["name"] += f", {gpu['nics']:g} x {gpu['nic'] * 8 / 1e9:g} Gb/s NICs per node"
    elif a.nics_per_node is not None or a.nic_gbps is not None:
        refuse("--nics-per-node and --nic-gbps describe the --gpu machine: give --gpu")
    layouts = [parse_layout(text) for text in a.layout]   # every refusal before any report
    if a.gpu and any(lay["fp8"] for lay in layouts) and not spec.get("fp8"):
        refuse(f"fp8=1 on {spec['name']}: it has no FP8 tensor cores")
    config = load(a.model)
    elem = 4 if a.dtype == "float32" else 2
    params = count_params(config)
    rows = []
    for lay in layouts:
        rows.append(plan(config, params, lay, elem, a.mem_gib))
        if a.gpu:
            rows[-1]["steptime"] = step_lines(config, params, lay, gpu, elem)
    if len(rows) > 1:
        print(f"summary ({a.model}, {a.dtype}; GiB per GPU)")
        print(f"  {'layout':<44} {'states':>7} {'acts':>7} {'logits':>7} {'total':>7}")
        for r in rows:
            lay = r["layout"]
            name = " ".join(f"{k}{lay[k]}" for k in ("tp", "cp", "pp", "dp", "ep") if lay[k] > 1)
            name += f" zero{lay['zero']}{' sp' if lay['sp'] else ''} {lay['recompute']}"
            if lay["pp"] > 1 and lay["schedule"] != "1f1b":
                name += f" {lay['schedule']}" + (f" v{lay['v']}" if lay["v"] > 1 else "")
            acts = "-" if r["activations"] is None else f"{r['activations'] / GiB:.2f}"
            print(f"  {name:<44} {r['states'] / GiB:>7.2f} {acts:>7} {r['logits'] / GiB:>7.2f} "
                  f"{r['total'] / GiB:>7.2f}{r['fits']}")
    return rows


if __name__ == "__main__":
    main()
