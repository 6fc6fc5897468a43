"""What several test modules share (tests import this module, never each other)."""
import numpy as np

from mpidist import nn, optim
from mpidist.models import tensor_parallel
from mpidist.nn.placement import boxes, global_shape
from mpidist.parallel import DDP, FSDP, Pipeline, Wrapper, mesh


def reassemble(comm, placed, read):
    """Return {name: global array} from every rank's ``read(parameter)``, cut into boxes by ``boxes()`` alone.

    ``placed``: this rank's ``PlacedParameter``s (pass the primary copies only where a tied weight has others).
    Collective over ``comm`` (one allgather), which must span every rank holding a part. Elements several ranks
    hold (replicas) must agree exactly; an element no rank holds stays NaN.
    """
    mine = []
    for p in placed:
        local = np.asarray(read(p.parameter))
        mine.append((p.name, global_shape(p.placement, local.shape),
                     [(b.offsets, b.sizes, b.view(local).copy()) for b in boxes(p.placement, local.shape, name=p.name)]))
    full = {}
    for items in comm.allgather(mine):
        for name, shape, pieces in items:
            out = full.setdefault(name, np.full(shape, np.nan))
            for offsets, sizes, data in pieces:
                region = out[tuple(slice(a, a + n) for a, n in zip(offsets, sizes))]
                held = ~np.isnan(region)
                np.testing.assert_array_equal(region[held], data[held], err_msg=f"{name}: replicas differ")
                region[...] = data
    return full


def assert_reassembles(comm, placed, read, expected, atol=0.0):
    """Assert that ``reassemble(comm, placed, read)`` equals ``expected`` ({name: array}), names and values.

    ``atol`` 0 asks for equality; every element must be held by some rank (NaN fails the comparison).
    """
    full = reassemble(comm, placed, read)
    assert sorted(full) == sorted(expected), "the placed names are not the unsplit model's"
    for name, want in expected.items():
        np.testing.assert_allclose(full[name], want, rtol=0, atol=atol, err_msg=name)


def train_slice(model, wrapped, opt, batch, dp, dp_rank, pipeline, steps):
    """Take ``steps`` steps of ``opt`` on data-parallel rank ``dp_rank``'s 1/``dp`` of ``batch`` through ``wrapped``.

    ``wrapped`` is a Pipeline (``pipeline`` true: its ``step`` runs the schedule and the loss) or a module whose
    output ``model.loss`` scores.
    """
    x, y = batch
    n = len(x) // dp
    mine = slice(dp_rank * n, (dp_rank + 1) * n)
    for _ in range(steps):
        opt.zero_grad()
        if pipeline:
            wrapped.step(x[mine], y[mine])
        else:
            model.loss(wrapped(x[mine]), y[mine]).backward()
        opt.step()


class GPTLayout:
    """Wrap one rank's GPT ``model`` at a layout over ``comm``; train it on its share of ``batch``; ``close`` it.

    ``kind``: "plain" (no wrapper; ``comm`` becomes None), "ddp", "tp" (tensor_parallel, materialized: a deferred
    model has no wrapper to draw it), "fsdp", "hybrid" (hybrid_shard over halves), "no_shard", "pp" and "pp_tied"
    (one stage per rank, 1F1B over 2 micro-batches), "fsdp_tp" (FSDP over the dp ranks of a dp=2 mesh of
    tensor-parallel blocks); any other kind is a (dp, pp, tp) mesh of ``dims`` (default: dp about half the ranks,
    tp 2): DDP or a Pipeline over tensor-parallel blocks. Attributes: ``model``, ``wrapped`` (what to gather
    from), ``comm`` (the communicator spanning it), ``grid``, ``dp``, ``dp_rank``, ``pipeline``, ``opt`` (AdamW,
    lr 0.01).
    """

    def __init__(self, comm, model, kind, dims=None, batch=None, steps=1):
        size = comm.Get_size()
        self.model, self.comm, self.batch, self.steps = model, comm, batch, steps
        self.grid, self.dp, self.dp_rank, self.pipeline = None, 1, 0, False
        if kind == "plain":
            self.wrapped, self.comm = model, None
        elif kind == "ddp":
            self.wrapped, self.dp, self.dp_rank = DDP(model, comm), size, comm.Get_rank()
        elif kind == "tp":
            self.wrapped = nn.materialize(tensor_parallel(model, comm, sequence_parallel=False))
        elif kind in ("fsdp", "hybrid", "no_shard"):
            extra = {"strategy": "hybrid_shard", "shard_size": max(1, size // 2)} if kind == "hybrid" else \
                {"strategy": "no_shard"} if kind == "no_shard" else {}
            self.wrapped = FSDP(model, comm, units=model.fsdp_units(), **extra)
            self.dp, self.dp_rank = size, comm.Get_rank()
        elif kind in ("pp", "pp_tied"):
            stage = model.pipeline_stages(size)[comm.Get_rank()]
            self.wrapped = Pipeline(stage, comm, 2, "1f1b", loss_fn=model.loss, tied_parameters=stage.tied)
            self.pipeline = True
        elif kind == "fsdp_tp":
            self.grid = mesh(comm, dp=2, pp=1, tp=size // 2)
            self.dp, self.dp_rank = 2, self.grid.dp_rank
            tensor_parallel(model, self.grid.tp_comm, sequence_parallel=False)
            self.wrapped = FSDP(model, self.grid.dp_comm, units=model.fsdp_units())
        else:  # a (dp, pp, tp) mesh, gathered over the whole world
            dp, pp, tp = dims if dims is not None else (max(1, size // 2), 1, min(2, size))
            self.grid = mesh(comm, dp=dp, pp=pp, tp=tp)
            self.dp, self.dp_rank = self.grid.dp, self.grid.dp_rank
            if tp > 1:
                tensor_parallel(model, self.grid.tp_comm, sequence_parallel=False)
            if pp > 1:
                stage = model.pipeline_stages(pp)[self.grid.pp_rank]
                self.wrapped = Pipeline(stage, self.grid.pp_comm, 2, "1f1b", loss_fn=model.loss,
                                        dp_comm=self.grid.dp_comm if dp > 1 else None, tied_parameters=stage.tied)
                self.pipeline = True
            else:
                self.wrapped = DDP(model, self.grid.dp_comm)
        self.opt = optim.AdamW(list(self.wrapped.parameters()), lr=0.01)

    def train(self, steps=None):
        """Take ``steps`` optimizer steps (the constructor's count by default) on this rank's share of ``batch``."""
        train_slice(self.model, self.wrapped, self.opt, self.batch, self.dp, self.dp_rank, self.pipeline,
                    self.steps if steps is None else steps)

    def close(self):
        """Detach the wrapper and free the mesh's communicators (collective)."""
        if isinstance(self.wrapped, Wrapper):
            self.wrapped.remove()
        if self.grid is not None:
            self.grid.free()


def ring_reference(inputs, dtype, mean=False):
    """The 16-bit ring's result (``mpidist.ring16``) from every rank's 1-D input, in numpy: chunk c (ceil(size / n)
    elements) starts at rank c + 1 and travels right, each rank adding its float32 value to the 16-bit message it
    received; rank c rounds the last sum (divided by n in float32 with ``mean``), and every rank gets those bits.
    A reduce-scatter's rank c holds chunk c of it."""
    n, size = len(inputs), inputs[0].size
    chunk = -(-size // n)
    out = np.empty(size, dtype)
    for c in range(n):
        span = slice(c * chunk, min((c + 1) * chunk, size))
        acc = inputs[(c + 1) % n][span].astype(np.float32)
        for j in range(2, n + 1):
            acc = inputs[(c + j) % n][span].astype(np.float32) + acc.astype(dtype).astype(np.float32)
        out[span] = (acc / np.float32(n) if mean else acc).astype(dtype)
    return out
