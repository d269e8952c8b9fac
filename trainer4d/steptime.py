"""steptime.py: how long one optimizer step of a layout takes on a cluster, and its MFU.

A roofline model built from the suite's own formulas, for one GPU of the busiest pipeline stage:

    step = M x slot x (1 + bubble ratio) + exposed data-parallel comm + optimizer step
    slot = matmul + attention + elementwise       (one micro-batch, forward and backward)
         + exposed TP, CP, pipeline-send and expert all-to-all comm of that micro-batch

    matmul       6 Psi_matmul n / (T P) FLOPs (harness.flops' count; recompute full adds the
                 layers' forward: 8 instead of 6) at the GPU's measured matmul ceiling (MAMF)
    attention    causal: the kernel computes half of the s x s scores, so 12 L h s n / 2 / (T P)
                 FLOPs (full recompute or selective: + the forward's third) at ATTENTION_EFFICIENCY
    elementwise  every byte a layer's forward keeps (harness.recompute.activation_bytes, the
                 suite's one activation model) and the logits (oom_search.predict_peak) moved
                 ELEMENTWISE_PASSES times through HBM (norms, activations, casts, softmax, adds)
    stage        the slower of a stage of ceil(L/P) layers and the last stage (the rest of the
                 layers and the LM head)
    comm         trainer4d.plan.comm_per_step's rows, wire bytes (harness.meter.RING_FACTOR) over
                 NVLink when the group fits in a node (rank order TP, CP, PP, DP innermost
                 first: Llama 3's), else the network's bandwidth per GPU (an all-reduce over
                 two nodes with several ranks in each: NCCL's tree, twice it), each at NCCL's
                 measured share of it (LINK_EFFICIENCY); a ring or tree across nodes no faster
                 than NVLink at its measured share (its hops inside a node)
    overlap      TP exposed (async TP: hidden behind the matmuls); CP's K,V all-gathers exposed
                 (Llama 3's variant); pipeline sends (pp_overlap: hidden behind the micro-batch's
                 compute) and all-to-alls (ep_overlap: behind the matmuls) exposed; DP's collectives
                 share one link per phase: the gradient reduction (and ZeRO-3's backward
                 gathers) behind the backward of one micro-batch (ZeRO-2/3: of each), the
                 parameter gathers behind a forward, except the last bucket reduced and the
                 first unit gathered (a layer each); a hidden second slows the compute beside
                 it by OVERLAP_SLOWDOWN, charged to the communication; FSDP1's BACKWARD_POST
                 (bwd_prefetch=post): the backward's first unit gathered too, per micro-batch
    bubble       pp_schedule.simulate's idle fraction of the schedule (unit costs F=1, B=2; equal to
                 bubble_formula for 1F1B and interleaved), the stages balanced
    optimizer    AdamW with fp32 masters over this GPU's shard: 30 bytes per parameter of HBM
                 traffic (read grad, master, m, v; write master, m, v, the bf16 parameter)
    fp8          (layout fp8=1) the decoder linears' matmuls at the ceiling x the datasheet's
                 FP8 / bf16 peak, their casts FP8_CAST_BYTES per feature and token through HBM

The reported FLOP/s follow a source's convention: "model" = harness.flops (6 Psi_matmul + 12 L h s
per token, attention counted in full as Megatron-core r0.8.0, torchtitan and PaLM do; current
Megatron-LM halves it: published.ATTENTION_COUNT says each source's count), "hardware" = Narayanan
et al. 2021's, which also counts the recompute's forward (96 B s l h^2 (1 + s/6h + V/16lh)).

Every GPU figure is a datasheet's (GPUS, each with its source); the numbers that are not (MAMF
per GPU, ATTENTION_EFFICIENCY, ELEMENTWISE_PASSES, LINK_EFFICIENCY, OVERLAP_SLOWDOWN) come from
measurements, the same for every row, never fitted to a published row: see constants(),
LINK_EFFICIENCY and OVERLAP_SLOWDOWN.
"""
from __future__ import annotations

import json
import math
import os
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Datasheet figures per GPU: dense bf16 peak FLOP/s (no sparsity), HBM bytes/s, NVLink bytes/s per
# GPU and direction, bytes/s per NIC and NICs per node (one per GPU, the HGX/DGX reference design;
# the CLI's --nics-per-node and --nic-gbps change them for another machine), GPUs per node;
# mamf: the largest bf16 matmul FLOP/s measured (Bekman, ml-engineering,
# compute/accelerator/README.md, "Maximum Achievable Matmul FLOPS comparison table", its torch
# 2.6-2.7 rows: A100 SXM 271.2, H100 SXM 794.5 ("H200 is the same"), B200 SXM 1,745.0).
GPUS = {
    # A100 datasheet (nvidia-a100-datasheet-us-2188504): BF16 Tensor Core 312 TFLOPS (624 with
    # sparsity), 80GB HBM2e 2,039 GB/s, NVLink 600 GB/s (12 links x 25 GB/s each direction);
    # HDR InfiniBand 200 Gb/s per GPU (Selene: eight 200Gbps HCAs per node, Narayanan et al. 2021)
    "a100": dict(name="A100 80GB SXM", peak=312e12, hbm=2.039e12, nvlink=300e9, nic=25e9,
                 nics=8, per_node=8, mamf=271.2e12, fp8=None),   # (no FP8 tensor cores)
    # the same datasheet's 40GB part: HBM2 1,555 GB/s; the rest as the 80GB's
    "a100-40gb": dict(name="A100 40GB SXM", peak=312e12, hbm=1.555e12, nvlink=300e9,
                      nic=25e9, nics=8, per_node=8, mamf=271.2e12, fp8=None),
    # H100 whitepaper v1.04 Table 1: BF16 Tensor Core 989.4 TFLOPS dense; product page: 80GB
    # HBM3 3.35 TB/s; 18 NVLink-4 links, 900 GB/s total; 400 Gb/s NDR per GPU (DGX H100); FP8
    # Tensor Core 1,978.9 TFLOPS dense (3,957.8 with sparsity)
    "h100": dict(name="H100 80GB SXM (HBM3, 700 W)", peak=989.4e12, hbm=3.35e12, nvlink=450e9,
                 nic=50e9, nics=8, per_node=8, mamf=794.5e12, fp8=1978.9e12),
    # torchtitan's benchmark GPUs (benchmarks/llama3_h100_202412_torchtitan.md): "96GB HBM2e with
    # 2.4 TB/sec", 500 W, "400 Gb/s per GPU"; its peak is unpublished: "between SXM and NVL" (the
    # H100 NVL datasheet: BF16 1,671 TFLOPS with sparsity, 835.5 dense), taken at the middle of
    # that bracket, 912.5 TFLOPS; its matmul ceiling: the H100 SXM's MAMF scaled the same (FP8:
    # twice the bf16 peak, as on every Hopper datasheet)
    "h100-96gb": dict(name="H100 96GB HBM2e (500 W)", peak=912.5e12, hbm=2.4e12, nvlink=450e9,
                      nic=50e9, nics=8, per_node=8, mamf=794.5e12 * 912.5 / 989.4,
                      fp8=2 * 912.5e12),
    # H800: the H100 die with NVLink cut to 400 GB/s (no public NVIDIA datasheet; third-party
    # spec sheets); DeepSeek-V3's report: "IB (50 GB/s)" per GPU
    "h800": dict(name="H800 SXM", peak=989.4e12, hbm=3.35e12, nvlink=200e9, nic=50e9, nics=8,
                 per_node=8, mamf=794.5e12, fp8=1978.9e12),
    # H200 product page: BF16 1,979 TFLOPS with sparsity (989 dense), FP8 3,958 (1,979 dense),
    # 141GB HBM3e 4.8 TB/s; NVLink 900 GB/s
    "h200": dict(name="H200 SXM 141GB", peak=989.4e12, hbm=4.8e12, nvlink=450e9, nic=50e9, nics=8,
                 per_node=8, mamf=794.5e12, fp8=1978.9e12),
    # HGX B200 page: FP16/BF16 36 PFLOPS per 8 GPUs with sparsity ("dense is 1/2"): 2.25 PF per
    # GPU; DGX B200 64 TB/s HBM3e per 8 GPUs; NVLink 5 1.8 TB/s; ConnectX-7 400 Gb/s per GPU;
    # FP8 72 PFLOPS with sparsity per 8 GPUs: 4.5 PF dense per GPU
    "b200": dict(name="B200 (HGX, 1000 W)", peak=2.25e15, hbm=8.0e12, nvlink=900e9, nic=50e9,
                 nics=8, per_node=8, mamf=1745e12, fp8=4.5e15),
}
GPU_ALIASES = {"a100-80gb": "a100", "h100-sxm": "h100", "h200-sxm": "h200"}


def gpu_spec(name: str) -> dict:
    key = GPU_ALIASES.get(name.lower(), name.lower())
    if key not in GPUS:
        import sys
        print(f"error: unknown --gpu {name!r} (known: {', '.join(GPUS)})", file=sys.stderr)
        raise SystemExit(2)
    return GPUS[key]


# ----------------------------------------------------------------------------------------------
# The constants that are not datasheet figures: read from the suite's own H100 measurements
# ----------------------------------------------------------------------------------------------
OPTIMIZER_BYTES = 30   # AdamW, fp32 masters: read grad, master, m, v (4 each), write master, m,
#                        v (4 each) and the bf16 parameter (2)
_GPU_RESULTS = os.path.join(ROOT, "results", "gpu")
ATTENTION_FILE = os.path.join(_GPU_RESULTS, "cp_kernels.json")
STEP_FILE = os.path.join(_GPU_RESULTS, "2026-11-26-h100", "speed.json")


def attention_efficiency(path: str = ATTENTION_FILE) -> float:
    """The fused causal SDPA kernel, forward and backward, as a fraction of the H100's peak:
    scripts/gpu_cp_kernels.py's 'fused SDPA, whole sequence' bf16 row (Llama 3.2 1B's heads,
    head dim 64, one sequence). FLOPs executed: 3 x (2 matmuls x 2 b H s^2 d) / 2 (causal)."""
    with open(path) as f:
        d = json.load(f)
    row = next(r for r in d["rows"] if r["kernel"].startswith("fused SDPA") and
               r["dtype"] == "bfloat16")
    b, H, s, hd = d["batch"], d["heads"], d["seq"], d["head_dim"]
    flops = 3 * 2 * 2 * b * H * s * s * hd / 2
    return flops / (row["ms"] / 1e3) / GPUS["h100"]["peak"]


def constants() -> dict:
    """GEMM efficiency per GPU (MAMF / peak), the attention efficiency and the elementwise passes.
    ELEMENTWISE_PASSES is what the measured single-H100 reference step (llama3.2-1b, 4 x 2,048
    tokens, bf16, HF eager, fused AdamW with fp32 masters: results/gpu/2026-11-26-h100/
    speed.json) leaves after its matmuls, attention and optimizer step, in units of the bytes its
    forward keeps: solved once from that one run."""
    if "value" in _CONSTANTS:
        return _CONSTANTS["value"]
    eff = attention_efficiency()
    with open(STEP_FILE) as f:
        run = next(r for r in json.load(f)["items"] if r["run"] == "reference, full logits")
    shape = LLAMA32_1B
    lay = dict(tp=1, cp=1, pp=1, dp=1, ep=1, seq=run["length"], mb=run["batch"], m=1, v=1,
               schedule="1f1b", zero=0, sp=0, recompute="none", tp_overlap=0)
    parts = step_time(shape, lay, "h100", [], passes=0.0, attn_eff=eff)   # one GPU: no comm
    per_layer, logits = kept_bytes(shape, lay, 2)
    per_pass = (per_layer * shape["layers"] + logits) / GPUS["h100"]["hbm"]
    passes = (run["step_s"] - parts["step"]) / per_pass
    _CONSTANTS["value"] = dict(attention_efficiency=eff, elementwise_passes=passes,
                               reference_step_s=run["step_s"], reference=run["run"])
    return _CONSTANTS["value"]


_CONSTANTS: dict = {}

# Llama 3.2 1B (the measured reference step's model): its public config
LLAMA32_1B = dict(layers=16, hidden=2048, heads=32, kv_heads=8, ffn=8192, gated=True,
                  vocab=128256, tied=True)


# ----------------------------------------------------------------------------------------------
# A model's shape and its FLOPs
# ----------------------------------------------------------------------------------------------
def moe_shape(layers: int, hidden: int, heads: int, kv_heads: int, head_dim: int, experts: int,
              top_k: int, expert_ffn: int, vocab: int, tied: bool, shared_ffn: int = 0,
              dense_layers: int = 0, dense_ffn: int = 0, attention: int | None = None,
              other: int = 0) -> dict:
    """A MoE model's shape for step_time: gated (SwiGLU) experts of width expert_ffn, top_k of
    `experts` routed per token, shared experts of total width shared_ffn, the first
    dense_layers dense (width dense_ffn). Per layer, on average over the model: the active
    matmul parameters (attention, the router's h x E, the shared experts, top_k routed ones) and
    the active MLP width (the activations a token keeps); every parameter counted (attention:
    its matmul parameters if given, else q, k, v, o at heads x head_dim; other: per layer beyond
    the matmuls, the norms)."""
    h, moe = hidden, layers - dense_layers
    attn = attention if attention is not None else 2 * h * head_dim * (heads + kv_heads)
    active = attn + h * experts + 3 * h * (shared_ffn + top_k * expert_ffn)
    dense = attn + 3 * h * dense_ffn
    routed = moe * experts * 3 * h * expert_ffn
    norms = other or 2 * h
    params = (moe * (active - 3 * h * top_k * expert_ffn) + dense_layers * dense + routed
              + layers * norms + vocab * h * (1 if tied else 2) + h)
    return dict(layers=layers, hidden=h, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                ffn=round((moe * (top_k * expert_ffn + shared_ffn) + dense_layers * dense_ffn)
                          / layers), gated=True, vocab=vocab, tied=tied,
                layer_matmul=(moe * active + dense_layers * dense) / layers, params=params,
                experts=experts, top_k=top_k, moe_layers=moe, expert_params=routed,
                expert_ffn=expert_ffn)


def shape_of(config) -> dict | None:
    """The shape step_time needs, read from any dense HF decoder: the model is built on the meta
    device with one decoder layer (nothing allocated), and its parts are measured, not named.
    The attention's matmul weights (fused or not, GQA/MQA) and the MLP's (the layer's other
    2-D weights) give the layer's exact matmul parameters; the MLP's width is its
    down projection's other dimension and it is gated when it holds 3 h x ffn matrices (SwiGLU,
    GeGLU; 2: GELU, squared ReLU); the rest of the layer (norms with or without bias, linear
    biases) and of the model (positions, the final norm) is counted exactly. A MoE model
    (harness.is_moe) is built whole and measured by moe_shape_of. None when a part cannot be
    found."""
    import copy
    import torch
    from transformers import AutoModelForCausalLM
    from harness.anatomy import attention_of, kv_heads, parts
    from harness.models import is_moe
    h = config.hidden_size
    head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
    one = copy.deepcopy(config)
    if not is_moe(config):
        one.num_hidden_layers = 1
        if isinstance(getattr(one, "layer_types", None), list):   # per-layer kinds: the first
            one.layer_types = one.layer_types[:1]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(one)
    p = parts(model)
    layer = p.layers[0] if p.layers is not None else None
    attention = attention_of(layer) if layer is not None else None
    if attention is None:
        return None
    if is_moe(config):
        return moe_shape_of(config, p, head_dim)
    attn, mlp = matrices(layer)     # (OPT: fc1 and fc2 directly in the layer)
    if not mlp:
        return None
    down = mlp[-1][1]   # (the last registered: the down projection, [h, f] or [f, h])
    ffn = down.shape[1] if down.shape[0] == h else down.shape[0]
    mlp_mm = sum(w.numel() for _, w in mlp)
    layer_mm = mlp_mm + attn
    layer_all = sum(w.numel() for w in layer.parameters())
    rest = sum(w.numel() for w in model.parameters()) - layer_all
    return dict(layers=config.num_hidden_layers, hidden=h, heads=config.num_attention_heads,
                kv_heads=kv_heads(config), ffn=ffn, gated=round(mlp_mm / (h * ffn)) == 3,
                vocab=config.vocab_size, tied=bool(p.tied), layer_matmul=layer_mm,
                params=config.num_hidden_layers * layer_all + rest, head_dim=head_dim)


def matrices(layer) -> tuple[int, list]:
    """A decoder layer's matmul weights: (its attention's 2-D weights' count, [(name, weight)]
    of the layer's other 2-D weights, in registration order)."""
    from harness.anatomy import attention_of
    inside = {id(w) for w in attention_of(layer).parameters()}
    return (sum(w.numel() for w in attention_of(layer).parameters() if w.dim() == 2),
            [(n, w) for n, w in layer.named_parameters() if w.dim() == 2 and id(w) not in inside])


def moe_shape_of(config, p, head_dim: int) -> dict | None:
    """moe_shape measured on the meta model (parts p): a layer with routed experts (`.experts.`
    in its parameters' names, harness.n_experts of them) against the dense ones; per expert its
    routed parameters / n_experts (3 h x width: gated); the router, the 2-D weight of shape
    (n_experts, h) beside them; the shared experts, the layer's other MLP matrices."""
    from harness.anatomy import kv_heads
    from harness.models import n_experts
    h, E = config.hidden_size, n_experts(config)
    moe = [l for l in p.layers if any(".experts." in n for n, _ in l.named_parameters())]
    dense = [l for l in p.layers if l not in moe]
    if not moe:
        return None
    layer = moe[0]
    attn, others = matrices(layer)
    routed = sum(w.numel() for n, w in layer.named_parameters() if ".experts." in n)
    mats = [w for n, w in others if ".experts." not in n]
    shared = sum(w.numel() for w in mats if tuple(w.shape) != (E, h))
    if routed % (3 * h * E) or shared % (3 * h):
        return None     # (experts that are not gated h x f matrices: not priced)
    d_mlp = matrices(dense[0])[1] if dense else []
    return moe_shape(config.num_hidden_layers, h, config.num_attention_heads, kv_heads(config),
                     head_dim, E, config.num_experts_per_tok, routed // (3 * h * E),
                     config.vocab_size, bool(p.tied), shared_ffn=shared // (3 * h),
                     dense_layers=len(dense),
                     dense_ffn=sum(w.numel() for _, w in d_mlp) // (3 * h), attention=attn,
                     other=sum(w.numel() for w in layer.parameters()) - attn - routed
                     - sum(w.numel() for w in mats))


def layer_matmul_params(sh: dict) -> int:
    """One decoder layer's matmul parameters: q and o (h x h), k and v (h x kv), the MLP (or, for
    a shape read from a model, shape_of's count)."""
    if "layer_matmul" in sh:
        return sh["layer_matmul"]
    h = sh["hidden"]
    kv = sh["kv_heads"] * (h // sh["heads"])
    return 2 * h * h + 2 * h * kv + (3 if sh["gated"] else 2) * h * sh["ffn"]


FP8_CAST_BYTES = 6   # per feature and token of an FP8 linear: X cast for the forward and X^T
#                      for dW (each a 2-byte read and a 1-byte write), dY and dY^T the same


def layer_linear_features(sh: dict) -> int:
    """One decoder layer's linears' input plus output features (q, k, v, o, the MLP's): the
    activation features an FP8 layer casts per token."""
    h, f = sh["hidden"], sh["ffn"]
    kv = sh["kv_heads"] * (h // sh["heads"])
    up = 2 if sh["gated"] else 1
    return (4 * h + up * h + f) + (3 * h + 2 * kv + up * f)


def param_count(sh: dict) -> int:
    """All parameters: the layers (matmuls and two norms), embedding, head unless tied, the norm
    (or, for a shape read from a model, shape_of's count)."""
    if "params" in sh:
        return sh["params"]
    h, V = sh["hidden"], sh["vocab"]
    return sh["layers"] * (layer_matmul_params(sh) + 2 * h) + V * h * (1 if sh["tied"] else 2) + h


def attention_width(sh: dict) -> int:
    """The attention's query width, heads x head_dim (h unless the head dim is set apart: Qwen3's
    MoE models have 32 heads of 128 at h = 2048): the scores' and values' FLOPs scale with it."""
    return sh["heads"] * sh.get("head_dim", sh["hidden"] // sh["heads"])


def flops_per_token(sh: dict, seq: int, convention: str = "model") -> float:
    """Training FLOPs per token in a source's convention. model: harness.flops.model_flops's
    6 Psi_matmul + 12 L h s (the head counted, the embedding not, attention in full; h: the
    attention's width; a MoE layer's Psi_matmul: its active matmuls, the router, the shared
    experts and top_k routed ones); hardware: Narayanan et al. 2021's, the layers' forward once
    more for the recompute (8 per parameter, 16 L h s), the head not."""
    L, V = sh["layers"], sh["vocab"]
    layers, head, h = L * layer_matmul_params(sh), V * sh["hidden"], attention_width(sh)
    if convention == "model":
        return 6 * (layers + head) + 12 * L * h * seq
    if convention == "hardware":
        return 8 * layers + 6 * head + 16 * L * h * seq
    if convention == "causal":      # the model's, attention counted as the causal half
        return 6 * (layers + head) + 6 * L * h * seq
    raise ValueError(convention)


def doc_work(seq: int, doc_min: int, rows: int = 64, seed: int = 0) -> float:
    """Causal attention's work under packed documents (layout key doc_min=N): rows of `seq`
    tokens cut by the suite's length distribution (harness.data.doc_lengths: Pareto alpha 1.2
    floored at N tokens, the last document cut by the row's end), each document attending
    within itself: the mean over `rows` rows of sum l (l + 1) / 2 over seq (seq + 1) / 2, the
    share of the causal pairs left (a kernel that skips every masked pair does that much; flash
    kernels skip whole masked blocks, so reach it at their block size). Memory does not change:
    a flash kernel keeps its output and log-sum-exp, eager the whole s x s scores, masked or
    not (oom_search's count is the same)."""
    from harness.data import doc_lengths
    pairs = [sum(n * (n + 1) // 2 for n in doc_lengths(seed, i, seq, doc_min))
             for i in range(rows)]
    return sum(pairs) / rows / (seq * (seq + 1) / 2)


def recomputed(lay: dict) -> tuple[float, float]:
    """(the share of the layers' matmul forward, the share of attention's forward) the recompute
    runs again: full: 1/k of the layers (recompute_every=k); selective: attention alone."""
    rec = lay.get("recompute", "none")
    again = 1 / lay.get("recompute_every", 1) if rec == "full" else 0.0
    return again, again if rec == "full" else float(rec == "selective")


def executed_per_token(sh: dict, lay: dict) -> float:
    """Hardware FLOPs per token: the model's and the recompute's forward (full: the recomputed
    layers' 2 per parameter and 4 L h s; selective: attention's 4 L h s), attention in full
    (Narayanan et al.'s HFU; equal to flops_per_token(..., "hardware") under full recompute)."""
    L, h, s = sh["layers"], attention_width(sh), lay["seq"]
    again, att_again = recomputed(lay)
    return (flops_per_token(sh, s, "model") + 2 * again * L * layer_matmul_params(sh)
            + 4 * att_again * L * h * s)


def config_of(sh: dict):
    """A Llama-shaped stand-in for the suite's formula functions (plan.comm_per_step,
    recompute.activation_bytes, oom_search.predict_peak), which read these attributes."""
    moe = dict(num_experts_per_tok=sh["top_k"], num_local_experts=sh["experts"],
               first_k_dense_replace=sh["layers"] - sh["moe_layers"]) if "experts" in sh else {}
    return SimpleNamespace(model_type="llama", hidden_size=sh["hidden"],
                           num_hidden_layers=sh["layers"], num_attention_heads=sh["heads"],
                           num_key_value_heads=sh["kv_heads"], intermediate_size=sh["ffn"],
                           vocab_size=sh["vocab"],
                           head_dim=sh.get("head_dim", sh["hidden"] // sh["heads"]),
                           tie_word_embeddings=sh["tied"], **moe)


def kept_bytes(sh: dict, lay: dict, elem: int) -> tuple[float, float]:
    """(bytes one layer's forward keeps per micro-batch on this GPU (no recompute), bytes of the
    logits and their fp32 log-softmax on the last stage)."""
    from harness.recompute import activation_bytes
    from oom_search import predict_peak
    cfg = config_of(sh)
    s = lay["seq"] // lay["cp"]
    attn = "eager" if lay.get("attn") == "eager" else "sdpa"    # eager: the s x s scores too
    per_layer = activation_bytes(cfg, lay["mb"], s, elem, "none", attn, tp=lay["tp"],
                                 sp=bool(lay["sp"]))["per_layer"]
    if "experts" in sh:   # a MoE layer's token copies: dispatched (the experts' input, kept for
        # their backward) and returned (the experts' outputs, kept for the weighted combine),
        # top_k of each token each (its experts' inner activations: in the active ffn above)
        tokens = lay["mb"] * s // (lay["tp"] if lay["sp"] else 1)
        per_layer += (sh["moe_layers"] / sh["layers"] * 2 * sh["top_k"] * sh["hidden"] * elem
                      * tokens)
    logits = predict_peak("tp" if lay["tp"] > 1 else "ddp", lay["tp"], s, lay["mb"], cfg,
                          elem)["logits"]
    return per_layer, logits


def scores_bytes(sh: dict, lay: dict, elem: int) -> float:
    """The s x s part of one layer's kept bytes under unfused attention (attn=eager: the
    softmax's scores, in fp32 and in the run's dtype), what eager keeps beyond a fused kernel:
    the region selective recompute re-runs (Korthikanti et al.'s core attention: the softmax
    over the scores, with 2022's dropout, forward again), 0 under a fused kernel."""
    if lay.get("attn") != "eager":
        return 0.0
    from harness.recompute import activation_bytes
    cfg, s = config_of(sh), lay["seq"] // lay["cp"]
    kw = dict(tp=lay["tp"], sp=bool(lay["sp"]))
    return (activation_bytes(cfg, lay["mb"], s, elem, "none", "eager", **kw)["per_layer"]
            - activation_bytes(cfg, lay["mb"], s, elem, "none", "sdpa", **kw)["per_layer"])


def stages(L: int, P: int) -> list[tuple[int, bool]]:
    """(layers, holds the LM head) of the stages that can be the slowest: ceil(L/P) layers each,
    the last stage the rest and the head (one stage holds everything when P = 1)."""
    if P == 1:
        return [(L, True)]
    per = math.ceil(L / P)
    return [(per, False), (L - (P - 1) * per, True)]


# ----------------------------------------------------------------------------------------------
# Where each group's ranks sit, and what a collective costs
# ----------------------------------------------------------------------------------------------
def folded(lay: dict) -> bool:
    """MoE parallel folding (Megatron-core's): an ep group larger than dp x cp takes the tp ranks
    in too (expert TP 1: each tp rank's sequence-parallel tokens dispatched on their own)."""
    return (lay["dp"] * lay["cp"]) % lay["ep"] != 0


def expert_dp(lay: dict) -> int:
    """The ranks that hold the same experts (ZeRO's and the reduction's group for them)."""
    return lay["dp"] * lay["cp"] * (lay["tp"] if folded(lay) else 1) // lay["ep"]


# the rank orders, innermost first: Llama 3's (PP inside DP, the default) and Megatron-LM's
# (DP inside PP: Megatron, Megatron-DeepSpeed, NeMo, torchtitan's mesh), layout key order=
ORDERS = {"llama3": ("tp", "cp", "pp", "dp"), "megatron": ("tp", "cp", "dp", "pp")}


def pieces(lay: dict, group: str) -> list[tuple[int, int]]:
    """A group's members as (count, rank stride) along the grid's dimensions, innermost first.
    ZeRO's dp group spans dp x cp; an ep group is ep consecutive members of that enumeration
    (cp first; folded: tp x cp x dp), an edp group the members ep apart in it."""
    stride, s = {}, 1
    for d in ORDERS[lay.get("order", "llama3")]:
        stride[d], s = s, s * lay[d]
    if group in ("tp", "cp", "pp"):
        return [(lay[group], stride[group])]
    T, C, D, E = lay["tp"], lay["cp"], lay["dp"], lay["ep"]
    dims = ([(T, 1)] if folded(lay) and group in ("ep", "edp") else []) + [(C, stride["cp"]),
                                                                           (D, stride["dp"])]
    if group == "dp":
        return dims
    out, step = [], 1      # walk the enumeration: ep takes the first E members, edp every E-th
    for n, st in dims:
        if group == "ep":
            take = min(n, max(1, E // step))
            out.append((take, st))
        else:                   # edp: along this dimension, members `E / step` apart
            gap = max(1, E // step)
            out.append((max(1, n // gap), st * gap) if gap < n else (1, st))
        step *= n
    return [(n, st) for n, st in out if n > 1] or [(1, 1)]


def in_node(lay: dict, group: str, per_node: int) -> int:
    """How many of a group's members share one node (per_node consecutive ranks)."""
    g, span = 1, 1
    for n, st in pieces(lay, group):
        if st * (n - 1) + span > per_node:          # not all n of this dimension fit
            return g * max(1, min(n, per_node // st)) if st < per_node and g == span else g
        g, span = g * n, st * (n - 1) + span
    return g


NOT_RINGS = ("pp", "ep")   # a point-to-point send and an all-to-all: no ring over the node


def group_size(lay: dict, group: str) -> int:
    return {"tp": lay["tp"], "cp": lay["cp"], "pp": lay["pp"], "dp": lay["dp"] * lay["cp"],
            "edp": expert_dp(lay), "ep": lay["ep"]}[group]


def tree_on_two_nodes(lay: dict, group: str, op: str, gpu: dict) -> bool:
    """NCCL's tree all-reduce where it beats the ring on bandwidth: a group of two nodes with
    several ranks in each. The tree reduces along NVLink inside a node and crosses the network
    with half the ring's traffic: "If the bottleneck is the network and intra-node bandwidth is
    far from being saturated, the Tree performance can go up to ~2x the network speed", so "NCCL
    should use Tree on 2 nodes for large sizes" (S. Jeaugey, NVIDIA/nccl issue 946); NVLink
    still caps it (comm_seconds). Its other gain, latency on small messages, this model has no
    term for (its collectives are tens of MB and more)."""
    g = in_node(lay, group, gpu["per_node"])
    return op == "all_reduce" and 1 < g and group_size(lay, group) == 2 * g


def link(lay: dict, group: str, gpu: dict) -> tuple[str, float]:
    """(link class, bytes/s per GPU and direction) of a group: NVLink when its ranks, at stride
    (the product of the groups inside it), fit in one node; else the network's, as NCCL routes
    it. A ring collective runs one ring per rail (channel), and each ring leaves a node once:
    per node, one rank's share of the wire bytes crosses the network, through all the node's
    NICs. The node's NICs are shared by the per_node / g groups of this kind in it (g: this
    group's ranks per node), so a group of g ranks per node gets g NIC-shares per GPU: a
    data-parallel group that fills the node (FSDP alone) all of them, one beside tp = 8 a
    GPU's own. A point-to-point send (pp) and an all-to-all (ep) leave through each GPU's NIC
    share (no ring to fold them into). A ring's hops inside a node run over NVLink, which caps
    it (comm_seconds, each link at its measured share)."""
    size = group_size(lay, group)
    g = in_node(lay, group, gpu["per_node"])        # this group's ranks in one node
    if g >= size:           # (pp: the whole pipeline; once it spans nodes, a boundary crosses)
        return "nvlink", gpu["nvlink"]
    share = gpu["nic"] * gpu["nics"] / gpu["per_node"]   # one GPU's share of its node's NICs
    if group in NOT_RINGS:
        return "network", share
    return "network", share * g


def wire_bytes(group: str, op: str, nbytes: float, lay: dict) -> float:
    """Bytes one rank sends for a row of trainer4d.plan.comm_per_step (harness.meter.RING_FACTOR
    on the group's size; a point-to-point send: its buffer)."""
    from harness.meter import RING_FACTOR
    size = 2 if group == "pp" else group_size(lay, group)     # (a send: one pair)
    key = {"all_gather": "all_gather_into_tensor", "reduce_scatter": "reduce_scatter_tensor",
           "all_to_all": "all_to_all_single"}.get(op, op)
    return nbytes * RING_FACTOR[key](size) if key in RING_FACTOR else nbytes


# What NCCL moves of a link's datasheet bandwidth on large messages (nccl-tests busbw): NVLink 4's
# rings 80-82% (8 x H200 at 16 GiB: all-gather 361.4, reduce-scatter 362.9, all-reduce 367.2 of
# 450 GB/s; stas00/ml-engineering, network/README.md, its SHARP section; NVLS's 480 GB/s
# all-reduce is not taken: it serves all-reduce only), a 400 Gb/s ConnectX-7 NIC "around
# 48GB/s" of 50 (NVIDIA/nccl-tests issue 319). Every named GPU's spec carries them.
LINK_EFFICIENCY = {"nvlink": 0.81, "network": 0.96}
# Compute that runs beside communication is slower: 18.9% on average against the same compute
# alone (Lee et al. 2025, "Characterizing Compute-Communication Overlap in GPU-Accelerated
# Distributed Deep Learning", arXiv 2507.03114: GPT and Llama training on A100, H100, MI250 and
# MI210; SMs and HBM shared with NCCL's kernels). Each second of communication hidden behind
# compute costs this much of a second, charged to that communication (tp, ep, pp, dp).
OVERLAP_SLOWDOWN = 0.189
for _spec in GPUS.values():
    _spec.setdefault("link_efficiency", LINK_EFFICIENCY)
    _spec.setdefault("overlap_slowdown", OVERLAP_SLOWDOWN)


def comm_seconds(rows: list, lay: dict, gpu: dict) -> dict:
    """Seconds per optimizer step of each (group, op) of trainer4d.plan.comm_per_step's rows, on
    its link."""
    out = {}
    for group, op, calls, nbytes, _ in rows:
        wire = wire_bytes(group, op, nbytes, lay)
        kind, bw = link(lay, group, gpu)
        eff = gpu.get("link_efficiency", {})           # (a toy spec: the datasheet's rates)
        rate = bw * eff.get(kind, 1.0)
        if kind == "network" and group not in NOT_RINGS:
            if tree_on_two_nodes(lay, group, op, gpu):
                rate *= 2
            # the ring's (or tree's) hops inside a node run over NVLink: no faster than it
            rate = min(rate, gpu["nvlink"] * eff.get("nvlink", 1.0))
        off = wire
        if group == "ep" and kind == "network":   # the share bound for other nodes (the rest
            inside = in_node(lay, "ep", gpu["per_node"])   # goes over NVLink meanwhile)
            off = nbytes * (lay["ep"] - inside) / lay["ep"]
        out[(group, op)] = dict(seconds=off / rate, calls=calls, link=kind, wire=wire)
    return out


# ----------------------------------------------------------------------------------------------
# The step
# ----------------------------------------------------------------------------------------------
def step_time(sh: dict, lay: dict, gpu, comm_rows: list, elem: int = 2,
              passes: float | None = None, attn_eff: float | None = None) -> dict:
    """Seconds of one optimizer step on one GPU of the busiest stage, and its parts (see the
    module docstring). lay: trainer4d.plan.parse_layout's keys; comm_rows: plan.comm_per_step's
    rows for it (plan.step_report passes them)."""
    import pp_schedule
    g = gpu_spec(gpu) if isinstance(gpu, str) else gpu
    if passes is None or attn_eff is None:
        c = constants()
        passes = c["elementwise_passes"] if passes is None else passes
        attn_eff = c["attention_efficiency"] if attn_eff is None else attn_eff
    T, C, P, M = lay["tp"], lay["cp"], lay["pp"], lay["m"]
    L, h = sh["layers"], sh["hidden"]
    n = lay["mb"] * lay["seq"] // C                 # this GPU's tokens per micro-batch
    layer_mm, head_mm = layer_matmul_params(sh), sh["vocab"] * h
    again, att_again = recomputed(lay)
    per_layer, logits = kept_bytes(sh, lay, elem)
    scores = scores_bytes(sh, lay, elem)

    fp8 = lay.get("fp8", 0)
    if fp8 and not g.get("fp8"):
        import sys
        print(f"error: fp8=1 on {g['name']}: it has no FP8 tensor cores", file=sys.stderr)
        raise SystemExit(2)
    # FP8 (fp8=1, fp8.py's rule): the decoder layers' linears run at the matmul ceiling scaled
    # by the datasheet's FP8 / bf16 peak (an assumption: no FP8 MAMF is measured), the LM head
    # and attention in bf16; each FP8 linear's casts add FP8_CAST_BYTES per feature and token
    speed = g["fp8"] / g["peak"] if fp8 else 1.0

    # packed documents: a flash kernel skips the masked pairs (eager computes the whole square)
    docs = (doc_work(lay["seq"], lay["doc_min"])
            if lay.get("doc_min") and lay.get("attn") != "eager" else 1.0)
    # a MoE layer's routed experts: the tp ranks split their tokens only when folded (sequence
    # parallel); otherwise every tp rank runs the same tokens through the same experts
    routed = (sh["moe_layers"] / L * 3 * h * sh["top_k"] * sh["expert_ffn"]
              if "experts" in sh else 0.0)
    expert_split = T if "experts" in sh and folded(lay) else 1

    def stage(layers: int, head: bool) -> tuple[float, float, float]:
        """One micro-batch through a stage on one GPU (forward F, backward 2F, the recompute's
        forward again): its matmul, attention and elementwise seconds."""
        mm = ((6 + 2 * again) * layers * (layer_mm - routed + routed * T / expert_split) / speed
              + 6 * head_mm * head) * n / T
        att = (12 + 4 * att_again) * layers * attention_width(sh) * lay["seq"] * n / T * docs
        if lay.get("attn") == "eager":    # the s x s scores as batched matmuls, masked half too
            t_att = att / g["mamf"]
        else:                             # a flash kernel skips the masked half
            t_att = att / 2 / (attn_eff * g["peak"])
        kept = per_layer * layers + logits * head
        cast = fp8 * FP8_CAST_BYTES * layer_linear_features(sh) / T * n * layers
        # selective recompute under unfused attention: the s x s elementwise work of the
        # forward again (the matmuls' FLOPs are att_again's); none under a fused kernel
        redo = passes * scores * layers / 3 if lay.get("recompute") == "selective" else 0.0
        return (mm / g["mamf"], t_att,
                ((passes * kept + cast) * (1 + again / 3) + redo) / g["hbm"])
    t_mm, t_att, t_elem = max((stage(k, head) for k, head in stages(L, P)), key=sum)
    compute = t_mm + t_att + t_elem
    comm = comm_seconds(comm_rows, lay, g)

    def total(group, op=None):
        return sum(v["seconds"] for (gr, o), v in comm.items()
                   if gr == group and (op is None or o == op))
    # per micro-batch: TP (hidden behind the matmuls with async TP), CP, pp sends, all-to-alls
    tp = total("tp") / M
    tp_exposed = max(0.0, tp - t_mm) if lay.get("tp_overlap") else tp
    ep = total("ep") / M   # ep_overlap: the all-to-alls behind another micro-batch's matmuls
    window = t_mm - (tp - tp_exposed if lay.get("tp_overlap") else 0.0)   # (what TP left)
    ep_exposed = max(0.0, ep - max(0.0, window)) if lay.get("ep_overlap") else ep
    k = g.get("overlap_slowdown", 0.0)   # (a toy spec: overlap is free)
    # pipeline sends (pp_overlap: Megatron-core's interleaved schedule, overlap_p2p_comm, its
    # default there) behind the micro-batch's compute
    pp = total("pp") / M
    pp_exposed = max(0.0, pp - compute) if lay.get("pp_overlap") else pp
    tp_cost, ep_cost, pp_cost = (x + k * (t - x) for t, x in
                                 ((tp, tp_exposed), (ep, ep_exposed), (pp, pp_exposed)))
    slot = compute + tp_cost + total("cp") / M + pp_cost + ep_cost
    bubble = pp_schedule.simulate(lay["schedule"], P, M, lay["v"])[2] if P > 1 else 0.0
    pipeline = M * slot / (1 - bubble)
    # data parallel, one link shared by every DP collective of a phase: ZeRO-3's forward gathers
    # behind the forwards; the gradient reduction (ZeRO-2/3: every micro-batch's, else the last
    # one's) and ZeRO-3's backward gathers behind the backwards; ZeRO-0..2's gather of the
    # updated parameters behind the next step's first forward. Exposed besides: the last bucket
    # reduced (one layer's) and the first unit gathered, which nothing can hide.
    units = max(1, math.ceil(L / P))
    fwd, bwd = compute / 3, 2 * compute / 3
    z = lay["zero"]
    reduce = sum(total(g, op) for g in ("dp", "edp") for op in ("all_reduce", "reduce_scatter"))
    gather = sum(total(g, "all_gather") for g in ("dp", "edp"))
    if z == 3:
        phases = [(gather / 2, M * fwd), (reduce + gather / 2, M * bwd)]
        tails = reduce / (M * units) + gather / (2 * M * units)
        # FSDP1's BACKWARD_POST (bwd_prefetch=post, Composer's default) prefetches each unit's
        # gather from the post-backward hook of the unit before it, so the backward's first
        # unit, which has none, waits for its own gather in every micro-batch (pytorch#108190);
        # the rest overlap as under BACKWARD_PRE (the CPU issues them a unit ahead)
        if lay.get("bwd_prefetch") == "post":
            tails += gather / (2 * units)
    else:
        phases = [(gather, fwd), (reduce, M * bwd if z == 2 else bwd)]
        tails = reduce / ((M if z == 2 else 1) * units) + gather / units
    dp = sum(max(0.0, t - window) + k * min(t, window) for t, window in phases) + tails
    if not lay.get("dp_overlap", 1):      # reduced after the backward (Megatron 2021's local DDP)
        dp = reduce + gather
    # the optimizer step over this GPU's shard (ZeRO-1+: 1/(dp cp) of the stage's parameters)
    ex = sh.get("expert_params", 0)    # routed experts: split over ep (not tp), ZeRO over edp
    z = lay["zero"] >= 1
    shard = ((param_count(sh) - ex) / (T * P * (lay["dp"] * lay["cp"] if z else 1))
             + ex / (lay["ep"] * P * (expert_dp(lay) if z else 1)))
    optimizer = OPTIMIZER_BYTES * shard / g["hbm"]
    step = pipeline + dp + optimizer
    return dict(step=step, matmul=M * t_mm, attention=M * t_att, elementwise=M * t_elem,
                tp=M * tp_cost, cp=total("cp"), pp_send=M * pp_cost, ep=M * ep_cost,
                bubble=pipeline - M * slot, dp=dp, optimizer=optimizer, comm=comm)


def report(sh: dict, lay: dict, gpu, comm_rows: list, elem: int = 2,
           convention: str = "model") -> dict:
    """step_time's parts with the tokens/s, TFLOP/s and MFU of the layout."""
    g = gpu_spec(gpu) if isinstance(gpu, str) else gpu
    parts = step_time(sh, lay, g, comm_rows, elem)
    gpus = lay["tp"] * lay["cp"] * lay["pp"] * lay["dp"]
    tokens = lay["mb"] * lay["seq"] * lay["m"] * lay["dp"]      # per step, all replicas
    flops = flops_per_token(sh, lay["seq"], convention) * tokens
    tflops = flops / parts["step"] / gpus
    per_gpu = lambda f: f * tokens / parts["step"] / gpus / g["peak"]      # noqa: E731
    return dict(parts, gpus=gpus, tokens=tokens, tokens_per_gpu=tokens / parts["step"] / gpus,
                tflops=tflops / 1e12, mfu=tflops / g["peak"], gpu=g["name"],
                mfu_causal=per_gpu(flops_per_token(sh, lay["seq"], "causal")),
                hfu=per_gpu(executed_per_token(sh, lay)),
                mfu_fp8=tflops / g["fp8"] if lay.get("fp8") else None)


BREAKDOWN = ("matmul", "attention", "elementwise", "tp", "cp", "pp_send", "ep", "bubble", "dp",
             "optimizer")


def print_report(r: dict, out=print, width: int = 60) -> None:
    """The breakdown as a table and one bar (each part's letter, its share of the step)."""
    out(f"  step time on {r['gpu']}: {r['step']:.3f} s; {r['tokens_per_gpu']:,.0f} tokens/s/GPU, "
        f"{r['tflops']:.0f} TFLOP/s/GPU, MFU {r['mfu']:.1%} (model FLOPs, attention in full)")
    out(f"    MFU counting causal attention's half (6 L h s per token): {r['mfu_causal']:.1%}; "
        f"HFU (the recompute's forward counted too): {r['hfu']:.1%}")
    if r.get("mfu_fp8") is not None:
        out(f"    FP8 (the decoder linears; head and attention in bf16): MFU above divides by "
            f"the bf16 peak (torchtitan's convention); by the FP8 peak: {r['mfu_fp8']:.1%}")
    bar = ""
    for i, k in enumerate(BREAKDOWN):
        share = r[k] / r["step"]
        if r[k] > 0:
            out(f"    {k:<12} {r[k]:>9.4f} s  {share:6.1%}  [{'MAETCSXBDO'[i]}]")
        bar += "MAETCSXBDO"[i] * round(share * width)
    out(f"    |{bar}|")


# ----------------------------------------------------------------------------------------------
# The validation table (trainer4d.plan.validate computes its rows)
# ----------------------------------------------------------------------------------------------
def layout_text(lay: dict) -> str:
    dims = " ".join(f"{k}{lay[k]}" for k in ("tp", "cp", "pp", "dp", "ep") if lay.get(k, 1) > 1)
    sched = (f", {lay['schedule']}" + (f" V={lay['v']}" if lay["schedule"] == "interleaved" else "")
             if lay["pp"] > 1 else "")
    extra = "".join(s for k, s in (("tp_overlap", ", TP overlapped"),
                                   ("pp_scatter", ", scatter/gather"), ("fp8", ", FP8"),
                                   ("ep_overlap", ", EP overlapped"),
                                   ("pp_overlap", ", sends overlapped"),
                                   ("doc_min", f", documents >= {lay.get('doc_min')} tokens"),
                                   ("fp8_gather", " (FP8 all-gather)"))
                    if lay.get(k))
    k = lay.get("recompute_every", 1)
    rec = lay["recompute"] + (f" (1 layer in {k})" if k > 1 and lay["recompute"] != "none" else "")
    post = ", BACKWARD_POST" if lay.get("bwd_prefetch") == "post" else ""
    return (f"{dims}, seq {lay['seq']}, mb {lay['mb']} x M {lay['m']}{sched}, ZeRO-{lay['zero']}"
            f"{post}, recompute {rec}{extra}")


def table(data: dict) -> str:
    """The validation table (docs/steptime.md renders it from results/plan-validation.json)."""
    lines = ["| row | source | model | GPU | layout (assumed) | published | predicted | error | "
             "largest parts of the predicted step |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        parts = sorted(r["breakdown"].items(), key=lambda kv: -kv[1])[:3]
        lines.append(f"| {r['id']} | {r['source']} | {r['model']} | {r['gpu']} | {r['layout']} "
                     f"({r['assumed']}) | {r['published']:.1f} | {r['predicted']:.1f} | "
                     f"{r['rel_err']:+.1%} | " + ", ".join(f"{k} {v:.0%}" for k, v in parts)
                     + " |")
    return "\n".join(lines)
