"""ZeroRedundancyOptimizer: each data-parallel rank keeps the optimizer state of 1/N of the parameters (ZeRO-1).

DDP replicas, and a Pipeline's replicas of a stage, all hold the same parameters and, after their gradient
averaging, the same gradients; a plain optimizer then keeps the same state on every replica (AdamW: two moments,
and a float32 master weight per 16-bit parameter, 12 bytes per parameter). This optimizer splits that state over
the replicas, as Megatron-LM's distributed optimizer and PyTorch's ZeroRedundancyOptimizer do: each rank updates
its shard of the parameters with an ordinary mpidist optimizer (the inner one) and the ranks then allgather the
new values. The parameters, their gradients and the gradient averaging stay as they are.

Glossary:
- bucket: the parameters of one parameter group that share a dtype and array type; one allgather (per chunk)
  carries a bucket's new values.
- shard: every parameter of ``n`` elements is split over the ``N`` ranks of ``comm`` as FSDP splits it: rank
  ``r`` owns elements ``[r S, min((r + 1) S, n))``, ``S = ceil(n / N)`` (the last ranks may own fewer, or
  none). A parameter is split on its own, so two copies of one weight (a pipeline's tied embedding on its first
  and last stage) are split alike, whatever else their stages hold.
- piece: the part of one parameter a rank owns. ``width``: a bucket's ``sum(S)``, the elements every rank
  sends per step (its pieces, each padded to ``S``).
- proxy: a Parameter per piece whose ``data`` and ``grad`` are, at each step, views of that part of the parameter
  and of its gradient (no copy): what the inner optimizer steps, so its state is shaped like the piece. ``params``
  lists the proxies (what ``state`` is indexed by, as in every mpidist optimizer); ``param_groups`` hold the real
  parameters, so learning-rate schedules, gradient scalers and checkpoints see the model's groups.

A step is bit for bit the plain optimizer's step: every supported update (SGD, Adam, AdamW) is elementwise, the
proxies are the same values and gradients, a parameter without a gradient is skipped (its pieces too), and a
16-bit parameter's float32 master is made from its values as the plain optimizer makes it. Communication per
step: one allgather per bucket and chunk of at most ``chunk_bytes`` per rank (``allgather_calls``), in the
parameters' dtype; the first carries one more element per rank, whether that rank's update failed, so that a
failure on one rank raises on every rank after the values were exchanged (never a rank left waiting). Its bytes
are half of DDP's allreduce of the same parameters. Checkpoints (``mpidist.checkpoint``) save a proxy's state under
the key of the parameter its piece is of (``flat_pieces``), as FSDP's shards are saved: they load at any layout,
into this optimizer or into the plain one. With ``DDP.join``, pass the optimizer (``join(optimizer=opt)``): the
joined ranks must take part in its allgathers (``join()`` without it refuses, reading ``sharding_optimizer``).
"""
from __future__ import annotations

import hashlib
import weakref
from typing import List, NamedTuple

import numpy as np

from .. import collectives
from ..comm import check_comm
from ..comm.agree import agreed, check_same, name_ranks
from ..nn import Parameter
from ..optim import Optimizer
from ..xp import get_array_module, to_numpy
from .agreement import check_same_shards

__all__ = ["ZeroRedundancyOptimizer", "CHUNK_BYTES", "shard_bounds", "allgather_calls", "shard_width",
           "sharding_optimizer"]

# parameter -> (a weak reference to) the ZeroRedundancyOptimizer stepping it; beside the parameter, not on it, so
# that parameters stay picklable and are not kept alive by it
_SHARDED_BY = weakref.WeakKeyDictionary()


def sharding_optimizer(param):
    """Return the live ZeroRedundancyOptimizer that steps ``param`` (None if none does)."""
    ref = _SHARDED_BY.get(param)
    return None if ref is None else ref()


# The largest piece one allgather carries per rank: bounds the step's gathered buffer (N x this) whatever the size
# of the model, while keeping a call's latency small next to its bytes.
CHUNK_BYTES = 64 * 2**20


def shard_bounds(n: int, size: int, rank: int):
    """Return ``(start, stop)``: the elements of a parameter of ``n`` that rank ``rank`` of ``size`` owns."""
    per = -(-n // size)
    return min(n, rank * per), min(n, (rank + 1) * per)


def shard_width(sizes, size: int) -> int:
    """Return the elements every rank sends for a bucket of parameters of ``sizes`` elements: ``sum(ceil(n / N))``
    (the first rank's shard, the largest)."""
    return sum(-(-n // size) for n in sizes)


def allgather_calls(width: int, itemsize: int, chunk_bytes: int = CHUNK_BYTES) -> List[int]:
    """Return the elements per rank of each allgather a step makes for a bucket of ``width`` (``shard_width``),
    before the first one's status element."""
    chunk = max(1, chunk_bytes // itemsize)
    return [min(chunk, width - lo) for lo in range(0, width, chunk)]


class _Piece(NamedTuple):
    """Elements ``[start, start + count)`` of ``param`` (flattened), at ``offset`` of the rank's padded layout."""

    param: Parameter
    start: int
    count: int
    offset: int


class _Bucket:
    """One bucket: its parameters, each one's place in the padded per-rank layout, this rank's pieces, their proxies."""

    def __init__(self, group, params, rank, size):
        self.group, self.params, self.size = group, params, size
        self.sizes = [p.data.size for p in params]
        self.per = [-(-n // size) for n in self.sizes]
        self.starts = np.cumsum([0] + self.per).tolist()
        self.width = self.starts[-1]
        self.pieces = []
        for p, n, s, at in zip(params, self.sizes, self.per, self.starts):
            lo, hi = shard_bounds(n, size, rank)
            if lo < hi:
                self.pieces.append(_Piece(p, lo, hi - lo, at))
        self.proxies = [Parameter(_part(piece.param.data, piece)) for piece in self.pieces]
        self._viewed = [piece.param.data for piece in self.pieces]   # the arrays the proxies' views are of

    def attach(self):
        """Point every proxy at its piece of the parameter's values and gradient (views). A parameter given a new
        array since (a model's ``load_state_dict``) gets a new view, so the inner optimizer checks a 16-bit one's
        master against its values; otherwise the same view, so it needs not."""
        for k, (proxy, piece) in enumerate(zip(self.proxies, self.pieces)):
            data = _contiguous(piece.param)
            if data is not self._viewed[k]:
                proxy.data, self._viewed[k] = _part(data, piece), data
            proxy.grad = None if piece.param.grad is None else _part(piece.param.grad, piece)

    def detach(self):
        for proxy in self.proxies:
            proxy.grad = None

    def allgather(self, comm, chunk_bytes, status=None):
        """Give every rank's parameters every rank's pieces (chunk by chunk), read from the proxies (where the update
        wrote them, also when it had to write elsewhere: a held, read-only parameter). ``status``: this rank's
        flag, sent with the first chunk; return every rank's flags (None without)."""
        first = self.params[0].data
        xp = get_array_module(first)
        size, lo, flags = self.size, 0, None
        for count in allgather_calls(self.width, first.dtype.itemsize, chunk_bytes) or [0]:
            extra = 1 if status is not None and lo == 0 else 0
            send = xp.zeros(count + extra, dtype=first.dtype)
            for proxy, piece in zip(self.proxies, self.pieces):
                a, b = max(piece.offset, lo), min(piece.offset + piece.count, lo + count)
                if a < b:
                    send[a - lo: b - lo] = proxy.data[a - piece.offset: b - piece.offset]
            if extra:
                send[count] = status
            gathered = xp.empty(size * (count + extra), dtype=first.dtype).reshape(size, count + extra)
            collectives.allgather(send, comm, out=gathered.reshape(-1))
            if extra:
                flags = [float(v) for v in to_numpy(gathered[:, count])]
            for p, n, s, at in zip(self.params, self.sizes, self.per, self.starts):
                a, b = max(at, lo), min(at + s, lo + count)
                if a < b:
                    self._write(p, n, s, a - at, b - at, gathered[:, a - lo: b - lo])
            lo += count
        return flags

    @staticmethod
    def _write(p, n, s, j0, j1, block):
        """Write ``block`` (rank by rank: elements ``j0:j1`` of each rank's piece of ``p``, ``s`` a piece's size) into
        ``p``."""
        flat = _contiguous(p, writable=True).reshape(-1)
        full = n // s   # ranks whose piece is whole
        if full:
            flat[:full * s].reshape(full, s)[:, j0:j1] = block[:full]
        q = full
        while q < block.shape[0] and q * s + j0 < n:   # the last, shorter piece
            stop = min(n, q * s + j1)
            flat[q * s + j0: stop] = block[q, :stop - q * s - j0]
            q += 1


def _part(array, piece):
    """Return ``piece``'s elements of ``array`` (the parameter's values or gradient) as a 1-D view (a copy only for
    a non-contiguous gradient, which the update only reads)."""
    return array.reshape(-1)[piece.start: piece.start + piece.count]


def _contiguous(param, writable=False):
    """Return ``param.data``, first moved to a contiguous (and, with ``writable``, writable) copy if it is not one:
    its flat views must be views."""
    if writable:
        param.make_writable()
    if not param.data.flags.c_contiguous:
        param.data = get_array_module(param.data).ascontiguousarray(param.data)
    return param.data


def _digest(arrays):
    h = hashlib.blake2b(digest_size=8)
    for a in arrays:
        h.update(np.ascontiguousarray(to_numpy(a)).reshape(-1).view(np.uint8).tobytes())
    return h.hexdigest()


class ZeroRedundancyOptimizer(Optimizer):
    """Shard ``optimizer_class``'s state over ``comm``'s ranks (see the module notes).

    ``params``: this rank's parameters (a list, or a list of groups ``{"params": [...], **options}``), the same
    shapes, dtypes, order and (from the first step on) values on every rank of ``comm``: the data-parallel group
    (DDP's communicator, a Pipeline's ``dp_comm``), never FSDP's shards or ranks holding different tensor-parallel
    slices; ``optimizer_class``: an ``mpidist.optim.Optimizer`` subclass (SGD, Adam, AdamW) and ``defaults`` its
    hyperparameters; ``chunk_bytes``: the most one allgather carries per rank. Call ``step()`` on every rank of
    ``comm`` after the gradients are averaged, as with the plain optimizer. Raises on every rank of ``comm``
    (ValueError, TypeError) naming what differs or is wrong.
    """

    def __init__(self, params, optimizer_class, comm, *, chunk_bytes=CHUNK_BYTES, **defaults):
        context = "ZeroRedundancyOptimizer"
        check_comm(context, comm)
        params = list(params)

        def validate():
            if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, Optimizer)) or \
                    issubclass(optimizer_class, ZeroRedundancyOptimizer):
                raise TypeError(f"optimizer_class must be an mpidist.optim.Optimizer subclass such as "
                                f"optim.AdamW (got {optimizer_class!r})")
            if not params:
                raise ValueError("got an empty parameter list")
            if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 1:
                raise ValueError(f"chunk_bytes must be an int >= 1 (got {chunk_bytes!r})")
            # each group's parameters as a list (a generator, e.g. module.parameters(), is read once, here)
            groups = [{**g, "params": list(g["params"])} for g in params] if isinstance(params[0], dict) \
                else [{"params": params}]
            probe = optimizer_class([Parameter(np.zeros(1))], **defaults)   # checks the hyperparameters
            options = {k: v for k, v in probe.param_groups[0].items() if k != "params"}
            for g, group in enumerate(groups):
                unknown = sorted(set(group) - set(options) - {"params"})
                if unknown:
                    raise TypeError(f"parameter group {g} has options {unknown} that "
                                    f"{optimizer_class.__name__} does not take")
                bad = [i for i, p in enumerate(group["params"]) if not isinstance(p, Parameter)]
                if bad:
                    raise TypeError(f"parameters {bad} of group {g} are not mpidist.nn.Parameter")
            return groups, options

        groups, options = agreed(comm, validate, context)
        super().__init__(groups, options)
        self.comm, self.rank, self.size = comm, comm.Get_rank(), comm.Get_size()
        self.chunk_bytes = chunk_bytes
        self.buckets: List[_Bucket] = []
        for g, group in enumerate(self.param_groups):
            by_kind = {}
            for p in group["params"]:
                by_kind.setdefault((str(p.data.dtype), type(p.data).__module__), []).append(p)
            self.buckets.extend(_Bucket(g, ps, self.rank, self.size) for ps in by_kind.values())
        check_same(comm, [(b.group, str(b.params[0].data.dtype), [tuple(p.data.shape) for p in b.params])
                          for b in self.buckets]
                   + [("optimizer", optimizer_class.__qualname__, chunk_bytes)]
                   + [("group", g, sorted((k, repr(v)) for k, v in group.items() if k != "params"))
                      for g, group in enumerate(self.param_groups)], context, what="entry (bucket, optimizer, group)")
        check_same_shards(comm, [(f"group {g} parameter {i}", p) for g, group in enumerate(self.param_groups)
                                 for i, p in enumerate(group["params"])], context)
        inner_groups = [{**{k: v for k, v in group.items() if k != "params"},
                         "params": [proxy for b in self.buckets if b.group == g for proxy in b.proxies]}
                        for g, group in enumerate(self.param_groups)]
        self.inner = optimizer_class(inner_groups, **defaults)
        self.params = self.inner.params       # what ``state`` is indexed by (checkpoints read the two together)
        # the pieces in the inner optimizer's order (its groups in order, each group's buckets in order)
        self._pieces = [piece for g in range(len(self.param_groups)) for b in self.buckets if b.group == g
                        for piece in b.pieces]
        self._values_checked = False
        for group in self.param_groups:   # what DDP.join reads: its joined ranks must step this optimizer too
            for p in group["params"]:
                _SHARDED_BY[p] = weakref.ref(self)

    # The inner optimizer holds the state; checkpoints and users read and replace it here.
    @property
    def state(self):
        return self.inner.state if "inner" in self.__dict__ else self.__dict__.get("_state", {})

    @state.setter
    def state(self, value):
        if "inner" in self.__dict__:
            self.inner.state = value
        else:
            self.__dict__["_state"] = value

    @property
    def state_type(self):
        """The optimizer type a checkpoint records: the inner one's, so state moves to and from the plain optimizer."""
        return type(self.inner).__qualname__

    def flat_pieces(self, index):
        """Return the pieces of real parameters that proxy ``index`` (of ``params``) holds: ``[(param, start, count,
        offset)]`` (one), start in the parameter flattened, offset 0 in the proxy."""
        piece = self._pieces[index]
        return [piece._replace(offset=0)]

    def _check_values(self):
        """At the first step: every rank must hold the same values (replicas), or the allgather would overwrite each
        rank's own numbers with the others' (FSDP's shards, another tensor-parallel slice)."""
        check_same(self.comm, [(b.group, str(b.params[0].data.dtype), _digest(p.data for p in b.params))
                               for b in self.buckets],
                   "ZeroRedundancyOptimizer.step: the ranks of its communicator hold different values of the "
                   "parameters at the first step; it splits the state of replicas (DDP's communicator, a Pipeline's "
                   "dp_comm), not of FSDP's shards or of ranks holding different tensor-parallel slices",
                   what="(group, dtype, digest of the values) of bucket")
        self._values_checked = True

    def _step(self):
        if not self._values_checked:
            self._check_values()
        self._sync_hyperparameters()
        error = None
        try:
            for b in self.buckets:
                b.attach()
            self.inner._step()
        except Exception as exc:  # noqa: BLE001 - the values are still exchanged, then every rank raises
            error = exc
        finally:
            for b in self.buckets:
                b.detach()
        flags = None
        for k, b in enumerate(self.buckets):
            got = b.allgather(self.comm, self.chunk_bytes, status=(1.0 if error else 0.0) if k == 0 else None)
            flags = got if k == 0 else flags
        failed = [r for r, f in enumerate(flags or []) if f]
        if failed:
            mine = f"{type(error).__name__}: {error}" if error is not None else None
            raise RuntimeError(f"ZeroRedundancyOptimizer.step: the update failed on {name_ranks(failed)} (this rank: "
                               f"{mine or 'updated'}); every rank holds every rank's shard as it stood after its "
                               f"update") from error
        for group in self.param_groups:   # as the plain optimizer counts each parameter's updates
            for p in group["params"]:
                if p.grad is not None:
                    p.version += 1

    def zero_grad(self, set_to_none=True):
        for group in self.param_groups:
            for p in group["params"]:
                if set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad[...] = 0

    def recycle(self, released, held):
        self.inner.recycle(released, held)

    def _layout(self):
        return {"rank": self.rank, "size": self.size,
                "buckets": [[b.group, str(b.params[0].data.dtype), b.sizes] for b in self.buckets]}

    def _sync_hyperparameters(self):
        for ours, theirs in zip(self.param_groups, self.inner.param_groups):
            theirs.update({k: v for k, v in ours.items() if k != "params"})

    def state_dict(self):
        """Return this rank's shard of the state (the inner optimizer's, indexed by proxy) and where it lies; it
        loads back only at the same rank of a group of the same size (``mpidist.checkpoint`` reshards)."""
        self._sync_hyperparameters()
        inner = self.inner.state_dict()
        return {"state": inner["state"], "param_groups": inner["param_groups"], "zero": self._layout()}

    def load_state_dict(self, state_dict):
        where, here = state_dict.get("zero"), self._layout()
        if where != here:
            raise ValueError(f"ZeroRedundancyOptimizer.load_state_dict: the state is of rank "
                             f"{where and where.get('rank')} of {where and where.get('size')}, this is rank "
                             f"{self.rank} of {self.size} (or the parameters differ); mpidist.checkpoint loads "
                             f"optimizer state at any layout")
        self.inner.load_state_dict({"state": state_dict["state"], "param_groups": state_dict["param_groups"]})
        for ours, theirs in zip(self.param_groups, self.inner.param_groups):
            ours.update({k: v for k, v in theirs.items() if k != "params"})

    def state_bytes(self):
        """Return the bytes of this rank's optimizer state arrays (its shard's)."""
        return sum(v.nbytes for s in self.state.values() for v in s.values() if hasattr(v, "nbytes"))
