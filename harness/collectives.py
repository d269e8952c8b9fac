"""collectives.py: the two small collective helpers a strategy file calls (a flattened all-reduce,
clipping by a global norm without a host read). The algorithm's own collectives stay raw
torch.distributed calls in the strategy files."""
import torch
import torch.distributed as dist


def local_part(t):
    """A DTensor's local part (its storage; fsdp.py's shards are DTensors); any other tensor
    (or None) as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


def like(param, t):
    """t (a plain tensor, this rank's part) labelled as `param` is: a DTensor of the same
    placements when param is one (tp.py's and fsdp.py's parameters), else t itself."""
    if not hasattr(param, "to_local"):
        return t
    from torch.distributed.tensor import DTensor
    return DTensor.from_local(t, param.device_mesh, param.placements, shape=param.shape,
                              stride=param.stride(), run_check=False)


def refuse_state_dict(model, line: str):
    """model.state_dict() raises ValueError(line), before anything reads or writes a tensor:
    for a model that holds plain shards (this rank's rows, experts or freed storage under the
    whole tensor's name), which torch.distributed.checkpoint takes as replicated and would save
    as the whole tensor. Called again, the newest line is the one raised (compose4d's over the
    tp and zero it is built from)."""
    from .plants import planted
    if planted("state-dict-unrefused"):   # plant: the plain shards saved as if whole
        return
    if not hasattr(model, "_state_dict_refused"):
        model.register_state_dict_post_hook(_refuse)
    model._state_dict_refused = line


def _refuse(module, state_dict, prefix, local_metadata):
    raise ValueError(module._state_dict_refused)


def all_reduce_flat(tensors: list[torch.Tensor], group=None):
    """Sum `tensors` over the group in place with one all_reduce of their concatenation
    (many small gradients: one call instead of one each)."""
    if not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    off = 0
    for t in tensors:
        t.copy_(flat[off:off + t.numel()].view_as(t))
        off += t.numel()


def clip_by_norm(sq: torch.Tensor, grads, max_norm: float) -> torch.Tensor:
    """Global-norm clipping without a host read: `sq` is the reduced squared global norm (a
    device scalar); every gradient in `grads` is scaled by torch.nn.utils.clip_grad_norm_'s
    coefficient min(1, max_norm / (norm + 1e-6)), computed and applied on the device (a
    coefficient of 1 multiplies by one, as torch does), so the step need not wait for the norm.
    max_norm <= 0: no clipping. Returns the norm, a 0-d tensor (read it when logging)."""
    norm = sq.sqrt().reshape(())
    if max_norm > 0:
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))
    return norm
