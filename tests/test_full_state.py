"""Full-model gather and load (mpidist.parallel.full_state) at every layout, against one process.

Reference: one process's ``GPT(CONFIG, rng=np.random.default_rng(0))``: its ``state_dict()`` at construction,
and after two AdamW steps on the global batch. Every layout builds the same model from the same seed, trains
the same steps on its share of the batch, and ``full_state_dict`` must give back the reference's tensors in the
reference's order. ``load_full_state_dict`` of another state, then training, must equal one process trained from
that state. Runs on SimComm worlds 1, 2, 4 (the 2x2x2 layout on 8 simulated ranks) and under mpiexec -n 2 / -n 4.
"""
import numpy as np
import pytest

import mpidist
from mpidist import nn, optim
from mpidist.models import GPT, GPTConfig
from mpidist.nn.placement import Shard
from mpidist.parallel import DDP
from mpidist.parallel import full_optimizer_state_dict, full_state_dict, iter_full_state, load_full_state_dict
from mpidist.nn.precision import apply_policy

from helpers import GPTLayout

# vocabulary 61: padded rows at tp 2 and 4; float64 so that layouts agree with one process to 1e-12.
CONFIG = GPTConfig(vocab_size=61, block_size=8, n_layer=2, n_head=4, n_embd=16, dtype="float64")
UNTIED = GPTConfig(vocab_size=61, block_size=8, n_layer=2, n_head=4, n_embd=16, dtype="float64", tie_weights=False)
BATCH, STEPS, TOL = 8, 2, 1e-12

KINDS = ["plain", "ddp", "tp", "dp_tp", "fsdp", "hybrid", "pp", "pp_tied"]


def batch():
    rng = np.random.default_rng(5)
    return rng.integers(0, CONFIG.vocab_size, (BATCH, CONFIG.block_size)), \
        rng.integers(0, CONFIG.vocab_size, (BATCH, CONFIG.block_size))


class Layout(GPTLayout):
    """One rank's GPT from ``seed`` at a layout (tests/helpers.py), trained ``STEPS`` steps on ``batch()`` by default.

    ``policy``: a mixed-precision Policy, applied before wrapping as apply_policy asks.
    """

    def __init__(self, comm, kind, dims=None, seed=0, policy=None):
        model = GPT(UNTIED if kind == "pp" else CONFIG, rng=np.random.default_rng(seed))
        if policy is not None:
            apply_policy(model, policy)
        super().__init__(comm, model, kind, dims, batch(), STEPS)


def one_process(config=CONFIG, state=None, steps=STEPS):
    """Return one process's state_dict after ``steps`` AdamW steps on the whole batch (from ``state`` if given)."""
    model = GPT(config, rng=np.random.default_rng(0))
    if state is not None:
        model.load_state_dict(state)
    opt = optim.AdamW(list(model.parameters()), lr=0.01)
    x, y = batch()
    for _ in range(steps):
        opt.zero_grad()
        model.loss(model(x), y).backward()
        opt.step()
    return model.state_dict()


def assert_state_equals(got, want, atol):
    assert list(got) == list(want), "names or order differ from the unsplit model's state_dict()"
    for name, value in want.items():
        assert isinstance(got[name], np.ndarray) and got[name].dtype == value.dtype, name
        np.testing.assert_allclose(got[name], value, rtol=0, atol=atol, err_msg=name)


def check_gather(layout, config, root, all_ranks=False):
    """Gather at construction (exact) and after training (TOL) onto ``root``, against one process."""
    me = layout.comm.Get_rank() if layout.comm is not None else 0
    got = full_state_dict(layout.wrapped, layout.comm, rank=root, all_ranks=all_ranks)
    if me == root or all_ranks:
        assert_state_equals(got, GPT(config, rng=np.random.default_rng(0)).state_dict(), 0)
    else:
        assert got == {}
    layout.train()
    got = full_state_dict(layout.wrapped, layout.comm, rank=root, all_ranks=all_ranks)
    if me == root or all_ranks:
        assert_state_equals(got, one_process(config), TOL)
    else:
        assert got == {}


@pytest.mark.world_sizes(1, 2, 4)
@pytest.mark.parametrize("kind", KINDS)
def test_full_state_dict_equals_one_process_at_every_layout(comm, kind):
    layout = Layout(comm, kind)
    check_gather(layout, UNTIED if kind == "pp" else CONFIG, root=0)
    layout.close()


@pytest.mark.world_sizes(2, 4)
@pytest.mark.parametrize("kind", ["dp_tp", "fsdp"])
def test_full_state_dict_on_another_rank_and_on_all_ranks(comm, kind):
    layout = Layout(comm, kind)
    check_gather(layout, CONFIG, root=comm.Get_size() - 1)
    layout.close()
    layout = Layout(comm, kind)
    check_gather(layout, CONFIG, root=0, all_ranks=True)
    layout.close()


@pytest.mark.world_sizes(4)
@pytest.mark.parametrize("dims", [(1, 2, 2), (2, 2, 1)], ids=["pp2_tp2", "dp2_pp2"])
def test_full_state_and_load_equal_one_process_on_a_pipeline_mesh(comm, dims):
    layout = Layout(comm, "mesh", dims)
    check_gather(layout, CONFIG, root=0)
    layout.close()
    layout = Layout(comm, "mesh", dims)
    check_load(layout, CONFIG)
    layout.close()


def _gather_3d(comm):
    layout = Layout(comm, "mesh", (2, 2, 2))
    check_gather(layout, CONFIG, root=0)
    layout.close()
    layout = Layout(comm, "mesh", (2, 2, 2))
    check_load(layout, CONFIG)
    layout.close()


@pytest.mark.mpi_skip  # simulated ranks only: under mpiexec every rank would run all eight again
def test_full_state_and_load_equal_one_process_at_dp2_pp2_tp2():
    mpidist.simulate(8, _gather_3d)


def other_state(config=CONFIG):
    """A full state unlike the seed-0 model's, for loads."""
    return GPT(config, rng=np.random.default_rng(3)).state_dict()


def check_load(layout, config):
    """Load another state from rank 0, check every copy, train, and compare with one process from that state."""
    me = 0 if layout.comm is None else layout.comm.Get_rank()
    state = other_state(config)
    load_full_state_dict(layout.wrapped, state if me == 0 else None, layout.comm)
    got = full_state_dict(layout.wrapped, layout.comm, all_ranks=True)
    assert_state_equals(got, state, 0)  # every rank's copy (replicas, tied copies) was written
    layout.train()
    got = full_state_dict(layout.wrapped, layout.comm)
    if me == 0:
        assert_state_equals(got, one_process(config, state), TOL)


@pytest.mark.world_sizes(1, 2, 4)
@pytest.mark.parametrize("kind", KINDS)
def test_load_full_state_dict_then_training_equals_one_process(comm, kind):
    layout = Layout(comm, kind)
    check_load(layout, UNTIED if kind == "pp" else CONFIG)
    layout.close()


class CountingComm:
    """``comm`` that records the source of every message a receive takes (a matched probe), in order."""

    def __init__(self, comm):
        self._comm, self.sources = comm, []

    def __getattr__(self, name):
        return getattr(self._comm, name)

    def Mprobe(self, source, tag, status):
        message = self._comm.Mprobe(source, tag, status)
        self.sources.append(status.Get_source())
        return message

    def Improbe(self, source, tag, status):
        message = self._comm.Improbe(source, tag, status)
        if message is not None:
            self.sources.append(status.Get_source())
        return message


@pytest.mark.world_sizes(2, 4)
def test_iter_full_state_receives_one_tensor_per_yield(comm):
    """Under tensor parallelism the root receives, between two yields, exactly the other ranks' shards of the
    tensor it yields (a sharded one: every other rank; a replicated one: nothing), never the next tensor's."""
    layout = Layout(comm, "tp")
    root, size = 0, comm.Get_size()
    counting = CountingComm(comm) if comm.Get_rank() == root else comm
    placements = {name: p.placement for name, p in layout.model.named_parameters()}
    order = [name for name, _ in GPT(CONFIG, rng=np.random.default_rng(0)).named_parameters()]
    seen = []
    for name, full in iter_full_state(layout.model, counting, rank=root):
        seen.append(name)
        if comm.Get_rank() != root:
            assert full is None
            continue
        received = sorted(set(counting.sources))
        expected = list(range(1, size)) if isinstance(placements[name], Shard) else []
        assert received == expected, name
        counting.sources.clear()
    assert seen == order


class WithBuffers(nn.Module):
    def __init__(self, rng):
        super().__init__()
        self.fc = nn.Linear(3, 4, rng=rng, dtype="float64")
        self.register_buffer("scale", np.arange(4, dtype=np.float64))
        self.register_buffer("count", np.array(7, dtype=np.int64))

    def forward(self, x):
        return self.fc(x)


@pytest.mark.world_sizes(1, 2, 4)
def test_buffers_come_after_parameters_and_load_into_every_replica(comm):
    ref = WithBuffers(np.random.default_rng(0))
    ddp = DDP(WithBuffers(np.random.default_rng(0)), comm)
    got = full_state_dict(ddp, all_ranks=True)
    assert_state_equals(got, ref.state_dict(), 0)
    state = {name: value + 1 for name, value in ref.state_dict().items()}
    load_full_state_dict(ddp, state if comm.Get_rank() == 0 else None)
    assert_state_equals(ddp.module.state_dict(), state, 0)
    ddp.remove()


def _bad_states():
    good = GPT(CONFIG, rng=np.random.default_rng(0)).state_dict()
    missing = dict(good)
    del missing["blocks.0.mlp.fc.weight"]
    extra = dict(good, **{"blocks.9.bias": np.zeros(3)})
    wrong = dict(good, **{"embed.wpe.weight": np.zeros((9, 16))})
    return {"missing": (missing, r"missing: \['blocks.0.mlp.fc.weight'\]"),
            "unexpected": (extra, r"unexpected: \['blocks.9.bias'\]"),
            "shape": (wrong, r"shape mismatch for 'embed.wpe.weight' \(state_dict: \(9, 16\), model: \(8, 16\)\)"),
            "not_a_mapping": ([1, 2], "mapping of name -> array"),
            "dtype": (dict(good, **{"blocks.1.ln1.weight": np.full(16, "x")}),
                      r"'blocks.1.ln1.weight' has dtype <U1 in the state_dict, which does not cast to the model's "
                      r"float64"),
            # Shaped and typed like the model's array, but numpy cannot read it (as a torch tensor that requires
            # grad): the root must find out before the ranks agree, or the others wait for a send that never comes.
            "unreadable": (dict(good, **{"blocks.1.ln1.weight": _Unreadable((16,), np.float64)}),
                           r"'blocks.1.ln1.weight' is not an array numpy can read \(_Unreadable: no numpy for you\)")}


class _Unreadable:
    def __init__(self, shape, dtype):
        self.shape, self.dtype = shape, np.dtype(dtype)

    def __array__(self, *args, **kwargs):
        raise RuntimeError("no numpy for you")


@pytest.mark.world_sizes(1, 2, 4)
@pytest.mark.parametrize("case", ["missing", "unexpected", "shape", "not_a_mapping", "dtype", "unreadable"])
def test_bad_full_state_raises_on_every_rank_and_changes_nothing(comm, case):
    layout = Layout(comm, "dp_tp")
    before = full_state_dict(layout.wrapped, comm, all_ranks=True)
    state, message = _bad_states()[case]
    with pytest.raises(ValueError, match=message):
        load_full_state_dict(layout.wrapped, state if comm.Get_rank() == 0 else None, comm)
    assert_state_equals(full_state_dict(layout.wrapped, comm, all_ranks=True), before, 0)
    layout.close()


@pytest.mark.world_sizes(2, 4)
def test_a_dtype_the_collectives_do_not_carry_raises_on_every_rank(comm):
    """A float128 parameter cannot travel: every rank says so from the catalog (a send of it would fail on the
    sending rank only and leave the root waiting)."""
    module = nn.Linear(2, 2, dtype=np.float64)
    module.weight = nn.Parameter(np.zeros((2, 2), dtype=np.longdouble))
    for call in (lambda: full_state_dict(module, comm, rank=1),
                 lambda: load_full_state_dict(module, None, comm, rank=1)):
        with pytest.raises(ValueError, match=r"'weight' has dtype float128 on rank 0, which mpidist's collectives "
                                             r"do not carry"):
            call()


def test_a_parameter_without_optimizer_state_yet_is_left_out(comm):
    """Before the first step AdamW holds no state: the gathered state names no parameter."""
    layout = Layout(comm, "ddp")
    got = full_optimizer_state_dict(layout.wrapped, layout.opt, comm)
    if comm.Get_rank() == 0:
        assert got["state"] == {}
    layout.close()


@pytest.mark.world_sizes(1, 2, 4)
@pytest.mark.parametrize("root", ["negative", "size", "bool"])
def test_a_root_outside_the_communicator_raises_on_every_rank(comm, root):
    layout = Layout(comm, "ddp")
    size = comm.Get_size()
    root = {"negative": -1, "size": size, "bool": True}[root]
    with pytest.raises(ValueError, match=rf"full_state_dict: rank must be a rank of the communicator, 0..{size - 1}"):
        full_state_dict(layout.wrapped, comm, rank=root)
    with pytest.raises(ValueError, match=r"load_full_state_dict: rank must be a rank of the communicator"):
        load_full_state_dict(layout.wrapped, None, comm, rank=root)
    layout.close()


@pytest.mark.world_sizes(1, 2, 4)
def test_non_strict_load_keeps_missing_tensors_and_ignores_unknown_ones(comm):
    layout = Layout(comm, "dp_tp")
    before = full_state_dict(layout.wrapped, comm, all_ranks=True)
    state = other_state()
    del state["embed.wpe.weight"]
    state["not.in.the.model"] = np.zeros(2)
    load_full_state_dict(layout.wrapped, state if comm.Get_rank() == 0 else None, comm, strict=False)
    got = full_state_dict(layout.wrapped, comm, all_ranks=True)
    for name in got:
        want = before[name] if name == "embed.wpe.weight" else state[name]
        np.testing.assert_array_equal(got[name], want, err_msg=name)
    layout.close()


@pytest.mark.world_sizes(4)
def test_a_communicator_that_misses_some_shards_raises_on_every_rank(comm):
    """DDP over the data-parallel ranks of a dp x tp mesh spans only them: its default communicator holds one
    half of each sharded tensor, which the gather must refuse (naming comm=) instead of returning garbage."""
    layout = Layout(comm, "dp_tp")
    with pytest.raises(ValueError, match=r"full_state_dict: the chunks of '.*' cover .* pass comm="):
        full_state_dict(layout.wrapped)
    layout.close()


@pytest.mark.world_sizes(1, 2, 4)
@pytest.mark.parametrize("kind", KINDS)
def test_optimizer_state_equals_one_process_moments(comm, kind):
    """AdamW's moments after two steps, gathered by unsplit name, equal one process's (and its step count)."""
    config = UNTIED if kind == "pp" else CONFIG
    model = GPT(config, rng=np.random.default_rng(0))
    opt = optim.AdamW(list(model.parameters()), lr=0.01)
    x, y = batch()
    for _ in range(STEPS):
        opt.zero_grad()
        model.loss(model(x), y).backward()
        opt.step()
    layout = Layout(comm, kind)
    layout.train()
    got = full_optimizer_state_dict(layout.wrapped, layout.opt, layout.comm)
    me = 0 if layout.comm is None else comm.Get_rank()
    if me != 0:
        assert got == {}
    else:
        names = [name for name, _ in model.named_parameters()]
        assert list(got["state"]) == names
        assert [g["params"] for g in got["param_groups"]] == [names]
        assert got["param_groups"][0]["lr"] == 0.01
        for i, name in enumerate(names):
            assert got["state"][name]["step"] == STEPS, name
            for key in ("exp_avg", "exp_avg_sq"):
                np.testing.assert_allclose(got["state"][name][key], opt.state[i][key], rtol=0, atol=TOL,
                                           err_msg=f"{name} {key}")
    layout.close()


@pytest.mark.world_sizes(4)
def test_a_pipeline_over_dp_and_pp_communicators_needs_comm(comm):
    """A Pipeline given a dp_comm has no communicator of its own over all its ranks: without comm= the gather
    would see one stage's tensors only, so it raises on every rank; with the world it equals one process."""
    layout = Layout(comm, "mesh", (2, 2, 1))
    with pytest.raises(TypeError, match=r"full_state_dict: the layout of Pipeline spans several ranks .* pass comm="):
        full_state_dict(layout.wrapped)
    got = full_state_dict(layout.wrapped, comm)
    if comm.Get_rank() == 0:
        assert_state_equals(got, GPT(CONFIG, rng=np.random.default_rng(0)).state_dict(), 0)
    layout.close()
