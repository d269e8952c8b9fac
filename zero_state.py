"""zero_state.py: ZeRO's flat shards seen as per-parameter tensors: the harness's reassembly
and resident bytes, layout-free checkpoints, and torch-format optimizer state dicts.

zero.py keeps every state (parameters, gradients, the optimizer's) as one flat shard per unit:
rank r holds elements [r s, (r+1) s) of the unit's buffer, s = padded / W, and a parameter is
the range [off, off + numel) of that buffer. What follows is bookkeeping over those ranges
(plus all-gathers over the shard group), none of it part of ZeRO's algorithm; zero.py mixes it
into its two classes (the units themselves, and their bytes: zero_units.py):

    FlatTensors   (zero.Zero and its subclass zeropp.ZeroPP)
        full_tensors(kind), gather_flat(shards) -> {name: tensor}   each unit's shard
                                                 all-gathered and cut per parameter
        flat_shards(tensors) -> [shard]          the inverse: this rank's shard of each unit
        grad_tensors()                           the resident gradient storage
        gathered()                               every unit's full parameters, for a read
    ShardedState  (zero.ZeroOptimizer)
        shard_param_groups(cls, group_of)        the inner optimizer over flat runs of the
                                                 shards, one run per parameter group and unit
        grad_shards(), clip_grad_norm_(max_norm) the reduced shards; global-norm clipping
        shard_state(key), load_shard_state(key, shards, where), steps_taken
                                                 an elementwise state, one flat shard per unit
                                                 (compose4d's checkpoints: any layout reads them)
        state_dict(), load_state_dict(sd)        torch's unsharded format (collective): a plain
                                                 torch optimizer over the same groups reads it;
                                                 plus "fp32_masters" (MasterAdamW's convention)
        state_tensors()                          the resident optimizer state
    clip_shard_grads(grads, max_norm, group)     global-norm clipping from the shards' norms
"""
import contextlib

import torch
import torch.distributed as dist

from harness import clip_by_norm, planted
from harness.precision import LOW_PRECISION


class FlatTensors:
    """Mixed into zero.Zero: reads its `units` (zero_units.FlatUnit), `group`, `stage` and
    wait_params()."""

    def ahead(self, u, step: int) -> list:
        """Stage 3's prefetch: the units of the next `prefetch` module groups after u's (step +1
        the forward's order, -1 the backward's), u's own skipped: a frozen unit and its
        trainable twin (LoRA) share their modules and are gathered together; a unit whose output
        takes no backward (a frozen embedding's) is not gathered for the backward."""
        out, groups, i = [], [], self.unit_index[u] + step
        while 0 <= i < len(self.units):
            v, i = self.units[i], i + step
            if v.modules == u.modules:
                continue
            if v.modules not in groups:
                if len(groups) == self.prefetch:
                    break
                groups.append(v.modules)
            if step > 0 or v.backward:
                out.append(v)
        return out

    def free_frozen(self, u):
        """Stage 3, as the backward reaches u: free the gathered frozen units (LoRA's base) after
        u's module group, which the backward has passed (no gradient marks their end, as the
        reduced units' do); end_backward, queued once per backward, frees those it leaves."""
        if not self.end_queued:
            self.end_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.end_backward)
        self._free_frozen(v for v in self.units[self.unit_index[u] + 1:] if v.modules != u.modules)

    def end_backward(self):
        """The backward ended: free the frozen units still gathered (the last group it reached)."""
        self.end_queued = False
        self._free_frozen(self.units)

    def _free_frozen(self, units):
        for v in units:   # (a prefetch still in flight is for the next use: kept)
            if not v.n_grads and v.gathered and v.handle is None:
                v.free_params()

    def grad_tensors(self) -> list[torch.Tensor]:
        """The resident gradient storage: stage 1's full buffers (and its reduced shards when
        they are a separate fp32 tensor), stages 2 and 3's shards."""
        full = [u.grad_full for u in self.units] if self.stage == 1 else []
        shards = [u.grad_shard for u in self.units
                  if self.stage > 1 or u.grad_shard.dtype != u.grad_full.dtype]
        return full + shards

    def full_tensors(self, kind: str) -> dict[str, torch.Tensor]:
        """Every parameter's ("param") or reduced gradient's ("grad") full tensor (collective)."""
        if self.stage < 3:
            self.wait_params()   # the shards are views of the buffers a gather may still fill
        grad = kind == "grad"   # (a frozen unit has no gradient: None, not gathered)
        out = self.gather_flat([u.grad_shard if grad else u.shard for u in self.units],
                               [u for u in self.units if u.n_grads or not grad])
        for n, p in (self.model.named_parameters() if self.model is not None else ()):
            if n not in out:   # frozen: outside the units (stages 1, 2), or in one not reduced
                out[n] = None if grad else p.detach()
        return out

    def gather_flat(self, shards: list[torch.Tensor], units=None) -> dict[str, torch.Tensor]:
        """Per-parameter tensors from one flat shard per unit (parameters, gradients or an
        optimizer state), all-gathered over the group (only `units`' when given)."""
        out = {}
        for u, src in zip(self.units, shards):
            if units is not None and u not in units:
                continue
            flat = torch.empty(u.padded, dtype=src.dtype, device=src.device)
            dist.all_gather_into_tensor(flat, src.contiguous(), group=u.group)  # [s] x W -> [W * s]
            for n, p, off in zip(u.names, u.params, u.offsets):
                out[n] = flat[off:off + p.numel()].view(p.shape)
        return out

    def flat_shards(self, tensors: dict[str, torch.Tensor], units=None) -> list:
        """The inverse of gather_flat: this rank's flat shard of each unit, from per-parameter
        tensors (zero padding), in the tensors' own dtype (fp32 masters and moments stay fp32
        in a bf16 run: a resume must not round them); None for a unit not in `units`."""
        out = []
        for u in self.units:
            if units is not None and u not in units:
                out.append(None)
                continue
            dtype = tensors[u.names[0]].dtype if u.names else u.full.dtype
            flat = torch.zeros(u.padded, dtype=dtype, device=u.full.device)
            for n, p, off in zip(u.names, u.params, u.offsets):
                flat[off:off + p.numel()] = tensors[n].reshape(-1)
            out.append(flat[u.rank * u.shard_numel:(u.rank + 1) * u.shard_numel].clone())
        return out

    @contextlib.contextmanager
    def gathered(self):
        """Every unit's full parameters readable for the duration (stage 3: gathered, then freed)."""
        if self.stage < 3:
            self.wait_params()
            yield
            return
        for u in self.units:
            u.wait()
        try:
            yield
        finally:
            for u in self.units:
                u.free_params()


class ShardedState:
    """Mixed into zero.ZeroOptimizer: reads its `engine` (the units), `masters` (this rank's
    flat shard of each unit, or its fp32 copy), `runs` [(unit, start in the shard, length,
    group)] and `views` (the inner optimizer's parameters, one per run), `inner`, `index`
    (torch's numbering), `param_groups` and `group`; shard_param_groups builds the masters,
    runs, views and inner."""

    def shard_param_groups(self, optimizer_class, group_of: dict):
        """Build masters, runs, views and the inner optimizer (zero.ZeroOptimizer.__init__).
        This rank's shard of each unit (or its fp32 master), cut into runs of one parameter
        group's trainable parameters: the inner optimizer's parameters. Frozen ones are in no
        run; the padding is in its unit's last run (zeros with zero gradients stay zero)."""
        engine = self.engine
        self.masters = [u.shard.detach().float().clone()   # flat [s] per unit (a frozen
                        if u.shard.dtype in LOW_PRECISION and u.n_grads   # one: none)
                        else u.shard for u in engine.units]
        self.mixed = any(m is not u.shard for m, u in zip(self.masters, engine.units))
        runs = []   # [unit index, start in the shard, length, group]
        for ui, u in enumerate(engine.units):
            for i, (p, off) in enumerate(zip(u.params, u.offsets)):
                end = u.padded if i == len(u.params) - 1 else off + p.numel()  # + the padding:
                a, b = max(off, u.lo), min(end, u.lo + u.shard_numel)   # zeros stay zero
                if a >= b or not p.requires_grad:
                    continue
                g = group_of[p]
                last = runs[-1] if runs else None
                if last and last[0] == ui and last[3] == g and last[1] + last[2] == a - u.lo:
                    last[2] += b - a
                else:
                    runs.append([ui, a - u.lo, b - a, g])
        self.runs = [tuple(r) for g in range(len(self.param_groups)) for r in runs if r[3] == g]
        self.views = [self.masters[ui][a:a + n] for ui, a, n, _ in self.runs]   # flat [n] each
        inner_groups = [dict({k: v for k, v in g.items() if k != "params"},
                             params=[v for v, r in zip(self.views, self.runs) if r[3] == gi])
                        for gi, g in enumerate(self.param_groups)]
        if not self.views:   # a rank whose shards hold no trainable element
            inner_groups[0]["params"] = [self.masters[0][:0]]
        self.inner = optimizer_class(inner_groups)
        for g, ig in zip(self.param_groups, self.inner.param_groups):   # complete defaults
            g.update({k: v for k, v in ig.items() if k != "params" and k not in g})

    def grad_shards(self) -> list[torch.Tensor]:   # this rank's reduced gradients, per unit
        return [u.grad_shard for u in self.engine.units]

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip the averaged gradients by their global norm (one scalar all_reduce); returns
        the norm before clipping, like torch.nn.utils.clip_grad_norm_."""
        self.reduce_gradients()
        return clip_shard_grads(self.grad_shards(), max_norm, self.group)

    def state_tensors(self) -> list[torch.Tensor]:
        """The resident optimizer-state tensors (fp32 masters, the inner optimizer's states)."""
        states = [t for st in self.inner.state.values() for t in st.values()
                  if torch.is_tensor(t) and t.dim() > 0]
        return [m for m, u in zip(self.masters, self.engine.units) if m is not u.shard] + states

    def shard_state(self, key: str) -> list[torch.Tensor]:
        """This rank's flat shard of an elementwise state per unit ("param": the parameter
        shard, or its fp32 master), zeros where the state does not exist (yet)."""
        if key == "param":
            return list(self.masters)
        # (a frozen unit, LoRA's base, has no state: an empty tensor, not a shard of zeros)
        out = [torch.zeros_like(m) if u.n_grads else m[:0]
               for m, u in zip(self.masters, self.engine.units)]
        for v, (ui, a, n, _) in zip(self.views, self.runs):
            if key in self.inner.state.get(v, {}):
                out[ui][a:a + n] = self.inner.state[v][key]
        return out

    def load_shard_state(self, key: str, shards: list[torch.Tensor], where=lambda group: True):
        """The inverse of shard_state for an elementwise state of the inner optimizer, into the
        runs of the parameter groups `where` accepts (muon.py's: momentum_buffer for Muon's
        matrices, AdamW's moments for the rest)."""
        for v, (ui, a, n, gi) in zip(self.views, self.runs):
            if where(self.param_groups[gi]):
                self.inner.state[v][key] = shards[ui][a:a + n].to(v.dtype).clone()

    @property
    def steps_taken(self) -> int:
        """The inner optimizer's step count (Adam's bias correction)."""
        st = next((s for s in map(self.inner.state.get, self.views) if s and "step" in s), {})
        return int(st["step"]) if st else 0   # (muon.py's Muon runs keep no step)

    @steps_taken.setter
    def steps_taken(self, t: int):
        for v, (_, _, _, gi) in zip(self.views, self.runs):
            if self.param_groups[gi].get("muon"):   # (torch's Muon counts no steps)
                continue
            # (on the shard's device: the fused kernel reads it there)
            self.inner.state[v]["step"] = torch.tensor(float(t), dtype=torch.float32,
                                                       device=v.device)

    def _layout(self):
        """{(unit, group): {key: dtype}} of the elementwise states (a unit's parameters may sit
        in groups with different states: muon.py's Muon and AdamW) and {group: {key: value}} of
        the scalar ones, as every rank needs them for the gathers (one object all-gather)."""
        elem, scalar = {}, {}
        for v, (ui, a, n, gi) in zip(self.views, self.runs):
            for k, x in self.inner.state.get(v, {}).items():
                if torch.is_tensor(x) and x.dim() == 1:
                    elem.setdefault((ui, gi), {})[k] = x.dtype
                else:   # (on the CPU: a fused kernel's step lives on the device, and a
                    # pickled CUDA tensor would come back on the sender's GPU)
                    scalar.setdefault(gi, {})[k] = x.detach().cpu() if torch.is_tensor(x) else x
        every = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(every, (elem, scalar), group=self.group)
        elem, scalar = {}, {}
        for e, s in every:
            for ui, keys in e.items():
                elem.setdefault(ui, {}).update(keys)
            for gi, vals in s.items():
                scalar.setdefault(gi, {}).update(vals)
        return elem, scalar

    def state_dict(self) -> dict:
        """The unsharded optimizer's state dict (collective: every rank gets it): per parameter
        (torch's numbering over the groups) its elementwise states at full shape and the
        group's scalar ones (e.g. step)."""
        elem, scalar = self._layout()
        group_of = {self.index[p]: gi for gi, g in enumerate(self.param_groups)
                    for p in g["params"]}
        state: dict = {}
        for ui, u in enumerate(self.engine.units):
            keys = {k: d for (vi, _), kd in elem.items() if vi == ui for k, d in kd.items()}
            for key in sorted(keys):
                local = torch.zeros(u.shard_numel, dtype=keys[key], device=u.shard.device)
                for v, (vi, a, n, _) in zip(self.views, self.runs):
                    if vi == ui and key in self.inner.state.get(v, {}):
                        local[a:a + n] = self.inner.state[v][key]
                full = torch.empty(u.padded, dtype=local.dtype, device=local.device)
                dist.all_gather_into_tensor(full, local, group=u.group)   # [s] x W -> [W * s]
                for p, off in zip(u.params, u.offsets):   # (only its group's states)
                    if p.requires_grad and key in elem.get((ui, group_of[self.index[p]]), {}):
                        state.setdefault(self.index[p], {})[key] = \
                            full[off:off + p.numel()].view(p.shape).clone()
        for i in state:
            for k, x in scalar.get(group_of[i], {}).items():
                state[i][k] = x.clone() if torch.is_tensor(x) else x
        groups = [dict({k: v for k, v in g.items() if k != "params"},
                       params=[self.index[p] for p in g["params"]]) for g in self.param_groups]
        return {"state": dict(sorted(state.items())), "param_groups": groups,
                "fp32_masters": self._gather_masters()}

    def _low_params(self) -> list[torch.Tensor]:
        """The low-precision parameters, in torch's numbering: whose fp32 masters the state dict
        carries (harness.precision.MasterAdamW's convention, a list in this order)."""
        return [p for p in self.index if p.dtype in LOW_PRECISION]

    def _master_units(self):
        """{parameter: (unit index, offset)} for the parameters of units with fp32 masters."""
        return {p: (ui, off) for ui, (u, m) in enumerate(zip(self.engine.units, self.masters))
                if m is not u.shard for p, off in zip(u.params, u.offsets)}

    def _gather_masters(self) -> list[torch.Tensor]:
        """Every low-precision parameter's fp32 master at full shape (collective: each unit's
        master shard all-gathered over its group); a parameter outside every unit (frozen,
        stages 1, 2) is its own master, widened."""
        where, full = self._master_units(), {}
        for ui, (u, m) in enumerate(zip(self.engine.units, self.masters)):
            if m is not u.shard:   # flat [W * s] fp32 <- this rank's [s]
                full[ui] = torch.empty(u.padded, dtype=m.dtype, device=m.device)
                dist.all_gather_into_tensor(full[ui], m.contiguous(), group=u.group)
        out = []
        for p in self._low_params():
            if p in where:
                ui, off = where[p]
                out.append(full[ui][off:off + p.numel()].view(p.shape).clone())
            else:
                out.append(p.detach().float().clone())
        return out

    def _load_masters(self, masters: list[torch.Tensor]):
        """The inverse of _gather_masters: this rank's slice of each unit's fp32 master shard
        from the full masters, and the low-precision parameters set to their rounding (the
        full buffers where they are allocated: stages 1, 2, or a gathered stage-3 unit; the
        shards)."""
        where = self._master_units()
        if self.engine.stage < 3:
            self.engine.wait_params()   # an in-flight gather would overwrite the buffers
        for p, saved in zip(self._low_params(), masters):
            saved = saved.detach().reshape(-1)
            if p not in where:
                p.detach().copy_(saved.view(p.shape))
                continue
            ui, off = where[p]
            u, m = self.engine.units[ui], self.masters[ui]
            x0, x1 = max(off, u.lo), min(off + p.numel(), u.lo + u.shard_numel)
            if x0 < x1:   # this rank's part of p: flat [x0, x1) of the unit
                m[x0 - u.lo:x1 - u.lo] = saved[x0 - off:x1 - off]
            if u.gathered:
                u.full[off:off + p.numel()] = saved
        for u, m in zip(self.engine.units, self.masters):
            if m is not u.shard:
                u.shard.copy_(m)   # (stages 1, 2: a view of the full buffer, written above too)

    def load_state_dict(self, state_dict: dict):
        """Load an unsharded state dict (this optimizer's, or a plain torch optimizer's over the
        same parameter groups): every rank keeps its slices. Its fp32 masters, where it has them
        (this optimizer's, harness.precision.MasterAdamW's), are restored in fp32 and the bf16
        parameters set to their rounding; without them (a plain torch optimizer's) the masters
        stay those copied from the parameters."""
        groups, state = state_dict["param_groups"], state_dict["state"]
        masters = state_dict.get("fp32_masters")
        if masters is not None:
            low = self._low_params()
            if len(masters) != len(low):
                raise ValueError(f"ZeroOptimizer.load_state_dict: {len(masters)} fp32 masters "
                                 f"for {len(low)} low-precision parameters")
            for p, m in zip(low, masters):
                if m.shape != p.shape:
                    raise ValueError(f"ZeroOptimizer.load_state_dict: the fp32 master of "
                                     f"parameter {self.index[p]} has shape {tuple(m.shape)}, "
                                     f"the parameter {tuple(p.shape)}")
        if [len(g["params"]) for g in groups] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError("ZeroOptimizer.load_state_dict: the parameter groups' sizes "
                             f"{[len(g['params']) for g in groups]} differ from this "
                             f"optimizer's {[len(g['params']) for g in self.param_groups]}")
        ids = [i for g in groups for i in g["params"]]
        by_param = {p: state.get(ids[self.index[p]]) for p in self.index}
        for p, st in by_param.items():
            for k, x in (st or {}).items():
                if torch.is_tensor(x) and x.dim() > 0 and x.shape != p.shape:
                    raise ValueError(f"ZeroOptimizer.load_state_dict: state {k!r} of parameter "
                                     f"{self.index[p]} has shape {tuple(x.shape)}, the "
                                     f"parameter {tuple(p.shape)}")
        inner_state = {}
        for j, (v, (ui, a, n, gi)) in enumerate(zip(self.views, self.runs)):
            u, entry = self.engine.units[ui], {}
            lo, hi = u.lo + a, u.lo + a + n
            for p, off in zip(u.params, u.offsets):
                st = by_param.get(p)
                x0, x1 = max(off, lo), min(off + p.numel(), hi)
                if not st or x0 >= x1:
                    continue
                for k, x in st.items():
                    if torch.is_tensor(x) and x.dim() > 0:
                        if k not in entry:
                            entry[k] = torch.zeros(n, dtype=x.dtype, device=v.device)
                        entry[k][x0 - lo:x1 - lo] = x.reshape(-1)[x0 - off:x1 - off]
                    elif k not in entry:
                        entry[k] = x.clone() if torch.is_tensor(x) else x
            if entry:
                inner_state[j] = entry
        for g, sg in zip(self.param_groups, groups):
            g.update({k: v for k, v in sg.items() if k != "params"})
        inner_groups, j = [], 0
        for g, ig in zip(self.param_groups, self.inner.param_groups):
            inner_groups.append(dict({k: v for k, v in g.items() if k != "params"},
                                     params=list(range(j, j + len(ig["params"])))))
            j += len(ig["params"])
        self.inner.load_state_dict({"state": inner_state, "param_groups": inner_groups})
        if masters is not None:
            with torch.no_grad():
                self._load_masters(masters)

    # -- an update computed per run, laid into the units' flat shards and back (muon.py's) --
    def runs_to_shards(self, units, views, updates) -> dict:
        """{unit index: flat [s]}: the views' (the runs') updates laid into this rank's shard of
        each of `units`, zeros elsewhere (other runs, the padding)."""
        where = {id(v): r for v, r in zip(self.views, self.runs)}
        shards = {ui: torch.zeros_like(self.masters[ui]) for ui in units}   # flat [s] each
        for v, upd in zip(views, updates):
            ui, a, n, _ = where[id(v)]
            shards[ui][a:a + n] = upd
        return shards

    def shards_to_runs(self, views, result: dict) -> list:
        """Each view's slice of its unit's flat [s] result, as (update, lr scale 1.0): a scale
        is in already, since a run may span matrices of different shapes."""
        where, out = {id(v): r for v, r in zip(self.views, self.runs)}, []
        for v in views:
            ui, a, n, _ = where[id(v)]
            out.append((result[ui][a:a + n], 1.0))
        return out


def clip_shard_grads(grads: list[torch.Tensor], max_norm: float, group=None) -> torch.Tensor:
    """Global-norm clipping from shard norms: one scalar all_reduce, no host read (the norm is
    returned as a device scalar). Padding is zero."""
    sq = torch.zeros(1, dtype=torch.float64, device=grads[0].device)
    for g in grads:
        sq += g.double().pow(2).sum()
    if not planted("clip-local-norm"):   # plant: each rank clips by its own shard's norm
        dist.all_reduce(sq, group=group)   # [1] float64, summed over W
    return clip_by_norm(sq, grads, max_norm)   # torch.nn.utils.clip_grad_norm_'s formula
