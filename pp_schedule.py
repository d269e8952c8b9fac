"""pp_schedule.py: pipeline schedules as data (GPipe, 1F1B, interleaved 1F1B, ZB-H1, DualPipeV),
their simulator and bubble formulas, the lockstep point-to-point grid and the stage split. Pure
Python: no torch, no processes. pp.py runs what this module plans.

The idea
    P ranks hold the model's stages, the batch is M micro-batches; stage r runs micro-batch m
    after stage r-1 did, so the pipeline fills and drains, and the idle share is the bubble:
      GPipe / AFAB  (Huang et al. 2019) all forwards, then all backwards: (P-1)/(M+P-1); every
                    stage holds the activations of all M micro-batches
      1F1B          (PipeDream-Flush, Narayanan et al. 2021) P-1-r warm-up forwards, a steady
                    state of one forward then one backward, the cool-down's backwards
                    (_one_f_one_b): same bubble, at most P micro-batches in flight
      interleaved   (Megatron, Narayanan et al. 2021) V chunks r, r+P, ... per rank: (P-1)/(V*M+P-1)
      ZB-H1         (Qi et al. 2024) B split into I (input gradient, critical path) and W (weight
                    gradient, deferred into the cool-down): (P-1)/(3M+P-1) with T_F = T_I = T_W
      DualPipeV     (DeepSeek-V3 2024) 2P chunks in a V, rank r holding r and 2P-1-r: DualPipe's
                    (P-1)(F&B + B - 3W) idle per rank = (P-1)/(3M+P-1); activations of up to 2P+1
                    chunk-micro-batches per rank (1F1B: 2P); needs M >= 2P
    Schedules are pure functions (P, M, V, rank) -> actions (kind, chunk, micro-batch), kind in
    F, B, I, W (torch's _Action one to one); simulate() checks their dependencies and measures
    the bubble with unit costs (F=1, B=2, I=W=1); Grid turns them into the point-to-point plan.
    More: docs/internals.md, 'pp_schedule.py'.

Public API
    SCHEDULES, COST; schedule(name, P, M, V, rank) -> [(kind, chunk, micro-batch)]
    chunks_per_rank(name, V), chunk_owner(name, c, P)       the placement of the P*V chunks
    simulate(name, P, M, V=1, cost=None, paired=False)
        -> (per-rank [(kind, chunk, mb, start, end)], makespan, bubble, peak in-flight)
    bubble_formula(name, P, M, V=1); messages(kind, c, m, C) (what an action receives, sends)
    Grid(name, P, M, V=1) the lockstep p2p plan; split_layers(costs, first, last, n) the split
"""

# ----------------------------------------------------------------------------------------------
# Schedules: pure functions
# ----------------------------------------------------------------------------------------------
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb", "dualpipev")
COST = {"F": 1, "B": 2, "I": 1, "W": 1}      # the simulator's unit costs (B = I + W)


def chunks_per_rank(name: str, V: int) -> int:
    """V for the interleaved schedule, 2 for DualPipeV, else 1."""
    return V if name == "interleaved" else 2 if name == "dualpipev" else 1


def schedule_error(name: str, P: int, M: int) -> str | None:
    """Why schedule `name` cannot run M micro-batches over P stages (one line), or None."""
    if name == "interleaved" and P < 2:
        return "interleaved 1F1B needs at least 2 pipeline ranks"
    if name == "interleaved" and (M % P or M < P):
        return (f"interleaved 1F1B needs the micro-batches ({M}) to be a multiple of the "
                f"pipeline size {P}")
    if name == "dualpipev" and M < 2 * P:
        return (f"DualPipeV needs the micro-batches ({M}) >= 2 x the pipeline size ({2 * P}): "
                f"each rank's steady state pairs micro-batches from both arms of the V")
    return None


def chunk_owner(name: str, c: int, P: int) -> int:
    """The rank that holds chunk c: looped (c % P), or for DualPipeV the V (c on the way down,
    2P-1-c on the way up)."""
    if name == "dualpipev":
        return c if c < P else 2 * P - 1 - c
    return c % P


def schedule(name: str, P: int, M: int, V: int, rank: int) -> list[tuple[str, int, int]]:
    """Actions (kind, chunk, micro-batch) for `rank`; chunk c lives on chunk_owner(name, c, P)."""
    if name == "gpipe":
        return [("F", rank, m) for m in range(M)] + [("B", rank, m) for m in range(M)]
    if name == "1f1b":
        return _one_f_one_b(P, M, rank)
    if name == "interleaved":
        return _interleaved(P, M, V, rank)
    if name == "zb":
        return _zb_h1(P, M, rank)
    if name == "dualpipev":
        return _dualpipev(P, M, rank)
    raise ValueError(name)


def _one_f_one_b(P, M, rank):
    warm = min(P - rank - 1, M)
    acts = [("F", rank, m) for m in range(warm)]             # warm-up: P-1-r forwards
    f, b = warm, 0
    while f < M:                                             # steady state: one F, one B
        acts += [("F", rank, f), ("B", rank, b)]
        f, b = f + 1, b + 1
    acts += [("B", rank, m) for m in range(b, M)]            # cool-down: the last backwards
    return acts


def _interleaved(P, M, V, rank):
    """Megatron's interleaved 1F1B: micro-batches go through the chunks in groups of P."""
    n = V * M

    def fwd(k):  # k-th forward on this rank -> (chunk, micro-batch)
        group, within = divmod(k, P * V)
        return (((k // P) % V) * P + rank, group * P + within % P)

    def bwd(k):
        group, within = divmod(k, P * V)
        return (((V - 1 - (k // P) % V)) * P + rank, group * P + within % P)
    warm = min((P - rank - 1) * 2 + (V - 1) * P, n)
    acts = [("F",) + fwd(k) for k in range(warm)]
    f, b = warm, 0
    while f < n:
        acts += [("F",) + fwd(f), ("B",) + bwd(b)]
        f, b = f + 1, b + 1
    acts += [("B",) + bwd(k) for k in range(b, n)]
    return acts


def _zb_h1(P, M, rank):
    """1F1B with each B split into I then W, W deferred by `rank` backward steps: later stages
    keep their I's back to back, so the gradient wave reaches stage 0 in (P-1) I's instead of
    (P-1) B's, and their deferred W's fill what would have been the cool-down bubble. In-flight
    activations (F done, I not) stay those of 1F1B."""
    delay = rank
    acts, pending = [], []
    for kind, c, m in _one_f_one_b(P, M, rank):
        if kind == "F":
            acts.append((kind, c, m))
            continue
        acts.append(("I", c, m))
        pending.append(m)
        if len(pending) > delay:
            acts.append(("W", c, pending.pop(0)))
    acts += [("W", rank, m) for m in pending]
    return acts


def _dualpipev(P, M, rank, pairs: list | None = None):
    """DualPipeV (DeepSeek's DualPipe cut in half), rank r holding chunks down = r and
    up = 2P-1-r. Eight phases, each a count that depends on the rank, so that the micro-batches
    fed into chunk 0 arrive at every rank just in time:
      1 warm-up        2(P-1-r) forwards of `down`
      2                r+1 pairs F(down) F(up)
      3                P-1-r times I(up), W(up), F(up): the zero-bubble split starts the first
                       backwards early and keeps the up chunk fed
      4 steady state   M-2P+r+1 times F(down)&B(up), F(up)&B(down): a forward of one
                       micro-batch paired with a backward of another, on the other chunk
      5                P-1-r times B(up), F(up)&B(down): the up chunk's last forwards
      6                r+1 pairs B(up) B(down), split into I and deferred W from the middle on
                       (the odd ranks one backward earlier than the even ones)
      7 cool-down      P-1-r times W, I(down): the deferred W's fill the drain
      8                r+1 W's: the rest of them
    Each count is the number of micro-batches of that kind, so every chunk sees F, and B or I+W,
    once per micro-batch (M >= 2P). `pairs`, when given, receives the index of each overlapped
    pair's F (its B is the next action): DeepSeek's F&B chunks, which simulate(paired=True)
    starts together."""
    down, up = rank, 2 * P - 1 - rank
    acts, pending = [], []
    nxt = {}                              # (chunk, "F" | "B") -> its next micro-batch

    def fwd(c):
        m = nxt.get((c, "F"), 0)
        nxt[(c, "F")] = m + 1
        acts.append(("F", c, m))

    def bwd(c, split=False):
        m = nxt.get((c, "B"), 0)
        nxt[(c, "B")] = m + 1
        acts.append(("I" if split else "B", c, m))
        if split:
            pending.append((c, m))

    def weight():
        if pending:
            acts.append(("W",) + pending.pop(0))

    def pair(f, b):                       # F&B: a forward and another micro-batch's backward
        if pairs is not None:
            pairs.append(len(acts))
        fwd(f), bwd(b)

    for _ in range(2 * (P - 1 - rank)):
        fwd(down)
    for _ in range(rank + 1):
        fwd(down), fwd(up)
    for _ in range(P - 1 - rank):
        bwd(up, split=True), weight(), fwd(up)
    for i in range(M - 2 * P + rank + 1):
        if i == 0 and rank == P - 1:      # the V's bottom: B(up) needs this very F(down)
            fwd(down), bwd(up)
        else:
            pair(down, up)
        pair(up, down)
    for _ in range(P - 1 - rank):
        bwd(up), pair(up, down)
    split = False
    for i in range(rank + 1):
        split = split or (i == (rank + 1) // 2 and rank % 2 == 1)
        bwd(up, split)
        split = split or (i == (rank + 1) // 2 and rank % 2 == 0)
        bwd(down, split)
    for _ in range(P - 1 - rank):
        weight(), bwd(down, split)
    while pending:
        weight()
    return acts


# ----------------------------------------------------------------------------------------------
# Simulation and the bubble
# ----------------------------------------------------------------------------------------------
def simulate(name, P, M, V=1, cost=None, paired=False):
    """Run every rank's actions with unit costs (`cost`, default COST), honouring dependencies,
    each action as soon as its inputs are there (as the executor runs them). paired=True
    (DualPipeV): each overlapped F&B pair starts only once both halves' inputs are there, as
    DeepSeek's implementation runs it (both receives, then both computations). Returns (per-rank
    action lists with (start, end), makespan, bubble fraction, peak in-flight)."""
    V = chunks_per_rank(name, V)
    C, cost = P * V, cost or COST
    acts = [schedule(name, P, M, V, r) for r in range(P)]
    pair_at = [set() for _ in range(P)]
    if paired and name == "dualpipev":
        for r in range(P):
            _dualpipev(P, M, r, pairs := [])
            pair_at[r] = set(pairs)
    done, t_rank, pos = {}, [0.0] * P, [0] * P
    timeline = [[] for _ in range(P)]
    inflight, peak = [0] * P, [0] * P

    def deps_of(kind, c, m):
        deps = []
        if kind == "F" and c > 0:
            deps.append(("F", c - 1, m))
        if kind in ("B", "I"):
            deps.append(("F", c, m))
            if c < C - 1:
                deps.append(("B" if ("B", c + 1, m) in done else "I", c + 1, m))
        if kind == "W":
            deps.append(("I", c, m))
        return deps

    progress = True
    while progress:
        progress = False
        for r in range(P):
            while pos[r] < len(acts[r]):
                group = acts[r][pos[r]:pos[r] + (2 if pos[r] in pair_at[r] else 1)]
                deps = [d for a in group for d in deps_of(*a) if d not in group]
                if any(d not in done for d in deps):
                    break
                t = max([t_rank[r]] + [done[d] for d in deps])
                for kind, c, m in group:
                    start, t = t, t + cost[kind]
                    done[(kind, c, m)] = t
                    timeline[r].append((kind, c, m, start, t))
                    inflight[r] += 1 if kind == "F" else (-1 if kind in ("B", "I") else 0)
                    peak[r] = max(peak[r], inflight[r])
                t_rank[r] = t
                pos[r] += len(group)
                progress = True
    if any(pos[r] < len(acts[r]) for r in range(P)):
        raise RuntimeError(f"schedule {name} deadlocks (P={P}, M={M}, V={V})")
    makespan = max(t_rank)
    busy = sum(e - s for tl in timeline for *_, s, e in tl)
    return timeline, makespan, 1 - busy / (P * makespan), peak


def bubble_formula(name, P, M, V=1) -> float:
    """(P-1)/(M+P-1); interleaved (P-1)/(V*M+P-1); ZB-H1 with T_F = T_I = T_W:
    (P-1)(T_F+T_I-T_W) / (M(T_F+T_I+T_W) + (P-1)(T_F+T_I-T_W)) = (P-1)/(3M+P-1).
    DualPipeV: DualPipe's (PP/2-1)(T_F&B + T_B - 3 T_W) idle per rank with PP = 2P chunk stages,
    T_F&B = T_F + T_B (the pair runs back to back) and T_B = T_I + T_W, over 2M (T_F + T_B) of
    work: with T_F = T_I = T_W, 2(P-1) / (6M + 2(P-1)) = (P-1)/(3M+P-1)."""
    if name == "dualpipev":
        F, I, W = COST["F"], COST["I"], COST["W"]
        idle = (P - 1) * ((F + I + W) + (I + W) - 3 * W)
        return idle / (2 * M * (F + I + W) + idle)
    if name == "zb":
        return (P - 1) / (3 * M + P - 1)
    return (P - 1) / ((V if name == "interleaved" else 1) * M + P - 1)


# ----------------------------------------------------------------------------------------------
# Messages and the lockstep point-to-point grid
# ----------------------------------------------------------------------------------------------
def messages(kind: str, c: int, m: int, C: int):
    """(what action (kind, c, m) receives before it runs, what it sends after), each a message
    key (source chunk, destination chunk, micro-batch, backward) or None."""
    if kind == "F":
        return ((c - 1, c, m, False) if c > 0 else None,
                (c, c + 1, m, False) if c < C - 1 else None)
    if kind in ("B", "I"):
        return ((c + 1, c, m, True) if c < C - 1 else None,
                (c, c - 1, m, True) if c > 0 else None)
    return None, None


class Grid:
    """Every rank's actions on one lockstep grid of time steps, the point-to-point plan that
    NCCL can run (the scheme of torch.distributed.pipelining's PipelineScheduleMulti).

    NCCL ignores tags and runs a communicator's operations in issue order, each send waiting
    for its receive. Posting each send and receive alone, where it is needed, deadlocks 1F1B:
    stage 0's second warm-up send waits for stage 1's receive, queued behind stage 1's gradient
    send, which waits for stage 0's receive behind that first send.

    The steps come from simulate() with every action costing 1: each rank runs at most one
    action per step. After step t's action a rank posts one batch_isend_irecv: that action's
    send and the receives of every message its neighbours send at step t. A message is thus
    sent and received in the same step's batches on both ranks, so batches pair up step by step:
    no send waits on a receive that is queued behind another blocked operation, under any
    schedule (NCCL ignores tags and runs a communicator's operations in issue order; see
    harness/nccl.py). Receives are posted early and waited just before the action that uses
    them. `steps[r][t]` = (action or None, send keys, receive keys); `first_forward[m]`: the
    step of micro-batch m's first forward (chunk 0), the grid's consistent cut for m."""

    def __init__(self, name: str, P: int, M: int, V: int = 1):
        C = P * chunks_per_rank(name, V)
        timeline, T, _, _ = simulate(name, P, M, V, cost=dict.fromkeys(COST, 1))
        T = int(T)
        self.steps = [[(None, [], []) for _ in range(T)] for _ in range(P)]
        self.first_forward = {}
        for r in range(P):
            for kind, c, m, start, _ in timeline[r]:
                _, send = messages(kind, c, m, C)
                if send and chunk_owner(name, send[1], P) == r:
                    send = None      # the V's turn: handed over in memory (pp.Pipeline.run)
                t = int(start)
                self.steps[r][t] = ((kind, c, m), [send] if send else [], self.steps[r][t][2])
                if kind == "F" and c == 0:
                    self.first_forward[m] = t
                if send:
                    self.steps[chunk_owner(name, send[1], P)][t][2].append(send)


# ----------------------------------------------------------------------------------------------
# Stage split
# ----------------------------------------------------------------------------------------------
def split_layers(costs: list[float], first: float, last: float, n: int) -> list[range]:
    """Contiguous split of layers (costs) into n non-empty chunks minimising the largest chunk
    cost, the first chunk also paying `first` (embeddings) and the last `last` (norm + head)."""
    L = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    INF = float("inf")
    best = [[INF] * (L + 1) for _ in range(n + 1)]   # best[k][i]: first i layers in k chunks
    cut = [[0] * (L + 1) for _ in range(n + 1)]
    best[0][0] = 0.0
    for k in range(1, n + 1):
        for i in range(k, L + 1):
            for j in range(k - 1, i):
                cost = prefix[i] - prefix[j] + (first if j == 0 else 0) + (last if i == L else 0)
                val = max(best[k - 1][j], cost)
                if val < best[k][i]:
                    best[k][i], cut[k][i] = val, j
    bounds, i = [], L
    for k in range(n, 0, -1):
        bounds.append(range(cut[k][i], i))
        i = cut[k][i]
    return bounds[::-1]


def boundary_messages(name: str, P: int, V: int, rank: int) -> int:
    """Sends per micro-batch from `rank` (and as many receives; pp.py's executor, the rig's and
    the planners' count): an activation out of each of its chunks but the last, a gradient back
    out of each but the first, where the neighbouring chunk is on another rank."""
    C = P * chunks_per_rank(name, V)
    owner = [chunk_owner(name, c, P) for c in range(C)]
    return sum((c < C - 1 and owner[c + 1] != rank) + (c > 0 and owner[c - 1] != rank)
               for c in range(C) if owner[c] == rank)
