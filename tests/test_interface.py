"""The wrapper interface (mpidist.parallel.interface) under DDP, a plain module and a tensor-parallel GPT.

Reference: one process's ``GPT(cfg, rng=np.random.default_rng(0))``. Every rank builds its layout from the same
seed; the test puts every rank's local arrays (allgathered) back into global tensors by their placements alone
and compares them with the reference's parameters and, after a backward and ``clip_grad_norm_``, with the
reference's gradients scaled by the formula of ``torch.nn.utils.clip_grad_norm_`` (norm by ``np.linalg.norm``).
The same wrappers built from a DeviceMesh train like one process, and meshes whose dimensions do not fit raise
on every rank. Runs on SimComm worlds and under ``mpiexec -n 2 / -n 4 pytest --with-mpi``.
"""
import ast
import dataclasses
import math
import pathlib

import numpy as np
import pytest

import mpidist
from mpidist import nn
from mpidist.models import GPT, GPTConfig, lm_loss
from mpidist.nn.placement import FlatShard, Replicate, set_placement
from mpidist.optim import Adam, AdamW
from mpidist.models import tensor_parallel
from mpidist.parallel import DDP, DeviceMesh, Pipeline, full_state_dict, mesh
from mpidist.parallel.fsdp import FSDP
from mpidist.parallel.interface import LocalModule, PlacedParameter, Wrapper, as_wrapper

from helpers import assert_reassembles, train_slice

CONFIG = GPTConfig(vocab_size=61, block_size=8, n_layer=1, n_head=4, n_embd=16, dropout=0.0, tie_weights=False,
                   dtype="float64")  # vocabulary 61: padded rows at tp 2 and 4
BATCH = 4
KINDS = ["plain", "tp", "ddp", "ddp_tp"]


def reference_model():
    return GPT(CONFIG, rng=np.random.default_rng(0))


def batch():
    tokens = np.random.default_rng(7).integers(0, CONFIG.vocab_size, (BATCH, CONFIG.block_size + 1))
    return tokens[:, :-1], tokens[:, 1:]


class Layout:
    """One rank's model, wrapper, the loss to call and its share of the global batch."""

    def __init__(self, comm, kind):
        self.grid, self.dp_rank, self.dp = None, 0, 1
        model = reference_model()
        self.loss = lm_loss
        if kind == "plain":
            self.wrapper = as_wrapper(model)
        elif kind == "tp":
            model = tensor_parallel(model, comm, sequence_parallel=False)
            self.wrapper, self.loss = as_wrapper(model), model.loss
        elif kind == "ddp":
            self.wrapper = DDP(model, comm)
            self.dp_rank, self.dp = comm.Get_rank(), comm.Get_size()
        else:  # DDP over the data-parallel ranks of a dp x tp mesh
            self.grid = mesh(comm, tp=2 if comm.Get_size() % 2 == 0 else 1)
            model = tensor_parallel(model, self.grid.tp_comm, sequence_parallel=False)
            self.wrapper, self.loss = DDP(model, self.grid.dp_comm), model.loss
            self.dp_rank, self.dp = self.grid.dp_rank, self.grid.dp
        self.model = model

    def backward(self):
        x, y = batch()
        n = BATCH // self.dp
        mine = slice(self.dp_rank * n, (self.dp_rank + 1) * n)
        call = self.wrapper if isinstance(self.wrapper, DDP) else self.model
        self.loss(call(x[mine]), y[mine]).backward()

    def close(self):
        self.wrapper.remove()
        if self.grid is not None:
            self.grid.free()


def parameters(model):
    """Return {name: array} of ``model``'s parameters (the reference a layout reassembles to)."""
    return {name: p.data for name, p in model.named_parameters()}


@pytest.mark.world_sizes(1, 2, 4)
@pytest.mark.parametrize("kind", KINDS)
def test_placed_parameters_reassemble_the_unsplit_model(comm, kind):
    layout = Layout(comm, kind)
    ref = reference_model()
    placed = layout.wrapper.placed_parameters()
    assert isinstance(layout.wrapper, Wrapper)
    assert [p.name for p in placed] == [name for name, _ in ref.named_parameters()]
    assert [id(p.parameter) for p in placed] == [id(p) for p in layout.model.parameters()]
    assert list(layout.wrapper.parameters()) == list(layout.model.parameters())
    assert_reassembles(comm, placed, lambda p: p.data, parameters(ref))
    layout.close()


@pytest.mark.world_sizes(1, 2, 4)
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
@pytest.mark.parametrize("kind", KINDS)
def test_clip_grad_norm_equals_the_norm_of_the_global_gradient(comm, kind, norm_type):
    ref = reference_model()
    x, y = batch()
    lm_loss(ref(x), y).backward()
    ref_grads = {name: p.grad for name, p in ref.named_parameters()}
    total = float(np.linalg.norm(np.concatenate([g.ravel() for g in ref_grads.values()]), ord=norm_type))
    layout = Layout(comm, kind)
    layout.backward()
    max_norm = total / 4
    norm = layout.wrapper.clip_grad_norm_(max_norm, norm_type=norm_type)
    assert norm == pytest.approx(total, rel=1e-10)
    scale = max_norm / (total + 1e-6)
    assert_reassembles(comm, layout.wrapper.placed_parameters(), lambda p: p.grad,
                       {name: g * scale for name, g in ref_grads.items()}, atol=1e-12)
    layout.close()


@pytest.mark.world_sizes(1, 2, 4)
@pytest.mark.parametrize("kind", KINDS)
def test_mesh_and_communicators(comm, kind):
    layout = Layout(comm, kind)
    wrapper = layout.wrapper
    assert wrapper.communicators() == ()
    expected_mesh = {"plain": None, "tp": comm, "ddp": comm}.get(kind, layout.grid and layout.grid.dp_comm)
    assert isinstance(wrapper.mesh, DeviceMesh) and wrapper.mesh.comm is expected_mesh
    # Its dimensions: DDP's data-parallel ranks, a tensor-parallel module's placement ranks, none for a plain one.
    names = {"plain": (), "tp": ("tp",)}.get(kind, ("dp",))
    assert wrapper.mesh.names == names and wrapper.mesh.size() == (1 if expected_mesh is None else
                                                                    expected_mesh.Get_size())
    assert all(wrapper.mesh[name] is expected_mesh for name in names)
    # The norm adds up over the tensor-parallel ranks only: data-parallel replicas hold the same gradients.
    tp_comm = {"tp": comm, "ddp_tp": layout.grid and layout.grid.tp_comm}.get(kind)
    assert wrapper.grad_norm_comms() == (() if tp_comm is None else (tp_comm,))
    assert all(a is b for a, b in zip(wrapper.grad_norm_comms(), (tp_comm,)))
    layout.close()


@pytest.mark.world_sizes(2, 4)
def test_after_remove_a_backward_stays_local(comm):
    """DDP.remove() leaves no hook: the next backward's gradients are this rank's own, not the average."""
    layout = Layout(comm, "ddp")
    layout.wrapper.remove()
    x, y = batch()
    n = BATCH // comm.Get_size()
    mine = slice(comm.Get_rank() * n, (comm.Get_rank() + 1) * n)
    lm_loss(layout.model(x[mine]), y[mine]).backward()
    alone = reference_model()
    lm_loss(alone(x[mine]), y[mine]).backward()
    everyone = reference_model()
    lm_loss(everyone(x), y).backward()
    for (name, p), a, e in zip(layout.model.named_parameters(), alone.parameters(), everyone.parameters()):
        np.testing.assert_allclose(p.grad, a.grad, rtol=0, atol=1e-12, err_msg=name)
    assert any(not np.allclose(a.grad, e.grad) for a, e in zip(alone.parameters(), everyone.parameters()))
    layout.wrapper.remove()  # twice: nothing left to remove


@pytest.mark.mpi_skip
def test_no_sync_and_sync_gradients_under_a_local_module():
    """A local module's gradients are final after backward: no_sync accumulates, sync_gradients keeps them."""
    model = reference_model()
    wrapper = as_wrapper(model)
    x, y = batch()
    with wrapper.no_sync():
        lm_loss(model(x[:2]), y[:2]).backward()
    lm_loss(model(x[2:]), y[2:]).backward()
    wrapper.sync_gradients()
    ref = reference_model()
    lm_loss(ref(x[:2]), y[:2]).backward()
    lm_loss(ref(x[2:]), y[2:]).backward()
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        np.testing.assert_array_equal(p.grad, r.grad, err_msg=name)


@pytest.mark.mpi_skip
def test_memory_stats_count_parameters_gradients_and_optimizer_state():
    model = nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 2))
    wrapper = as_wrapper(model)
    opt = Adam(list(wrapper.parameters()), lr=0.1)
    model(np.ones((2, 3), dtype=np.float32)).sum().backward()
    opt.step()
    nbytes = 4 * (3 * 5 + 5 + 5 * 2 + 2)  # float32 weights and biases
    stats = wrapper.memory_stats(opt)
    assert stats == {"param_bytes": nbytes, "grad_bytes": nbytes, "optimizer_state_bytes": 2 * nbytes,
                     "persistent_bytes": 4 * nbytes, "peak_bytes": 4 * nbytes}  # Adam: two moments per element
    with pytest.raises(ValueError, match=r"LocalModule.memory_stats: Adam holds none of this wrapper's parameters"):
        wrapper.memory_stats(Adam([nn.Parameter(np.zeros(2, dtype=np.float32))], lr=0.1))


@pytest.mark.mpi_skip
def test_as_wrapper_returns_wrappers_and_refuses_other_types():
    model = nn.Linear(2, 2)
    wrapper = as_wrapper(model)
    assert isinstance(wrapper, LocalModule) and wrapper.module is model and wrapper.mesh.comm is None
    assert as_wrapper(wrapper) is wrapper
    with pytest.raises(TypeError, match=r"as_wrapper: expected a parallel wrapper \(DDP\) or an mpidist.nn.Module, "
                                        r"got int"):
        as_wrapper(3)


class _FakeComm:
    def __init__(self, size):
        self.size = size

    def Get_size(self):
        return self.size


@pytest.mark.mpi_skip
def test_a_local_module_placed_over_two_communicators_is_refused():
    model = nn.Linear(2, 2)
    set_placement(model.weight, Replicate(_FakeComm(2)))
    set_placement(model.bias, Replicate(_FakeComm(3)))
    with pytest.raises(ValueError, match=r"LocalModule: the parameters of Linear are placed over 2 different "
                                         r"communicators \(sizes \[2, 3\]\)"):
        as_wrapper(model)


class _TiedCopy(Wrapper):
    """A wrapper holding a weight twice (as a pipeline's last stage holds a tied embedding): the copy not primary."""

    def __init__(self, primary, copy):
        self.mesh = DeviceMesh.from_dimensions({})
        self.placed = (PlacedParameter("w", primary, None), PlacedParameter("w", copy, None, primary=False))

    def placed_parameters(self):
        return self.placed

    def named_buffers_global(self):
        return iter(())

    def communicators(self):
        return ()

    def grad_norm_comms(self):
        return ()

    def no_sync(self):
        raise NotImplementedError

    def sync_gradients(self):
        pass

    def remove(self):
        pass


@pytest.mark.mpi_skip
def test_clip_counts_a_tied_copy_once_and_scales_it_alike():
    grad = np.array([3.0, 4.0])
    primary, copy = nn.Parameter(np.zeros(2)), nn.Parameter(np.zeros(2))
    primary.grad, copy.grad = grad.copy(), grad.copy()
    wrapper = _TiedCopy(primary, copy)
    assert list(wrapper.parameters()) == [primary, copy]
    assert wrapper.clip_grad_norm_(1.0) == pytest.approx(5.0, rel=1e-12)  # not sqrt(2) * 5
    for p in (primary, copy):
        np.testing.assert_allclose(p.grad, grad / (5.0 + 1e-6), rtol=1e-12)


@pytest.mark.parametrize("layout", ["copy_listed_twice", "copy_is_the_primary_object"])
def test_clip_scales_each_parameter_once_however_often_it_is_listed(layout):
    """A tied weight in two chunks of one interleaved pipeline rank is listed twice (or the primary object is
    also listed as a copy): its gradient is scaled once, not squared."""
    grad = np.array([3.0, 4.0])
    primary, copy = nn.Parameter(np.zeros(2)), nn.Parameter(np.zeros(2))
    primary.grad, copy.grad = grad.copy(), grad.copy()
    wrapper = _TiedCopy(primary, copy)
    if layout == "copy_listed_twice":
        wrapper.placed += (PlacedParameter("w", copy, None, primary=False),)
    else:
        wrapper.placed += (PlacedParameter("w", primary, None, primary=False),)
    assert wrapper.clip_grad_norm_(1.0) == pytest.approx(5.0, rel=1e-12)
    for p in (primary, copy):
        np.testing.assert_allclose(p.grad, grad / (5.0 + 1e-6), rtol=1e-12)


# -- Pipeline ---------------------------------------------------------------------------------------------------
# A GPT cut by pipeline_stages over the pipeline ranks of a mesh: "pp" and "pp_tied" over all ranks (a world of 4
# cuts one block into stages [embed], [block], [], [head]), "dp_pp_tied" with two data-parallel replicas.
PIPELINE_KINDS = ["pp", "pp_tied", "dp_pp_tied"]


def pipeline_config(kind):
    return dataclasses.replace(CONFIG, tie_weights=kind != "pp")


class PipelineLayout:
    def __init__(self, comm, kind):
        size = comm.Get_size()
        self.config = pipeline_config(kind)
        self.grid = mesh(comm, pp=size if kind != "dp_pp_tied" else size // 2)
        self.dp, self.dp_rank = self.grid.dp, self.grid.dp_rank
        self.stage = GPT(self.config, rng=np.random.default_rng(0)).pipeline_stages(self.grid.pp)[self.grid.pp_rank]
        self.pipe = Pipeline(self.stage, self.grid.pp_comm, 2, "1f1b", loss_fn=lm_loss,
                             dp_comm=self.grid.dp_comm if self.dp > 1 else None, tied_parameters=self.stage.tied)

    def step(self):
        x, y = batch()
        n = BATCH // self.dp
        mine = slice(self.dp_rank * n, (self.dp_rank + 1) * n)
        self.pipe.step(x[mine], y[mine])

    def close(self):
        self.pipe.remove()
        self.grid.free()


def pipeline_reference(kind):
    return GPT(pipeline_config(kind), rng=np.random.default_rng(0))


@pytest.mark.world_sizes(2, 4)
@pytest.mark.parametrize("kind", PIPELINE_KINDS)
def test_pipeline_placed_parameters_are_the_unsplit_models(comm, kind):
    layout = PipelineLayout(comm, kind)
    pipe, ref = layout.pipe, pipeline_reference(kind)
    placed = pipe.placed_parameters()
    assert isinstance(pipe, Wrapper)
    assert {p.stage for p in placed} <= {layout.grid.pp_rank}
    assert [id(p.parameter) for p in placed] == [id(p) for p in layout.stage.parameters()]
    # Primary names over all stages, in stage order (each replica alike), are the one-process model's names.
    per_stage = {}
    for stage, names in comm.allgather((layout.grid.pp_rank, [p.name for p in placed if p.primary])):
        assert per_stage.setdefault(stage, names) == names, f"replicas of stage {stage} differ"
    assert [n for s in sorted(per_stage) for n in per_stage[s]] == [name for name, _ in ref.named_parameters()]
    assert_reassembles(comm, [p for p in placed if p.primary], lambda p: p.data, parameters(ref))
    # The head's copy of the tied embedding: not primary, under the embedding's name, on the last stage only.
    copies = [p for p in placed if not p.primary]
    last = layout.grid.pp_rank == layout.grid.pp - 1
    if kind == "pp" or layout.grid.pp == 1:
        assert copies == []
    else:
        assert [(p.name, p.stage, p.parameter is layout.stage[len(layout.stage) - 1].weight) for p in copies] == \
            ([("embed.wte.weight", layout.grid.pp - 1, True)] if last else [])
        for p in copies:
            np.testing.assert_array_equal(p.parameter.data, ref.embed.wte.weight.data)
    layout.close()


@pytest.mark.world_sizes(2, 4)
@pytest.mark.parametrize("kind", PIPELINE_KINDS)
def test_pipeline_communicators_and_buffers(comm, kind):
    layout = PipelineLayout(comm, kind)
    pipe, grid = layout.pipe, layout.grid
    tied = kind != "pp" and grid.pp > 1 and grid.pp_rank in (0, grid.pp - 1)
    own = pipe.communicators()
    assert len(own) == (grid.dp > 1) + tied
    assert isinstance(pipe.mesh, DeviceMesh) and pipe.mesh["pp"] is grid.pp_comm
    if grid.dp > 1:  # given apart, no one communicator holds the dp and pp groups
        assert own[0] is grid.dp_comm and pipe.mesh.comm is None
        assert pipe.mesh.names == ("dp", "pp") and pipe.mesh["dp"] is grid.dp_comm
    else:
        assert pipe.mesh.comm is grid.pp_comm and pipe.mesh.names == ("pp",)
    if tied:  # the first and last stages' group, holding the embedding and the head's copy
        assert own[-1].Get_size() == 2
    assert len(pipe.grad_norm_comms()) == 1 and pipe.grad_norm_comms()[0] is grid.pp_comm
    ref = dict(pipeline_reference(kind).named_buffers())
    for name, array in pipe.named_buffers_global():
        np.testing.assert_array_equal(array, ref[name], err_msg=name)
    layout.close()


@pytest.mark.world_sizes(2, 4)
@pytest.mark.parametrize("kind", PIPELINE_KINDS)
def test_pipeline_clip_grad_norm_equals_the_norm_of_the_global_gradient(comm, kind):
    """The base class's clip over a pipeline: the tied weight counted once, its copy scaled alike."""
    ref = pipeline_reference(kind)
    x, y = batch()
    lm_loss(ref(x), y).backward()
    ref_grads = {name: p.grad for name, p in ref.named_parameters()}
    total = float(np.linalg.norm(np.concatenate([g.ravel() for g in ref_grads.values()])))
    layout = PipelineLayout(comm, kind)
    layout.step()
    max_norm = total / 4
    assert layout.pipe.clip_grad_norm_(max_norm) == pytest.approx(total, rel=1e-10)
    scale = max_norm / (total + 1e-6)
    placed = layout.pipe.placed_parameters()
    assert_reassembles(comm, [p for p in placed if p.primary], lambda p: p.grad,
                       {name: g * scale for name, g in ref_grads.items()}, atol=1e-12)
    for p in placed:
        if not p.primary:
            np.testing.assert_allclose(p.parameter.grad, ref_grads[p.name] * scale, rtol=0, atol=1e-12)
    layout.close()


@pytest.mark.world_sizes(2)
def test_pipeline_remove_leaves_no_data_parallel_hook(comm):
    """After Pipeline.remove() a backward through a stage (pp = 1, dp = 2: the whole model) stays local."""
    layout = PipelineLayout(comm, "dp_pp_tied")
    assert layout.grid.pp == 1 and layout.dp == 2
    layout.pipe.remove()
    x, y = batch()
    mine = slice(comm.Get_rank() * 2, comm.Get_rank() * 2 + 2)
    lm_loss(layout.stage(x[mine]), y[mine]).backward()
    alone = pipeline_reference("dp_pp_tied")
    lm_loss(alone(x[mine]), y[mine]).backward()
    for (name, p), a in zip(layout.stage.named_parameters(), alone.parameters()):
        np.testing.assert_allclose(p.grad, a.grad, rtol=0, atol=1e-12, err_msg=name)
    layout.pipe.remove()  # twice: nothing left to remove
    layout.grid.free()


@pytest.mark.world_sizes(2, 4)
def test_pipeline_no_sync_accumulates_and_the_next_step_reduces(comm):
    """Two half-batch steps, the first under no_sync, give the full batch's gradients (x2: two means added)."""
    ref = pipeline_reference("dp_pp_tied")
    x, y = batch()
    lm_loss(ref(x), y).backward()
    layout = PipelineLayout(comm, "dp_pp_tied")
    with layout.pipe.no_sync():
        layout.step()
    layout.step()
    placed = layout.pipe.placed_parameters()
    assert_reassembles(comm, [p for p in placed if p.primary], lambda p: p.grad,
                       {name: 2 * p.grad for name, p in ref.named_parameters()}, atol=1e-12)
    for p in placed:
        if not p.primary:
            np.testing.assert_allclose(p.parameter.grad, 2 * ref.embed.wte.weight.grad, rtol=0, atol=1e-12)
    layout.close()


# -- FSDP -------------------------------------------------------------------------------------------------------
# FSDP over every rank with one unit per layer (embedding, block, head), and "tp" FSDP over the data-parallel ranks
# of a dp x tp mesh around a tensor-parallel GPT: its FlatShards then cut tensor-parallel blocks.
FSDP_KINDS = ["full_shard", "shard_grad_op", "no_shard", "tp"]


class FSDPLayout:
    def __init__(self, comm, kind):
        model = reference_model()
        self.grid, self.loss, self.dp_comm = None, lm_loss, comm
        if kind == "tp":
            self.grid = mesh(comm, tp=2)
            model = tensor_parallel(model, self.grid.tp_comm, sequence_parallel=False)
            self.loss, self.dp_comm = model.loss, self.grid.dp_comm
        self.model = model
        self.fsdp = FSDP(model, self.dp_comm, strategy="full_shard" if kind == "tp" else kind,
                         units=model.fsdp_units())

    def backward(self):
        x, y = batch()
        n = BATCH // self.dp_comm.Get_size()
        mine = slice(self.dp_comm.Get_rank() * n, (self.dp_comm.Get_rank() + 1) * n)
        self.loss(self.fsdp(x[mine]), y[mine]).backward()

    def close(self):
        self.fsdp.remove()
        if self.grid is not None:
            self.grid.free()


def fsdp_sizes(kind):
    return (2, 4) if kind == "tp" else (1, 2, 4)


@pytest.mark.world_sizes(1, 2, 4)
@pytest.mark.parametrize("kind", FSDP_KINDS)
def test_fsdp_placed_parameters_reassemble_the_unsplit_model(comm, kind):
    if comm.Get_size() not in fsdp_sizes(kind):
        pytest.skip(f"{kind} needs an even world")
    layout = FSDPLayout(comm, kind)
    fsdp, ref = layout.fsdp, reference_model()
    placed = fsdp.placed_parameters()
    assert isinstance(fsdp, Wrapper)
    assert [p.name for p in placed] == [name for name, _ in ref.named_parameters()]
    assert all(isinstance(p.placement, FlatShard) for p in placed)
    assert {id(p.parameter) for p in placed} == {id(s) for s in fsdp.parameters()}
    assert list(fsdp.parameters()) == list(Wrapper.parameters(fsdp))
    assert_reassembles(comm, placed, lambda p: p.data, parameters(ref))
    layout.close()


@pytest.mark.world_sizes(1, 2, 4)
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
@pytest.mark.parametrize("kind", FSDP_KINDS)
def test_fsdp_clip_grad_norm_equals_the_norm_of_the_global_gradient(comm, kind, norm_type):
    if comm.Get_size() not in fsdp_sizes(kind):
        pytest.skip(f"{kind} needs an even world")
    ref = reference_model()
    x, y = batch()
    lm_loss(ref(x), y).backward()
    ref_grads = {name: p.grad for name, p in ref.named_parameters()}
    total = float(np.linalg.norm(np.concatenate([g.ravel() for g in ref_grads.values()]), ord=norm_type))
    layout = FSDPLayout(comm, kind)
    layout.backward()
    max_norm = total / 4
    norm = layout.fsdp.clip_grad_norm_(max_norm, norm_type=norm_type)
    assert norm == pytest.approx(total, rel=1e-10)
    scale = max_norm / (total + 1e-6)
    assert_reassembles(comm, layout.fsdp.placed_parameters(), lambda p: p.grad,
                       {name: g * scale for name, g in ref_grads.items()}, atol=1e-12)
    layout.close()


@pytest.mark.world_sizes(1, 2, 4)
@pytest.mark.parametrize("kind", FSDP_KINDS)
def test_fsdp_mesh_and_communicators(comm, kind):
    if comm.Get_size() not in fsdp_sizes(kind):
        pytest.skip(f"{kind} needs an even world")
    layout = FSDPLayout(comm, kind)
    fsdp = layout.fsdp
    assert fsdp.communicators() == ()  # it made none: full_shard shards over comm, no_shard replicates over it
    assert isinstance(fsdp.mesh, DeviceMesh) and fsdp.mesh.comm is layout.dp_comm
    dim = "replicate" if kind == "no_shard" else "shard"
    assert fsdp.mesh.names == (dim,) and fsdp.mesh[dim] is layout.dp_comm
    # The norm adds up over the ranks holding disjoint pieces: tensor-parallel ranks, then the shard group.
    expected = {"no_shard": (), "tp": (layout.grid and layout.grid.tp_comm, layout.dp_comm)}.get(kind, (comm,))
    assert len(fsdp.grad_norm_comms()) == len(expected)
    assert all(a is b for a, b in zip(fsdp.grad_norm_comms(), expected))
    assert all(p.placement.comm is (None if kind == "no_shard" else layout.dp_comm) for p in fsdp.placed_parameters())
    assert [name for name, _ in fsdp.named_buffers_global()] == [name for name, _ in layout.model.named_buffers()]
    layout.close()


@pytest.mark.world_sizes(2, 4)
def test_fsdp_remove_lets_the_module_be_wrapped_again(comm):
    """After remove() the module carries no FSDP hooks or mark: given its full values back, a new FSDP wraps it."""
    layout = FSDPLayout(comm, "full_shard")
    model, ref = layout.model, reference_model()
    layout.fsdp.remove()
    with pytest.raises(AttributeError):
        layout.fsdp.remove_hooks  # renamed: one name, the interface's
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        p.data = r.data.copy()
    lm_loss(model(batch()[0]), batch()[1]).backward()  # no hook gathers or reduces: plain local gradients
    lm_loss(ref(batch()[0]), batch()[1]).backward()
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        np.testing.assert_array_equal(p.grad, r.grad, err_msg=name)
        p.grad = None
    again = FSDP(model, comm, units=model.fsdp_units())
    assert_reassembles(comm, again.placed_parameters(), lambda p: p.data, parameters(ref))
    again.remove()
    layout.fsdp.remove()  # twice: nothing left to remove


# -- package boundaries -------------------------------------------------------------------------------------------
def _private_imports_across_packages():
    """Return "path:line module.name" for every private name a module of mpidist imports from another subpackage
    (mpidist.models from mpidist.parallel, say): what one package offers another must be public."""
    root = pathlib.Path(mpidist.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        package = module if parts[-1] == "__init__" else module.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[:2] == module.split(".")[:2] or not source.startswith("mpidist"):
                continue
            found += [f"{path.relative_to(root.parent)}:{node.lineno} {source}.{alias.name}" for alias in node.names
                      if alias.name.startswith("_") and not alias.name.startswith("__")]
    return found


@pytest.mark.mpi_skip
def test_no_package_imports_private_names_of_another():
    assert _private_imports_across_packages() == []


# -- wrappers built from a mesh ----------------------------------------------------------------------------------
# Every wrapper takes its groups from a DeviceMesh: DDP a 1-D mesh, FSDP a 1-D mesh or a 2-D one (hybrid sharding:
# replicate over the first dimension, shard over the second), Pipeline the "pp" (and "dp", "tp") dimensions of a
# mesh. Two AdamW steps on each rank's share of the batch must give one process's parameters (float64, 1e-12),
# reassembled from every rank by placements alone; and the wrapper's mesh spans the layout, so full_state_dict needs
# no comm=. Pipelines use tied weights (the head's copy of the embedding) and two blocks, cut into up to 4 stages.
MESH_KINDS = {"ddp": (1, 2, 4), "fsdp_1d": (1, 2, 4), "fsdp_2d": (2, 4), "fsdp_1d_hybrid": (2, 4), "pp": (2, 4),
              "dp_pp": (4,), "pp_tp": (4,)}
MESH_STEPS = 2


class MeshLayout:
    def __init__(self, comm, kind):
        size = comm.Get_size()
        pipelined = kind in ("pp", "dp_pp", "pp_tp")  # two blocks: every one of 4 stages holds a layer
        self.config = dataclasses.replace(CONFIG, tie_weights=pipelined, n_layer=2 if pipelined else 1)
        self.model = model = GPT(self.config, rng=np.random.default_rng(0))
        self.pipeline, self.dp, self.dp_rank = False, size, comm.Get_rank()
        if kind == "ddp":
            self.mesh = DeviceMesh(comm, {"dp": size})
            self.wrapper = DDP(model, self.mesh)
            assert self.wrapper.comm is self.mesh["dp"]
        elif kind == "fsdp_1d_hybrid":  # a 1-D mesh is its communicator: shard_size splits it as it would that
            self.mesh = DeviceMesh(comm, {"dp": size})
            self.wrapper = FSDP(model, self.mesh, strategy="hybrid_shard", shard_size=2, units=model.fsdp_units())
            split = self.wrapper.mesh  # the (replicate, shard) mesh of the groups FSDP split off mesh["dp"]
            assert split.names == ("replicate", "shard") and split.shape == (size // 2, 2)
            assert split.comm is self.mesh["dp"] and split["shard"] is self.wrapper.shard_comm
            assert split["replicate"] is self.wrapper.replicate_comm
        elif kind in ("fsdp_1d", "fsdp_2d"):
            self.mesh = DeviceMesh(comm, {"dp": size} if kind == "fsdp_1d" else {"replicate": -1, "shard": 2})
            self.wrapper = FSDP(model, self.mesh, units=model.fsdp_units())
            if kind == "fsdp_2d":
                assert self.wrapper.settings.strategy.value == "hybrid_shard"
                assert self.wrapper.shard_comm is self.mesh["shard"]
                assert self.wrapper.replicate_comm is self.mesh["replicate"]
            else:
                assert self.wrapper.shard_comm is self.mesh["dp"] and self.wrapper.replicate_comm is None
        else:
            dp, pp, tp = {"pp": (1, size, 1), "dp_pp": (2, 2, 1), "pp_tp": (1, 2, 2)}[kind]
            self.mesh = mesh(comm, dp=dp, pp=pp, tp=tp)
            if tp > 1:
                tensor_parallel(model, self.mesh.tp_comm, sequence_parallel=False)
            stage = model.pipeline_stages(pp)[self.mesh.pp_rank]
            self.wrapper = Pipeline(stage, self.mesh, 2, "1f1b", loss_fn=model.loss, tied_parameters=stage.tied)
            self.pipeline, self.dp, self.dp_rank = True, self.mesh.dp, self.mesh.dp_rank
            assert self.wrapper.comm is self.mesh["pp"]
            assert self.wrapper.dp_comm is (self.mesh["dp"] if dp > 1 else None)
        assert self.wrapper.mesh is self.mesh or kind == "fsdp_1d_hybrid"
        self.opt = AdamW(list(self.wrapper.parameters()), lr=0.01)

    def train(self):
        train_slice(self.model, self.wrapper, self.opt, batch(), self.dp, self.dp_rank, self.pipeline, MESH_STEPS)

    def close(self):
        self.wrapper.remove()
        self.mesh.free()


def trained_alone(config):
    """Return one process's parameters after MESH_STEPS AdamW steps on the whole batch."""
    model = GPT(config, rng=np.random.default_rng(0))
    opt = AdamW(list(model.parameters()), lr=0.01)
    x, y = batch()
    for _ in range(MESH_STEPS):
        opt.zero_grad()
        model.loss(model(x), y).backward()
        opt.step()
    return model


@pytest.mark.world_sizes(1, 2, 4)
@pytest.mark.parametrize("kind", list(MESH_KINDS))
def test_a_wrapper_built_from_a_mesh_trains_like_one_process(comm, kind):
    if comm.Get_size() not in MESH_KINDS[kind]:
        pytest.skip(f"{kind} runs on {MESH_KINDS[kind]} ranks")
    layout = MeshLayout(comm, kind)
    layout.train()
    ref = trained_alone(layout.config)
    placed = [p for p in layout.wrapper.placed_parameters() if p.primary]
    assert_reassembles(comm, placed, lambda p: p.data, parameters(ref), atol=1e-12)
    got = full_state_dict(layout.wrapper)  # over wrapper.mesh.comm: the whole layout
    if comm.Get_rank() == 0:
        assert list(got) == list(ref.state_dict())
        for name, value in ref.state_dict().items():
            np.testing.assert_allclose(got[name], value, rtol=0, atol=1e-12, err_msg=name)
    layout.close()


@pytest.mark.world_sizes(2, 4)
def test_a_mesh_whose_dimensions_do_not_fit_raises_on_every_rank(comm):
    size = comm.Get_size()
    grid = mesh(comm, dp=size // 2, tp=2)
    dims = f"dp={size // 2}, pp=1, tp=2"
    with pytest.raises(ValueError, match=rf"DDP: ranks [0-9,]+: a mesh must have one dimension, the data-parallel "
                                         rf"ranks \(got {dims}\); pass that dimension's mesh"):
        DDP(reference_model(), grid)
    with pytest.raises(ValueError, match=rf"FSDP: ranks [0-9,]+: a mesh must have one dimension \(shard over it\) "
                                         rf"or two \(replicate over the first, shard over the second\) \(got {dims}\)"):
        FSDP(reference_model(), grid)
    hybrid = DeviceMesh(comm, {"replicate": size // 2, "shard": 2})
    two = f"replicate={size // 2}, shard=2"
    with pytest.raises(ValueError, match=rf"FSDP: ranks [0-9,]+: a 2-D mesh \({two}\) gives the shard and replica "
                                         rf"groups: pass no shard_size with it"):
        FSDP(reference_model(), hybrid, shard_size=2)
    with pytest.raises(ValueError, match=rf"a 2-D mesh \({two}\) shards over its second dimension but "
                                         rf"strategy='no_shard' shards nothing"):
        FSDP(reference_model(), hybrid, strategy="no_shard")
    stage = reference_model().pipeline_stages(2)[min(comm.Get_rank(), 1)]
    other = DeviceMesh(comm, {"x": 2, "y": size // 2})
    with pytest.raises(ValueError, match=rf"Pipeline: ranks [0-9,]+: a mesh must have one dimension \(the pipeline\) "
                                         rf"or a dimension 'pp' and besides it only 'dp' \(replicas\) and 'tp' "
                                         rf"\(tensor parallel inside stages\) \(got x=2, y={size // 2}\)"):
        Pipeline(stage, other, 2, loss_fn=lm_loss)
    pipeline = mesh(comm, dp=2, pp=size // 2)
    with pytest.raises(ValueError, match=rf"Pipeline: ranks [0-9,]+: the mesh \(dp=2, pp={size // 2}, tp=1\) gives "
                                         rf"the data-parallel ranks: pass no dp_comm with it"):
        Pipeline(stage, pipeline, 2, loss_fn=lm_loss, dp_comm=pipeline.dp_comm)
    for m in (grid, hybrid, other, pipeline):
        m.free()
