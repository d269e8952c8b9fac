"""pp.py: pipeline parallelism (GPipe, 1F1B, interleaved 1F1B, ZB-H1, DualPipeV) from raw p2p.

The idea
    Cut the model into stages, one per rank (P ranks), and the batch into M micro-batches.
    Activations flow forward from stage to stage and gradients flow back, so the pipeline fills
    and drains; the idle share is the bubble. The schedules (GPipe, 1F1B, interleaved, ZB-H1,
    DualPipeV), their bubbles and memory are data in pp_schedule.py (its docstring's table).
    One worked: 1F1B, P = 2, M = 4, on the lockstep grid (pp_schedule.Grid; . is idle):
        rank 0   F0 F1 .  B0 F2 B1 F3 B2 .  B3       warm-up P-1-r = 1 extra forward, then
        rank 1   .  F0 B0 F1 B1 F2 B2 F3 B3 .        one forward, one backward; cool-down
    (the grid orders the actions and their messages, not time: a B costs about two F's)
    This file is the executor: it cuts an HF model into P*V chunks (pp_schedule.split_layers),
    runs any schedule's actions over raw point-to-point, splits the backward for ZB-H1 and
    DualPipeV (I: the input's gradient now; W: grad_W += g^T x per linear, later) and sums the
    tied embeddings' gradient. Loss: each micro-batch's CE sum / N (the global token count).
    Who talks to whom: a chunk's rank sends its activation to the next chunk's rank and its
    gradient to the previous one's, on a lockstep grid (pp_schedule.Grid): one action per rank
    per step, then one batch_isend_irecv (NCCL's rules: harness/nccl.py).

Communication per step (mb = B/M sequences, S length, H hidden, b bytes): every chunk boundary
    between two ranks (P*V - 1 of them; DualPipeV 2P - 2) carries M activations forward and M
    gradients back, each mb*S*H*b, plus one all_reduce of the tied embedding gradient when tied
    and the ends are on two ranks. More: docs/internals.md, 'pp.py'.

Public API
    pipe = Pipeline(model, P, V, rank, schedule, group=None, tie_group=None): this rank's
        chunks of an HF decoder; pipe.run(batch, M, n_tokens) one step's forwards and
        backwards, pipe.sync_tied() the tied gradient (the trainer's held-out loss and
        mid-step preemption: trainer4d/pipeline.py)
    clip_across_stages(model, max_norm, pipe); pp.X re-exports pp_schedule's planning names.

Run:  torchrun --nproc_per_node=2 pp.py --mode correctness --schedule 1f1b   (learning, plants)
"""
import torch
import torch.distributed as dist
import torch.nn as nn

from harness import (Batch, attention_masks, clip_by_norm, document_masks, lm_loss_sum, parts,
                     phase, planted)
from harness.models import embed_output, head_output, rotary_by_type, set_part
from harness import dropout
# the pure plan (re-exported: pp.schedule, pp.simulate, pp.Grid, ... keep working)
from pp_schedule import (COST, SCHEDULES, Grid, bubble_formula, chunk_owner,  # noqa: F401
                         chunks_per_rank, messages, schedule, simulate, split_layers)


# ----------------------------------------------------------------------------------------------
# The split backward: I computes the input gradient now, W the weight gradients later
# ----------------------------------------------------------------------------------------------
class WeightGradStore:
    """The deferred weight gradients of a stage's linear layers (the split backward). While
    `key` is set (during an I action of (chunk, micro-batch) `key`), a DeferredLinear's backward
    computes only its input's gradient and appends (module, input, output gradient) to
    pending[key]; flush(key) (the W action) computes every stashed weight's gradient."""

    def __init__(self):
        self.key = None
        self.pending: dict = {}

    @torch.no_grad()     # (with grad mode on, g^T x would record a graph that keeps every x
    def flush(self, key):  # and g alive through the weight's .grad)
        for module, x, g in self.pending.pop(key, ()):   # x (B, S, in), g (B, S, out)
            # (B, S, out) -> (B*S, out), (B, S, in) -> (B*S, in); B: micro-batch rows
            g2, x2 = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
            w = module.weight                  # [out, in]
            if w.grad is None:
                w.grad = g2.t() @ x2
            else:                      # accumulated in place: no weight-sized temporary
                w.grad.addmm_(g2.t(), x2)
            if module.bias is not None:
                gb = g2.sum(0)
                module.bias.grad = gb if module.bias.grad is None else module.bias.grad.add_(gb)


class DeferredLinear(torch.autograd.Function):
    """y = x W^T + b whose backward, while the store is deferring (an I action), returns only
    dL/dx and leaves dL/dW = g^T x for the W action; otherwise the ordinary linear backward."""

    @staticmethod
    def forward(ctx, x, weight, bias, module, store):   # x (B, S, in), [out, in] -> (B, S, out)
        ctx.save_for_backward(x, weight)
        ctx.module, ctx.store, ctx.has_bias = module, store, bias is not None
        return torch.nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, g):         # g (B, S, out) -> dx (B, S, in), dW [out, in], db [out]
        x, weight = ctx.saved_tensors
        dx = g @ weight if ctx.needs_input_grad[0] else None
        if ctx.store.key is not None:         # I: the weight's gradient waits for W
            ctx.store.pending.setdefault(ctx.store.key, []).append((ctx.module, x, g))
            return dx, None, None, None, None
        g2 = g.reshape(-1, g.shape[-1])                   # (B, S, out) -> (B*S, out)
        dw = g2.t() @ x.reshape(-1, x.shape[-1])          # x (B, S, in) -> (B*S, in); [out, in]
        db = g2.sum(0) if ctx.has_bias else None
        return dx, dw, db, None, None


def defer_linears(modules, store: WeightGradStore) -> list:
    """Route every nn.Linear under `modules` through DeferredLinear; returns the linears."""
    linears = [m for mod in modules for m in mod.modules() if isinstance(m, nn.Linear)]
    for lin in linears:
        lin.forward = (lambda x, lin=lin: DeferredLinear.apply(x, lin.weight, lin.bias, lin,
                                                               store))
    return linears


# ----------------------------------------------------------------------------------------------
# The pipeline: this rank's chunks and the executor
# ----------------------------------------------------------------------------------------------
class Pipeline:
    """This rank's chunks of `model` and the executor of its schedule. `group` is the pipeline
    group (None: the world; ranks are group ranks); `tie_group` the two-rank group of the first
    and last stage when the embeddings are tied (created by the caller, on every rank, in the
    same order). A composition (compose4d.py) passes `positions` (the global position ids of
    this rank's tokens, for context parallelism), `seq_shards` (the residual stream is split
    that many ways along the sequence, for Megatron SP), `hidden_columns` (which of a
    micro-batch's columns that residual stream holds on this rank, for dropout.py's masks) and
    `loss_sum` (the vocab-parallel loss; default harness.lm_loss_sum).
    `forward` and `backward` do an action's compute and nothing else (run() receives and sends
    around them), so a caller may wrap them: the benchmark times them that way (PP below)."""

    def __init__(self, model, P: int, V: int, rank: int, schedule_name: str, group=None,
                 tie_group=None, split_backward: bool | None = None, *, positions=None,
                 seq_shards: int = 1, hidden_columns: slice | None = None, loss_sum=None,
                 ring=None):
        V = chunks_per_rank(schedule_name, V)
        self.model, self.rank, self.group = model, rank, group
        self.stages, self.virtual_stages = P, V     # P stages, V chunks per rank
        self.schedule_name, self.n_chunks = schedule_name, P * V
        self.positions, self.seq_shards = positions, seq_shards
        self.hidden_columns, self.loss_sum = hidden_columns, loss_sum or lm_loss_sum
        self.ring, self.docs, self.ring_blocks = ring, None, {}   # (compose4d's cp: documents)
        self._grids = {}         # M -> Grid
        # the model's parts, found by HF's accessors (any causal LM's names: harness.parts)
        self.parts = p = parts(model)
        self.layers = p.layers
        n_layer = [sum(t.numel() for t in layer.parameters()) for layer in p.layers]
        emb = sum(t.numel() for t in p.embed.parameters())
        head = (sum(t.numel() for t in p.norm.parameters()) if p.norm is not None else 0) \
            + p.head.weight.numel()
        self.chunk_layers = split_layers([float(x) for x in n_layer], emb, head, self.n_chunks)
        self.costs = [sum(n_layer[i] for i in b) + (emb if c == 0 else 0)
                      + (head if c == self.n_chunks - 1 else 0)
                      for c, b in enumerate(self.chunk_layers)]
        self.my_chunks = [c for c in range(self.n_chunks) if self.owner(c) == rank]
        keep = {i for c in self.my_chunks for i in self.chunk_layers[c]}
        self.tied = p.tied
        self.head_weight = p.names["head"] + ".weight"   # (its name: the tied copy's)
        first, last = 0 in self.my_chunks, self.n_chunks - 1 in self.my_chunks
        if self.tied and last and not first:
            p.head.weight = nn.Parameter(p.embed.weight.detach().clone(),   # (frozen under
                                         requires_grad=p.embed.weight.requires_grad)   # LoRA)
        for i in range(len(p.layers)):  # drop what this rank does not run
            if i not in keep:
                p.layers[i] = nn.Identity()
        if not first:
            set_part(model, p.names["embed"], None)
            p.embed = None
        if not last:
            for part in ("norm", "head"):
                if getattr(p, part) is not None:
                    set_part(model, p.names[part], None)
                    setattr(p, part, None)
        self.tie_group = (tie_group if self.tied and self.owner(0) != self.owner(self.n_chunks - 1)
                          else None)
        self.wgrad = WeightGradStore()     # the split backward: W's stashed pairs
        self.split = (schedule_name in ("zb", "dualpipev") if split_backward is None
                      else split_backward)   # (False: the cut only, torch's pipelining runs it)
        self.small_params = {}
        if self.split:
            for c in self.my_chunks:
                linears = defer_linears(self.modules_of(c), self.wgrad)
                deferred = {id(lin.weight) for lin in linears}
                self.small_params[c] = [p for p in self.params_of(c) if id(p) not in deferred]

    def owner(self, c: int) -> int:
        """The (group) rank that holds chunk c."""
        return chunk_owner(self.schedule_name, c, self.stages)

    # -- the model, cut into chunks --
    def run_chunk(self, c, x, S, docs=None):
        """Chunk c's share of the model's own forward: x (B, S) token ids on the first chunk,
        else (B, S, H) hidden states -> (B, S, H), or (B, S, V) logits on the last (B: the
        micro-batch's rows; S/T under Megatron SP, T = seq_shards). docs (B, S): packed
        documents' position ids (--doc-mask), their masks HF's own (document_masks). Around
        the layers it does what the family's forward does (harness.models: the embedding's
        multiplier, a rotary pair per layer type, the final norm, the logits' scale and cap);
        selfcheck.py proves it on the run's model before training."""
        p, config = self.parts, self.model.config
        pos = (torch.arange(S, device=x.device) if self.positions is None
               else self.positions)[None] if docs is None else docs           # (1 or B, S)
        h = embed_output(p, x) if c == 0 else x                               # (B, S, H)
        types = getattr(config, "layer_types", None)
        cos_sin = rotary_by_type(p, h, pos, types)      # {type: ((1 or B, S, d), ...)}
        masks = (None if self.positions is not None    # (context parallel: its own attention)
                 else attention_masks(config, S, h.dtype, h.device) if docs is None
                 else document_masks(config, h.new_empty(h.shape[0], docs.shape[1], 1), docs))
        # (the masks span the whole sequence: under SP, h holds 1/T of it, attention all of it)
        if planted("doc-mask-causal-only"):   # plant: packed documents attend across
            masks = attention_masks(config, S, h.dtype, h.device)
        for i in self.chunk_layers[c]:
            kind = types[i] if types else "full_attention"
            h = p.layers[i](h, attention_mask=masks and masks[kind], position_ids=pos,
                            position_embeddings=cos_sin.get(kind))
        if c == self.n_chunks - 1:
            if p.norm is not None:
                if not planted("pp-skips-final-norm"):   # plant: the final norm skipped
                    h = p.norm(h)
            h = head_output(p.head(h), config)                                # (B, S, V)
        return h

    def modules_of(self, c):
        p = self.parts
        mods = [p.layers[i] for i in self.chunk_layers[c]]
        if c == 0:
            mods.append(p.embed)
        if c == self.n_chunks - 1:
            mods += [m for m in (p.norm, p.head) if m is not None]
        return mods

    def params_of(self, c):
        return [p for m in self.modules_of(c) for p in m.parameters()]

    # -- point-to-point --
    def _post(self, sends: dict, keys_out: list, keys_in: list, shape, dtype, received: dict):
        """One step's batch: the sends `keys_out` (tensors from `sends`) and the receives
        `keys_in`, in one batch_isend_irecv. Tags name (destination chunk, micro-batch,
        direction) for gloo; NCCL ignores them, and the grid does not need them."""
        ops, bufs = [], []        # every tensor (B, S/T, H): an activation or its gradient
        for src, dst, m, bwd in keys_out:
            ops.append(dist.P2POp(dist.isend, sends.pop((src, dst, m, bwd)), group=self.group,
                                  group_peer=self.owner(dst),
                                  tag=(m * self.n_chunks + dst) * 2 + bwd))
        for src, dst, m, bwd in keys_in:
            buf = torch.empty(shape, dtype=dtype, device=self.device)   # (B, S/T, H)
            ops.append(dist.P2POp(dist.irecv, buf, group=self.group, group_peer=self.owner(src),
                                  tag=(m * self.n_chunks + dst) * 2 + bwd))
            bufs.append(((src, dst, m, bwd), buf))
        if not ops:
            return
        if planted("split-batches"):   # plant: each op alone, sends first (gloo runs it)
            works = [w for op in ops for w in dist.batch_isend_irecv([op])]   # (B, S/T, H) each
        else:
            works = list(dist.batch_isend_irecv(ops))     # each op (B, S/T, H)
        self.batches = [b for b in self.batches if b[0]]   # drop the batches already waited
        # the sent tensors stay alive until their batch is waited (receive buffers live in
        # `received` until used, then with the stashed inputs until their backward)
        self.batches.append((works, [op.tensor for op in ops[:len(keys_out)]]))
        for key, buf in bufs:
            received[key] = (buf, works)

    @staticmethod
    def _wait(works: list):
        """Wait a batch once (a gloo receive waited twice waits for another message)."""
        while works:
            works.pop().wait()

    def _take(self, received: dict, key) -> torch.Tensor:
        """A received tensor, once its batch is done (waited just before it is used)."""
        buf, works = received.pop(key)
        self._wait(works)
        return buf

    # -- each action's work: compute only (run() receives before and sends after) --
    def forward(self, c, m, x, mbs, n_tokens):
        """F: chunk c on micro-batch m's input x (token ids on chunk 0, else the received
        activations). The last chunk returns the loss the micro-batch backpropagates, its CE
        sum / n_tokens (so the sum over micro-batches is the global mean), and the CE sum to
        report; the other chunks return their output activations and None."""
        self.documents(m, mbs[m])
        with dropout.at(mbs[m], hidden=self.hidden_columns):
            out = self.run_chunk(c, x, mbs[m].input_ids.shape[1], mbs[m].doc_positions)
        if c < self.n_chunks - 1:
            return out, None
        ce = self.loss_sum(out, mbs[m].labels)
        loss = ce / n_tokens
        if planted("microbatch-scale"):   # plant: torch-style 1/M on top
            loss = ce / n_tokens / len(mbs)
        if planted("mean-of-means"):      # plant: each micro-batch's own mean
            loss = ce / mbs[m].n_tokens / len(mbs)
        return loss, ce.detach().double()

    def documents(self, m, mb=None):
        """Ring attention (`ring`: compose4d's cp_ring context) under packed documents: micro-
        batch m's block masks, made from its rows' whole-sequence positions (`docs`, the global
        batch's, by row id) before its first forward (mb given), put back before its other
        chunks' forwards and its backwards (another micro-batch's forward may have run between,
        and its masks are others'). They are kept for the step (M of them: a bound to lift
        when S grows, by dropping each after its last backward)."""
        if self.ring is None:
            return
        if mb is not None and m not in self.ring_blocks:   # (once per micro-batch, not chunk)
            from cp_ring import set_documents
            set_documents(self.ring, None if self.docs is None else self.docs[mb.row_ids()])
            self.ring_blocks[m] = self.ring.blocks
        self.ring.blocks = self.ring_blocks[m]

    def backward(self, kind, c, m, x, out, g):
        """B, I or W of chunk c for micro-batch m, from its stashed input x and output out and
        the output's gradient g (None on the last chunk, where out is the loss). B: the whole
        backward; I: one backward pass for the input's gradient and the small parameters'
        (norms, embeddings), the linear layers stashing their (input, output gradient) pairs;
        W: the linear layers' weight gradients from those pairs (x, out, g unused). Returns the
        input's gradient, for chunk c - 1 (B and I, c > 0), else None."""
        if not planted("ring-docs-not-restored"):   # plant: the last forward's masks kept
            self.documents(m)
        if kind == "B":
            torch.autograd.backward(out, g)
        elif kind == "I":
            self.wgrad.key = self._last_i = (c, m)    # (_last_i: for the w-stale-grad plant)
            try:
                torch.autograd.backward(out, g, inputs=([x] if c > 0 else [])
                                        + self.small_params[c])
            finally:
                self.wgrad.key = None
        elif kind == "W":
            self.wgrad.flush(self._last_i if planted("w-stale-grad") else (c, m))  # plant: stale
        return x.grad if kind in ("B", "I") and c > 0 else None

    # -- one optimizer step's worth of micro-batches --
    def grid(self, M: int) -> Grid:
        """The schedule's lockstep grid for M micro-batches (built once per M)."""
        if M not in self._grids:
            self._grids[M] = Grid(self.schedule_name, self.stages, M, self.virtual_stages)
        return self._grids[M]

    def run(self, batch: Batch, M: int, n_tokens: int | None = None,
            mbs: list | None = None, steps=None, docs=None) -> torch.Tensor:
        """This rank's part of one optimizer step over `batch` in M micro-batches (or the given
        list `mbs`, whose sizes may differ when P = 1); each micro-batch backpropagates its CE
        sum / n_tokens (default: the batch's own count). Returns the CE sum of the micro-batches
        this rank computed the loss of (float64). The schedule loop walks this rank's row of the
        grid (Grid): at each step the step's action (its input taken from a posted receive),
        then the step's batch of sends and receives. `steps`: that row as the caller edits it
        (default grid(M).steps[rank]; the trainer's preemption cuts it short:
        trainer4d/pipeline.py). docs: the global batch's (B, S) document positions, for `ring`."""
        n_tokens = n_tokens or batch.n_tokens
        self.docs, self.ring_blocks = docs, {}
        mbs = mbs or batch.split(M)             # (B, S) -> M micro-batches, each (B/M, S)
        M = len(mbs)
        B, S = mbs[0].input_ids.shape           # a micro-batch's: B is its rows from here on
        shape = (B, S // self.seq_shards, self.model.config.hidden_size)  # (B, S/T, H) on the wire
        dtype = next(self.model.parameters()).dtype
        self.device = batch.input_ids.device
        self.batches = []
        self.wgrad.pending.clear()             # (a stopped step's I's whose W never ran)
        received, sends = {}, {}               # message key -> tensor
        inputs, outputs, grads = {}, {}, {}    # per (chunk, micro-batch), until its B or W
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for action, keys_out, keys_in in (steps or self.grid(M).steps[self.rank]):
            if action is not None:
                kind, c, m = action
                recv_key, send_key = messages(kind, c, m, self.n_chunks)
                if kind == "F":
                    with phase("forward"):
                        x = (mbs[m].input_ids if recv_key is None else
                             self._take(received, recv_key).requires_grad_())
                        out, ce = self.forward(c, m, x, mbs, n_tokens)
                        if send_key:
                            sends[send_key] = out.detach().contiguous()   # (B, S/T, H)
                        else:
                            loss_sum += ce
                        inputs[(c, m)], outputs[(c, m)] = x, out
                else:
                    with phase("backward"):
                        if kind in ("B", "I"):
                            g = None if recv_key is None else self._take(received, recv_key)
                            grads[(c, m)] = g
                        else:
                            g = grads[(c, m)]
                        dx = self.backward(kind, c, m, inputs[(c, m)], outputs[(c, m)], g)
                        if send_key:
                            sends[send_key] = dx.contiguous()   # (B, S/T, H)
                        if kind in ("B", "W"):
                            del inputs[(c, m)], outputs[(c, m)], grads[(c, m)]
                if send_key and self.owner(send_key[1]) == self.rank:
                    # the V's turn (DualPipeV): the next chunk is this rank's, no message
                    t_out = sends.pop(send_key)
                    if planted("v-turn-zero-grad"):   # plant: the gradient dropped
                        t_out = torch.zeros_like(t_out) if send_key[3] else t_out
                    received[send_key] = (t_out, [])
            self._post(sends, keys_out, keys_in, shape, dtype, received)
        for works, _ in self.batches:
            self._wait(works)
        self.batches = []
        return loss_sum

    def tie_trains(self) -> bool:
        """This rank holds an end of a tied pair whose gradient is summed over tie_group: the
        first stage's embedding or the last stage's head copy, trainable (--lora freezes it)."""
        first, last = 0 in self.my_chunks, self.n_chunks - 1 in self.my_chunks
        if self.tie_group is None or not (first or last):
            return False
        return (self.parts.embed if first else self.parts.head).weight.requires_grad

    def sync_tied(self):
        """The first stage's embedding and the last stage's head are one tied tensor."""
        if self.tie_trains():
            w = self.parts.embed.weight if 0 in self.my_chunks else self.parts.head.weight
            dist.all_reduce(w.grad, group=self.tie_group)   # [V, H]: the tied embedding's gradient


def clip_across_stages(model, max_norm, pipe):
    """Global-norm clipping: every stage's squared norm summed; a tied head copy counts once."""
    # on the model's device: NCCL takes no CPU tensors (and no host copy per parameter)
    sq = torch.zeros(1, dtype=torch.float64, device=next(model.parameters()).device)
    skip_copy = pipe.tied if not planted("clip-tied-twice") else False   # plant: counted twice
    for n, p in model.named_parameters():
        if p.grad is not None and not (skip_copy and n == pipe.head_weight):
            sq += p.grad.double().pow(2).sum()
    dist.all_reduce(sq, group=pipe.group)   # (1,) float64: the squared norm
    return clip_by_norm(sq, [p.grad for p in model.parameters() if p.grad is not None], max_norm)


if __name__ == "__main__":   # torchrun pp.py --mode ...: the test rig runs it
    from rig.pp import main
    main()
