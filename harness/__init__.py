"""harness: everything that is not a parallelism.

A strategy file (ddp.py, zero.py, ...) holds the algorithm; its test rig (rig/ddp.py, ...) a
small adapter class (`Strategy`, whose contract is below); `main(StrategyClass)` does the
rest: launches the process group, builds the single-device reference, generates the data, and
runs the modes against the reference. Nothing here knows how any strategy splits the work, and
nothing here imports a strategy file (tests/test_layout.py checks it).

The package, one concern per module (a strategy imports its names from here, the package):

    strategy.py     the adapter contract (`Strategy`), the single-device `Reference`, `Plant`,
                    and the helpers adapters share (make_adamw, spread_across_ranks, ...)
    collectives.py  all_reduce_flat, clip_by_norm, local_part: the helpers strategy files call
    plants.py       `planted(NAME)`: the switch for a planted bug, set by the harness for a run
    models.py       presets (tiny-<family>: one small model per HF decoder family), HF configs
                    and checkpoint directories, the reference model; --attn auto; float64 kept
                    inside norms and attention (Float64Kept); the masks and soft-capping a
                    model's forward applies around its layers, for pp and compose4d
    data.py         the synthetic Markov language (exact loss floor), `Batch`, ignored labels
    loss.py         the loss normalisation: CE sum over a rank's tokens / global token count
    precision.py    the mixed-precision policy: fp32 master weights (`make_adamw`)
    loss_scale.py   float16's dynamic loss scale (found_inf agreed over the ranks) and its
                    measurement against bfloat16 (`python -m harness.loss_scale`)
    meter.py        `phase("forward")` marks; the communication meter (`METER`, `Expect`,
                    `name_group`) that counts every torch.distributed call by op and group
    memory.py       the live-storage tracker (CPU and CUDA), steady-state peak, simulated OOM
    timing.py       timed steps (CUDA events on GPU), ranks aligned, max over ranks; ActionTimeline
    compare.py      the verdicts: each error judged against measured single-device noise
    spread.py       each gradient's rounding floor, sqrt(K) u sum |terms|, from the target's
                    own sums (Higham & Mary's probabilistic bound): the verdict's noise floor
    oracle.py       the references' optimizers (OracleAdamW; OracleMuon: torch.optim.Muon
                    itself), sharing no code with the strategies'
    run.py          one run of one mode: arguments, group, config, language; the reference /
                    strategy pair from one set of weights
    correctness.py  modes `correctness` and `plants`
    learning.py     mode `learning`
    benchmark.py    modes `benchmark` and `peak`
    report.py       --out files and plots
    launch.py       command line, per-mode defaults, process group, one-line config errors
    cli.py          `main`: validate, launch once, run each (dtype, mode) of each run
    nccl.py         `--nccl-semantics`: every p2p batch and collective recorded with its waits
                    and checked under NCCL's rules (harness/nccl.py's docstring)
    recompute.py    `--recompute none|full|selective`: one helper for every strategy, with its
                    per-layer formula and measurement (`python -m harness.recompute`); the
                    package exports MODES, apply_recompute, activation_bytes, measure (loaded on
                    first use); run.make_pair applies it after the strategy is built
    corpus.py       real text (`--data`): read, tokenize into a cache, whole-document held-out
                    split, packing, sample i a pure function of (seed, i)
    train_data.py   the train mode's data arguments, batches, held-out evaluation, greedy samples
    loading.py      each rank reads only its shard of a safetensors checkpoint (meta device)
    trainlog.py     the train mode's train.jsonl, TensorBoard events and loss.png
    timeline.py     a pipeline's per-rank action timelines: the measured bubble, ASCII and PNG
    routing.py      ep_moe's routing statistics (loads, drops, off-rank rows), observed from
                    outside the algorithm, and HF's router losses as the dropless oracle
    reduce_probe.py DDP's reduction error in a low --reduce-dtype, measured from outside the
                    engine (an unmetered float64 sum beside each bucket's reduction)

The contract: what a strategy's adapter (rig/<file>.py, a subclass of `Strategy`) supplies
------------------------------------------------------------------------------------------------
Required, three things:
    __init__(ref_model, args, env)
                              build: the local (sharded) model and optimizer *from the full
                              reference weights* (never from a fresh random init), so both start
                              bit-identical. `ref_model` is this rank's private copy: slice it,
                              wrap it, or keep it.
    step(batch) -> float      forward, backward and optimizer step on this rank's share of the
                              global batch (`Batch`, the same object on every rank). Returns the
                              global loss with the reference's normalisation: the mean over all
                              target tokens of the global batch (`batch.n_tokens`), whatever the
                              split. Use `lm_loss_sum` and `global_loss`. Gradients of the last
                              step must stay readable until the next step (zero them at the start).
    full_grads(), full_params() -> dict[str, Tensor]
                              the full tensors keyed by the reference's parameter names
                              (collective: every rank calls; rank 0's result is compared). The
                              defaults read self.model's own parameters (a replicated model).

Optional, by what it serves (class attributes and methods; the defaults do nothing):
  the command line and its refusals
    name                      short name used in reports ("ddp")
    add_args(parser)          staticmethod: the strategy's own flags
    constraints(args, world, config) -> list[str]
                              staticmethod: each string names one violated constraint. Checked on
                              every rank before the process group exists; rank 0 prints the first
                              one as a single line and every rank exits with code 2.
    optimizers, muon_modes    the --optimizer and --muon-mode values it takes (default adamw
                              only; muon.py's under ddp, zero, fsdp, tp, sp, pp, cp, ep,
                              compose4d)
    modes, cpu_dtype, chunked_ce
                              extra --mode values ({name: function(run, cls) -> bool}: compose4d's
                              "train"); a CPU default dtype per mode where MODE_DEFAULTS' does not
                              suit; whether --ce-chunk is taken
  the correctness verdict
    syncs_initial_params      True if the strategy claims to make replicas identical itself (DDP
                              broadcasts from rank 0): ranks != 0 then get a *perturbed* copy of
                              the weights, so a missing sync fails.
    grad_norm                 set by step() when --clip is on: the pre-clip global gradient norm
                              (float or 0-d tensor); gradients are compared before clipping, the
                              norm on its own row.
    extra_checks() -> list[(name, ok, detail)]
                              strategy-specific checks (collective; rank 0's verdict); each must
                              be able to fail.
    plants                    {NAME: Plant(doc, args, world)}: the bugs the strategy can plant in
                              itself and the configuration in which correctness must FAIL
                              (tests/test_plants.py); the code tests `planted(NAME)` on the line
                              the bug changes (harness/plants.py): no API takes a plant.
    reference                 the single-device reference class (default `Reference`: plain HF
                              model + AdamW), for an objective with more terms (ep_moe's router
                              losses).
    lossy_noise(run)          classmethod: for a strategy that rounds on purpose (zeropp's int8),
                              a single-device model of that rounding, one more noise sample.
    self_check                ("what", build(model, args) -> fn(ids) -> logits): a rebuilt forward
                              proven equal to the model's own (harness/selfcheck.py).
  the benchmark
    expected_comm() -> list[Expect]
                              the per-step communication from the learner file's formulas,
                              printed beside the metered figures; a difference fails.
    model_states() -> dict[str, list[Tensor]], memory_formula()
                              the resident tensors by category (params, grads, optimizer; the
                              default reads self.model and self.optimizer) and their formula.
    native                    PyTorch's own implementation as a Strategy subclass (or a list, or
                              a staticmethod of the args returning one), for --compare-native.
    wait_comm()               finish the communication step() leaves in flight (ZeRO's parameter
                              all-gathers for the next forward), before a profiled step ends
    report_lines(), learning_lines()
                              extra lines after a benchmark (self.bench holds its timings) or a
                              learning run (collective).

Modes (`--mode correctness|learning|benchmark|all|plants|peak`): see correctness.py,
learning.py and benchmark.py. `--out DIR` writes correctness.json, learning.csv (+ .png with
matplotlib), benchmark.json.
"""
from .benchmark import run_benchmark, run_peak, bench_strategy  # noqa: F401
from .cli import RUN_MARK, main  # noqa: F401
from .compare import (TOL_K, Comparison, NoisePolicy, clip_coef, preclip_grads,  # noqa: F401
                      role)
from .correctness import run_correctness, run_plants  # noqa: F401
from .data import PAD_ID, Batch, MarkovLanguage, ignore_spans, make_batch  # noqa: F401
from .launch import (base_parser, fail_config, launch, ranks_per_node, uneven_nodes,  # noqa: F401
                     resolve_defaults, teardown)
from .learning import run_learning  # noqa: F401
from .loss import IGNORE_INDEX, global_loss, lm_loss_sum, scalar  # noqa: F401
from .memory import OOM_EXIT, MemoryTracker, SimulatedOOM, steady_peak  # noqa: F401
from .meter import METER, CommMeter, Expect, group_name, name_group, phase  # noqa: F401
from .models import (DTYPES, PRESETS, ConfigError, attention_features, attention_masks,  # noqa: F401
                     document_masks,
                     attention_of, kv_heads, parts,
                     build_model,
                     common_constraints, soft_cap, resolve_attn,
                     has_weights, is_moe, load_config, model_kwargs, param_count, keep_float64)
from .plants import planted, planting  # noqa: F401
from .precision import MasterAdamW  # noqa: F401
from .run import Env, Run  # noqa: F401
from .collectives import (all_reduce_flat, clip_by_norm, like, local_part,  # noqa: F401
                          refuse_state_dict)
from .strategy import (HARNESS_PLANTS, DTensorBaseline, Plant, Reference,  # noqa: F401
                       Strategy, full_tensor, make_adamw, spread_across_ranks)

# recompute.py's names load on first use (PEP 562), so that `python -m harness.recompute` does not
# find its own module imported by the package already (runpy's RuntimeWarning)
_RECOMPUTE = ("MODES", "apply_recompute", "activation_bytes", "measure", "recompute_what")


def __getattr__(name):
    if name in _RECOMPUTE:
        from . import recompute
        return getattr(recompute, name)
    raise AttributeError(f"module 'harness' has no attribute {name!r}")
