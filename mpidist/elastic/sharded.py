"""FSDP state that survives the loss of ranks: each rank's shard is also held by buddy ranks, in memory.

Words used here:

- *position*: a rank's place in the communicator a commit was taken over. A commit remembers the world ranks
  of every position, so it can be read whatever failed since, and the chunk (shard index) each position holds:
  its position under ``full_shard``/``shard_grad_op``; under hybrid sharding the replicas of a chunk (one per
  shard group) hold equal packets, so each is a holder of that chunk besides the buddies.
- *packet*: one position's committed shards as bytes, unit after unit: the flat parameter shard, then each
  per-parameter optimizer array (Adam's ``exp_avg``...) shaped like it, in sorted key order. Every position's
  packet has the same layout and size (FSDP's shards are equal-sized).
- *buddies*: with ``replicas=R`` the packet of position ``j`` is also held by positions ``j+1 .. j+R-1``
  (mod the size). A commit sends a rank's packet to its ``R-1`` successors and receives its ``R-1``
  predecessors' packets (``Sendrecv`` around the ring); only then is the commit complete on that rank.
- *commit id*: ``step * ID_SCALE + ranks lost when the layout was made``: the survivors agree on the smallest,
  which is the oldest step any of them may need and, for equal steps, the older layout (see ``restore``).

A failure: the survivors agree on a commit that all of them hold (ranks are at most one commit apart, and
two are kept). For every chunk of that commit's layout, the first live rank among its holders (the positions
holding it, then their buddies) provides its packet; one ``Allgatherv`` over the survivors gives every survivor
every chunk, from which it rebuilds each unit's full flat parameter and optimizer arrays. The old FSDP lets go of
the module (``FSDP.remove``), the module's parameters get their full values, ``build(comm)`` wraps it
again over the survivors (a new FSDP, its shards cut for the new size), and the optimizer and schedule are
made anew by the given factories and loaded with the re-cut arrays. The survivors then commit at once in the
new layout without communicating (every survivor holds the full arrays, so it cuts its buddies' packets
itself), so a second failure right after is covered. A position none of whose holders survives cannot be
restored: every survivor raises the same ``RuntimeError`` naming it (use more replicas).

Memory: a commit holds, per kept commit (two), this rank's packet and ``R-1`` buddy packets, i.e.
``keep * R`` times the persistent per-rank bytes of parameter and optimizer shards (``FSDP.memory_stats``);
``stats["commit_bytes"]`` reports one commit's. Buffers are reused from the oldest kept commit, so steady
state allocates nothing. A restore holds the full model and optimizer state on every survivor for a moment.
Until its first commit is known to be held by every rank (a barrier ends that commit) every rank also keeps the
module's own arrays from before FSDP sharded it, so that a rank lost before then lets the survivors start again
(``forget_commits``). ``build(comm)`` must end with the FSDP's construction (no collective after it): a failure
after it but before ``build`` returns would leave that FSDP attached to the module.
"""

import time

import numpy as np
from mpi4py import MPI

from ..comm import world_ranks
from .state import Replicated, _param_groups

__all__ = ["ShardedState", "ID_SCALE"]

ID_SCALE = 1 << 20  # commit id = step * ID_SCALE + ranks lost at the layout (fewer than this many ranks)


class _Layout:
    """How the packets of one FSDP layout are cut: units, their shard sizes, the optimizer keys per unit."""

    def __init__(self, units, opt_keys):
        self.units = units            # [(label, spans, numel, shard_numel, dtype)]
        self.opt_keys = opt_keys      # [sorted keys of the unit's per-shard optimizer arrays]
        self.fields = []              # (unit index, key or None for the parameter, byte offset, count, dtype)
        offset = 0
        for u, ((_, _, _, shard_numel, dtype), keys) in enumerate(zip(units, opt_keys)):
            for key in (None, *keys):
                self.fields.append((u, key, offset, shard_numel, dtype))
                offset += shard_numel * dtype.itemsize
        self.nbytes = offset

    def views(self, packet):
        """Return ``{(unit, key): typed view}`` of a packet (a uint8 array of ``nbytes``)."""
        return {(u, key): packet[o:o + n * dt.itemsize].view(dt) for u, key, o, n, dt in self.fields}


class ShardedState(Replicated):
    """The state of FSDP training kept in memory with buddy copies of every shard (``replicas`` holders each).

    ``module``: the model FSDP wraps (built alike on every rank). ``optimizer(params)`` and
    ``scheduler(optimizer)`` (optional) are factories: the optimizer is made over the FSDP's shard parameters
    at the start and again after each failure (the shards change size); use ``state.optimizer`` and
    ``state.scheduler`` in the step. The FSDP shards every unit alike over the whole communicator: fully, or
    hybrid (shard groups replicated across groups). ``replicas``: how many ranks hold each position's packet
    (2: itself and one buddy), capped at the number of live ranks.
    """

    def __init__(self, module, optimizer, scheduler=None, sampler=None, rngs=(), extra=None, replicas=2, keep=2):
        super().__init__(sampler, rngs, extra, keep)
        if not callable(optimizer) or (scheduler is not None and not callable(scheduler)):
            raise TypeError(f"ShardedState: optimizer and scheduler must be factories, optimizer(params) and "
                            f"scheduler(optimizer) (got {type(optimizer).__name__}, {type(scheduler).__name__}): "
                            f"they are made again over the new shards after a failure")
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
            raise ValueError(f"ShardedState: replicas must be an int >= 1 (got {replicas!r})")
        self.module, self.replicas = module, replicas
        self._make_optimizer, self._make_scheduler = optimizer, scheduler
        self.optimizer = self.scheduler = self.wrapper = self.comm = None
        self._params = dict(module.named_parameters())
        self._buffers = [b for _, b in module.named_buffers()]
        self._world = None  # world ranks of the current layout's positions
        # The module's own arrays before the first FSDP took it apart (FSDP copies out of them and never writes
        # them) and the small state then: a rank lost before the first commit completed everywhere leaves the
        # survivors nothing else to start again from. Dropped once every rank is known to hold the first commit.
        self._start_values = None

    # -- what the survivors agree on ------------------------------------------------------------------------
    def held_bytes(self):
        """Bytes of the kept commits' packets on this rank (own shards and buddy copies)."""
        return sum(r["own"].nbytes + sum(b.nbytes for b in r["buddies"].values()) for r in self._commits)

    def _replicas(self):
        """Holders per packet this layout needs: ``replicas`` (capped at the ranks), or 1 (no buddies) where
        hybrid sharding (or no_shard) already keeps that many copies of every chunk."""
        replicas = min(self.replicas, len(self._world))
        return 1 if self._copies >= replicas else replicas

    def _id(self, step):
        return step * ID_SCALE + (MPI.COMM_WORLD.Get_size() - len(self._world))

    # -- building -------------------------------------------------------------------------------------------
    def start(self, build, comm):
        """Wrap the module (``build(comm)``, an FSDP) and make the optimizer and schedule over its shards."""
        if self._start_values is None and not self._commits:
            self._start_values = {name: p.data for name, p in self._params.items()}
        self._remember_start(self._buffers)
        return self._attach(build, comm)

    def cannot_start_again(self):
        if self._start_values is None:
            return ("ShardedState no longer holds the module's starting values (dropped once every rank held the "
                    "first commit)")
        return None

    def forget_commits(self):
        """Back to where training started, to start again over the survivors: the module's parameters get their
        starting values back (a failure may have cut the first FSDP's construction short), and so does the small
        state (sampler, generators, extras, buffers), on every survivor alike."""
        self._back_to_start(self._buffers)
        for name, p in self._params.items():
            p.data = self._start_values[name].copy()  # a copy: the starting values stay for another start
            p.grad = None
        self.wrapper = self.optimizer = self.scheduler = None

    def _attach(self, build, comm):
        wrapper = build(comm)
        layout = wrapper.shard_layout()
        size = comm.Get_size()
        kinds = {(s.num_shards, s.num_replicas) for s in layout}
        if len(kinds) != 1 or any(k * r != size for k, r in kinds):
            raise ValueError(f"ShardedState: every unit of the FSDP must be sharded alike over all {size} ranks "
                             f"(shards x replicas = {size}: full_shard, shard_grad_op or a hybrid strategy); units "
                             f"(label, shards, replicas): {[(s.label, s.num_shards, s.num_replicas) for s in layout]}")
        self.wrapper, self.comm = wrapper, comm
        self._world = world_ranks(comm)
        # Which chunk each position holds: under hybrid sharding the replicas of a chunk are natural holders.
        self._shard_of = list(wrapper.groups.shard_of)
        self._copies = size // (max(self._shard_of) + 1)  # ranks holding each chunk without any buddy
        self.optimizer = self._make_optimizer(list(wrapper.parameters()))
        shards = [s.parameter for s in layout]
        if len(self.optimizer.params) != len(shards) or any(a is not b for a, b in zip(self.optimizer.params, shards)):
            raise ValueError("ShardedState: the optimizer factory must take the FSDP's shard parameters in the "
                             "order given (one per unit)")
        self.scheduler = None if self._make_scheduler is None else self._make_scheduler(self.optimizer)
        return wrapper

    def _layout(self):
        units = [(s.label, s.params, s.numel, s.shard_numel, np.dtype(s.parameter.data.dtype))
                 for s in self.wrapper.shard_layout()]
        keys = [sorted(k for k, v in self.optimizer.state.get(i, {}).items()
                       if hasattr(v, "shape") and tuple(v.shape) == (units[i][3],)) for i in range(len(units))]
        return _Layout(units, keys)

    # -- commit ---------------------------------------------------------------------------------------------
    def commit(self):
        """Copy this rank's shards and receive its predecessors' (collective: a ring of ``Sendrecv``)."""
        if self._commits and self._commits[-1]["id"] == self._id(self.step):
            return
        start = time.perf_counter()
        layout = self._layout()
        replicas = self._replicas()
        spare = self._commits.pop(0) if len(self._commits) >= self.keep else None  # its buffers are reused
        own = _buffer(spare, "own", layout.nbytes)
        views = layout.views(own)
        for (u, key), view in views.items():
            shard = self.optimizer.params[u].data if key is None else self.optimizer.state[u][key]
            view[...] = shard
        comm, position, size = self.comm, self.comm.Get_rank(), self.comm.Get_size()
        buddies = {}
        for d in range(1, replicas):
            if d == 2:  # MPIDIST_FAULT at=commit: after the first exchange, so that some ranks hold this commit
                for fault in self.faults:
                    fault.maybe_fail(MPI.COMM_WORLD.Get_rank(), self.step, at="commit")
            source = (position - d) % size
            received = _buffer(spare, ("buddy", d), layout.nbytes)
            status = MPI.Status()
            comm.Sendrecv([own, MPI.BYTE], (position + d) % size, 0x5E1A, [received, MPI.BYTE], source, 0x5E1A,
                          status)
            if status.Get_count(MPI.BYTE) != layout.nbytes:
                raise RuntimeError(f"ShardedState.commit: position {source}'s packet has {status.Get_count(MPI.BYTE)} "
                                   f"bytes, this rank's {layout.nbytes}: the ranks' optimizer states differ")
            buddies[source] = received
        self._commits.append(self._record(layout, own, buddies, replicas))
        if self._start_values is not None:
            # Completes only once every rank entered it, i.e. took its first commit: from then on no failure can
            # find a survivor without one, and the unsharded starting values need not stay alive any longer.
            comm.Barrier()
            self._start_values = self._start_replicated = None
        self.stats["commits"] += 1
        self.stats["commit_s"] += time.perf_counter() - start
        self.stats["commit_bytes"] = layout.nbytes * replicas

    def _record(self, layout, own, buddies, replicas):
        scalars = {i: {k: v for k, v in s.items() if not hasattr(v, "shape")} for i, s in self.optimizer.state.items()}
        return {"id": self._id(self.step), "step": self.step, "world": list(self._world), "replicas": replicas,
                "shard_of": list(self._shard_of), "position": self.comm.Get_rank(), "layout": layout, "own": own,
                "buddies": buddies,
                "optimizer": {"scalars": scalars, "param_groups": _param_groups(self.optimizer)},
                "replicated": self._save_replicated(self.scheduler, self._buffers)}

    # -- restore --------------------------------------------------------------------------------------------
    def restore(self, failure, build, comm):
        """Rebuild the agreed commit's full state from the survivors' packets and re-shard it over ``comm``."""
        where = [r for r in self._commits if r["id"] == failure.commit]
        if not where:
            raise RuntimeError(f"ShardedState.restore: no commit with id {failure.commit} is held (held: "
                               f"{[r['id'] for r in self._commits]})")
        record = where[0]
        del self._commits[self._commits.index(record) + 1:]
        full, how = self._gather_full(record, comm)
        old = self.wrapper
        if old is not None:
            old.remove()
        layout = record["layout"]
        for u, (label, spans, numel, _, _) in enumerate(layout.units):
            for span in spans:
                p = self._params[span.name]
                p.data = full[(u, None)][span.offset:span.offset + span.numel].reshape(span.shape).copy()
                p.grad = None
        self._load_replicated(record["replicated"], None, self._buffers)
        wrapper = self._attach(build, comm)
        new = wrapper.shard_layout()
        if [(s.label, s.numel) for s in new] != [(u[0], u[2]) for u in layout.units]:
            raise RuntimeError(f"ShardedState.restore: build(comm) made other units "
                               f"({[(s.label, s.numel) for s in new]}) than were committed "
                               f"({[(u[0], u[2]) for u in layout.units]})")
        state = {}
        for i, s in enumerate(new):
            state[i] = dict(record["optimizer"]["scalars"].get(i, {}))
            for key in layout.opt_keys[i]:
                state[i][key] = _cut(full[(i, key)], s.shard_numel, s.shard_index)
        self.optimizer.load_state_dict({"state": state, "param_groups": record["optimizer"]["param_groups"]})
        self.optimizer.zero_grad()
        if self.scheduler is not None:
            self.scheduler.load_state_dict(record["replicated"]["scheduler"])
        self.step = record["step"]
        failure.restored_from = how
        # Every survivor holds a commit from here on, and the first commit's barrier may have completed on some
        # ranks only: drop the starting values everywhere alike, so that no later commit waits in that barrier.
        self._start_values = self._start_replicated = None
        self._commit_from_full(full)
        return wrapper

    def _gather_full(self, record, comm):
        """Return ``({(unit, key): full flat array}, description)`` of ``record``, gathered over ``comm``."""
        world, replicas, layout, shard_of = record["world"], record["replicas"], record["layout"], record["shard_of"]
        alive = world_ranks(comm)
        where = {w: r for r, w in enumerate(alive)}
        n = len(world)
        chunks = max(shard_of) + 1
        provider = []  # per chunk: (the comm rank that sends it, the old position whose packet it sends)
        for j in range(chunks):
            positions = [i for i in range(n) if shard_of[i] == j]  # one, or the replicas of a hybrid FSDP
            # Position i's packet is held by itself and its buddies, the next replicas - 1 positions.
            holders = [(world[(i + d) % n], i) for i in positions for d in range(replicas)]
            live = [(where[w], i) for w, i in holders if w in where]
            if not live:
                what = (f"position {positions[0]} (world rank {world[positions[0]]})" if len(positions) == 1 else
                        f"chunk {j} (positions {positions}, world ranks {[world[i] for i in positions]})")
                raise RuntimeError(f"ShardedState: the shards of {what} are lost: all {len(holders)} holder(s), world "
                                   f"ranks {[w for w, _ in holders]}, failed; use more replicas")
            provider.append(live[0])
        me = comm.Get_rank()
        mine = [j for j in range(chunks) if provider[j][0] == me]
        packets = {record["position"]: record["own"], **record["buddies"]}
        send = np.concatenate([packets[provider[j][1]] for j in mine]) if mine else np.empty(0, np.uint8)
        counts = [sum(1 for p, _ in provider if p == r) * layout.nbytes for r in range(comm.Get_size())]
        order = [j for r in range(comm.Get_size()) for j in range(chunks) if provider[j][0] == r]
        received = np.empty(chunks * layout.nbytes, np.uint8)
        comm.Allgatherv([send, MPI.BYTE], [received, (counts, None), MPI.BYTE])
        full = {}
        for u, key, offset, count, dtype in layout.fields:
            flat = np.empty(chunks * count, dtype)
            for slot, i in enumerate(order):
                at = slot * layout.nbytes + offset
                flat[i * count:(i + 1) * count] = received[at:at + count * dtype.itemsize].view(dtype)
            full[(u, key)] = flat[:layout.units[u][2]]
        from_buddies = sorted(world[i] for i in range(n) if world[i] not in where)
        how = (f"in-memory commit; shards of world rank(s) {from_buddies} from their "
               f"{'replicas or buddies' if chunks < n else 'buddies'}, re-sharded {n} -> {comm.Get_size()}"
               + (f" ({chunks} chunks x {n // chunks} replicas before)" if chunks < n else ""))
        return full, how

    def _commit_from_full(self, full):
        """Commit the restored state in the new layout, cutting the buddies' packets from the full arrays."""
        start = time.perf_counter()
        layout = self._layout()
        size, position = len(self._world), self.comm.Get_rank()
        replicas = self._replicas()

        def packet(i):  # position i's: the chunk it holds
            out = np.empty(layout.nbytes, np.uint8)
            for (u, key), view in layout.views(out).items():
                view[...] = _cut(full[(u, key)], layout.units[u][3], self._shard_of[i])
            return out

        buddies = {(position - d) % size: packet((position - d) % size) for d in range(1, replicas)}
        self._commits.append(self._record(layout, packet(position), buddies, replicas))
        del self._commits[:-self.keep]
        self.stats["commits"] += 1
        self.stats["commit_s"] += time.perf_counter() - start
        self.stats["commit_bytes"] = layout.nbytes * replicas


def _cut(full, shard_numel, index):
    """Return shard ``index`` of ``full`` (zero padding past its end), a new array."""
    out = np.zeros(shard_numel, full.dtype)
    piece = full[index * shard_numel:(index + 1) * shard_numel]
    out[:len(piece)] = piece
    return out


def _buffer(spare, name, nbytes):
    """Reuse the dropped commit's buffer ``name`` when it has the right size (no page faults per commit)."""
    if spare is not None:
        old = spare["own"] if name == "own" else spare["buddies"].get((spare["position"] - name[1]) % len(spare["world"]))
        if old is not None and old.nbytes == nbytes:
            return old
    return np.empty(nbytes, np.uint8)
