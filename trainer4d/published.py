"""published.py: training runs with published throughput, for `python -m trainer4d.plan validate`.

Each row: its source (a paper's table or a benchmark file, quoted where it is read), the model's
shape, the layout as published, what the source did not publish and the row assumes (said in
`assumed`), the GPU (trainer4d.steptime.GPUS) and the published figure in the source's own
convention: TFLOP/s per GPU counted as the source counts it ("model": 6 Psi_matmul + 12 L h s per
token, attention in full; "hardware": Narayanan et al.'s, with the recompute's forward), or
tokens/s per GPU (torchtitan), converted with its own FLOPs per token (6 N without the embedding
+ 12 L h s: the same count as "model") so that every row compares TFLOP/s.

Rules for what a source leaves out, the same for every row:
    micro-batch     1 sequence, M = the sequences per DP rank (torchtitan: its local batch, M = 1)
    interleaved V   2 when a source uses the interleaved schedule and does not say V
    recompute       none unless the source says (Narayanan: full, its FLOP count assumes it)
    DP sharding     Megatron-LM 2021: all-reduce (ZeRO-0); Megatron-core: its distributed
                    optimizer with overlapped gathers (ZeRO-1); Llama 3: FSDP that keeps the
                    parameters after forward (FSDP's ZeRO-2 mode; ZeRO-1 here, a conservative
                    approximation: interview Q25);
                    torchtitan's FSDP2: ZeRO-3 (resharded after forward); llm-foundry:
                    Composer's FSDP1, ZeRO-3 with BACKWARD_POST (bwd_prefetch=post), the
                    gradients reduced as its table's MP Mode says (DEFAULT fp32, PURE bf16)
    MLP             Megatron's GPT: 4h, not gated, multi-head attention (the README's table does
                    not say; its parameter counts agree)
    pipeline sends  overlapped (pp_overlap=1) under Megatron-core's interleaved schedule, whose
                    overlap_p2p_comm is on unless --no-overlap-p2p-communication (Megatron-LM's
                    arguments.py; off for plain 1F1B; the README of the C rows: "pipeline-
                    parallel communication (enabled by default)"; assumed for NeMo's and
                    Megatron-Bridge's interleaved rows, H2, H3, E5, which run Megatron-core);
                    exposed elsewhere (Megatron-LM 2021, DeepSpeed's pipeline, Llama 3's
                    unpublished framework)
"""
from __future__ import annotations

LLAMA3_405B = dict(layers=126, hidden=16384, heads=128, kv_heads=8, ffn=53248, gated=True,
                   vocab=128256, tied=False)
LLAMA3_70B = dict(layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, gated=True,
                  vocab=128256, tied=False)
LLAMA3_8B = dict(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, gated=True,
                 vocab=128256, tied=False)


UNPUBLISHED_V = 2     # the interleaved schedule's chunks per rank where a source does not say


def gpt(layers, hidden, heads, vocab, tied):
    return dict(layers=layers, hidden=hidden, heads=heads, kv_heads=heads, ffn=4 * hidden,
                gated=False, vocab=vocab, tied=tied)


def lay(**kw):
    out = dict(tp=1, cp=1, pp=1, dp=1, ep=1, seq=2048, mb=1, m=1, v=1, schedule="1f1b", zero=1,
               sp=0, recompute="none", tp_overlap=0)
    out.update(kw)
    return out


SOURCES = {
    "llama3": "Llama 3 Herd of Models (arXiv 2407.21783v3), Table 4: 405B on H100 80GB HBM3 "
              "700 W, 8 per server on NVLink, RoCE 400 Gb/s per GPU; [TP, CP, PP, DP] innermost "
              "first; interleaved pipeline; no activation checkpointing at 8K; 'BF16 MFU'",
    "narayanan": "Narayanan et al. 2021 (arXiv 2104.04473), Table 1: GPT on A100 80GB "
                 "(Selene: 8 per node, NVSwitch, eight 200 Gb/s HDR HCAs), seq 2048, vocab "
                 "51,200, interleaved schedule, activation recomputation, FLOPs by its Eq. 3 "
                 "(which counts the recompute's forward)",
    "megatron": "NVIDIA/Megatron-LM README 'Training Speed and Scalability' (images/"
                "model_table.png, commit f2e5db402c; Megatron-core r0.8.0): GPT, vocab 131,072, "
                "seq 4096, H100; --overlap-grad-reduce --overlap-param-gather --tp-comm-overlap; "
                "FLOPs by training.py's num_floating_point_operations (3 x forward, attention in "
                "full)",
    "llmfoundry": "mosaicml/llm-foundry scripts/train/benchmarking/README.md at 061f2c7ce6 (MPT "
                  "on H100 80GB and A100 80GB, FSDP FULL_SHARD over all GPUs, amp_bf16; T/s/GPU; "
                  "its MFU counts 6 N + 12 L d s per token, attention in full, as harness.flops); "
                  "shapes from scripts/train/yamls/pretrain/mpt-*.yaml (ALiBi, MLP 4h, MHA, "
                  "vocab 50368, tied)",
    "mcore-moe": "NVIDIA/Megatron-LM examples/moe_recipes/README.md at 8a2ac1fdc7 (dev): "
                 "'Median TFLOP/s/GPU' per recipe, the tuple 'TP/PP/EP/CP/ETP' and "
                 "'MBS/GBS/SL', each row's YAML beside it; H100; routing forced balanced "
                 "(moe_router_force_load_balancing); Megatron-LM's count of this era halves "
                 "causal attention",
    "bridge": "NVIDIA-NeMo/Megatron-Bridge docs/performance-summary.md, its '26.04.01 NeMo "
              "Container' section, DGX-H100: 'Tokens / sec / GPU' with GBS, MBS, sequence "
              "length, TP, PP, CP, VP, EP; 'we force-balance the token distribution among "
              "experts and all benchmarks are token-dropless'; recipes in src/megatron/bridge/"
              "perf_recipes (qwen/h100)",
    "mlm-llama": "NVIDIA/Megatron-LM examples/llama/README.md at bd32927e7e, 'FP8 Performance' "
                 "(Model, #GPUs, GBS, MBS, SL, TP, PP, CP, VP, EP, GA, Tokens/sec/GPU, "
                 "TFLOP/sec/GPU); the GPU is not named in the table (H100: its script is "
                 "train_llama3_8b_h100_fp8.sh, the configuration NeMo's performance scripts')",
    "bloom": "bigscience-workshop/bigscience train/tr11-176B-ml (chronicles.md at e726b15982: "
             "'TFLOPs: 149.02' at GBS 2048, 105.22 s per iteration; README.md: NHIDDEN=14336 "
             "NLAYERS=70 NHEADS=112, SEQ_LEN=2048; TP 4 x PP 12 x DP 8 on 384 A100 80GB, MBS 2, "
             "full activation checkpointing, Megatron-DeepSpeed's pipeline, its bf16 optimizer "
             "sharding the states (ZeRO-1); its TFLOPs count the recompute's forward (Narayanan's "
             "formula, hardware FLOPs), vocab padded to 250,880)",
    "torchtitan": "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md (H100 96GB "
                  "HBM2e at 500 W, 8 per host, 400 Gb/s per GPU; TPS/GPU at the 90th "
                  "iteration; seq 8192 from train_configs at 9dec370) and docs/performance.md at "
                  "9dec370 (A100 80GB, FSDP2 on 64 GPUs; 405B on 128 H100 96GB)",
}

# How each source counts causal attention's FLOPs. The validation predicts every row with
# attention in full (harness.flops; "hardware" adds the recompute's forward), so a row compares
# like with like where its source counted in full too: current Megatron-LM (which halves it,
# the causal mask's zero half) would not.
ATTENTION_COUNT = {
    "llama3": "in full, assumed: the paper reports 'BF16 MFU' without its FLOP count",
    "narayanan": "in full (Eq. 3's s/6h term: the whole s x s square), plus the recompute's "
                 "forward (hardware FLOPs)",
    "megatron": "in full: r0.8.0's num_floating_point_operations (12 B s L h^2 (... + s/h)); "
                "current Megatron-LM halves it",
    "torchtitan": "not needed: tokens/s, converted with the same FLOPs per token on both sides",
    "llmfoundry": "not needed: tokens/s (its MFU's count, 6 N + 12 L d s, is in full too)",
    "bloom": "in full, plus the recompute's forward (Narayanan's formula with f = 4: hardware "
             "FLOPs)",
    "mlm-llama": "not needed: tokens/s (its TFLOP/s count attention in full: 57.91 GFLOP per "
                 "token at Llama 3 8B's 8K, its 800 / 13,812)",
    "mcore-moe": "the causal half (Megatron-LM's num_floating_point_operations since 2025; "
                 "its MoE layers' active experts)",
    "bridge": "not needed: tokens/s (its TFLOP/s count the causal half)",
}

# (id, source, model name, shape, gpu, layout, metric, published, convention, what the row assumes)
ROWS = [
    ("A1", "llama3", "Llama 3 405B", LLAMA3_405B, "h100",
     lay(tp=8, pp=16, dp=64, seq=8192, m=32, schedule="interleaved", v=UNPUBLISHED_V, sp=1),
     "tflops", 430.0, "model", "V = 2 (unpublished), micro-batch 1 sequence, SP"),
    ("A2", "llama3", "Llama 3 405B", LLAMA3_405B, "h100",
     lay(tp=8, pp=16, dp=128, seq=8192, m=16, schedule="interleaved", v=UNPUBLISHED_V, sp=1),
     "tflops", 400.0, "model", "V = 2, micro-batch 1, SP"),
    ("A3", "llama3", "Llama 3 405B", LLAMA3_405B, "h100",
     lay(tp=8, cp=16, pp=16, dp=8, seq=131072, m=16, schedule="interleaved", v=UNPUBLISHED_V,
         sp=1), "tflops", 380.0, "model",
     "V = 2, micro-batch 1, SP, DP 8 (v3; the HTML shows 4), no recompute"),
]
# Narayanan et al.'s runs as NVIDIA/Megatron-LM examples/sc21/run_table_1.sh launches them:
# micro-batch (MBS), layers per virtual stage (V = layers / P / that; none: plain 1F1B), DDP
# "torch" (bucketed, overlapped) up to 18B and "local" (reduced after the backward) from 39B,
# --fp16 (the gradients all-reduced in fp16 by Megatron's 2021 default), seq 2048; attention
# computed whole (2021's fused softmax over the s x s scores, no flash kernel)
for rid, (L, h, heads, T, P, gpus, batch, tf, mbs, vp, ddp) in {
        "B1": (24, 2304, 24, 1, 1, 32, 512, 137, 16, 0, "torch"),
        "B2": (30, 3072, 32, 2, 1, 64, 512, 138, 16, 0, "torch"),
        "B3": (36, 4096, 32, 4, 1, 128, 512, 142, 16, 0, "torch"),
        "B4": (40, 6144, 48, 8, 1, 256, 1024, 135, 8, 0, "torch"),
        "B5": (48, 8192, 64, 8, 2, 512, 1536, 138, 4, 0, "local"),
        "B6": (60, 10240, 80, 8, 4, 1024, 1792, 140, 2, 5, "local"),
        "B7": (80, 12288, 96, 8, 8, 1536, 2304, 148, 2, 5, "local"),
        "B8": (96, 16384, 128, 8, 16, 1920, 2160, 155, 1, 3, "local"),
        "B9": (105, 20480, 128, 8, 35, 2520, 2520, 163, 1, 1, "local"),
        "B10": (128, 25600, 160, 8, 64, 3072, 3072, 163, 1, 0, "local")}.items():
    D = gpus // (T * P)
    V = L // (P * vp) if vp else 1
    ROWS.append((rid, "narayanan", f"GPT {L}x{h}", gpt(L, h, heads, 51200, True), "a100",
                 lay(tp=T, pp=P, dp=D, seq=2048, mb=mbs, m=batch // (D * mbs), zero=0,
                     order="megatron",
                     recompute="full", pp_scatter=1, reduce_bytes=2, attn="eager",
                     dp_overlap=int(ddp == "torch"),
                     schedule="interleaved" if V > 1 else "1f1b", v=V),
                 "tflops", float(tf), "hardware",
                 f"run_table_1.sh: micro-batch {mbs}, " + (f"V = {V}, " if V > 1 else "")
                 + f"{ddp} DDP, fp16 all-reduce"))
for rid, (L, h, heads, T, P, D, batch, tf) in {
        "C1": (24, 2048, 16, 1, 1, 48, 192, 408.8), "C2": (30, 4096, 32, 2, 1, 48, 192, 465.9),
        "C3": (32, 6144, 48, 4, 1, 48, 192, 489.1), "C4": (48, 7168, 56, 8, 1, 48, 192, 459.6),
        "C5": (84, 8192, 64, 8, 2, 48, 384, 419.7), "C6": (92, 10240, 80, 8, 4, 48, 768, 420.5),
        "C7": (96, 12288, 96, 8, 6, 48, 1152, 432.8), "C8": (96, 16384, 128, 8, 8, 48, 1536, 474.4),
        "C9": (112, 18432, 144, 8, 16, 48, 3072, 459.9)}.items():
    ROWS.append((rid, "megatron", f"GPT {L}x{h}", gpt(L, h, heads, 131072, False), "h100",
                 lay(tp=T, pp=P, dp=D, seq=4096, m=batch // D, zero=1, tp_overlap=int(T > 1),
                     order="megatron",
                     sp=int(T > 1),
                     schedule="interleaved" if P > 1 else "1f1b", v=UNPUBLISHED_V if P > 1 else 1,
                     pp_overlap=int(P > 1)),
                 "tflops", tf, "model",
                 "micro-batch 1" + (", V = 2" if P > 1 else "") + ", SP (TP overlap needs it), "
                 "no recompute, MLP 4h"))


def titan(rid, model, shape, gpu, tokens, assumed, dp, mb, **kw):
    """A torchtitan row: FSDP2 (ZeRO-3) at seq 8192, published as tokens/s per GPU; its
    selective checkpointing (layer: every other layer; op: every other matmul kept) as one layer
    in two recomputed."""
    kw = dict(dict(recompute="full", recompute_every=2), **kw)
    return (rid, "torchtitan", model, shape, gpu, lay(dp=dp, seq=8192, mb=mb, zero=3, **kw),
            "tokens", tokens, "model", assumed)


ROWS += [
    titan("D1", "Llama 3.1 8B", LLAMA3_8B, "h100-96gb", 5762.0, "FSDP2 eager; op-level SAC as "
          "half the layers recomputed", dp=8, mb=2),
    titan("D2", "Llama 3.1 8B", LLAMA3_8B, "h100-96gb", 6667.0, "as D1 with torch.compile (the "
          "model has no compile: eager's elementwise passes)", dp=8, mb=2),
    titan("D3", "Llama 3.1 8B", LLAMA3_8B, "h100-96gb", 8532.0, "as D2 with Float8 (torchao's "
          "tensorwise recipe on the decoder linears, FP8 at twice the bf16 matmul ceiling)",
          dp=8, mb=2, fp8=1),
    titan("D8", "Llama 3.1 8B", LLAMA3_8B, "h100-96gb", 5605.0, "as D1 on 16 hosts", dp=128, mb=2),
    titan("D9", "Llama 3.1 8B", LLAMA3_8B, "h100-96gb", 6514.0, "as D8 with torch.compile",
          dp=128, mb=2),
    titan("D'1", "Llama 3 8B", LLAMA3_8B, "a100", 2904.0, "selective layer AC: every other "
          "layer recomputed", dp=64, mb=1),
    titan("D'2", "Llama 3 8B", LLAMA3_8B, "a100", 2973.0, "selective op AC as half the layers "
          "recomputed", dp=64, mb=1),
    titan("D'3", "Llama 3 70B", LLAMA3_70B, "a100", 331.0, "full AC", dp=64, mb=1,
          recompute_every=1),
    titan("D'4", "Llama 3.1 405B", LLAMA3_405B, "h100-96gb", 109.0, "FSDP 16 x TP 8 (TP 8 from "
          "its config), full AC, bf16", dp=16, mb=2, tp=8, recompute_every=1),
]

# MosaicML's llm-foundry benchmark table: MPT under FSDP FULL_SHARD on every GPU, amp_bf16, its
# activation checkpointing per row (full), published as tokens/s per GPU (T/s/GPU); (model,
# seq, GPUs, GPU, micro-batch, grad accum, act. ckpt, T/s/GPU). Composer's FSDP1 with its
# defaults (composer/trainer/dist_strategy.py: backward_prefetch 'BACKWARD_POST'; the yamls
# set none): the backward's first unit waits for its gather (bwd_prefetch=post); MP Mode
# DEFAULT reduces the gradients in fp32, PURE (the A100 70B row) in bf16 (reduce_bytes=2)
MPT = {"7b": (32, 4096, 32), "13b": (40, 5120, 40), "30b": (48, 7168, 56), "70b": (80, 8192, 64)}
for rid, (size, seq, gpus, gpu, mbs, accum, ckpt, tps) in {
        "F1": ("70b", 2048, 64, "h100", 8, 4, True, 1039.0),
        "F2": ("30b", 2048, 32, "h100", 14, 3, True, 2308.0),
        "F3": ("13b", 2048, 64, "h100", 2, 1, False, 4800.0),
        "F4": ("7b", 2048, 8, "h100", 6, 1, False, 10643.0),
        "F5": ("7b", 8192, 8, "h100", 8, 2, True, 6935.0),
        "F6": ("70b", 2048, 64, "a100", 8, 4, True, 410.0)}.items():
    L, h, heads = MPT[size]
    ROWS.append((rid, "llmfoundry", f"MPT-{size}", gpt(L, h, heads, 50368, True), gpu,
                 lay(dp=gpus, seq=seq, mb=mbs, m=accum, zero=3,
                     recompute="full" if ckpt else "none", bwd_prefetch="post",
                     reduce_bytes=4 if gpu == "h100" else 2),
                 "tokens", tps, "model", f"FSDP FULL_SHARD (ZeRO-3), micro-batch {mbs} x "
                 f"{accum}, {'activation checkpointing' if ckpt else 'no recompute'}; "
                 + ("fp32 reduction (DEFAULT); 8 x 400 Gb/s per node (unpublished)"
                    if gpu == "h100" else "bf16 reduction (PURE); 1600 Gb/s RoCE per node")))
# BLOOM-176B at full throttle: GBS 2048 = 8 replicas x 128 micro-batches of 2 sequences
ROWS.append(("G1", "bloom", "BLOOM 176B", gpt(70, 14336, 112, 250880, True), "a100",
             lay(tp=4, pp=12, dp=8, seq=2048, mb=2, m=128, zero=1, recompute="full",
                 attn="eager", order="megatron"),
             "tflops", 149.02, "hardware", "1F1B (DeepSpeed's pipeline), no SP, TP not "
             "overlapped, attention unfused (2022), the network unpublished (8 x 200 Gb/s)"))
# Megatron-LM's Llama 3 FP8 table (NeMo's performance scripts): DP = GPUs / (TP PP CP), M = GA
ROWS += [
    ("H1", "mlm-llama", "Llama 3 8B", LLAMA3_8B, "h100",
     lay(cp=2, dp=4, seq=8192, m=32, fp8=1, order="megatron"),
     "tokens", 13812.0, "model", "FP8 as fp8=1, CP 2, no recompute, H100 (inferred)"),
    ("H2", "mlm-llama", "Llama 3 70B", LLAMA3_70B, "h100",
     lay(tp=4, pp=8, dp=2, seq=8192, m=64, schedule="interleaved", v=5, sp=1, tp_overlap=1,
         fp8=1, order="megatron", pp_overlap=1), "tokens", 1621.0, "model",
     "FP8, SP with TP overlapped (NeMo's scripts turn it on), no recompute, H100 (inferred)"),
    ("H3", "mlm-llama", "Llama 3 405B", LLAMA3_405B, "h100",
     lay(tp=8, pp=8, cp=2, dp=8, seq=8192, m=64, schedule="interleaved", v=8, sp=1,
         tp_overlap=1, fp8=1, order="megatron", pp_overlap=1), "tokens", 315.0, "model",
     "FP8, SP with TP overlapped, no recompute, H100 (inferred)"),
]

# Qwen3's MoE models (Megatron-LM's recipe YAMLs and NeMo's qwen3.py: 128 routed experts, top 8,
# every layer MoE, no shared expert, 128-wide heads, untied, q and k norms)
def _qwen3(layers, hidden, heads, expert_ffn):
    from .steptime import moe_shape
    return moe_shape(layers, hidden, heads, 4, 128, 128, 8, expert_ffn, 151936, False,
                     other=2 * hidden + 2 * 128)


QWEN3_30B_A3B, QWEN3_235B_A22B = _qwen3(48, 2048, 32, 768), _qwen3(94, 4096, 64, 1536)
ROWS += [
    ("E1", "mcore-moe", "Qwen3-235B-A22B", QWEN3_235B_A22B, "h100",
     lay(tp=2, pp=8, dp=16, ep=32, seq=4096, m=128, schedule="interleaved", v=4, sp=1,
         ep_overlap=1, order="megatron", pp_overlap=1), "tflops", 214.3, "causal",
     "EP 32 folded over TP 2 x DP 16; V = 4 from its YAML's 3 layers per virtual stage; its "
     "selective recompute (MoE activation, norms) not priced; TP not overlapped"),
    ("E2", "mcore-moe", "Qwen3-30B-A3B", QWEN3_30B_A3B, "h100",
     lay(dp=32, ep=8, seq=4096, m=8, order="megatron"), "tflops", 234.1, "causal",
     "BF16 baseline, no recompute"),
    ("E3", "mcore-moe", "Qwen3-30B-A3B", QWEN3_30B_A3B, "h100",
     lay(dp=32, ep=8, seq=4096, m=8, fp8=1, order="megatron"), "tflops", 232.4, "causal",
     "FP8 blockwise as fp8=1 (the decoder linears at the FP8 peak's ratio)"),
    ("E4", "bridge", "Qwen3-30B-A3B", QWEN3_30B_A3B, "h100",
     lay(dp=16, ep=16, seq=4096, m=64, fp8=1, order="megatron"), "tokens", 8960.0, "model",
     "FP8, EP 16 over two nodes, no recompute, EP not overlapped (its recipe: HybridEP)"),
    ("E5", "bridge", "Qwen3-235B-A22B", QWEN3_235B_A22B, "h100",
     lay(tp=2, pp=8, dp=16, ep=32, seq=4096, m=512, schedule="interleaved", v=4, sp=1, fp8=1,
         ep_overlap=1, order="megatron", pp_overlap=1), "tokens", 1696.0, "model",
     "FP8, EP 32 folded over TP 2 x DP 16, EP overlapped (its recipe's moe_a2a_overlap), no "
     "recompute"),
]


def hf_config(shape: dict, seq: int):
    """A row's model as an HF config, what a user hands the CLI (`--model FILE`): LlamaConfig
    when its MLP is gated, GPT2Config otherwise (GPT's LayerNorm and linear biases, learned
    positions for `seq` tokens). tests/test_steptime.py runs every row through the CLI with it."""
    from transformers import GPT2Config, LlamaConfig, Qwen3MoeConfig
    if "experts" in shape:   # (the Qwen3 MoE rows)
        return Qwen3MoeConfig(hidden_size=shape["hidden"], num_hidden_layers=shape["layers"],
                              num_attention_heads=shape["heads"],
                              num_key_value_heads=shape["kv_heads"], head_dim=shape["head_dim"],
                              num_experts=shape["experts"], num_experts_per_tok=shape["top_k"],
                              moe_intermediate_size=shape["expert_ffn"],
                              vocab_size=shape["vocab"], tie_word_embeddings=shape["tied"])
    if shape["gated"]:
        return LlamaConfig(hidden_size=shape["hidden"], intermediate_size=shape["ffn"],
                           num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
                           num_key_value_heads=shape["kv_heads"], vocab_size=shape["vocab"],
                           tie_word_embeddings=shape["tied"])
    return GPT2Config(n_embd=shape["hidden"], n_inner=shape["ffn"], n_layer=shape["layers"],
                      n_head=shape["heads"], vocab_size=shape["vocab"], n_positions=seq,
                      tie_word_embeddings=shape["tied"])
