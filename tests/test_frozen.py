"""Frozen parameters (``requires_grad=False``) under every wrapper, against one process.

Fine-tuning parity: a tiny GPT (2 layers, width 16, 4 heads, context 8, vocabulary 64, float64, no dropout)
with its embeddings (the token embedding is also the tied head's weight) and its first block frozen is trained
for a few AdamW steps with weight decay, an optimizer built on *every* parameter as a user would write it. In
one process the frozen parameters get no gradient, so AdamW leaves them as they are (weight decay moves only
parameters with a gradient). The same training under DDP, FSDP (each strategy, one unit per layer and one
unit for the whole model, whose frozen parameters split off into a frozen part; hybrid sharding), a Pipeline
(each schedule), FSDP-wrapped pipeline stages under zb_h1, and (dp, tp, pp) meshes must give the reference's
losses and trainable parameters, leave every frozen array bitwise unchanged and give it no gradient (no storage,
no communication: DDP's buckets hold trainable parameters only, FSDP reduce-scatters trainable units only).

Agreement: a parameter frozen on some ranks only raises on every rank naming it and the ranks (DDP, FSDP,
hybrid FSDP, ``tensor_parallel``, a pipeline's tied copies), and changing ``requires_grad`` after a wrapper
was built raises at the next backward.

Runs on SimComm worlds and under ``mpiexec -n 2 / -n 4 pytest --with-mpi``.
"""
import functools
import threading
import time

import numpy as np
import pytest

from mpidist import simulate
from mpidist.guard import record
from mpidist.models import GPT, GPTConfig, lm_loss
from mpidist.optim import SGD, AdamW
from mpidist.models import tensor_parallel
from mpidist.parallel import DDP, FSDP, Pipeline, mesh

TOL = 1e-10
STEPS = 3
LR, WEIGHT_DECAY = 1e-2, 0.1
VOCAB, T, D, HEADS = 64, 8, 16, 4
BATCH = 12  # splits over 1, 2, 3 and 4 data-parallel ranks


FROZEN = ("embed", "blocks.0")  # the embeddings (a tied head's weight is the token embedding's) and the first block


def make_model(n_layer=2, frozen=FROZEN, tie=True):
    """The same initial weights everywhere (one seeded generator), the modules named in ``frozen`` frozen."""
    model = GPT(GPTConfig(vocab_size=VOCAB, block_size=T, n_layer=n_layer, n_head=HEADS, n_embd=D, dropout=0.0,
                          dtype="float64", tie_weights=tie), rng=np.random.default_rng(0))
    modules = dict(model.named_modules())
    for path in frozen:
        modules[path].requires_grad_(False)
    return model


def global_batch(step):
    """Step ``step``'s global batch (token ids, next-token targets), equal on every rank."""
    tokens = np.random.default_rng(1000 + step).integers(0, VOCAB, (BATCH, T + 1))
    return tokens[:, :-1], tokens[:, 1:]


def rows(a, part, parts):
    n = len(a) // parts
    assert n * parts == len(a), f"batch of {len(a)} does not split into {parts} equal parts"
    return a[part * n:(part + 1) * n]


def optimizer(params, kind="adamw"):
    """AdamW (or SGD with momentum) with weight decay on every parameter given, frozen ones included: what moved
    frozen weights under a wrapper that gave them gradient storage."""
    if kind == "sgd":
        return SGD(list(params), lr=LR, momentum=0.9, weight_decay=WEIGHT_DECAY)
    return AdamW(list(params), lr=LR, weight_decay=WEIGHT_DECAY)


_reference_lock = threading.Lock()


@functools.lru_cache(maxsize=None)
def _reference(n_layer, kind, frozen_modules, tie):
    model = make_model(n_layer, frozen_modules, tie)
    start = {name: p.data.copy() for name, p in model.named_parameters()}
    opt = optimizer(model.parameters(), kind)
    losses = []
    for step in range(STEPS):
        x, y = global_batch(step)
        opt.zero_grad()
        loss = lm_loss(model(x), y)
        loss.backward()
        losses.append(float(loss))
        opt.step()
    state = model.state_dict()
    for a in state.values():
        a.setflags(write=False)
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    # Premises: the reference trains what is trainable and leaves the frozen parameters exactly as they were.
    assert frozen == {n for n in start if any(n.startswith(f"{path}.") for path in frozen_modules)}
    assert len(frozen) < len(start)
    assert all(np.array_equal(state[n], start[n]) for n in frozen)
    assert all(not np.array_equal(state[n], start[n]) for n in start if n not in frozen)
    return state, losses, frozen


def reference(n_layer=2, kind="adamw", frozen=FROZEN, tie=True):
    """(state_dict, losses, names of the frozen parameters) of single-process fine-tuning on the global batches."""
    with _reference_lock:  # simulated ranks are threads: compute once, share the read-only result
        return _reference(n_layer, kind, frozen, tie)


def assert_frozen_untouched(named, start, what):
    """Every frozen parameter of ``named`` holds its starting values bit for bit and has no gradient."""
    frozen = [(name, p) for name, p in named if not p.requires_grad]
    assert frozen, f"{what}: premise: some parameters are frozen"
    for name, p in frozen:
        np.testing.assert_array_equal(p.data, start[name], err_msg=f"{what}: frozen {name} moved")
        assert p.grad is None, f"{what}: frozen {name} has a gradient"


# -- data parallel: DDP and FSDP ---------------------------------------------------------------------------------
def reduce_scatters(comm, since):
    """How many reduce-scatters on ``comm`` started after ``since`` the flight recorder holds."""
    return sum(1 for r in record.snapshot() if r[record.OP] == "ireduce_scatter" and r[record.COMM].owner() is comm
               and r[record.START] >= since)


def data_parallel_train(comm, wrapper, model, kind):
    """Train on this rank's slice of each global batch; return the losses (mean over ranks)."""
    opt = optimizer(wrapper.parameters(), kind)
    trainable = [p for p in model.parameters() if p.requires_grad]
    losses = []
    for step in range(STEPS):
        x, y = (rows(a, comm.Get_rank(), comm.Get_size()) for a in global_batch(step))
        opt.zero_grad()
        since = time.monotonic()
        loss = lm_loss(wrapper(x), y)
        loss.backward()
        assert all(p.grad is None for p in wrapper.parameters() if not p.requires_grad), "a frozen shard got a grad"
        if isinstance(wrapper, DDP):
            assert all(p.grad is not None for p in trainable)
        elif wrapper.shard_comm is not None:  # one reduce-scatter per trainable unit, none for a frozen one
            assert reduce_scatters(wrapper.shard_comm, since) == sum(p.requires_grad for p in wrapper.parameters())
        losses.append(float(np.mean(comm.allgather(float(loss)))))  # equal slices: the mean of means
        opt.step()
    return losses


def assert_matches_reference(state, losses, ref_state, ref_losses):
    np.testing.assert_allclose(losses, ref_losses, rtol=TOL, atol=0, err_msg="losses")
    assert list(state) == list(ref_state)
    for name, value in ref_state.items():
        np.testing.assert_allclose(state[name], value, rtol=TOL, atol=TOL, err_msg=name)


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_ddp_fine_tuning_matches_one_process_and_leaves_frozen_parameters_alone(comm, kind):
    ref_state, ref_losses, frozen = reference(kind=kind)
    model = make_model()
    start = {name: p.data.copy() for name, p in model.named_parameters()}
    ddp = DDP(model, comm)
    # No gradient storage and so no communication for frozen parameters: the buckets hold the trainable ones.
    assert sorted(n for b in ddp.buckets for n in b.names) == sorted(n for n in start if n not in frozen)
    losses = data_parallel_train(comm, ddp, model, kind)
    assert_matches_reference(model.state_dict(), losses, ref_state, ref_losses)
    assert_frozen_untouched(model.named_parameters(), start, "DDP")


FSDP_CASES = [("full_shard", "layers", "adamw"), ("shard_grad_op", "layers", "adamw"), ("no_shard", "layers", "adamw"),
              ("full_shard", "whole", "adamw"), ("shard_grad_op", "whole", "adamw"), ("no_shard", "whole", "adamw"),
              ("full_shard", "whole", "sgd")]


def fsdp_case_id(case):
    return "-".join(case)


def fsdp_fine_tune(comm, units, kind, **kwargs):
    """Fine-tune under FSDP with one unit per layer ("layers") or one for the whole model ("whole")."""
    ref_state, ref_losses, frozen = reference(kind=kind)
    model = make_model()
    start = {name: p.data.copy() for name, p in model.named_parameters()}
    fsdp = FSDP(model, comm, units=model.fsdp_units() if units == "layers" else [model], **kwargs)
    losses = data_parallel_train(comm, fsdp, model, kind)
    state = comm.bcast(fsdp.full_state_dict(), root=0)
    assert_matches_reference(state, losses, ref_state, ref_losses)
    for name in frozen:
        np.testing.assert_array_equal(state[name], start[name], err_msg=f"FSDP: frozen {name} moved")
    for name, p in model.named_parameters():
        assert p.grad is None or p.requires_grad, f"FSDP: frozen {name} has a gradient"
    # Each shard is all frozen or all trainable; a frozen one is a frozen Parameter that never got a gradient.
    for unit in fsdp.shard_layout():
        names = {span.name for span in unit.params}
        assert names <= frozen or not names & frozen, f"unit {unit.label} mixes frozen and trainable parameters"
        assert unit.parameter.requires_grad == (not names & frozen)
        assert unit.parameter.grad is None or unit.parameter.requires_grad
    if units == "whole":  # one unit holding both: its frozen parameters form a unit of their own, used by it
        assert [(u.label, u.uses) for u in fsdp.units] == [("<root>", ("<root> (frozen)",)), ("<root> (frozen)", ())]


@pytest.mark.parametrize("case", FSDP_CASES, ids=fsdp_case_id)
def test_fsdp_fine_tuning_matches_one_process_and_leaves_frozen_parameters_alone(comm, case):
    strategy, units, kind = case
    fsdp_fine_tune(comm, units, kind, strategy=strategy)


@pytest.mark.world_sizes(4)
@pytest.mark.parametrize("case", [("hybrid_shard", "layers", "adamw"), ("hybrid_shard_grad_op", "whole", "adamw")],
                         ids=fsdp_case_id)
def test_hybrid_fsdp_fine_tuning_matches_one_process_and_leaves_frozen_parameters_alone(comm, case):
    strategy, units, kind = case
    fsdp_fine_tune(comm, units, kind, strategy=strategy, shard_size=2)


# -- pipelines and (dp, tp, pp) meshes ---------------------------------------------------------------------------
def mesh_fine_tune(comm, dp, tp, pp, schedule="1f1b"):
    """Fine-tune on a dp x tp x pp mesh (DDP over dp, tensor_parallel over tp, a Pipeline over pp); every rank
    compares its parameters (slices) with the reference's, converted and cut the same way."""
    v = 2 if schedule == "interleaved" else 1
    n_layer = 2 if pp * v <= 3 else 4
    ref_state, ref_losses, _ = reference(n_layer)
    grid = mesh(comm, dp=dp, pp=pp, tp=tp)
    model, expected = make_model(n_layer), make_model(n_layer)
    expected.load_state_dict(dict(ref_state))
    if tp > 1:
        model = tensor_parallel(model, grid.tp_comm)
        expected = tensor_parallel(expected, grid.tp_comm)  # the reference's values, as this rank's slices
    if pp * v > 1:
        stages, ref_stages = model.pipeline_stages(pp * v), expected.pipeline_stages(pp * v)
        chunks = [stages[c * pp + grid.pp_rank] for c in range(v)]
        ref_chunks = [ref_stages[c * pp + grid.pp_rank] for c in range(v)]
        wrapper = Pipeline(chunks if v > 1 else chunks[0], grid.pp_comm, 2, schedule, loss_fn=model.loss,
                           dp_comm=grid.dp_comm if dp > 1 else None,
                           tied_parameters=[t for c in chunks for t in c.tied])
        mine = [(f"{c}.{n}", p) for c, chunk in enumerate(chunks) for n, p in chunk.named_parameters()]
        theirs = [(f"{c}.{n}", p) for c, chunk in enumerate(ref_chunks) for n, p in chunk.named_parameters()]
    else:
        wrapper = DDP(model, grid.dp_comm) if dp > 1 else model
        mine, theirs = list(model.named_parameters()), list(expected.named_parameters())
    assert [n for n, _ in mine] == [n for n, _ in theirs]
    start = {name: p.data.copy() for name, p in mine}
    params = [p for _, p in mine]
    opt = optimizer(params) if params else None  # a pipeline stage of no blocks holds nothing
    losses = []
    for step in range(STEPS):
        x, y = (rows(a, grid.dp_rank, dp) for a in global_batch(step))
        if opt is not None:
            opt.zero_grad()
        if pp * v > 1:
            losses.append(wrapper.step(x, y, broadcast_loss=True))
        else:
            loss = model.loss(wrapper(x), y)
            loss.backward()
            losses.append(float(np.mean(grid.dp_comm.allgather(float(loss)))))  # equal slices: mean of means
        if opt is not None:
            opt.step()
    np.testing.assert_allclose(losses, ref_losses, rtol=TOL, atol=0, err_msg="losses")
    for (name, p), (_, q) in zip(mine, theirs):
        np.testing.assert_allclose(p.data, q.data, rtol=TOL, atol=TOL, err_msg=name)
    if any(not p.requires_grad for p in params):
        assert_frozen_untouched(mine, start, f"mesh dp={dp} tp={tp} pp={pp}")
    for group in getattr(wrapper, "tied", ()):
        group.free()
    grid.free()


@pytest.mark.world_sizes(2, 4)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", "zb_h1"])
def test_pipeline_fine_tuning_matches_one_process_and_leaves_frozen_parameters_alone(comm, schedule):
    mesh_fine_tune(comm, 1, 1, comm.Get_size(), schedule)


def _layout_id(layout):
    return "dp{}-tp{}-pp{}".format(*layout)


@pytest.mark.world_sizes(2)
@pytest.mark.parametrize("layout", [(1, 2, 1), (1, 1, 2)], ids=_layout_id)
def test_mesh_of_2_fine_tuning_matches_one_process(comm, layout):
    mesh_fine_tune(comm, *layout)


@pytest.mark.world_sizes(4)
@pytest.mark.parametrize("layout", [(2, 2, 1), (2, 1, 2), (1, 2, 2)], ids=_layout_id)
def test_mesh_of_4_fine_tuning_matches_one_process(comm, layout):
    mesh_fine_tune(comm, *layout)


@pytest.mark.mpi_skip  # simulated ranks only: under mpiexec every rank would run all eight again
def test_mesh_of_8_fine_tuning_matches_one_process():
    simulate(8, mesh_fine_tune, 2, 2, 2)


# -- every rank agrees on what is frozen -----------------------------------------------------------------------
def frozen_on_last_rank(comm, name):
    """A model that every rank builds alike, except that the last rank froze parameter ``name``."""
    model = make_model(frozen=())
    if comm.Get_rank() == comm.Get_size() - 1:
        dict(model.named_parameters())[name].requires_grad_(False)
    return model


def disagreement(context, comm, index, name):
    """The message check_same gives when the last rank froze parameter ``index`` (``name``) and no other did."""
    last = comm.Get_size() - 1
    others = "rank 0" if last == 1 else f"ranks {','.join(map(str, range(last)))}"
    return (rf"^{context}: a parameter is frozen \(requires_grad=False\) on some ranks only; freeze the same "
            rf"parameters on every rank before wrapping: ranks disagree at parameter {index}: "
            rf"{others}: \('{name}', 'trainable'\); rank {last}: \('{name}', 'frozen'\)$")


@pytest.mark.world_sizes(2, 3, 4)
@pytest.mark.parametrize("wrapper", ["DDP", "FSDP"])
def test_a_parameter_frozen_on_some_ranks_only_raises_on_every_rank(comm, wrapper):
    model = frozen_on_last_rank(comm, "blocks.1.mlp.fc.weight")
    index = [n for n, _ in model.named_parameters()].index("blocks.1.mlp.fc.weight")
    with pytest.raises(ValueError, match=disagreement(wrapper, comm, index, "blocks.1.mlp.fc.weight")):
        if wrapper == "DDP":
            DDP(model, comm)
        else:
            FSDP(model, comm, units=model.fsdp_units())


@pytest.mark.world_sizes(4)
def test_a_parameter_frozen_on_some_ranks_only_raises_under_hybrid_fsdp(comm):
    model = frozen_on_last_rank(comm, "embed.wpe.weight")
    with pytest.raises(ValueError, match=disagreement("FSDP", comm, 1, "embed.wpe.weight")):
        FSDP(model, comm, strategy="hybrid_shard", shard_size=2, units=model.fsdp_units())


@pytest.mark.world_sizes(2, 4)
def test_a_parameter_frozen_on_some_tensor_parallel_ranks_only_raises_on_every_rank(comm):
    model = frozen_on_last_rank(comm, "embed.wte.weight")
    with pytest.raises(ValueError, match=disagreement("tensor_parallel", comm, 0, "embed.wte.weight")):
        tensor_parallel(model, comm)


@pytest.mark.world_sizes(2, 3, 4)
def test_tied_copies_frozen_on_one_holder_only_raise_on_every_rank(comm):
    p, r = comm.Get_size(), comm.Get_rank()
    stage = make_model(frozen=()).pipeline_stages(p)[r]
    if r == 0:
        stage.tied[0].requires_grad_(False)  # the embedding's copy, not the head's on the last rank
    shape = rf"\(\({VOCAB}, {D}\), 'float64', '{{}}'\)"
    with pytest.raises(ValueError, match=rf"^Pipeline: the copies of tied parameter 'tied' differ between ranks "
                                         rf"\(shape, dtype, requires_grad\): rank 0: {shape.format('frozen')}; "
                                         rf"rank {p - 1}: {shape.format('trainable')}$"):
        Pipeline(stage, comm, 2, loss_fn=lm_loss, tied_parameters=stage.tied)


@pytest.mark.world_sizes(2, 3, 4)
def test_a_frozen_tied_weight_sends_nothing_and_keeps_no_gradient(comm):
    p, r = comm.Get_size(), comm.Get_rank()
    model = make_model()
    stage = model.pipeline_stages(p)[r]
    assert all(not t.requires_grad for t in stage.tied), "the head's copy of a frozen weight is frozen too"
    pipe = Pipeline(stage, comm, 2, loss_fn=lm_loss, tied_parameters=stage.tied)
    pipe.step(*global_batch(0))
    for group in pipe.tied:
        assert group.frozen == bool(group.params)
        assert all(t.grad is None for t in group.params)
        group.free()


# -- requires_grad is fixed once a wrapper is built --------------------------------------------------------------
@pytest.mark.world_sizes(1, 2)
@pytest.mark.parametrize("wrapper", ["DDP", "FSDP"])
@pytest.mark.parametrize("change", ["unfreeze", "freeze"])
def test_changing_requires_grad_after_wrapping_raises_at_the_next_backward(comm, wrapper, change):
    model = make_model()
    wrapped = DDP(model, comm) if wrapper == "DDP" else FSDP(model, comm, units=model.fsdp_units())
    x, y = global_batch(0)
    lm_loss(wrapped(x), y).backward()  # as built: fine
    name, flag = ("embed.wpe.weight", True) if change == "unfreeze" else ("blocks.1.mlp.fc.weight", False)
    dict(model.named_parameters())[name].requires_grad_(flag)
    before, after = ("frozen", "trainable") if flag else ("trainable", "frozen")
    with pytest.raises(RuntimeError, match=rf"^{wrapper}: requires_grad changed after the wrapper was built: "
                                           rf"'{name}' \({before} -> {after}\); "):
        lm_loss(wrapped(x), y).backward()


@pytest.mark.world_sizes(2, 4)
def test_fsdp_stages_under_zero_bubble_fine_tune_like_one_process(comm):
    """FSDP-wrapped pipeline stages (zb_h1: B now, W later): the first stage is all frozen, the second one unit
    mixing frozen attention with trainable layers; B and W give frozen parameters nothing."""
    frozen_modules = FROZEN + ("blocks.1.attn",)
    ref_state, ref_losses, frozen = reference(frozen=frozen_modules, tie=False)
    grid = mesh(comm, pp=2)
    model = make_model(frozen=frozen_modules, tie=False)
    stage = model.pipeline_stages(2)[grid.pp_rank]
    names = [(f"{prefix}.{name}", p) for prefix, layer in zip(stage.names, stage)
             for name, p in layer.named_parameters()]
    start = {name: p.data.copy() for name, p in names}
    fsdp = FSDP(stage, grid.dp_comm, units=[stage])
    assert [u.label for u in fsdp.units] == (["<root>"] if grid.pp_rank == 0 else ["<root>", "<root> (frozen)"])
    pipe = Pipeline(fsdp, grid.pp_comm, 2, "zb_h1", loss_fn=lm_loss)
    opt = optimizer(fsdp.parameters())
    losses = []
    for step in range(STEPS):
        x, y = (rows(a, grid.dp_rank, grid.dp) for a in global_batch(step))
        opt.zero_grad()
        loss = pipe.step(x, y, broadcast_loss=True)
        assert pipe.stats.peak_pending_w > 0 or grid.pp_rank == 0  # the second stage's W ran after its B
        assert all(p.grad is None for p in fsdp.parameters() if not p.requires_grad)
        losses.append(float(np.mean(grid.dp_comm.allgather(loss))))
        opt.step()
    np.testing.assert_allclose(losses, ref_losses, rtol=TOL, atol=0, err_msg="losses")
    with fsdp.summon_full_params():
        for name, p in names:
            np.testing.assert_allclose(p.data, ref_state[name], rtol=TOL, atol=TOL, err_msg=name)
            if name in frozen:
                np.testing.assert_array_equal(p.data, start[name], err_msg=f"frozen {name} moved")
                assert p.grad is None, f"frozen {name} has a gradient"
    grid.free()
