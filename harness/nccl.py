"""nccl.py: NCCL's matching rules, checked on CPU (`--nccl-semantics`).

gloo forgives what NCCL does not. A program that passes on gloo can hang or silently swap
messages on a GPU node, so every strategy script can record what it hands to torch.distributed
during a real run and check that record under NCCL's rules:

  tags are ignored         NCCL pairs the k-th send from rank i to rank j with the k-th receive
                           at j from i (FIFO per pair and communicator). gloo matched by tag, so
                           the two pairings agree only when the tag sequences agree; any
                           difference is a message NCCL would deliver to the wrong buffer.
  sizes agree              a matched send and receive carry the same bytes and dtype.
  batches progress         one batch_isend_irecv is one NCCL group: its sends and receives
  together                 progress together, and the batch ends when all of them have.
  sends block              a send completes only once its receive is posted.
  collectives in order     every rank of a group issues the group's collectives in the same order
                           (same op, same size).

The progress model is NCCL's as torch drives it. Each rank issues its operations in program
order. Each communicator (process group) runs them as a FIFO queue: an operation starts once all
earlier ones of its communicator on that rank are done. The host does not block on NCCL, but a
`wait()` on an operation's work (a synchronous call waits at once) makes everything issued
after it depend on its completion. A communicator's queue on one rank is one stream, and a
batch progresses only when every partner's batch is posted with it. A lone send or receive runs
on a two-rank communicator of its own, as in ProcessGroupNCCL. Waits that form a cycle are a
deadlock, reported with the ranks, operations and source lines that form it. Left out: the
order of operations across communicators (NCCL asks for one, for async collectives; this model
lets different communicators proceed independently), the root and reduce op of a collective,
and what does not go through torch.distributed's Python functions (DTensor's functional
collectives, torch DDP's C++ reducer: the --compare-native baselines).

Usage: `nccl_checked(fn, run, ...)` runs fn with the recorder on and prints the verdict (the
harness does this for every mode with --nccl-semantics, and for each run of --mode plants).
`NcclRecorder().start()` ... `finish()` is the same by hand (finish is a collective: rank 0
checks every rank's record, and all ranks return (ok, one line)). `check(traces)` is the pure
checker, used directly by tests.
"""
from __future__ import annotations

import inspect
from collections import defaultdict

import torch
import torch.distributed as dist

from .meter import _METERED, METER, call_site, group_name, patch_dist, restore_dist

P2P_FNS = ("send", "recv", "isend", "irecv", "batch_isend_irecv")
# collective -> the argument that must agree in size on every rank (None: only the op name)
COLLECTIVES = {
    "all_reduce": "tensor", "broadcast": "tensor", "reduce": "tensor",
    "all_gather": "tensor", "all_gather_into_tensor": "output_tensor",
    "all_gather_single": "output_tensor", "reduce_scatter": "output",
    "reduce_scatter_tensor": "input", "reduce_scatter_single": "input",
    "all_to_all": None, "all_to_all_single": None, "gather": "tensor", "scatter": "tensor",
    "barrier": None, "monitored_barrier": None, "all_gather_object": None,
    "broadcast_object_list": None, "gather_object": None, "scatter_object_list": None,
    "new_group": None,   # every rank of the parent group creates groups in the same order
}
def _size(t) -> int:
    if isinstance(t, (list, tuple)):
        return sum(_size(x) for x in t)
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _dtype(t) -> str:
    if isinstance(t, (list, tuple)):
        return _dtype(t[0]) if t else ""
    return str(t.dtype).replace("torch.", "") if isinstance(t, torch.Tensor) else ""


def _comm(group) -> tuple:
    """A communicator's identity, the same on every rank: (torch's group name, global ranks)."""
    if group is None or group is dist.group.WORLD:
        return (dist.group.WORLD.group_name, tuple(range(dist.get_world_size())))
    return (group.group_name, tuple(dist.get_process_group_ranks(group)))


class _Work:
    """A torch Work whose wait() is written into the trace: operations issued after it depend
    on the waited one (NCCL: the current stream waits for it)."""

    def __init__(self, work, rec, index):
        self._work, self._rec, self._index = work, rec, index

    def wait(self, *a, **k):
        self._rec.waited(self._index)
        return self._work.wait(*a, **k)

    def __getattr__(self, name):
        return getattr(self._work, name)


class NcclRecorder:
    """Records every p2p batch and collective of this rank in issue order. A trace entry is
    [kind, communicator, where, wait, body]: kind "p2p" (body: a list of (is_send, peer,
    bytes, dtype, tag)) or a collective's name (body: the size that must agree, or ""); wait:
    the index of the first operation issued after this one was waited (None: never waited).
    `names` maps a communicator to the meter's group name, for reports."""

    def __init__(self):
        self.trace: list[list] = []
        self.names: dict[tuple, str] = {}
        self._saved: dict = {}
        self._depth = 0

    def waited(self, index):
        e = self.trace[index]
        if e[3] is None:
            e[3] = len(self.trace)

    def _entry(self, kind, group, body, sync, comm=None) -> int:
        comm = comm or _comm(group)
        self.names.setdefault(comm, group_name(group))
        i = len(self.trace)
        self.trace.append([kind, comm, call_site(), i + 1 if sync else None, body])
        return i

    def _p2p(self, op_is_send, tensor, peer, tag) -> tuple:
        return (op_is_send, peer, _size(tensor), _dtype(tensor), tag)

    def _record(self, name, bound) -> int:
        if name == "batch_isend_irecv":
            ops = bound["p2p_op_list"]
            body = [self._p2p("send" in getattr(op.op, "__name__", ""), op.tensor, op.peer,
                              op.tag) for op in ops]
            return self._entry("p2p", ops[0].group if ops else None, body, False)
        if name in P2P_FNS:
            is_send = "send" in name
            group = bound.get("group")
            peer = bound.get("dst" if is_send else "src")
            gpeer = bound.get("group_dst" if is_send else "group_src")
            if peer is None and gpeer is not None:
                peer = dist.get_global_rank(group, gpeer) if group is not None else gpeer
            # NCCL runs a lone send/recv on a two-rank communicator of its own (batched p2p
            # uses the group's): a lone send never meets a batched receive
            me, pair = dist.get_rank(), tuple(sorted((dist.get_rank(), peer)))
            comm = (f"{_comm(group)[0]}:p2p{pair}", pair) if peer != me else None
            return self._entry("p2p", group, [self._p2p(is_send, bound["tensor"], peer,
                                                        bound.get("tag", 0))],
                               sync=name in ("send", "recv"), comm=comm)
        if name == "new_group":   # every rank creates groups in one order; through the store,
            # not a queue of NCCL work: its own pseudo-communicator
            world = tuple(range(dist.get_world_size()))
            return self._entry("new_group", None, str(tuple(bound.get("ranks") or ())), True,
                               comm=("new_group", world))
        arg = COLLECTIVES[name]
        key = f"{_size(bound[arg])} B {_dtype(bound[arg])}" if arg else ""
        return self._entry(name, bound.get("group"), key, not bound.get("async_op", False))

    def _wrap(self, name, fn):
        sig = inspect.signature(fn)

        def wrapper(*args, **kwargs):
            if self._depth:   # what a recorded call calls inside torch is part of it
                return fn(*args, **kwargs)
            bound = sig.bind(*args, **kwargs).arguments
            if name in _METERED:   # NCCL takes tensors on the run's device only
                METER.check_device(name, bound)
            i = self._record(name, bound)
            self._depth += 1
            try:
                out = fn(*args, **kwargs)
            finally:
                self._depth -= 1
            if isinstance(out, list):
                return [_Work(w, self, i) for w in out]
            return _Work(out, self, i) if out is not None and hasattr(out, "wait") else out
        wrapper.__name__ = name
        wrapper.__wrapped__ = fn
        return wrapper

    def start(self):
        """Wrap every p2p function and collective (meter.patch_dist)."""
        self._saved = patch_dist((*P2P_FNS, *COLLECTIVES), self._wrap)
        return self

    def stop(self):
        restore_dist(self._saved)
        self._saved = {}

    def finish(self) -> tuple[bool, str]:
        """Stop recording, check every rank's trace on rank 0; (ok, line) on every rank."""
        self.stop()
        traces = [None] * dist.get_world_size()
        dist.all_gather_object(traces, (self.trace, self.names))
        verdict = [None]
        if dist.get_rank() == 0:
            names = {}
            for _, n in traces:
                names.update(n)
            verdict = [check([t for t, _ in traces], names)]
        dist.broadcast_object_list(verdict, 0)
        return verdict[0]


def nccl_checked(fn, run, *args) -> bool:
    """fn(run, *args) with every rank's p2p and collectives recorded, then checked: the check's
    line is printed last (rank 0) and a violation fails the run."""
    rec = NcclRecorder().start()
    try:
        ok = fn(run, *args)
    finally:
        rec.stop()
    nccl_ok, line = rec.finish()
    run.print(line)
    return ok and nccl_ok


# ----------------------------------------------------------------------------------------------
# The checker: pure, on the gathered traces
# ----------------------------------------------------------------------------------------------
def _gname(comm, names) -> str:
    return f"group {names.get(comm, '?')} ({comm[0]}) {list(comm[1])}"


def describe(r, i, e, names=None) -> str:
    """One trace entry in words: rank, index, what, where."""
    kind, comm, where, _, body = e
    if kind == "p2p":
        parts = [f"{'send' if s else 'recv'} {n} B {'to' if s else 'from'} {peer} tag {tag}"
                 for s, peer, n, _, tag in body]
        return f"rank {r} op #{i} p2p[{', '.join(parts)}] at {where}"
    return f"rank {r} op #{i} {kind}({body}) on {_gname(comm, names or {})} at {where}"


def check(traces: list[list], names: dict | None = None) -> tuple[bool, str]:
    """(ok, one line): PASS with the counts, or the first violation of NCCL's rules."""
    names = names or {}
    R = len(traces)
    fail = "NCCL semantics: FAIL: "
    # 1. p2p pairing: FIFO per (communicator, sender, receiver); tags are ignored
    sends, recvs = defaultdict(list), defaultdict(list)
    for r, trace in enumerate(traces):
        for i, (kind, comm, _, _, body) in enumerate(trace):
            if kind != "p2p":
                continue
            for k, (is_send, peer, nbytes, dtype, tag) in enumerate(body):
                if peer not in comm[1]:
                    return False, fail + f"{describe(r, i, trace[i], names)} names rank {peer}, " \
                                         f"not in its group"
                key = (comm, r, peer) if is_send else (comm, peer, r)
                (sends if is_send else recvs)[key].append((r, i, k, tag, nbytes, dtype))
    partner, bad = {}, []
    for key in sorted(set(sends) | set(recvs)):
        comm, src, dst = key
        s, v = sends.get(key, []), recvs.get(key, [])
        for n, (a, b) in enumerate(zip(s, v)):
            sa, rb = describe(src, a[1], traces[src][a[1]], names), \
                describe(dst, b[1], traces[dst][b[1]], names)
            if a[3] != b[3]:
                bad.append((min(a[1], b[1]), f"tags are ignored: message #{n} from rank {src} "
                            f"to rank {dst}, sent with tag {a[3]} by {sa}, would land in the "
                            f"receive with tag {b[3]} of {rb}"))
            elif (a[4], a[5]) != (b[4], b[5]):
                bad.append((min(a[1], b[1]), f"size mismatch: message #{n} from rank {src} to "
                            f"rank {dst}: {a[4]} B {a[5]} sent by {sa}, {b[4]} B {b[5]} expected "
                            f"by {rb}"))
            partner[(a[0], a[1], a[2])] = (b[0], b[1], b[2])
            partner[(b[0], b[1], b[2])] = (a[0], a[1], a[2])
        if len(s) != len(v):
            x = (s if len(s) > len(v) else v)[min(len(s), len(v))]
            bad.append((x[1], f"unmatched: rank {src} sends {len(s)} message(s) to rank {dst} on "
                        f"{_gname(comm, names)}, rank {dst} receives {len(v)}; the first left "
                        f"over: {describe(x[0], x[1], traces[x[0]][x[1]], names)}"))
    # 2. collectives: the same sequence (op and size) on every member of a communicator
    colls = defaultdict(lambda: defaultdict(list))
    ordinal = {}
    for r, trace in enumerate(traces):
        for i, (kind, comm, where, _, body) in enumerate(trace):
            if kind != "p2p":
                seq = colls[comm][r]
                ordinal[(r, i)] = (comm, len(seq))
                seq.append((i, kind, body, where))
    for comm, per in colls.items():
        seqs = {m: per.get(m, []) for m in comm[1]}
        longest = max(seqs, key=lambda m: len(seqs[m]))
        for n, (i, kind, body, where) in enumerate(seqs[longest]):
            m = next((m for m, seq in seqs.items()
                      if n >= len(seq) or seq[n][1:3] != (kind, body)), None)
            if m is None:
                continue
            if n >= len(seqs[m]):
                bad.append((i, f"collective order: on {_gname(comm, names)} rank {m} issues "
                            f"{len(seqs[m])} collective(s), rank {longest} "
                            f"{len(seqs[longest])}: rank {m} never joins #{n} {kind}({body}) "
                            f"at {where}"))
            else:
                bad.append((min(i, seqs[m][n][0]), f"collective order: {_gname(comm, names)} "
                            f"#{n} is {kind}({body}) at {where} on rank {longest} but "
                            f"{seqs[m][n][1]}({seqs[m][n][2]}) at {seqs[m][n][3]} on rank {m}"))
            break
    if bad:
        return False, fail + min(bad)[1]
    # 3. progress under NCCL's model (module docstring)
    sim = _Progress(traces, partner, ordinal)
    sim.run()
    n_p2p = sum(len(e[4]) for t in traces for e in t if e[0] == "p2p")
    n_batches = sum(1 for t in traces for e in t if e[0] == "p2p")
    n_coll = sum(1 for t in traces for e in t if e[0] != "p2p")
    if not sim.finished():
        return False, fail + "deadlock: " + sim.cycle(names)
    return True, (f"NCCL semantics: PASS ({n_p2p} p2p ops in {n_batches} batches and {n_coll} "
                  f"collective calls on {R} ranks: tags ignored, FIFO per pair and communicator, "
                  f"batches progress together, sends wait for their receives, collectives in "
                  f"one order)")


class _Progress:
    """The model: per rank, a host that issues in program order (op i waits for every earlier
    op waited before i), and one FIFO queue per communicator."""

    def __init__(self, traces, partner, ordinal):
        self.t, self.partner, self.ordinal = traces, partner, ordinal
        R = len(traces)
        self.issued = [0] * R                 # host: ops 0..issued-1 are issued
        self.done = [set() for _ in range(R)]  # completed op indices
        self.p2p_done = set()                 # (r, i, k)
        self.queue = [defaultdict(list) for _ in range(R)]   # comm -> op indices, in order
        self.pos = [defaultdict(int) for _ in range(R)]      # comm -> index of its head
        # op i on rank r waits for the ops j < i with wait[j] <= i: the latest such j suffices
        # only if earlier ones are done too, so keep them all, sorted by wait position
        self.gates = [sorted((e[3], j) for j, e in enumerate(t) if e[3] is not None)
                      for t in traces]
        self.gate_pos = [0] * R

    def _head(self, r, comm):
        q, p = self.queue[r][comm], self.pos[r][comm]
        return q[p] if p < len(q) else None

    def _posted(self, r, i) -> bool:
        return i < self.issued[r] and self._head(r, self.t[r][i][1]) == i

    def _blocker(self, r):
        """The op that keeps rank r's host from issuing its next op, or None."""
        i = self.issued[r]
        gates = self.gates[r]
        while self.gate_pos[r] < len(gates) and gates[self.gate_pos[r]][1] in self.done[r]:
            self.gate_pos[r] += 1
        for w, j in gates[self.gate_pos[r]:]:
            if w > i:
                break
            if j not in self.done[r]:
                return j
        return None

    def _complete(self, r, i):
        self.done[r].add(i)
        self.pos[r][self.t[r][i][1]] += 1

    def run(self):
        progress = True
        while progress:
            progress = False
            for r, trace in enumerate(self.t):
                while self.issued[r] < len(trace) and self._blocker(r) is None:
                    i = self.issued[r]
                    self.queue[r][trace[i][1]].append(i)
                    self.issued[r] += 1
                    progress = True
                for comm in list(self.queue[r]):
                    i = self._head(r, comm)
                    while i is not None and self._try(r, i):
                        progress = True
                        i = self._head(r, comm)

    def _try(self, r, i) -> bool:
        e = self.t[r][i]
        if e[0] == "p2p":   # a batch progresses once every partner's batch is posted with it
            pending = [k for k in range(len(e[4])) if (r, i, k) not in self.p2p_done]
            if not all(self._posted(*self.partner[(r, i, k)][:2]) for k in pending):
                return False
            for k in pending:
                self.p2p_done |= {(r, i, k), self.partner[(r, i, k)]}
            self._complete(r, i)
            return True
        comm, n = self.ordinal[(r, i)]
        members = [(m, next(j for j in self.queue[m][comm][self.pos[m][comm]:]
                            if self.ordinal[(m, j)] == (comm, n)) if self._posted_coll(m, comm, n)
                    else None) for m in comm[1]]
        if any(j is None for _, j in members):
            return False
        for m, j in members:
            self._complete(m, j)
        return True

    def _posted_coll(self, m, comm, n) -> bool:
        j = self._head(m, comm)
        return j is not None and self.ordinal.get((m, j)) == (comm, n)

    def finished(self) -> bool:
        return all(len(self.done[r]) == len(t) for r, t in enumerate(self.t))

    def _waits_for(self, r, i):
        """(rank, op) that op i of rank r waits for."""
        e = self.t[r][i]
        if i >= self.issued[r]:
            return r, self._blocker(r)
        head = self._head(r, e[1])
        if head != i:
            return r, head
        if e[0] == "p2p":
            q, j, _ = next(self.partner[(r, i, k)] for k in range(len(e[4]))
                           if (r, i, k) not in self.p2p_done)
            return q, j
        comm, n = self.ordinal[(r, i)]
        for m in comm[1]:
            if not self._posted_coll(m, comm, n):
                return m, next(j for j, x in enumerate(self.t[m])
                               if self.ordinal.get((m, j)) == (comm, n))
        return r, i

    def cycle(self, names) -> str:
        """The chain of waits from the first stuck op until it repeats."""
        r = next(r for r, t in enumerate(self.t) if len(self.done[r]) < len(t))
        i = min(set(range(len(self.t[r]))) - self.done[r])
        seen, parts = [], []
        while (r, i) not in seen:
            seen.append((r, i))
            q, j = self._waits_for(r, i)
            parts.append(describe(r, i, self.t[r][i], names)
                         + (" (not yet issued)" if i >= self.issued[r] else ""))
            r, i = q, j
        k = seen.index((r, i))
        return " waits for ".join(parts[k:] + [parts[k].split(" at ")[0]])
