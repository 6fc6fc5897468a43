"""Pipeline executor and dp x pp mesh against single-process training of the same, unsplit model.

Every rank builds its own stages and the whole reference model from the same per-stage seeds, trains both on the
same batches (sizes that do not divide by m), and compares its own stage parameters with the reference's.
The full schedule x m matrix runs on SimComm worlds of 2, 3 and 4 ranks and under mpiexec -n 2 / -n 4.
"""
import numpy as np
import pytest

from mpidist.collectives import allreduce
from mpidist.nn import CrossEntropyLoss, Linear, Module, Sequential, Tanh
from mpidist.optim import SGD
from mpidist.parallel.mesh import mesh
from mpidist.parallel.pipeline import Action, Kind, Pipeline, Schedule, StepStats, insert_comms, one_f_one_b

IN, WIDTH, CLASSES = 3, 4, 3
SCHEDULES = ["gpipe", "1f1b", "interleaved", "zb_h1"]
MS = [1, 2, 3, 5, 8]
LR = 0.1
STEPS = 5


def make_stage(s, num_stages):
    """Model stage s of num_stages: Linear+Tanh, the last one ending in a Linear to logits."""
    rng = np.random.default_rng(100 + s)
    d_in = IN if s == 0 else WIDTH
    if s == num_stages - 1:
        return Sequential(Linear(d_in, WIDTH, rng=rng, dtype=np.float64), Tanh(),
                          Linear(WIDTH, CLASSES, rng=rng, dtype=np.float64))
    return Sequential(Linear(d_in, WIDTH, rng=rng, dtype=np.float64), Tanh())


def batch(step, n):
    rng = np.random.default_rng(1000 + step)
    return rng.normal(size=(n, IN)), rng.integers(0, CLASSES, size=n)


class Reference:
    """The unsplit model trained in one process on the full batch."""

    def __init__(self, num_stages):
        self.stages = [make_stage(s, num_stages) for s in range(num_stages)]
        self.model = Sequential(*self.stages)
        self.crit = CrossEntropyLoss()
        self.opt = SGD(list(self.model.parameters()), lr=LR)

    def grads(self, x, y):
        self.model.zero_grad()
        loss = float(self.crit(self.model.forward(x), y))
        self.model.backward(self.crit.backward())
        return loss

    def step(self, x, y):
        loss = self.grads(x, y)
        self.opt.step()
        return loss


def split_model(comm, schedule, v=None):
    """This rank's chunks (stages r, r + p, ...) of a model of p * v stages."""
    p, r = comm.Get_size(), comm.Get_rank()
    v = v or (2 if schedule == "interleaved" else 1)
    chunks = [make_stage(c * p + r, p * v) for c in range(v)]
    return chunks, p * v


def params_of(chunks):
    return [q for c in chunks for q in c.parameters()]


def assert_stage_matches(chunks, ref, rank, p, what="data"):
    for c, chunk in enumerate(chunks):
        mine = list(chunk.parameters())
        theirs = list(ref.stages[c * p + rank].parameters())
        assert len(mine) == len(theirs)
        for a, b in zip(mine, theirs):
            np.testing.assert_allclose(getattr(a, what), getattr(b, what), rtol=0, atol=1e-10)


def train_and_compare(comm, schedule, m, n):
    p, rank = comm.Get_size(), comm.Get_rank()
    chunks, num_stages = split_model(comm, schedule)
    stage = chunks if schedule == "interleaved" else chunks[0]
    pipe = Pipeline(stage, comm, m, schedule=schedule, loss_fn=CrossEntropyLoss())
    opt = SGD(params_of(chunks), lr=LR)
    ref = Reference(num_stages)
    for t in range(STEPS):
        x, y = batch(t, n)
        for c in chunks:
            c.zero_grad()
        loss = pipe.step(x, y, broadcast_loss=(t == STEPS - 1))
        ref_loss = ref.step(x, y)
        if rank == p - 1 or t == STEPS - 1:
            assert loss == pytest.approx(ref_loss, abs=1e-12)
        else:
            assert loss is None
        opt.step()
    assert_stage_matches(chunks, ref, rank, p)
    return pipe


@pytest.mark.world_sizes(2, 3, 4)
@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_parity_with_single_process_training(comm, schedule, m):
    train_and_compare(comm, schedule, m, n=13 if m % 2 else 17)


@pytest.mark.world_sizes(1)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_single_rank_pipeline_runs_local_transfers(comm, schedule):
    # p = 1: every boundary tensor (between interleaved chunks too) stays on the rank, with no messages.
    train_and_compare(comm, schedule, m=3, n=7)


class SplitBackward(Module):
    """A stage with a real B/W split: B computes input gradients only, W the weight gradients from kept (x, dy)."""

    def __init__(self, seq):
        super().__init__()
        self.seq = seq
        self.kept = {}

    def forward(self, x, mb=0):
        return self.seq.forward(x, mb)

    def backward(self, grad_out, mb=0):
        raise AssertionError("a split schedule must call backward_input and backward_weight, not backward")

    def backward_input(self, dy, mb=0):
        kept = []
        for layer in reversed(list(self.seq)):
            if isinstance(layer, Linear):
                kept.append((layer, layer.pop_saved(mb), dy))
                dy = dy @ layer.weight.data
            else:
                dy = layer.backward(dy, mb)
        self.kept[mb] = kept
        return dy

    def backward_weight(self, mb=0):
        for layer, x, dy in self.kept.pop(mb):
            layer.bias.accumulate_grad(dy.sum(axis=0))
            layer.weight.accumulate_grad(dy.T @ x)


@pytest.mark.world_sizes(2, 3, 4)
@pytest.mark.parametrize("m", [2, 5])
def test_zero_bubble_with_a_module_that_splits_backward(comm, m):
    p, rank = comm.Get_size(), comm.Get_rank()
    chunks, num_stages = split_model(comm, "zb_h1")
    stage = SplitBackward(chunks[0])
    pipe = Pipeline(stage, comm, m, schedule="zb_h1", loss_fn=CrossEntropyLoss())
    opt = SGD(params_of(chunks), lr=LR)
    ref = Reference(num_stages)
    for t in range(STEPS):
        x, y = batch(t, 13)
        chunks[0].zero_grad()
        pipe.step(x, y)
        ref.step(x, y)
        assert stage.kept == {}  # every W ran
        opt.step()
    assert_stage_matches(chunks, ref, rank, p)


@pytest.mark.world_sizes(2, 3, 4)
def test_first_stage_gets_real_gradients(comm):
    # The old executor sent zeros upstream: every stage but the last had zero gradients.
    p, rank = comm.Get_size(), comm.Get_rank()
    chunks, num_stages = split_model(comm, "1f1b")
    pipe = Pipeline(chunks[0], comm, 4, schedule="1f1b", loss_fn=CrossEntropyLoss())
    ref = Reference(num_stages)
    x, y = batch(0, 11)
    pipe.step(x, y)
    ref.grads(x, y)
    for q in chunks[0].parameters():
        assert np.abs(q.grad).max() > 1e-3
    assert_stage_matches(chunks, ref, rank, p, what="grad")


@pytest.mark.world_sizes(2, 3, 4)
@pytest.mark.parametrize("m", [2, 4, 8])
def test_activation_memory_follows_the_schedule(comm, m):
    p, rank = comm.Get_size(), comm.Get_rank()
    x, y = batch(0, 2 * m + 1)
    peaks = {}
    for schedule in ("gpipe", "1f1b", "zb_h1"):
        chunks, _ = split_model(comm, schedule)
        pipe = Pipeline(chunks[0], comm, m, schedule=schedule, loss_fn=CrossEntropyLoss())
        pipe.step(x, y)
        assert isinstance(pipe.stats, StepStats)
        assert pipe.stats.compute_s > 0 and pipe.stats.idle_s >= 0
        assert pipe.stats.wall_s >= pipe.stats.compute_s + pipe.stats.idle_s
        peaks[schedule] = pipe.stats
    assert peaks["gpipe"].peak_activations == m
    # 1F1B (and ZB-H1, which runs F and B in 1F1B order) holds p - rank micro-batches, not GPipe's m.
    assert peaks["1f1b"].peak_activations == min(p - rank, m)
    assert peaks["zb_h1"].peak_activations == min(p - rank, m)
    assert peaks["1f1b"].peak_pending_w == 0
    assert 1 <= peaks["zb_h1"].peak_pending_w <= min(rank + 1, m)


def newest_first_backward(p, m):
    """A schedule that is none of the built-ins: GPipe's forwards, then the backwards newest micro-batch first."""
    return Schedule("newest-first", p, m, 1, [[Action(r, Kind.F, k) for k in range(m)] +
                                              [Action(r, Kind.B, k) for k in reversed(range(m))] for r in range(p)])


@pytest.mark.parametrize("with_comms", [False, True], ids=["compute-only", "with-comms"])
def test_custom_schedule_object(comm, with_comms):
    """A hand-written Schedule, given with or without its send/recv actions, runs in its own order and trains
    like one process on the whole batch (micro-batches of 5, 4 and 4 samples)."""
    p, rank, m = comm.Get_size(), comm.Get_rank(), 3
    custom = newest_first_backward(p, m)
    pipe = train_and_compare(comm, insert_comms(custom) if with_comms else custom, m, n=13)
    assert pipe.schedule.has_comms == (p > 1)
    assert [a for a in pipe.actions if a.kind.is_compute] == list(custom.actions[rank])
    assert pipe.stats.peak_activations == m  # every forward before the first backward


# -- errors -------------------------------------------------------------------------------------------------

@pytest.mark.world_sizes(2, 4)
def test_constructor_errors(comm):
    chunks, _ = split_model(comm, "interleaved")
    loss = CrossEntropyLoss()
    with pytest.raises(ValueError, match=r"num_microbatches must be an int >= 1 \(got 0\)"):
        Pipeline(chunks[0], comm, 0, loss_fn=loss)
    with pytest.raises(ValueError, match=r"unknown schedule '1F1B'"):
        Pipeline(chunks[0], comm, 2, schedule="1F1B", loss_fn=loss)
    with pytest.raises(ValueError, match=r"'interleaved' needs a list of v >= 2 stage modules .*got 1"):
        Pipeline(chunks[0], comm, 2, schedule="interleaved", loss_fn=loss)
    with pytest.raises(ValueError, match=r"'gpipe' runs one stage module per rank \(got 2\)"):
        Pipeline(chunks, comm, 2, schedule="gpipe", loss_fn=loss)
    with pytest.raises(ValueError, match=r"is for p=1, m=2, v=1 but this pipeline has p="):
        Pipeline(chunks[0], comm, 2, schedule=one_f_one_b(1, 2), loss_fn=loss)
    # Only the last rank lacks loss_fn, yet every rank raises (instead of the others hanging later).
    with pytest.raises(ValueError, match=rf"^Pipeline: rank {comm.Get_size() - 1}: rank {comm.Get_size() - 1} holds the last stage .* needs loss_fn"):
        Pipeline(chunks[0], comm, 2)


@pytest.mark.world_sizes(2, 4)
def test_step_errors_raise_on_every_rank(comm):
    p, rank = comm.Get_size(), comm.Get_rank()
    chunks, _ = split_model(comm, "1f1b")
    pipe = Pipeline(chunks[0], comm, 4, loss_fn=CrossEntropyLoss())
    x, y = batch(0, 9)
    # Every rank raises the same message, naming the rank that rejected its input and why.
    with pytest.raises(ValueError, match=r"^Pipeline.step: rank 0: rank 0 runs the first stage and needs inputs"):
        pipe.step(None, y)
    with pytest.raises(ValueError, match=rf"^Pipeline.step: rank {p - 1}: rank {p - 1} runs the last stage and needs targets"):
        pipe.step(x, None)
    smaller = r"batch of 3 is smaller than the number of micro-batches \(4\)"
    with pytest.raises(ValueError, match=rf"^Pipeline.step: ranks? 0(,{p - 1})?: {smaller}"):
        pipe.step(x[:3], y[:3])
    pipe.step(x, y)  # still usable after rejected inputs


# -- data x pipeline mesh -------------------------------------------------------------------------------------

@pytest.mark.world_sizes(4)
def test_mesh_layout(comm):
    m = mesh(comm, dp=2, pp=2)
    rank = comm.Get_rank()
    assert (m.pp, m.dp, m.pp_rank, m.dp_rank) == (2, 2, rank % 2, rank // 2)
    assert m.pp_comm.Get_rank() == m.pp_rank and m.dp_comm.Get_rank() == m.dp_rank
    # Pipelines are consecutive ranks; a data-parallel group is one pipeline position across replicas.
    assert allreduce(np.array([rank]), m.pp_comm)[0] == (0 + 1 if rank < 2 else 2 + 3)
    assert allreduce(np.array([rank]), m.dp_comm)[0] == (0 + 2 if rank % 2 == 0 else 1 + 3)
    with pytest.raises(AttributeError):
        m.pp = 4
    m.free()


@pytest.mark.world_sizes(2, 4)
def test_mesh_size_error(comm):
    size = comm.Get_size()
    with pytest.raises(ValueError, match=rf"dp \* pp must equal the number of ranks \(dp=3, pp=2, dp\*pp=6, "
                                         rf"ranks={size}\)"):
        mesh(comm, dp=3, pp=2)
    with pytest.raises(ValueError, match=r"pp must be an int >= 1 \(got 0\)"):
        mesh(comm, dp=2, pp=0)


@pytest.mark.world_sizes(4)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_mesh_2x2_parity_with_single_process_training(comm, schedule):
    m = mesh(comm, dp=2, pp=2)
    chunks, num_stages = split_model(m.pp_comm, schedule)
    stage = chunks if schedule == "interleaved" else chunks[0]
    pipe = Pipeline(stage, m.pp_comm, 3, schedule=schedule, loss_fn=CrossEntropyLoss(), dp_comm=m.dp_comm)
    opt = SGD(params_of(chunks), lr=LR)
    ref = Reference(num_stages)
    per_replica = 7  # equal replica batches: the mean of replica means is the global mean
    for t in range(STEPS):
        x, y = batch(t, 2 * per_replica)
        mine = slice(m.dp_rank * per_replica, (m.dp_rank + 1) * per_replica)
        for c in chunks:
            c.zero_grad()
        loss = pipe.step(x[mine], y[mine], broadcast_loss=True)
        assert loss == pytest.approx(ref.step(x, y), abs=1e-12)
        opt.step()
    assert_stage_matches(chunks, ref, m.pp_rank, m.pp)
    m.free()
