"""ZeroRedundancyOptimizer: each data-parallel rank keeps the optimizer state of 1/N of the parameters (ZeRO-1).

DDP replicas, and a Pipeline's replicas of a stage, all hold the same parameters and, after their gradient
averaging, the same gradients; a plain optimizer then keeps the same state on every replica (AdamW: two moments,
and a float32 master weight per 16-bit parameter, 12 bytes per parameter). This optimizer splits that state over
the replicas, as Megatron-LM's distributed optimizer and PyTorch's ZeroRedundancyOptimizer do: each rank updates
its shard of the parameters with an ordinary mpidist optimizer (the inner one) and the ranks then allgather the
new values. The parameters, their gradients and the gradient averaging stay as they are.

Glossary:
- bucket: the parameters of one parameter group that share a dtype and array type, flattened row-major and
  concatenated in order: ``n`` elements.
- shard: rank ``r`` of ``comm`` (``N`` ranks) owns elements ``[r S, min((r + 1) S, n))`` of a bucket, ``S =
  ceil(n / N)``: at most one element more than any other rank (the last ranks may own fewer, or none).
- piece: the part of one parameter inside this rank's shard (a shard holds pieces of one or more parameters).
- proxy: a Parameter per piece whose ``data`` and ``grad`` are, at each step, views of that part of the parameter
  and of its gradient (no copy): what the inner optimizer steps, so its state is shaped like the piece. ``params``
  lists the proxies (what ``state`` is indexed by, as in every mpidist optimizer); ``param_groups`` hold the real
  parameters, so learning-rate schedules, gradient scalers and checkpoints see the model's groups.

A step is bit for bit the plain optimizer's step: every supported update (SGD, Adam, AdamW) is elementwise, the
proxies are the same values and gradients, a parameter without a gradient is skipped (its pieces too), and a
16-bit parameter's float32 master is made from its values as the plain optimizer makes it. Communication per step: one allgather per bucket and chunk of at most
``CHUNK_BYTES`` per rank (``allgather_calls``), in the parameters' dtype: the bytes of the parameters, as many as
DDP's allreduce moves again. Checkpoints (``mpidist.checkpoint``) save a proxy's state under the keys of the
parameter its piece is of (``flat_pieces``), as FSDP's shards are saved: they load at any layout, into this
optimizer or into the plain one.
"""
from __future__ import annotations

from typing import List, NamedTuple

import numpy as np

from .. import collectives
from ..comm import check_comm
from ..comm.agree import agreed, check_same
from ..nn import Parameter
from ..optim import Optimizer
from ..xp import get_array_module

__all__ = ["ZeroRedundancyOptimizer", "CHUNK_BYTES", "shard_bounds", "allgather_calls"]

# The largest piece one allgather carries per rank: bounds the step's gathered buffer (N x this) whatever the size
# of the model, while keeping a call's latency small next to its bytes.
CHUNK_BYTES = 64 * 2**20


def shard_bounds(n: int, size: int, rank: int):
    """Return ``(start, stop)``: the elements of a bucket of ``n`` that rank ``rank`` of ``size`` owns."""
    per = -(-n // size)
    return min(n, rank * per), min(n, (rank + 1) * per)


def allgather_calls(n: int, size: int, itemsize: int, chunk_bytes: int = CHUNK_BYTES) -> List[int]:
    """Return the elements per rank of each allgather a step makes for a bucket of ``n`` elements on ``size`` ranks."""
    per = -(-n // size)
    chunk = max(1, chunk_bytes // itemsize)
    return [min(chunk, per - lo) for lo in range(0, per, chunk)]


class _Piece(NamedTuple):
    """Elements ``[start, start + count)`` of ``param`` (flattened), at ``offset`` of this rank's shard."""

    param: Parameter
    start: int
    count: int
    offset: int


class _Bucket:
    """One bucket: its parameters, their flat offsets, this rank's shard, its pieces and their proxies."""

    def __init__(self, group, params, rank, size):
        self.group = group
        self.params = params
        self.offsets = np.cumsum([0] + [p.data.size for p in params]).tolist()
        self.n = self.offsets[-1]
        self.lo, self.hi = shard_bounds(self.n, size, rank)
        self.pieces = []
        for p, a, b in zip(params, self.offsets, self.offsets[1:]):
            lo, hi = max(a, self.lo), min(b, self.hi)
            if lo < hi:
                self.pieces.append(_Piece(p, lo - a, hi - lo, lo - self.lo))
        self.proxies = [Parameter(_part(piece.param.data, piece)) for piece in self.pieces]

    def attach(self):
        """Point every proxy at its piece of the parameter's current values and gradient (views: the parameter may
        have been given new arrays since, by a model's ``load_state_dict`` or a gradient scaler)."""
        for proxy, piece in zip(self.proxies, self.pieces):
            proxy.data = _part(piece.param.data, piece)
            proxy.grad = None if piece.param.grad is None else _part(piece.param.grad, piece)

    def detach(self):
        for proxy in self.proxies:
            proxy.grad = None

    def allgather(self, comm, size, chunk_bytes):
        """Give every rank's parameters every rank's shard of this bucket (chunk by chunk), read from the proxies
        (where the update wrote them, also when it had to write elsewhere: a held, read-only parameter)."""
        first = self.params[0].data
        xp = get_array_module(first)
        per = -(-self.n // size)
        lo = 0
        for count in allgather_calls(self.n, size, first.dtype.itemsize, chunk_bytes):
            send = xp.zeros(count, dtype=first.dtype)
            for proxy, piece in zip(self.proxies, self.pieces):
                a, b = max(piece.offset, lo), min(piece.offset + piece.count, lo + count)
                if a < b:
                    send[a - lo: b - lo] = proxy.data[a - piece.offset: b - piece.offset]
            gathered = xp.empty(size * count, dtype=first.dtype)
            collectives.allgather(send, comm, out=gathered)
            for q in range(size):
                a = min(self.n, q * per + lo)
                b = min(self.n, q * per + lo + count)
                if a < b:
                    self._write(a, gathered[q * count: q * count + (b - a)])
            lo += count

    def _write(self, start, values):
        """Write ``values`` into the parameters at flat position ``start`` of this bucket."""
        stop = start + values.size
        for p, a, b in zip(self.params, self.offsets, self.offsets[1:]):
            lo, hi = max(a, start), min(b, stop)
            if lo < hi:
                p.make_writable().reshape(-1)[lo - a: hi - a] = values[lo - start: hi - start]


def _part(array, piece):
    """Return ``piece``'s elements of ``array`` (the parameter's values or gradient) as a 1-D view (a copy only for
    a non-contiguous gradient, which the update only reads)."""
    return array.reshape(-1)[piece.start: piece.start + piece.count]


class ZeroRedundancyOptimizer(Optimizer):
    """Shard ``optimizer_class``'s state over ``comm``'s ranks (see the module notes).

    ``params``: this rank's parameters (a list, or a list of groups ``{"params": [...], **options}``), the same
    shapes, dtypes and order on every rank of ``comm`` (the data-parallel group: DDP's communicator, a Pipeline's
    ``dp_comm``); ``optimizer_class``: an ``mpidist.optim.Optimizer`` subclass (SGD, Adam, AdamW) and ``defaults``
    its hyperparameters; ``chunk_bytes``: the most one allgather carries per rank. Call ``step()`` on every rank of ``comm`` after the gradients are averaged, as with the
    plain optimizer. Raises on every rank of ``comm`` (ValueError, TypeError) naming what differs or is wrong.
    """

    def __init__(self, params, optimizer_class, comm, *, chunk_bytes=CHUNK_BYTES, **defaults):
        context = "ZeroRedundancyOptimizer"
        check_comm(context, comm)
        params = list(params) if not isinstance(params, (list, tuple)) else list(params)

        def validate():
            if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, Optimizer)) or \
                    issubclass(optimizer_class, ZeroRedundancyOptimizer):
                raise TypeError(f"optimizer_class must be an mpidist.optim.Optimizer subclass such as "
                                f"optim.AdamW (got {optimizer_class!r})")
            if not params:
                raise ValueError("got an empty parameter list")
            if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 1:
                raise ValueError(f"chunk_bytes must be an int >= 1 (got {chunk_bytes!r})")
            groups = params if isinstance(params[0], dict) else [{"params": params}]
            probe = optimizer_class([Parameter(np.zeros(1))], **defaults)   # checks the hyperparameters
            options = {k: v for k, v in probe.param_groups[0].items() if k != "params"}
            for g, group in enumerate(groups):
                unknown = sorted(set(group) - set(options) - {"params"})
                if unknown:
                    raise TypeError(f"parameter group {g} has options {unknown} that "
                                    f"{optimizer_class.__name__} does not take")
                group_params = list(group["params"])
                bad = [i for i, p in enumerate(group_params) if not isinstance(p, Parameter)]
                if bad:
                    raise TypeError(f"parameters {bad} of group {g} are not mpidist.nn.Parameter")
                strided = [i for i, p in enumerate(group_params) if not p.data.flags.c_contiguous]
                if strided:
                    raise ValueError(f"parameters {strided} of group {g} are not C-contiguous (their flat "
                                     f"views would be copies)")
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
        check_same(comm, [(b.group, str(b.params[0].data.dtype), b.n, [tuple(p.data.shape) for p in b.params])
                          for b in self.buckets] + [sorted((k, repr(v)) for k, v in options.items())], context,
                   what="bucket")
        inner_groups = [{**{k: v for k, v in group.items() if k != "params"},
                         "params": [proxy for b in self.buckets if b.group == g for proxy in b.proxies]}
                        for g, group in enumerate(self.param_groups)]
        self.inner = optimizer_class(inner_groups, **defaults)
        self.params = self.inner.params       # what ``state`` is indexed by (checkpoints read the two together)
        # the pieces in the inner optimizer's order (its groups in order, each group's buckets in order)
        self._pieces = [piece for g in range(len(self.param_groups)) for b in self.buckets if b.group == g
                        for piece in b.pieces]

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

    def _step(self):
        for ours, theirs in zip(self.param_groups, self.inner.param_groups):
            theirs.update({k: v for k, v in ours.items() if k != "params"})
        for b in self.buckets:
            b.attach()
        try:
            self.inner._step()
        finally:
            for b in self.buckets:
                b.detach()
        for b in self.buckets:
            b.allgather(self.comm, self.size, self.chunk_bytes)

    def zero_grad(self, set_to_none=True):
        for group in self.param_groups:
            for p in group["params"]:
                if set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad[...] = 0

    def recycle(self, released, held):
        self.inner.recycle(released, held)

    def state_dict(self):
        """Return this rank's shard of the state (the inner optimizer's, indexed by proxy) and where it lies; it
        loads back only at the same rank of a group of the same size (``mpidist.checkpoint`` reshards)."""
        inner = self.inner.state_dict()
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": list(range(len(g["params"])))}
                  for g in self.param_groups]
        return {"state": inner["state"], "param_groups": groups,
                "zero": {"rank": self.rank, "size": self.size, "buckets": [[b.n, b.lo, b.hi] for b in self.buckets]}}

    def load_state_dict(self, state_dict):
        where = state_dict.get("zero")
        here = {"rank": self.rank, "size": self.size, "buckets": [[b.n, b.lo, b.hi] for b in self.buckets]}
        if where != here:
            raise ValueError(f"ZeroRedundancyOptimizer.load_state_dict: the state is of rank {where and where.get('rank')}"
                             f" of {where and where.get('size')} (buckets {where and where.get('buckets')}), this is "
                             f"rank {self.rank} of {self.size} (buckets {here['buckets']}); mpidist.checkpoint "
                             f"loads optimizer state at any layout")
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(f"ZeroRedundancyOptimizer.load_state_dict: {len(groups)} parameter groups, this "
                             f"optimizer has {len(self.param_groups)}")
        self.inner.load_state_dict({"state": state_dict["state"], "param_groups": [
            {**g, "params": list(range(len(ig["params"])))} for g, ig in zip(groups, self.inner.param_groups)]})
        for group, saved in zip(self.param_groups, groups):
            group.update({k: v for k, v in saved.items() if k != "params"})

    def state_bytes(self):
        """Return the bytes of this rank's optimizer state arrays (its shard's)."""
        return sum(v.nbytes for s in self.state.values() for v in s.values() if hasattr(v, "nbytes"))

