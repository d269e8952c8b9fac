"""compose4d's model under torch.distributed.checkpoint, run by tests/test_torch_utils.py under
torchrun (issue: a sharded model keeps PyTorch's own promises, or refuses):

    torchrun --nproc_per_node=2 tests/dcp4d_check.py --mode train --pp 2 --out DIR

A compose4d model (the layout of the arguments) takes two steps; then a user's
`dcp.save(model.state_dict(), ...)`. Where a rank holds shards (tp, ZeRO-3, experts) the call
must refuse in one line before anything is written; elsewhere (replicas over dp x cp, pipeline
stages: each name held whole by the ranks that hold it) the checkpoint must load on one device
(rank 0, no process group: `no_dist`) into a fresh model and equal the trained model's full
tensors (rig/compose4d.py's full_params, the correctness oracle's) exactly.
Writes DIR/dcp.json: {"refused": line} or {"keys_missing", "keys_extra", "max_abs_diff"} or
{"load_error": line}."""
import json
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

from harness import Plant  # noqa: E402
from harness.cli import main  # noqa: E402
from rig.compose4d import Compose4D  # noqa: E402
from trainer4d.train import build  # noqa: E402


def dcp_mode(run, cls) -> bool:
    strat = build(run, cls)
    for step in range(2):
        strat.step(run.batch(step))
    full = strat.full_params()   # (collective) every tensor of the trained model, whole
    if strat.tied:               # (the oracle's one tied tensor; the last stage saves its copy)
        full[strat.pipe.head_weight] = full[strat.pipe.parts.names["embed"] + ".weight"]
    out, path = {}, os.path.join(run.args.out, "ckpt")
    try:
        state = strat.model.state_dict()
    except ValueError as e:      # the refusal: one line, nothing written
        out = {"refused": str(e), "written": os.path.exists(path)}
    else:
        dcp.save(state, checkpoint_id=path)
        dist.barrier()
        if run.env.is_main:
            out = load_alone(run, path, full)
    if run.env.is_main:
        os.makedirs(run.args.out, exist_ok=True)
        with open(os.path.join(run.args.out, "dcp.json"), "w") as f:
            json.dump(out, f)
    return True


def load_alone(run, path: str, full: dict) -> dict:
    """The checkpoint into a fresh unsharded model on this process alone, against `full`."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(1234)   # other weights than the trained ones
    fresh = AutoModelForCausalLM.from_config(run.config).to(full[next(iter(full))].dtype)
    saved = set(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)
    state = {n: t for n, t in fresh.state_dict().items() if n in saved}
    try:
        dcp.load(state, checkpoint_id=path, no_dist=True)
    except BaseException as e:   # (DCP's CheckpointException; a shard saved as the whole
        return {"load_error": str(e).strip().splitlines()[-1][:300]}   # tensor: sizes differ)
    return {"keys_missing": sorted(set(full) - saved), "keys_extra": sorted(saved - set(full)),
            "max_abs_diff": max((state[n].double() - full[n].cpu().double()).abs().max().item()
                                for n in full if n in state)}


class DCPCheck(Compose4D):
    modes = {"train": dcp_mode}   # (the train mode's defaults; this check in its place)
    plants = {**Compose4D.plants, "state-dict-unrefused": Plant(
        "model.state_dict() not refused on plain shards (harness.refuse_state_dict): DCP "
        "saves each rank's part under the whole tensor's name", ("--tp", "2"))}


if __name__ == "__main__":
    main(DCPCheck)
