"""A GPT built deferred and materialized at every layout holds the one-process model's values and trains like it.

Reference: one process's ``materialize`` of the same deferred GPT (same seed): its ``state_dict()`` bitwise at
construction, and after two AdamW steps on the whole batch within 1e-12 (float64). Each layout materializes only
its part (DDP: the whole model, without a broadcast; tensor parallel: its slices; FSDP and hybrid: its shard of
each unit; a pipeline: its stage's layers), and ``full_state_dict`` gathers it back. Memory: under SimComm the
ranks together allocate about one model, not one per rank; under mpiexec each process about its share.
"""
import sys
import tracemalloc

import numpy as np
import pytest

import mpidist
from mpidist import nn, optim
from mpidist.comm import is_simulated
from mpidist.models import GPT, GPTConfig, tensor_parallel
from mpidist.nn.deferred import deferred_bytes
from mpidist.parallel import DDP, FSDP, Pipeline, full_state_dict, mesh

from helpers import GPTLayout

CONFIG = GPTConfig(vocab_size=61, block_size=8, n_layer=2, n_head=4, n_embd=16, dtype="float64")
UNTIED = GPTConfig(vocab_size=61, block_size=8, n_layer=2, n_head=4, n_embd=16, dtype="float64", tie_weights=False)
BATCH, STEPS, TOL, SEED = 8, 2, 1e-12, 17


def deferred_gpt(config):
    with nn.deferred(seed=SEED):
        return GPT(config)


def batch():
    rng = np.random.default_rng(5)
    return rng.integers(0, CONFIG.vocab_size, (BATCH, CONFIG.block_size)), \
        rng.integers(0, CONFIG.vocab_size, (BATCH, CONFIG.block_size))


def one_process(config, steps):
    model = nn.materialize(deferred_gpt(config))
    opt = optim.AdamW(list(model.parameters()), lr=0.01)
    x, y = batch()
    for _ in range(steps):
        opt.zero_grad()
        model.loss(model(x), y).backward()
        opt.step()
    return model.state_dict()


class Layout(GPTLayout):
    """One rank's deferred GPT at a layout (tests/helpers.py; the wrapper materializes it), and a trainer."""

    def __init__(self, comm, kind, dims=None):
        self.config = UNTIED if kind == "pp" else CONFIG
        super().__init__(comm, deferred_gpt(self.config), kind, dims, batch(), STEPS)


def check_parity(comm, layout):
    got = full_state_dict(layout.wrapped, comm, rank=0)
    if comm.Get_rank() == 0:
        want = nn.materialize(deferred_gpt(layout.config)).state_dict()
        assert list(got) == list(want)
        for name, value in want.items():
            assert got[name].dtype == value.dtype and got[name].tobytes() == value.tobytes(), name
    layout.train()
    got = full_state_dict(layout.wrapped, comm, rank=0)
    if comm.Get_rank() == 0:
        for name, value in one_process(layout.config, STEPS).items():
            np.testing.assert_allclose(got[name], value, rtol=0, atol=TOL, err_msg=name)


@pytest.mark.world_sizes(1, 2, 4)
@pytest.mark.parametrize("kind", ["ddp", "tp", "fsdp", "no_shard", "pp", "pp_tied"])
def test_deferred_gpt_materialized_at_a_layout_trains_like_one_process(comm, kind):
    layout = Layout(comm, kind)
    check_parity(comm, layout)
    layout.close()


@pytest.mark.world_sizes(4)
@pytest.mark.parametrize("dims", ["hybrid", "fsdp_tp", (2, 1, 2), (1, 2, 2), (2, 2, 1)])
def test_deferred_gpt_on_hybrid_fsdp_and_meshes(comm, dims):
    layout = Layout(comm, dims) if isinstance(dims, str) else Layout(comm, "mesh", dims)
    check_parity(comm, layout)
    layout.close()


def test_fsdp_unit_mixing_deferred_and_materialized_parameters_raises():
    with nn.deferred(seed=1):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model[0].weight.data = np.zeros((4, 4), dtype=np.float32)

    def wrap(comm):
        with pytest.raises(ValueError, match=r"unit '0' mixes deferred and materialized.*'0\.weight'"):
            FSDP(model, comm)
        return True

    assert mpidist.simulate(1, wrap) == [True]


# -- memory: no rank allocates the whole model ------------------------------------------------------------------

MEMORY_CONFIG = GPTConfig(vocab_size=256, block_size=32, n_layer=4, n_head=4, n_embd=128, dtype="float64")


def build(comm, kind, deferred):
    """Build the model the way ``kind`` does on this rank (deferred or eager) and return the wrapper."""
    if deferred:
        model = deferred_gpt(MEMORY_CONFIG)
    else:
        model = GPT(MEMORY_CONFIG, rng=np.random.default_rng(SEED))
    if kind == "fsdp":
        return FSDP(model, comm, units=model.fsdp_units())
    grid = mesh(comm, dp=1, pp=2, tp=comm.Get_size() // 2)
    tensor_parallel(model, grid.tp_comm, sequence_parallel=False)
    stage = model.pipeline_stages(2)[grid.pp_rank]
    return Pipeline(stage, grid.pp_comm, 2, "1f1b", loss_fn=model.loss, tied_parameters=stage.tied)


def model_bytes():
    return deferred_bytes(deferred_gpt(MEMORY_CONFIG))


def peak_bytes(fn, *args):
    """Return the traced peak (above the start) of all threads while ``fn(*args)`` runs."""
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        fn(*args)
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("kind", ["fsdp", "tp_pp"])
def test_deferred_ranks_together_allocate_about_one_model(kind):
    """4 simulated ranks (threads of this process): eager, each builds the model (>= 4 models at the peak);
    deferred, each materializes its part (the parts make one model, plus small work arrays)."""
    whole = model_bytes()
    mpidist.simulate(4, build, kind, True)  # imports and caches out of the measurement
    deferred_peak = peak_bytes(mpidist.simulate, 4, build, kind, True)
    eager_peak = peak_bytes(mpidist.simulate, 4, build, kind, False)
    assert eager_peak >= 4 * whole, (eager_peak, whole)
    assert deferred_peak < 1.4 * whole, (deferred_peak, whole)


@pytest.mark.world_sizes(2, 4)
@pytest.mark.parametrize("kind", ["fsdp", "tp_pp"])
def test_deferred_rank_allocates_its_share(comm, kind):
    """Under mpiexec, each process's peak while building is its share of the model, not the model."""
    if is_simulated(comm):
        pytest.skip("per-process memory: run under mpiexec (SimComm ranks share one process)")
    if kind == "tp_pp" and comm.Get_size() < 4:
        pytest.skip("tp x pp needs 4 ranks")
    whole, size = model_bytes(), comm.Get_size()
    build(comm, kind, True)
    peak = peak_bytes(build, comm, kind, True)
    # FSDP: 1/size of every unit; tp x pp: half the layers, 1/(size/2) of each (the replicated norms and
    # position table whole), plus small work arrays: under 0.65 of the model at 2 ranks and 0.45 at 4.
    assert peak < (0.65 if size == 2 else 0.45) * whole, (peak, whole)


@pytest.mark.parametrize("kind", ["ddp", "fsdp", "pp_tied"])
def test_nothing_is_broadcast_at_construction(kind, monkeypatch):
    """Eager models take rank 0's values by broadcast; deferred ones draw their own part, sending nothing."""
    sent = []
    broadcast = mpidist.collectives.broadcast

    def counting(array, comm, *args, **kwargs):
        sent.append(int(np.size(array)))
        return broadcast(array, comm, *args, **kwargs)

    monkeypatch.setattr(mpidist.collectives, "broadcast", counting)

    def build(comm, deferred):
        model = deferred_gpt(CONFIG) if deferred else GPT(CONFIG, rng=np.random.default_rng(0))
        if kind == "ddp":
            return DDP(model, comm).remove()
        if kind == "fsdp":
            return FSDP(model, comm, units=model.fsdp_units()).remove()
        stage = model.pipeline_stages(2)[comm.Get_rank()]
        Pipeline(stage, comm, 2, "1f1b", loss_fn=model.loss, tied_parameters=stage.tied)

    mpidist.simulate(2, build, False)
    assert sum(sent) > 0  # the count sees an eager build's broadcasts
    sent.clear()
    mpidist.simulate(2, build, True)
    assert sent == []


@pytest.mark.world_sizes(2, 4)
def test_ddp_refuses_deferred_parameters_seeded_by_rank(comm):
    """manual_seed(base + rank) before a deferred build: replicas would differ; every rank raises naming them."""
    with nn.deferred(seed=SEED + comm.Get_rank()):
        model = nn.Linear(3, 2)
    with pytest.raises(ValueError, match="deferred seed") as raised:
        DDP(model, comm)
    assert f"rank 0: ('weight', {SEED})" in str(raised.value) and f"rank 1: ('weight', {SEED + 1})" in str(
        raised.value), raised.value


@pytest.mark.world_sizes(2)
def test_pipeline_refuses_tied_copies_deferred_under_different_seeds(comm):
    with nn.deferred(seed=SEED + comm.Get_rank()):
        model = GPT(CONFIG)
    stage = model.pipeline_stages(2)[comm.Get_rank()]
    with pytest.raises(ValueError, match="tied parameter") as raised:
        Pipeline(stage, comm, 2, "1f1b", loss_fn=model.loss, tied_parameters=stage.tied)
    assert f"{SEED}" in str(raised.value) and f"{SEED + 1}" in str(raised.value), raised.value


def test_materialize_refuses_a_module_already_holding_gpu_arrays(monkeypatch):
    """Deferred parameters are drawn on the host: next to GPU arrays they would leave the model half on the host."""
    on_gpu = nn.Linear(3, 2)
    with nn.deferred(seed=SEED):
        model = nn.Sequential(on_gpu, nn.Linear(2, 2))
    # No GPU here: stand in a CuPy array by saying the first layer's weight is one.
    monkeypatch.setattr(sys.modules["mpidist.nn.deferred"], "is_device_array", lambda a: a is on_gpu.weight.data)
    with pytest.raises(ValueError, match=r"materialize: Sequential holds GPU arrays \(0.weight\)"):
        nn.materialize(model)
