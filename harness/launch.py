"""launch.py: Command line and process group: the harness's flags, the per-mode defaults,
torchrun's environment, gloo on CPU and NCCL on CUDA with a timeout, clean teardown, and the
one-line exit (code 2) for a violated constraint, before any collective."""
from __future__ import annotations

import argparse
import copy
import datetime
import gc
import math
import os
import socket

import torch
import torch.distributed as dist

from .compare import TOL_K
from .meter import METER
from .models import DTYPES, PRESETS
from .run import Env, fail_config  # noqa: F401  (the package's name for it)
from .strategy import HARNESS_PLANTS


MODE_DEFAULTS = {  # (steps, dtype on cpu) per mode; see the numerics policy in the README
    "correctness": (2, "float64"),
    "plants": (2, "float64"),    # correctness runs: the clean one, then each planted bug
    "learning": (200, "float32"),
    "benchmark": (None, "float32"),
    "peak": (1, "float32"),
    "train": (100, "float32"),   # a strategy's own mode (compose4d's training run)
}


def _dtype_list(text: str) -> str:
    bad = [d for d in text.split(",") if d not in DTYPES]
    if bad:
        raise argparse.ArgumentTypeError(f"{bad[0]!r} is not one of {', '.join(DTYPES)}")
    return text


def base_parser(prog: str, modes=(), plants=None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--mode", default="correctness",
                   choices=["correctness", "learning", "benchmark", "all", "peak", "plants",
                            *modes])
    p.add_argument("--model", default="tiny",
                   help="preset (%s), a local HF model directory, or a config.json path"
                   % ", ".join(PRESETS))
    p.add_argument("--dtype", default=None, type=_dtype_list,
                   help="%s; comma-separated: each in turn in one process group "
                        "(e.g. float64,float32). Default: float64 for correctness, float32 "
                        "otherwise on CPU; bfloat16 for learning/benchmark on CUDA"
                        % "|".join(DTYPES))
    p.add_argument("--device", default=None, choices=["cpu", "cuda"],
                   help="default: cuda when available")
    p.add_argument("--attn", default="auto", choices=["auto", "sdpa", "eager"],
                   help="HF attention implementation of the models (auto: sdpa where the "
                        "model's class has it, eager otherwise, printed)")
    p.add_argument("--skip-self-check", action="store_true",
                   help="skip the check that a strategy re-implementing part of the forward "
                        "(pp's stage loop) computes the model's own forward on a truncated copy "
                        "of its config (harness/selfcheck.py; prints a warning)")
    # (recompute.MODES, spelled out: importing recompute here would load it with the package)
    p.add_argument("--recompute", default="none", choices=["none", "full", "selective"],
                   help="activation recompute in the strategy's model (harness/recompute.py): "
                        "full keeps each decoder layer's input, selective recomputes the "
                        "attention core; correctness and learning modes (the benchmark's comm "
                        "formulas assume none)")
    p.add_argument("--ce-chunk", type=int, default=0,
                   help="cross-entropy N tokens of logits at a time, the gradients formed in "
                        "the same pass (harness/loss.py; ddp.py's plain head and tp.py's "
                        "vocab-parallel one); 0: the full logits")
    p.add_argument("--dropout", type=float, default=None,
                   help="set the model's dropout (attention, and hidden where the family has "
                        "it, e.g. Phi3's residual dropout) to P; the masks are the same at every "
                        "layout (harness/dropout.py). Default: the model config's own")
    p.add_argument("--fp8", default=None, choices=["tensorwise", "rowwise", "blockwise"],
                   help="FP8 GEMMs in the decoder layers' linears (fp8.py), the reference's "
                        "too; every scale global over the ranks that split its tensor")
    p.add_argument("--doc-mask", action="store_true",
                   help="packed documents: each row is cut into documents of long-tailed "
                        "lengths (harness/data.py), positions restart at 0 in each and "
                        "attention stays within a document (HF's packed-sequence mask)")
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences per step)")
    p.add_argument("--length", type=int, default=64, help="sequence length")
    p.add_argument("--steps", type=int, default=None,
                   help="optimizer steps (default 2 for correctness, 200 for learning)")
    p.add_argument("--lr", type=float, default=None,
                   help="AdamW learning rate (default 1e-3 correctness, 3e-3 learning)")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--optimizer", choices=["adamw", "muon"], default="adamw",
                   help="muon: Muon on the hidden matrices, AdamW on the rest (muon.py; the "
                        "reference steps with torch.optim.Muon)")
    p.add_argument("--muon-lr", type=float, default=0.02, help="Muon's learning rate")
    p.add_argument("--muon-mode", choices=["auto", "owner", "gather"], default="auto",
                   help="who runs Newton-Schulz on a sharded matrix (muon.py): owner = one rank "
                        "per matrix, gather = every rank holding a piece; auto = the "
                        "strategy's default (zero: owner; ddp: replicated; tp, sp: tp-gather)")
    p.add_argument("--muon-ns-dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="Newton-Schulz's dtype: auto = bfloat16 for a bf16 model (torch's), the "
                        "parameters' own for float32/float64 (exact); float32 = float32 for a "
                        "bf16 model (its masters'); bfloat16 = torch's always")
    p.add_argument("--lora", type=int, default=0, metavar="R",
                   help="LoRA fine-tuning: peft's adapters of rank R on --lora-targets, the "
                        "rest frozen (harness/lora_setup.py, lora.py); 0: train every weight")
    p.add_argument("--lora-alpha", type=float, default=None,
                   help="LoRA's alpha (the adapters' scale is alpha / R); default 2 R")
    p.add_argument("--lora-targets", default="auto",
                   help="comma-separated module names peft wraps; auto: the attention and MLP "
                        "projections the model has")
    p.add_argument("--lora-dropout", type=float, default=0.0, help="dropout on the adapters' input")
    p.add_argument("--seed", type=int, default=0, help="model init, language and sample seed")
    p.add_argument("--branching", type=int, default=4,
                   help="successors per token in the synthetic Markov language")
    p.add_argument("--tol-k", type=float, default=None,
                   help="correctness: a strategy passes when err(strategy vs float64 reference) "
                        "<= K x the single-device noise + a floor (default %g; see the README's "
                        "numerics policy)" % 8.0)
    p.add_argument("--warmup", type=int, default=2, help="benchmark warm-up steps")
    p.add_argument("--bench-iters", type=int, default=5, help="benchmark timed steps")
    p.add_argument("--overlap-steps", type=int, default=3,
                   help="benchmark: steps profiled for the share of communication hidden behind "
                        "compute (harness/overlap.py; 0: not measured)")
    p.add_argument("--paired", type=int, default=0,
                   help="benchmark with --compare-native: also N rounds of ours, each baseline "
                        "and the single-device reference, one step each in turn (the order "
                        "reversed every other round), and the median and spread of the "
                        "per-round step-time ratios")
    p.add_argument("--log-every", type=int, default=10, help="learning-mode print interval")
    p.add_argument("--compare-native", action="store_true",
                   help="also run PyTorch's own implementation, where the strategy has one")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="process-group timeout in seconds: a dead peer fails instead of hanging")
    p.add_argument("--out", default=None, help="directory for json/csv/png results")
    p.add_argument("--reduce-dtype", default="float32", choices=["float32", "param"],
                   help="bf16/fp16 runs: the dtype of data-parallel gradient reductions (and "
                        "of ZeRO/FSDP's gradient shards): float32, or param (the gradients' "
                        "own dtype: half the bytes, more rounding)")
    p.add_argument("--nccl-semantics", action="store_true",
                   help="record every p2p batch and collective and check them under NCCL's "
                        "rules (tags ignored, FIFO per pair, batches progress together, sends "
                        "wait for receives, one collective order); the last line is the verdict")
    p.add_argument("--host-syncs", action="store_true",
                   help="correctness: watch every training step for host synchronisations (a "
                        "device value read on the host, a tensor built from host data; "
                        "harness/hostsync.py) and FAIL on one outside its ALLOWED table")
    p.add_argument("--clip", type=float, default=None,
                   help="clip gradients to this global L2 norm (0: off, the default; the "
                        "learning mode's default is inf: the norm measured, nothing clipped)")
    p.add_argument("--mem-budget-gb", type=float, default=None,
                   help="peak mode: a simulated OOM as soon as a rank's live tensor bytes "
                        "exceed this (CPU tracker); on CUDA the real allocator decides")
    p.add_argument("--mem-fraction", type=float, default=None,
                   help="peak mode on CUDA: torch.cuda.set_per_process_memory_fraction, to "
                        "emulate a smaller GPU")
    plants = {**HARNESS_PLANTS, **(plants or {})}
    p.add_argument("--plant-bug", default=None, choices=list(plants), metavar="NAME",
                   help="plant a known bug; correctness mode must FAIL. " + "; ".join(
                       f"{k}: {v.doc}" for k, v in plants.items()))
    p.add_argument("--runs", default=None, metavar="FILE",
                   help="a JSON list of argument lists, run one after another in this one "
                        "process group (start-up paid once); each needs its own --out, where "
                        "its verdict goes to status.json")
    p.add_argument("--plants", default=None,
                   help="--mode plants: comma-separated plants to run after the clean run "
                        "(default: all of this strategy's own)")
    return p


def resolve_defaults(args, mode: str, device: str, world: int = 1) -> argparse.Namespace:
    """A copy of args with the mode-dependent defaults filled in."""
    a = copy.copy(args)
    a.mode = mode
    steps, cpu_dtype = MODE_DEFAULTS[mode]
    if a.steps is None:
        a.steps = steps
    if a.dtype is None:
        a.dtype = cpu_dtype if (device == "cpu" or mode == "correctness") else "bfloat16"
    if a.lr is None:
        a.lr = 1e-3 if mode == "correctness" else 3e-3
    if a.tol_k is None:
        a.tol_k = TOL_K
    if a.clip is None:   # learning compares the norms: every strategy computes it when it clips
        a.clip = math.inf if mode == "learning" else 0.0   # (coefficient min(1, inf) = 1)
    return a


def env_from_os() -> tuple[int, int, int]:
    """(rank, world, local_rank) from torchrun's variables; a plain `python x.py` is world 1."""
    return (int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
            int(os.environ.get("LOCAL_RANK", 0)))


def ranks_per_node(world: int) -> int | None:
    """The launcher's node layout: torchrun's LOCAL_WORLD_SIZE (ranks on this node) when it
    splits `world` into more than one node of equal size, else None (one node, or not
    launched by torchrun). HSDP's replicas and ZeRO++'s node size default to it."""
    n = int(os.environ.get("LOCAL_WORLD_SIZE", 0) or 0)
    return n if 0 < n < world and world % n == 0 and not uneven_nodes(world) else None


def uneven_nodes(world: int) -> str | None:
    """Why the launcher's nodes cannot give a node layout, or None: with nodes of different
    sizes (torchrun --nproc_per_node differing per node) each node would derive other groups
    from its own LOCAL_WORLD_SIZE, and the collectives would not match. Every rank sees
    WORLD_SIZE and the node count GROUP_WORLD_SIZE; a node whose size is not their ratio
    says so (and torchrun stops the others when it exits)."""
    n = int(os.environ.get("LOCAL_WORLD_SIZE", 0) or 0)
    g = int(os.environ.get("GROUP_WORLD_SIZE", 0) or 0)
    if n and g and n * g != world:
        return (f"the launcher's nodes differ in size (this one has {n} ranks, {g} nodes, "
                f"{world} ranks in all)")
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args) -> Env:
    rank, world, local_rank = env_from_os()
    if "RANK" not in os.environ:  # plain python: a group of one, so strategy code is unchanged
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
        # torchrun gives each worker one thread; a plain run may use the whole machine.
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    if (int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0) or 0) > 0 and rank == 0
            and os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") != "1"):
        # the workers share the rendezvous store, where a restarted group finds its previous
        # attempt's addresses and fails to connect (pytorch/pytorch#135712)
        print("warning: torchrun --max-restarts: set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for "
              "the launcher, or a restarted group may fail to connect", flush=True)
    kw = dict(backend=backend, timeout=datetime.timedelta(seconds=args.timeout))
    if backend == "nccl":
        kw["device_id"] = device
    dist.init_process_group(**kw)
    METER.device = device
    return Env(rank, world, local_rank, device, backend)


def teardown(clean: bool = True):
    """Destroy the groups; after a barrier when every rank got here normally, so no rank tears
    down gloo while a peer is still inside a collective. Then collect the cyclic garbage (a
    strategy's hooks refer to it, and it to its subgroups) so that every ProcessGroupGloo is
    destructed, and its worker threads joined, now and not during interpreter shutdown, where
    that can abort the process ("terminate called without an active exception")."""
    if dist.is_initialized():
        if clean:
            with METER.paused():
                dist.barrier()
        dist.destroy_process_group()
    gc.collect()
