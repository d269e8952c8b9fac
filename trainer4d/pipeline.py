"""pipeline.py: what the trainer adds to pp.Pipeline, outside the learner file: the mid-step
preemption cut (`--preempt-at micro-batch`) and the held-out loss (forwards only).

Cut(pipe, M, stop) is the schedule row pp.Pipeline.run walks (its `steps`), cut short when the
ranks agree to stop: `cut = Cut(pipe, M, stop); pipe.run(batch, M, steps=cut)`; afterwards
`cut.completed` says how many micro-batches ran to the end. evaluate(pipe, batch, M) is the
held-out CE sum through the same chunks."""
import torch
import torch.distributed as dist

from harness import Batch


class Cut:
    """This rank's row of the pipeline's grid, (action, sends, receives) per step, with the
    preemption point: at the grid step where micro-batch m's first forward runs
    (Grid.first_forward), before that step's action and batch, every rank asks `stop(m)`. That
    step is a consistent cut: every message of an earlier step is posted on both of its ranks
    and nothing of micro-batches >= m is, so an agreement inside stop (a collective) hears from
    every rank and cannot deadlock under NCCL's rules. After a yes, the row keeps only what
    belongs to micro-batches < m (their actions and messages), so run() drains them. Never
    before micro-batch 0, so a step always makes progress. Its price: the agreement is a
    global barrier and a host read before every micro-batch, so no stage runs ahead (a larger
    bubble); train.py asks it only under --preempt-at micro-batch."""

    def __init__(self, pipe, M: int, stop):
        self.grid, self.rank, self.stop, self.M = pipe.grid(M), pipe.rank, stop, M
        self.completed = M       # micro-batches run to the end (set when the row is walked)

    def __iter__(self):
        starts = {t: m for m, t in self.grid.first_forward.items()}
        stop_at = None
        for t, (action, keys_out, keys_in) in enumerate(self.grid.steps[self.rank]):
            if stop_at is None and starts.get(t, 0) > 0 and self.stop(starts[t]):
                stop_at = starts[t]   # at the cut: nothing of micro-batches >= stop_at posted
            if stop_at is not None:
                action = action if action is not None and action[2] < stop_at else None
                keys_out = [k for k in keys_out if k[2] < stop_at]
                keys_in = [k for k in keys_in if k[2] < stop_at]
            yield action, keys_out, keys_in
        self.completed = self.M if stop_at is None else stop_at


@torch.no_grad()
def evaluate(pipe, batch: Batch, M: int, docs=None) -> torch.Tensor:
    """Forward only (held-out loss): this rank's chunks on each of M micro-batches, no graph
    kept. Returns the CE sum of the micro-batches whose loss this rank computed (float64).
    Every rank walks micro-batch m's chunks 0..C-1 in order, taking chunk c's input from
    chunk c-1's rank and handing its output to chunk c+1's: a chain, so each pair of ranks
    posts its sends and receives in the same order and nothing waits in a cycle (NCCL
    matches them in issue order; no tags are needed). docs: as Pipeline.run's (ring attention's
    packed documents)."""
    pipe.docs, pipe.ring_blocks = docs, {}
    mbs = batch.split(M)                    # (B, S) -> M micro-batches, each (B/M, S)
    B, S = mbs[0].input_ids.shape           # a micro-batch's: B is its rows from here on
    shape = (B, S // pipe.seq_shards, pipe.model.config.hidden_size)   # (B, S/T, H)
    dtype = next(pipe.model.parameters()).dtype
    device = batch.input_ids.device
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    for m, mb in enumerate(mbs):
        pipe.documents(m, mb)
        for c in pipe.my_chunks:
            if c == 0:
                x = mb.input_ids
            elif pipe.owner(c - 1) == pipe.rank:     # the V's turn: out of chunk c - 1
                x = out
            else:
                x = torch.empty(shape, dtype=dtype, device=device)   # (B, S/T, H)
                for w in dist.batch_isend_irecv([dist.P2POp(
                        dist.irecv, x, group=pipe.group, group_peer=pipe.owner(c - 1))]):
                    w.wait()
            out = pipe.run_chunk(c, x, S, mb.doc_positions)
            if c < pipe.n_chunks - 1 and pipe.owner(c + 1) != pipe.rank:   # out (B, S/T, H)
                for w in dist.batch_isend_irecv([dist.P2POp(
                        dist.isend, out.contiguous(), group=pipe.group,
                        group_peer=pipe.owner(c + 1))]):
                    w.wait()
            else:
                loss_sum += pipe.loss_sum(out, mb.labels).double()
    return loss_sum
