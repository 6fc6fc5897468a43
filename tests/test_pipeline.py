"""Pipeline executor and dp x pp mesh against single-process training of the same, unsplit model.

Every rank builds its own stages and the whole reference model from the same per-stage seeds, trains both on the
same batches (sizes that do not divide by m), and compares its own stage parameters with the reference's. The
reference is plain autograd in one process (``loss = crit(model(x), y); loss.backward()``) on the whole batch.
The full schedule x m matrix runs on SimComm worlds of 2, 3 and 4 ranks and under mpiexec -n 2 / -n 4.
"""
import numpy as np
import pytest

from mpidist.collectives import allreduce
from mpidist import nn
from mpidist.nn import CrossEntropyLoss, Embedding, Linear, Module, Sequential, Tanh
from mpidist.optim import SGD
from mpidist.parallel import mesh
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
        loss = self.crit(self.model(nn.Tensor(x)), y)
        loss.backward()
        return float(loss)

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


class EventLog:
    """Per-rank record of compute events and a snapshot of the stage's parameter gradients at each.

    "F": the stage's forward returned (forward hook). "B": the gradient of the stage's first Linear output
    was computed on its way to the stage input (a hook on that tensor; stages > 0 only: stage 0's inputs need no
    gradient, so all of its backward is weight work). "W": every parameter's gradient for one backward is final
    (post-accumulate-grad hooks; recorded when the last of them fires).
    """

    def __init__(self, stage):
        self.events, self.snapshots = [], []
        self.params = list(stage.parameters())
        self.input_needs_grad = False
        stage.register_forward_pre_hook(self._pre)
        stage.register_forward_hook(self._post)
        first_linear = next(mod for mod in stage.modules() if isinstance(mod, Linear))
        first_linear.register_forward_hook(self._hook_output)
        self.accumulated = 0
        for q in self.params:
            q.register_post_accumulate_grad_hook(self._accumulated)

    def _pre(self, module, args):
        self.input_needs_grad = any(t.requires_grad for t in args)

    def _post(self, module, args, out):
        self._record("F")

    def _hook_output(self, module, args, out):
        if self.input_needs_grad:
            out.register_hook(lambda grad: self._record("B"))

    def _accumulated(self, param):
        self.accumulated += 1
        if self.accumulated == len(self.params):
            self.accumulated = 0
            self._record("W")

    def _record(self, event):
        self.events.append(event)
        self.snapshots.append([None if q.grad is None else q.grad.copy() for q in self.params])


def same_grads(a, b):
    return all((x is None and y is None) or (x is not None and y is not None and np.array_equal(x, y))
               for x, y in zip(a, b))


@pytest.mark.world_sizes(2, 3, 4)
@pytest.mark.parametrize("m", [2, 5])
def test_zero_bubble_defers_weight_gradients_to_w(comm, m):
    """ZB-H1 with the generic deferred weight gradients: B leaves every parameter gradient as it was (None
    before the first W), each W changes them, the events follow the schedule's F/B/W order, and training
    matches one process."""
    p, rank = comm.Get_size(), comm.Get_rank()
    chunks, num_stages = split_model(comm, "zb_h1")
    log = EventLog(chunks[0])
    pipe = Pipeline(chunks[0], comm, m, schedule="zb_h1", loss_fn=CrossEntropyLoss())
    opt = SGD(params_of(chunks), lr=LR)
    ref = Reference(num_stages)
    for t in range(STEPS):
        x, y = batch(t, 13)
        chunks[0].zero_grad()
        log.events.clear()
        log.snapshots.clear()
        pipe.step(x, y)
        ref.step(x, y)
        # The compute order seen from inside the model is the schedule's (B is invisible on stage 0).
        expected = [a.kind.value for a in pipe.actions if a.kind.is_compute and (rank > 0 or a.kind is not Kind.B)]
        assert log.events == expected
        assert log.events.count("W") == m
        if rank > 0:
            first_b = log.events.index("B")
            assert first_b < log.events.index("W")
            assert all(g is None for g in log.snapshots[first_b])  # B ran, no parameter has a gradient yet
        before = [None] * len(log.params)
        for event, snapshot in zip(log.events, log.snapshots):
            if event == "W":
                assert not same_grads(snapshot, before)  # W accumulated this micro-batch's weight gradient
            else:
                assert same_grads(snapshot, before)  # F and B leave parameter gradients alone
            before = snapshot
        assert same_grads([q.grad for q in log.params], before)
        assert pipe.stats.peak_pending_w >= 1
        opt.step()
    assert_stage_matches(chunks, ref, rank, p)


def all_b_then_all_w(p, m):
    """A split schedule of GPipe's forwards, every B, then every W: each W runs long after its B."""
    return Schedule("b-then-w", p, m, 1, [[Action(r, Kind.F, k) for k in range(m)] +
                                          [Action(r, Kind.B, k) for k in range(m)] +
                                          [Action(r, Kind.W, k) for k in range(m)] for r in range(p)])


@pytest.mark.world_sizes(1, 2, 3)
def test_weight_gradients_wait_for_w_in_a_custom_split_schedule(comm):
    p, rank, m = comm.Get_size(), comm.Get_rank(), 3
    chunks, num_stages = split_model(comm, "1f1b")
    log = EventLog(chunks[0])
    pipe = Pipeline(chunks[0], comm, m, schedule=all_b_then_all_w(p, m), loss_fn=CrossEntropyLoss())
    ref = Reference(num_stages)
    x, y = batch(0, 10)
    pipe.step(x, y)
    ref.grads(x, y)
    events = "".join(log.events)
    assert events == ("FFF" + ("BBB" if rank > 0 else "") + "WWW")
    for event, snapshot in zip(log.events, log.snapshots):
        if event != "W":
            assert all(g is None for g in snapshot)
    assert pipe.stats.peak_pending_w == m and pipe.stats.peak_activations == m
    assert_stage_matches(chunks, ref, rank, p, what="grad")


# -- stages with several inputs and outputs ---------------------------------------------------------------

TOKENS = 5


class FirstStage(Module):
    """(x, ids) -> (h, h, ids): a hidden state, the same tensor as the residual stream, and the token ids."""

    def __init__(self, rng):
        super().__init__()
        self.lin = Linear(IN, WIDTH, rng=rng, dtype=np.float64)
        self.emb = Embedding(TOKENS, WIDTH, rng=rng, dtype=np.float64)

    def forward(self, x, ids):
        h = nn.functional.tanh(self.lin(x)) + self.emb(ids)
        return h, h, ids


class MiddleStage(Module):
    """(h, r, ids) -> (y, r + y, ids), or (y, r, ids) with r passed on unchanged (its own input leaf)."""

    def __init__(self, rng, add):
        super().__init__()
        self.add = add
        self.lin = Linear(WIDTH, WIDTH, rng=rng, dtype=np.float64)

    def forward(self, h, r, ids):
        y = nn.functional.tanh(self.lin(h))
        return y, (r + y if self.add else r), ids


class LastStage(Module):
    """(h, r, ids) -> logits of h + r (or of h alone: r then gets no gradient) plus a per-token bias."""

    def __init__(self, rng, use_residual):
        super().__init__()
        self.use_residual = use_residual
        self.lin = Linear(WIDTH, CLASSES, rng=rng, dtype=np.float64)
        self.bias = Embedding(TOKENS, CLASSES, rng=rng, dtype=np.float64)

    def forward(self, h, r, ids):
        return self.lin(h + r if self.use_residual else h) + self.bias(ids)


def make_multi_stage(s, num_stages, use_residual):
    rng = np.random.default_rng(200 + s)
    if s == 0:
        return FirstStage(rng)
    if s == num_stages - 1:
        return LastStage(rng, use_residual)
    return MiddleStage(rng, add=s % 2 == 0)


def multi_batch(step, n):
    rng = np.random.default_rng(2000 + step)
    return rng.normal(size=(n, IN)), rng.integers(0, TOKENS, size=n), rng.integers(0, CLASSES, size=n)


@pytest.mark.world_sizes(2, 3, 4)
@pytest.mark.parametrize("use_residual", [True, False], ids=["residual-used", "residual-unused"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_stages_with_several_inputs_and_outputs(comm, schedule, use_residual):
    """Stage boundaries carry (hidden, residual, token ids): two float tensors (one of them the same tensor
    twice, or a stage's own input passed on) and an integer array that needs no gradient. With the residual
    unused by the last stage its gradient is absent (None) and travels back as such."""
    p, rank = comm.Get_size(), comm.Get_rank()
    v = 2 if schedule == "interleaved" else 1
    num_stages = p * v
    chunks = [make_multi_stage(c * p + rank, num_stages, use_residual) for c in range(v)]
    pipe = Pipeline(chunks if v > 1 else chunks[0], comm, 3, schedule=schedule, loss_fn=CrossEntropyLoss())
    opt = SGD(params_of(chunks), lr=LR)
    ref_stages = [make_multi_stage(s, num_stages, use_residual) for s in range(num_stages)]
    ref_opt = SGD([q for st in ref_stages for q in st.parameters()], lr=LR)
    crit = CrossEntropyLoss()
    for t in range(STEPS):
        x, ids, y = multi_batch(t, 11)
        for c in chunks:
            c.zero_grad()
        loss = pipe.step((x, ids), y, broadcast_loss=True)
        for st in ref_stages:
            st.zero_grad()
        out = (nn.Tensor(x), nn.Tensor(ids))
        for st in ref_stages:
            out = st(*out) if isinstance(out, tuple) else st(out)
        ref_loss = crit(out, y)
        ref_loss.backward()
        ref_opt.step()
        assert loss == pytest.approx(float(ref_loss), abs=1e-12)
        opt.step()
    for c, chunk in enumerate(chunks):
        for (name, a), (_, b) in zip(chunk.named_parameters(), ref_stages[c * p + rank].named_parameters()):
            np.testing.assert_allclose(a.data, b.data, rtol=0, atol=1e-10, err_msg=f"stage {c * p + rank} {name}")


@pytest.mark.world_sizes(1)
def test_stage_output_errors(comm):
    # One rank (two chunks, the transfer between them local): a stage returning something that is not a tensor
    # or an array is named with its position. (On several ranks the others would wait for its message.)
    bad = Sequential(Linear(IN, WIDTH, rng=np.random.default_rng(0), dtype=np.float64))
    bad.register_forward_hook(lambda module, args, out: (out, "residual"))
    pipe = Pipeline([bad, make_stage(1, 2)], comm, 2, schedule="interleaved", loss_fn=CrossEntropyLoss())
    x, y = batch(0, 4)
    with pytest.raises(TypeError, match=r"Pipeline: stage 0 output 1 is a str; a stage returns a Tensor, an array"):
        pipe.step(x, y)
    pipe = Pipeline([make_stage(0, 2), make_stage(1, 2)], comm, 2, schedule="interleaved",
                    loss_fn=lambda out, y: out.sum())
    x, y = batch(0, 4)
    with pytest.raises(TypeError, match=r"loss_fn must return a scalar Tensor that requires grad \(got shape \(\)"):
        with nn.no_grad():
            pipe.step(x, y)


@pytest.mark.world_sizes(2)
def test_multi_input_batch_errors_raise_on_every_rank(comm):
    pipe = Pipeline(make_multi_stage(comm.Get_rank(), 2, True), comm, 2, loss_fn=CrossEntropyLoss())
    x, ids, y = multi_batch(0, 6)
    # A ragged batch is refused on every rank before any message moves.
    with pytest.raises(ValueError, match=r"^Pipeline.step: rank 0: the inputs arrays differ in batch size "
                                         r"\(axis 0 lengths: \[6, 5\]\)"):
        pipe.step((x, ids[:5]), y)
    pipe.step((x, ids), y)  # still usable


@pytest.mark.world_sizes(2, 3)
@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
def test_stages_with_activation_checkpointing(comm, schedule):
    """A stage that recomputes its activations in backward (``activation_checkpointing``) trains like one process
    without it; under zb_h1 the checkpoint's node splits too (B recomputes for the input gradient, W again for
    the weight gradients)."""
    p, rank = comm.Get_size(), comm.Get_rank()
    chunks, num_stages = split_model(comm, schedule)
    chunks[0].activation_checkpointing = True
    pipe = Pipeline(chunks[0], comm, 3, schedule=schedule, loss_fn=CrossEntropyLoss())
    opt = SGD(params_of(chunks), lr=LR)
    ref = Reference(num_stages)
    for t in range(STEPS):
        x, y = batch(t, 13)
        chunks[0].zero_grad()
        pipe.step(x, y)
        ref.step(x, y)
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


@pytest.mark.world_sizes(1, 2, 4)
def test_a_stage_that_is_not_a_module_raises_on_every_rank(comm):
    """Pipeline(None, ...) is refused at construction on every rank (it used to fail later, on rank 0 alone,
    while the others waited in a receive)."""
    last = comm.Get_size() - 1
    chunks, _ = split_model(comm, "interleaved")
    loss = CrossEntropyLoss()
    everyone = "rank 0" if last == 0 else f"ranks {','.join(map(str, range(last + 1)))}"
    with pytest.raises(TypeError, match=rf"^Pipeline: {everyone}: stage must be a module, called as stage\(\*inputs\) "
                                        rf"and with parameters\(\) \(got NoneType\)$"):
        Pipeline(None, comm, 2, loss_fn=loss)
    with pytest.raises(TypeError, match=rf"^Pipeline: rank {last}: stage must be a module, .*\(got int\)$"):
        Pipeline(3 if comm.Get_rank() == last else chunks[0], comm, 2, loss_fn=loss)
    with pytest.raises(TypeError, match=rf"^Pipeline: {everyone}: stage module 1 must be a module, .*\(got NoneType\)$"):
        Pipeline([chunks[0], None], comm, 2, schedule="interleaved", loss_fn=loss)


@pytest.mark.world_sizes(2, 4)
def test_step_errors_raise_on_every_rank(comm):
    p = comm.Get_size()
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
    with pytest.raises(ValueError, match=rf"dp \* pp \* tp must equal the number of ranks \(dp=3, pp=2, tp=1, "
                                         rf"dp\*pp\*tp=6, ranks={size}\)"):
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


@pytest.mark.world_sizes(2, 3, 4)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_evaluate_is_the_unsplit_forward_and_leaves_gradients_alone(comm, schedule):
    """Pipeline.evaluate: the loss of the unsplit model on the batch, no gradient written, training unaffected."""
    p, rank = comm.Get_size(), comm.Get_rank()
    chunks, num_stages = split_model(comm, schedule)
    pipe = Pipeline(chunks if schedule == "interleaved" else chunks[0], comm, 3, schedule=schedule,
                    loss_fn=CrossEntropyLoss())
    ref = Reference(num_stages)
    x, y = batch(0, 11)
    with nn.no_grad():
        expected = float(ref.crit(ref.model(nn.Tensor(x)), y))
    assert pipe.evaluate(x, y, broadcast_loss=True) == pytest.approx(expected, abs=1e-12)
    assert all(q.grad is None for q in params_of(chunks))
    # A training step after an evaluation matches the reference's first step.
    opt = SGD(params_of(chunks), lr=LR)
    assert pipe.step(x, y, broadcast_loss=True) == pytest.approx(ref.step(x, y), abs=1e-12)
    opt.step()
    assert_stage_matches(chunks, ref, rank, p)
    loss = pipe.evaluate(x, y)
    assert (loss is None) == (rank != (num_stages - 1) % p)


def test_evaluate_errors_raise_on_every_rank(comm):
    chunks, _ = split_model(comm, "1f1b")
    pipe = Pipeline(chunks[0], comm, 4, loss_fn=CrossEntropyLoss())
    x, y = batch(0, 3)
    with pytest.raises(ValueError, match=r"Pipeline.evaluate: rank 0: batch of 3 is smaller than the number of micro-batches \(4\)"):
        pipe.evaluate(x, y)


# -- global names (Pipeline as a Wrapper) -----------------------------------------------------------------------
def test_sequential_names_are_checked_and_kept_by_slices():
    layers = [Linear(2, 2), Tanh(), Linear(2, 2)]
    seq = Sequential(*layers, names=["a", "b.0", "c"])
    assert seq.names == ("a", "b.0", "c") and Sequential(*layers).names is None
    assert [n for n, _ in seq.named_parameters()] == ["0.weight", "0.bias", "2.weight", "2.bias"]  # module paths
    assert seq[1:].names == ("b.0", "c") and Sequential(*layers)[1:].names is None
    for bad in (["a", "b"], ["a", "a", "c"], ["a", "", "c"], ["a", 1, "c"]):
        with pytest.raises(ValueError, match=r"Sequential: names must be 3 distinct non-empty strings, one per "
                                             r"module \(got "):
            Sequential(*layers, names=bad)


@pytest.mark.world_sizes(2, 3)
def test_unnamed_stages_are_numbered_as_the_layers_of_one_sequential(comm):
    """Stages cut from a Sequential without names: layer i of the concatenation is "i." wherever it lies, so the
    primary names over all stages are the one-process Sequential's, with its values."""
    p, r = comm.Get_size(), comm.Get_rank()
    rng = np.random.default_rng(3)
    model = Sequential(*[Linear(3, 3, rng=rng) if i % 2 == 0 else Tanh() for i in range(2 * p + 1)])
    cuts = [0, *range(2, 2 * p, 2), 2 * p + 1]  # uneven: the last stage gets one layer more
    stage = model[cuts[r]:cuts[r + 1]]
    pipe = Pipeline(stage, comm, 2, loss_fn=lambda out, y: ((out - y) ** 2).mean())
    placed = pipe.placed_parameters()
    assert all(q.stage == r and q.primary for q in placed)
    names = [n for part in comm.allgather([(q.name, q.parameter.data) for q in placed]) for n in part]
    expected = list(model.named_parameters())
    assert [n for n, _ in names] == [n for n, _ in expected]
    for (n, a), (_, ref) in zip(names, expected):
        np.testing.assert_array_equal(a, ref.data, err_msg=n)
