"""FSDP against a single-process reference trained in each test on the whole global batch.

Every rank trains on its own equal slice of the global batch (mean loss per slice), the reference on the
whole batch; averaging slice gradients over ranks equals the whole-batch gradient, so parameters must
agree to rounding after every step. The model's units have 35, 77, 156, 26 and 65 elements: all but one
are uneven on 2, 3 and 4 ranks, so every padding path runs.

Training is ``crit(fsdp(x), y).backward()``: FSDP works only through hooks on the model. A second model,
``TiedResidualMLP`` (embedding, residual blocks, a head whose weight is the embedding's), covers parameters
shared across units and activation checkpointing per block.
"""

import contextlib
import math

import numpy as np
import pytest

import mpidist.nn as nn
from mpidist.optim import Adam
from mpidist.parallel import Wrapper
from mpidist.parallel.fsdp import FSDP, ShardingStrategy
from mpidist.parallel.fsdp import state_dict as fsdp_state

STRATEGIES = ["full_shard", "shard_grad_op", "no_shard"]
TOL = 1e-10
BATCH = 72  # divisible by 1..4 ranks, and each slice by 2 and 3 micro-batches
ITEMSIZE = 8

# The children of make_model(): ("linear", fan_in, fan_out, bias), ("layernorm", features) or an activation.
LAYERS = [("linear", 4, 7, True), ("tanh",), ("linear", 7, 11, False), ("relu",), ("linear", 11, 13, True),
          ("layernorm", 13), ("linear", 13, 5, False)]


def numel_of(kind, *dims):
    """Elements of a layer's parameters, from its shape alone: a linear layer has fan_in * fan_out weights and
    fan_out biases, a layer norm a scale and a shift per feature, an activation none."""
    if kind == "linear":
        fan_in, fan_out, bias = dims
        return fan_in * fan_out + (fan_out if bias else 0)
    if kind == "layernorm":
        return 2 * dims[0]
    return 0


UNIT_SIZES = [numel_of(*layer) for layer in LAYERS]  # 35, 0, 77, 0, 156, 26, 65


def make_model(seed=0, dtype=np.float64):
    """Return the test MLP of LAYERS; children 0, 2, 4, 5, 6 hold parameters (sizes in UNIT_SIZES)."""
    rng = np.random.default_rng(seed)
    build = {"linear": lambda i, o, bias: nn.Linear(i, o, bias=bias, rng=rng, dtype=dtype),
             "layernorm": lambda d: nn.LayerNorm(d, dtype=dtype), "tanh": nn.Tanh, "relu": nn.ReLU}
    return nn.Sequential(*(build[kind](*dims) for kind, *dims in LAYERS))


def expected_shard(model, children, num_shards, rank):
    """This rank's chunk of a unit's flat parameter, by the glossary's definition: the parameters of
    ``children`` concatenated in order, zero-padded to ceil(numel / num_shards) * num_shards elements,
    cut into ``num_shards`` equal chunks."""
    flat = np.concatenate([p.data.ravel() for i in children for p in model[i].parameters()])
    per_shard = math.ceil(flat.size / num_shards)
    padded = np.concatenate([flat, np.zeros(per_shard * num_shards - flat.size, dtype=flat.dtype)])
    return padded[rank * per_shard: (rank + 1) * per_shard]


def batches(steps, seed=1, batch=BATCH):
    """Yield the same global batches (x, labels) on every rank."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        yield rng.standard_normal((batch, 4)), rng.integers(0, 5, batch)


def my_slice(comm, a):
    n, r = comm.Get_size(), comm.Get_rank()
    b = len(a) // n
    return a[r * b: (r + 1) * b]


def ref_step(ref, opt, x, y):
    crit = nn.CrossEntropyLoss()
    crit(ref(x), y).backward()
    opt.step()
    opt.zero_grad()


def fsdp_step(comm, fsdp, opt, x, y):
    crit = nn.CrossEntropyLoss()
    crit(fsdp(my_slice(comm, x)), my_slice(comm, y)).backward()
    opt.step()
    opt.zero_grad()


def assert_matches(comm, fsdp, ref, tol=TOL):
    """Compare every parameter with the reference: on rank 0 via full_state_dict, on all ranks gathered."""
    full = fsdp.full_state_dict()
    expected = ref.state_dict()
    if comm.Get_rank() == 0:
        assert list(full) == list(expected)
        for name in expected:
            np.testing.assert_allclose(full[name], expected[name], rtol=0, atol=tol, err_msg=name)
    else:
        assert full == {}
    with fsdp.summon_full_params() as module:
        for (name, p), (_, q) in zip(module.named_parameters(), ref.named_parameters()):
            np.testing.assert_allclose(p.data, q.data, rtol=0, atol=tol, err_msg=name)


def padded_bytes(sizes, n):
    """Bytes of each gathered flat parameter: ceil(size / n) * n elements."""
    return [math.ceil(s / n) * n * ITEMSIZE for s in sizes if s]


# -- parity -------------------------------------------------------------------------------------------------
@pytest.mark.world_sizes(2, 3, 4)
@pytest.mark.parametrize("prefetch", [True, False])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_training_matches_single_process(comm, strategy, prefetch):
    ref = make_model()
    fsdp = FSDP(make_model(), comm, strategy=strategy, prefetch=prefetch)
    opt, ref_opt = Adam(fsdp.parameters(), lr=1e-2), Adam(list(ref.parameters()), lr=1e-2)
    for x, y in batches(10):
        fsdp_step(comm, fsdp, opt, x, y)
        ref_step(ref, ref_opt, x, y)
    assert_matches(comm, fsdp, ref)
    if strategy != "no_shard":
        assert all(p.data.size == 0 for p in fsdp.module.parameters()), "full parameters must be freed at rest"


def test_shards_are_uneven_for_this_model():
    """Guard the premises: the formula's sizes are the model's, and several are not divisible by 2, 3 or 4."""
    model = make_model()
    assert [sum(p.data.size for p in child.parameters()) for child in model] == UNIT_SIZES
    uneven = [s for s in UNIT_SIZES if s and all(s % n for n in (2, 3, 4))]
    assert len(uneven) >= 3


def test_full_state_dict_equals_reference_and_takes_rank_0_values(comm):
    # Other ranks start from different values: FSDP must adopt rank 0's, as DDP does.
    fsdp = FSDP(make_model(seed=comm.Get_rank()), comm)
    ref = make_model(seed=0)
    full = fsdp.full_state_dict()
    if comm.Get_rank() == 0:
        expected = ref.state_dict()
        assert list(full) == list(expected)
        assert all(np.array_equal(full[k], expected[k]) and full[k].dtype == expected[k].dtype for k in expected)
    else:
        assert full == {}
    assert_matches(comm, fsdp, ref, tol=0)


class InterfaceOnly(Wrapper):
    """An FSDP seen only through the Wrapper interface and its communicator: every other attribute refuses."""

    def __init__(self, fsdp):
        self.__dict__.update(wrapped=fsdp, mesh=fsdp.mesh, comm=fsdp.comm)

    def __getattr__(self, name):
        raise AttributeError(f"FSDP's full state dict read FSDP.{name}, which is not in the Wrapper interface")

    def placed_parameters(self):
        return self.wrapped.placed_parameters()

    def named_buffers_global(self):
        return self.wrapped.named_buffers_global()

    def communicators(self):
        return self.wrapped.communicators()

    def grad_norm_comms(self):
        return self.wrapped.grad_norm_comms()

    def no_sync(self):
        return self.wrapped.no_sync()

    def sync_gradients(self):
        self.wrapped.sync_gradients()

    def remove(self):
        self.wrapped.remove()


@pytest.mark.parametrize("strategy", STRATEGIES + ["hybrid_shard"])
def test_full_state_dict_and_its_load_read_only_the_wrapper_interface(comm, strategy):
    """FSDP's own full state dict is the generic gather (mpidist.parallel.full_state) over its placed parameters."""
    extra = {"shard_size": 2} if strategy == "hybrid_shard" and comm.Get_size() % 2 == 0 else {}
    if strategy == "hybrid_shard" and not extra:
        pytest.skip("hybrid_shard with shard_size 2 needs an even world")
    fsdp = FSDP(make_model(), comm, strategy=strategy, **extra)
    full = fsdp_state.full_state_dict(InterfaceOnly(fsdp))
    expected = make_model().state_dict()
    if comm.Get_rank() == 0:
        assert list(full) == list(expected)
        for name, value in expected.items():
            np.testing.assert_array_equal(full[name], value, err_msg=name)
    else:
        assert full == {}
    other = make_model(seed=5).state_dict()
    fsdp_state.load_full_state_dict(InterfaceOnly(fsdp), other if comm.Get_rank() == 0 else None)
    with fsdp.summon_full_params() as module:
        for name, p in module.named_parameters():
            np.testing.assert_array_equal(p.data, other[name], err_msg=name)


@pytest.mark.parametrize("units, labels", [
    ([[0, 1], [2, 3], [4, 5, 6]], ["0+1", "2+3", "4+5+6"]),
    ("modules", ["0", "2", "4", "5", "6"]),
    (100, ["0+1+2", "3+4", "5+6"]),
])
def test_unit_choices_train_like_the_reference(comm, units, labels):
    model = make_model()
    if units == "modules":
        units = [model[i] for i in (0, 2, 4, 5, 6)]
    fsdp = FSDP(model, comm, units=units)
    assert [u.label for u in fsdp.units] == labels
    n = comm.Get_size()
    numels = [sum(UNIT_SIZES[int(i)] for i in label.split("+")) for label in labels]
    assert [u.numel for u in fsdp.units] == numels
    assert [u.shard_numel for u in fsdp.units] == [math.ceil(s / n) for s in numels]
    ref = make_model()
    opt, ref_opt = Adam(fsdp.parameters(), lr=1e-2), Adam(list(ref.parameters()), lr=1e-2)
    for x, y in batches(3):
        fsdp_step(comm, fsdp, opt, x, y)
        ref_step(ref, ref_opt, x, y)
    assert_matches(comm, fsdp, ref)


class TwoTower(nn.Module):
    """A non-Sequential module whose forward calls two children (autograd derives its backward)."""

    def __init__(self, seed=0):
        super().__init__()
        rng = np.random.default_rng(seed)
        self.a = nn.Linear(4, 9, rng=rng, dtype=np.float64)
        self.act = nn.Tanh()
        self.b = nn.Linear(9, 5, rng=rng, dtype=np.float64)

    def forward(self, x):
        return self.b(self.act(self.a(x)))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_non_sequential_module_with_submodule_units(comm, strategy):
    model, ref = TwoTower(), TwoTower()
    fsdp = FSDP(model, comm, strategy=strategy, units=[model.a, model.b])
    opt, ref_opt = Adam(fsdp.parameters(), lr=1e-2), Adam(list(ref.parameters()), lr=1e-2)
    for x, y in batches(3):
        fsdp_step(comm, fsdp, opt, x, y)
        ref_step(ref, ref_opt, x, y)
    assert_matches(comm, fsdp, ref)


# -- gradient accumulation ------------------------------------------------------------------------------
@pytest.mark.world_sizes(1, 2, 3, 4)
@pytest.mark.parametrize("finish", ["backward", "sync_gradients"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_no_sync_accumulation_equals_one_big_batch(comm, strategy, finish):
    k = 3
    ref, fsdp = make_model(), FSDP(make_model(), comm, strategy=strategy)
    opt, ref_opt = Adam(fsdp.parameters(), lr=1e-2), Adam(list(ref.parameters()), lr=1e-2)
    crit = nn.CrossEntropyLoss()
    for x, y in batches(3):
        xs, ys = np.split(my_slice(comm, x), k), np.split(my_slice(comm, y), k)
        for i in range(k):
            last = i == k - 1 and finish == "backward"
            with (contextlib.nullcontext() if last else fsdp.no_sync()):
                (crit(fsdp(xs[i]), ys[i]) * (1 / k)).backward()
            if not last:
                # Unsharded grads accumulate in one flat buffer per unit; nothing reached the shards yet.
                if strategy != "no_shard":  # NO_SHARD accumulates into its full-size shard grad, like DDP
                    assert all(p.grad is None or not p.grad.any() for p in fsdp.parameters())
                linear = fsdp.module[4]
                assert linear.weight.grad.base is not None and linear.weight.grad.base is linear.bias.grad.base
        if finish == "sync_gradients":
            fsdp.sync_gradients()
        assert fsdp.memory_stats()["unsharded_grad_bytes"] == 0
        opt.step()
        opt.zero_grad()
        ref_step(ref, ref_opt, x, y)
    assert_matches(comm, fsdp, ref)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_microbatches_in_flight_equal_one_big_batch(comm, strategy):
    # Two graphs alive at once (the old mb= bookkeeping is now simply two forwards' graphs), their
    # backwards in the opposite order; each backward reduces its own contribution into the shards.
    ref, fsdp = make_model(), FSDP(make_model(), comm, strategy=strategy)
    opt, ref_opt = Adam(fsdp.parameters(), lr=1e-2), Adam(list(ref.parameters()), lr=1e-2)
    crit = nn.CrossEntropyLoss()
    for x, y in batches(3):
        xs, ys = np.split(my_slice(comm, x), 2), np.split(my_slice(comm, y), 2)
        losses = [crit(fsdp(xs[mb]), ys[mb]) for mb in (0, 1)]
        assert fsdp.num_inflight() == 2
        for mb in (1, 0):
            (losses[mb] * 0.5).backward()
        assert fsdp.num_inflight() == 0
        assert fsdp.memory_stats()["gathered_bytes"] == 0
        opt.step()
        opt.zero_grad()
        ref_step(ref, ref_opt, x, y)
    assert_matches(comm, fsdp, ref)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_zero_grad_clears_shard_grads(comm, strategy):
    fsdp = FSDP(make_model(), comm, strategy=strategy)
    x, y = next(batches(1))
    crit = nn.CrossEntropyLoss()
    with fsdp.no_sync():
        crit(fsdp(my_slice(comm, x)), my_slice(comm, y)).backward()
    fsdp.zero_grad(set_to_none=False)
    fsdp.sync_gradients()  # nothing left to reduce but zeros
    assert all(not p.grad.any() for p in fsdp.parameters() if p.grad is not None)
    fsdp.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in fsdp.parameters())
    assert all(p.grad is None for p in fsdp.module.parameters())
    assert fsdp.memory_stats()["grad_shard_bytes"] == fsdp.memory_stats()["unsharded_grad_bytes"] == 0


# -- state dicts ------------------------------------------------------------------------------------------
@pytest.mark.world_sizes(2, 3, 4)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_load_full_state_dict_reshards_and_training_continues(comm, strategy):
    ref = make_model()
    ref_opt = Adam(list(ref.parameters()), lr=1e-2)
    data = list(batches(7))
    for x, y in data[:3]:
        ref_step(ref, ref_opt, x, y)
    fsdp = FSDP(make_model(seed=5), comm, strategy=strategy)
    fsdp.load_full_state_dict(ref.state_dict() if comm.Get_rank() == 0 else None)
    assert_matches(comm, fsdp, ref, tol=0)
    opt, ref_opt = Adam(fsdp.parameters(), lr=1e-2), Adam(list(ref.parameters()), lr=1e-2)
    for x, y in data[3:]:
        fsdp_step(comm, fsdp, opt, x, y)
        ref_step(ref, ref_opt, x, y)
    assert_matches(comm, fsdp, ref)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_sharded_state_dict_round_trip(comm, strategy):
    fsdp = FSDP(make_model(), comm, strategy=strategy)
    opt = Adam(fsdp.parameters(), lr=1e-2)
    data = list(batches(6))
    for x, y in data[:2]:
        fsdp_step(comm, fsdp, opt, x, y)
    saved, saved_opt = fsdp.sharded_state_dict(), opt.state_dict()
    n = 1 if strategy == "no_shard" else comm.Get_size()
    assert [e["shard"].shape for e in saved.values()] == [(math.ceil(s / n),) for s in UNIT_SIZES if s]
    for x, y in data[2:4]:
        fsdp_step(comm, fsdp, opt, x, y)
    expected = fsdp.full_state_dict()
    for x, y in data[2:4]:
        fsdp_step(comm, fsdp, opt, x, y)  # move away from the saved state
    fsdp.load_sharded_state_dict(saved)
    opt.load_state_dict(saved_opt)
    for x, y in data[2:4]:
        fsdp_step(comm, fsdp, opt, x, y)
    got = fsdp.full_state_dict()
    assert list(got) == list(expected)
    assert all(np.array_equal(got[k], expected[k]) for k in expected)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_shards_hold_the_ranks_chunk_of_the_padded_flat_parameter(comm, strategy):
    fsdp = FSDP(make_model(), comm, strategy=strategy)
    n = 1 if strategy == "no_shard" else comm.Get_size()
    rank = 0 if strategy == "no_shard" else comm.Get_rank()
    reference = make_model()
    saved = fsdp.sharded_state_dict()
    assert list(saved) == ["0", "2", "4", "5", "6"]
    for label, entry in saved.items():
        want = expected_shard(reference, [int(label)], n, rank)
        assert entry["shard"].dtype == want.dtype
        np.testing.assert_array_equal(entry["shard"], want, err_msg=label)


# -- overlap of gradient reductions with backward compute ----------------------------------------------------
def nested_model(seed=0):
    """Three units 0, 2, 4 (children with parameters); unit 2 is Linear-Tanh-Linear, so a hook on its middle
    activation fires in the middle of its backward (after one of its matmuls' gradients, before the other's)."""
    rng = np.random.default_rng(seed)
    inner = nn.Sequential(nn.Linear(7, 9, rng=rng, dtype=np.float64), nn.Tanh(), nn.Linear(9, 11, rng=rng, dtype=np.float64))
    return nn.Sequential(nn.Linear(4, 7, rng=rng, dtype=np.float64), nn.Tanh(), inner, nn.ReLU(),
                         nn.Linear(11, 5, rng=rng, dtype=np.float64))


@pytest.mark.parametrize("backward_prefetch", ["pre", "post"])
@pytest.mark.parametrize("strategy", ["full_shard", "no_shard", "hybrid_shard"])
def test_a_units_reduction_is_in_flight_while_the_previous_unit_computes(comm, strategy, backward_prefetch):
    """Unit 4's reduce-scatter starts when its gradients are final and is still in flight in the middle of unit
    2's backward (finished when unit 2's starts); unit 2's is in flight during unit 0's; none after backward.
    With backward_prefetch="post" (two units of memory) it finishes before the next unit's gradients arrive."""
    size = comm.Get_size()
    ref = nested_model()
    extra = {"shard_size": 2 if size % 2 == 0 else 1} if strategy == "hybrid_shard" else {}
    fsdp = FSDP(nested_model(), comm, strategy=strategy, backward_prefetch=backward_prefetch, **extra)
    assert [u.label for u in fsdp.units if u.params] == ["0", "2", "4"]
    seen = []

    def watch(module, args, out, where):
        out.register_hook(lambda grad: seen.append((where, fsdp.reductions_in_flight())))

    fsdp.module[2][0].register_forward_hook(lambda m, a, o: watch(m, a, o, "middle of unit 2"))
    fsdp.module[0].register_forward_hook(lambda m, a, o: watch(m, a, o, "start of unit 0"))
    opt, ref_opt = Adam(fsdp.parameters(), lr=1e-2), Adam(list(ref.parameters()), lr=1e-2)
    for x, y in batches(3):
        seen.clear()
        fsdp_step(comm, fsdp, opt, x, y)
        ref_step(ref, ref_opt, x, y)
        if backward_prefetch == "pre":
            # Across replicas the allreduce of unit 4's chunk starts when its reduce-scatter finishes, and
            # runs during unit 0's backward next to unit 2's reduce-scatter.
            replicated = ("4", "2") if strategy == "hybrid_shard" and fsdp.settings.num_replicas > 1 else ("2",)
            assert seen == [("middle of unit 2", ("4",)), ("start of unit 0", replicated)]
        else:
            assert seen == [("middle of unit 2", ()), ("start of unit 0", ())]
        assert fsdp.reductions_in_flight() == ()
    assert_matches(comm, fsdp, ref)


# -- memory ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("prefetch", [True, False])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_memory_stats_are_exact(comm, strategy, prefetch):
    n = comm.Get_size()
    fsdp = FSDP(make_model(), comm, strategy=strategy, prefetch=prefetch)
    opt = Adam(fsdp.parameters(), lr=1e-2)
    before = fsdp.memory_stats(opt)
    shards = 1 if strategy == "no_shard" else n
    shard_bytes = sum(math.ceil(s / shards) * ITEMSIZE for s in UNIT_SIZES if s)
    assert before["param_shard_bytes"] == shard_bytes
    assert before["grad_shard_bytes"] == before["optimizer_state_bytes"] == 0
    crit = nn.CrossEntropyLoss()
    for x, y in batches(2):
        crit(fsdp(my_slice(comm, x)), my_slice(comm, y)).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)  # keep the shard grads: they are part of the persistent bytes
    stats = fsdp.memory_stats(opt)
    # Adam keeps two moments per element: params + grads + 2 moments = 4 shard sizes.
    assert stats["param_shard_bytes"] == stats["grad_shard_bytes"] == shard_bytes
    assert stats["optimizer_state_bytes"] == 2 * shard_bytes
    assert stats["persistent_bytes"] == 4 * shard_bytes
    assert stats["gathered_bytes"] == stats["unsharded_grad_bytes"] == 0

    units = padded_bytes(UNIT_SIZES, n)
    if strategy == "full_shard":
        # Param-less units (Tanh, ReLU) are skipped, so the neighbours that overlap are these pairs.
        expected = max(a + b for a, b in zip(units, units[1:])) if prefetch else max(units)
        assert stats["peak_gathered_bytes"] <= sum(sorted(units)[-2:])
        # A unit's reduce-scatter is in flight while the unit before it accumulates: two neighbours' gradients.
        assert stats["peak_unsharded_grad_bytes"] == max(a + b for a, b in zip(units, units[1:]))
    elif strategy == "shard_grad_op":
        expected = sum(units)  # every unit stays gathered from its forward to its backward
    else:
        expected = 0  # nothing is ever gathered: the full flat parameters are persistent
    assert stats["peak_gathered_bytes"] == expected
    assert stats["peak_bytes"] >= stats["persistent_bytes"] + stats["peak_gathered_bytes"]
    fsdp.reset_peak()
    assert fsdp.memory_stats()["peak_gathered_bytes"] == 0


def test_eval_forward_frees_params_even_when_kept_for_backward(comm):
    ref, fsdp = make_model(), FSDP(make_model(), comm, strategy="shard_grad_op")
    x = next(batches(1))[0]
    fsdp.eval()
    np.testing.assert_allclose(fsdp(x).data, ref.eval()(x).data, rtol=0, atol=TOL)
    assert fsdp.memory_stats()["gathered_bytes"] == 0 and fsdp.num_inflight() == 0
    fsdp.train()
    with nn.no_grad():
        fsdp(x)
    assert fsdp.memory_stats()["gathered_bytes"] == 0


# -- bad input -------------------------------------------------------------------------------------------
def test_strategy_accepts_enum_and_name_and_rejects_unknown(comm):
    assert FSDP(make_model(), comm, strategy=ShardingStrategy.NO_SHARD).settings.strategy is ShardingStrategy.NO_SHARD
    assert FSDP(make_model(), comm, strategy="shard_grad_op").settings.strategy is ShardingStrategy.SHARD_GRAD_OP
    with pytest.raises(ValueError, match=r"unknown strategy 'zero3'.*'full_shard', 'shard_grad_op', 'no_shard'"):
        FSDP(make_model(), comm, strategy="zero3")


@pytest.mark.parametrize("units, error, match", [
    ([[0, 1], [1, 2], [3, 4, 5, 6]], ValueError, r"module '1' is listed in unit 0 and unit 1"),
    ([0, 2, 4], ValueError, r"do not cover parameters \['5.weight', '5.bias', '6.weight'\]"),
    ([0, 2, 4, 5, 9], ValueError, r"unit index 9 out of range for a Sequential of 7 children"),
    ([0, "2"], TypeError, r"unit item must be .* \(got '2'\)"),
    ([], TypeError, r"non-empty list \(got \[\]\)"),
    (0, ValueError, r"threshold must be >= 1 element \(got units=0\)"),
])
def test_bad_units_name_the_value(comm, units, error, match):
    with pytest.raises(error, match=match):
        FSDP(make_model(), comm, units=units)


def test_bad_modules_name_the_problem(comm):
    with pytest.raises(ValueError, match=r"units=None .* module is a TwoTower"):
        FSDP(TwoTower(), comm)
    outsider = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"unit module Linear is not part of the wrapped module"):
        FSDP(make_model(), comm, units=[outsider])
    mixed = nn.Sequential(nn.Linear(2, 3, dtype=np.float32), nn.Linear(3, 2, dtype=np.float64))
    with pytest.raises(ValueError, match=r"unit 0 \('<root>'\) mixes dtypes \['float32', 'float64'\]"):
        FSDP(mixed, comm, units=[mixed])
    model = make_model()
    FSDP(model, comm)
    with pytest.raises(ValueError, match=r"already wrapped"):
        FSDP(model, comm)
    with pytest.raises(TypeError, match=r"prefetch must be a bool \(got 'yes'\)"):
        FSDP(make_model(), comm, prefetch="yes")


def test_state_dict_errors_fail_on_every_rank(comm):
    fsdp = FSDP(make_model(), comm)
    bad = make_model().state_dict()
    bad["6.bias"] = bad.pop("6.weight")
    with pytest.raises(ValueError, match=r"missing: \['6.weight'\], unexpected: \['6.bias'\]"):
        fsdp.load_full_state_dict(bad if comm.Get_rank() == 0 else None)
    wrong_shape = make_model().state_dict()
    wrong_shape["0.bias"] = np.zeros(3)
    with pytest.raises(ValueError, match=r"shape mismatch for '0.bias' \(state_dict: \(3,\), model: \(7,\)\)"):
        fsdp.load_full_state_dict(wrong_shape if comm.Get_rank() == 0 else None)
    other = FSDP(make_model(), comm, units=[[0, 1, 2], [3, 4, 5, 6]]).sharded_state_dict()
    with pytest.raises(ValueError, match=r"units do not match \(expected: \['0', '2', '4', '5', '6'\]"):
        fsdp.load_sharded_state_dict(other)
    with pytest.raises(TypeError, match=r"use full_state_dict\(\)"):
        fsdp.state_dict()
    module_opt = Adam(list(make_model().parameters()))
    with pytest.raises(ValueError, match=r"FSDP.memory_stats: Adam holds none of this wrapper's parameters"):
        fsdp.memory_stats(module_opt)
    fsdp(next(batches(1))[0])
    with pytest.raises(RuntimeError, match=r"in flight .*training forwards awaiting backward: 1"):
        fsdp.load_sharded_state_dict(fsdp.sharded_state_dict())


@pytest.mark.world_sizes(2, 3, 4)
def test_backward_prefetch_post_bounds_total_transient_to_two_units(comm):
    """With backward_prefetch="post" gathered params plus unsharded grads never exceed two units."""
    n = comm.Get_size()
    ref = make_model()
    fsdp = FSDP(make_model(), comm, backward_prefetch="post")
    opt, ref_opt = Adam(fsdp.parameters(), lr=1e-2), Adam(list(ref.parameters()), lr=1e-2)
    for x, y in batches(3):
        fsdp.reset_peak()
        fsdp_step(comm, fsdp, opt, x, y)
        ref_step(ref, ref_opt, x, y)
        stats = fsdp.memory_stats(opt)
        # The largest unit gathered plus its own unsharded gradient: nothing else is alive at that moment.
        assert stats["peak_bytes"] - stats["persistent_bytes"] <= 2 * max(padded_bytes(UNIT_SIZES, n))
    assert_matches(comm, fsdp, ref)
    with pytest.raises(ValueError, match=r"backward_prefetch must be 'pre' or 'post' \(got 'early'\)"):
        FSDP(make_model(), comm, backward_prefetch="early")


@pytest.mark.world_sizes(2, 3, 4)
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the poisoned input overflows on purpose
def test_check_finite_names_parameter_and_rank_on_every_rank(comm):
    bad = comm.Get_size() - 1
    fsdp = FSDP(make_model(), comm, check_finite=True)
    crit = nn.CrossEntropyLoss()
    x, y = next(batches(1))
    crit(fsdp(my_slice(comm, x)), my_slice(comm, y)).backward()  # finite: no error
    xb = my_slice(comm, x).copy()
    if comm.Get_rank() == bad:
        xb[0, 0] = np.inf  # only this rank's data is poisoned
    loss = crit(fsdp(xb), my_slice(comm, y))
    with pytest.raises(FloatingPointError, match=rf"FSDP: non-finite gradient.*'0.weight' on rank\(s\) \[{bad}\]"):
        loss.backward()
    # The failed backward left nothing gathered or pending: training can go on.
    assert fsdp.memory_stats()["gathered_bytes"] == fsdp.memory_stats()["unsharded_grad_bytes"] == 0
    assert fsdp.num_inflight() == 0


# -- tied parameters across units ---------------------------------------------------------------------------
VOCAB, WIDTH = 11, 6


class ResidualBlock(nn.Module):
    """``x + fc2(tanh(fc1(norm(x))))``, optionally with dropout on the branch."""

    def __init__(self, rng, p=0.0):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH, dtype=np.float64)
        self.fc1 = nn.Linear(WIDTH, 9, rng=rng, dtype=np.float64)
        self.fc2 = nn.Linear(9, WIDTH, rng=rng, dtype=np.float64)
        self.drop = nn.Dropout(p)

    def forward(self, x):
        return x + self.drop(self.fc2(nn.functional.tanh(self.fc1(self.norm(x)))))


class TiedResidualMLP(nn.Module):
    """Token embedding, residual blocks, final norm and an output head whose weight *is* the embedding's."""

    def __init__(self, seed=0, blocks=2, p=0.0):
        super().__init__()
        rng = np.random.default_rng(seed)
        self.emb = nn.Embedding(VOCAB, WIDTH, rng=rng, dtype=np.float64)
        self.blocks = nn.ModuleList([ResidualBlock(rng, p) for _ in range(blocks)])
        self.norm = nn.LayerNorm(WIDTH, dtype=np.float64)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False, dtype=np.float64)
        self.head.weight = self.emb.weight  # tied: one Parameter, used by two units

    def forward(self, tokens):
        h = self.emb(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def token_batches(steps, seed=3, batch=BATCH):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        yield rng.integers(0, VOCAB, (batch, 3)), rng.integers(0, VOCAB, (batch, 3))


def tied_units(model, order):
    units = [model.emb, *model.blocks, [model.norm, model.head]]
    return units if order == "embedding_first" else units[::-1]


@pytest.mark.parametrize("order", ["embedding_first", "head_first"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_tied_weights_across_units_train_like_one_process(comm, strategy, order):
    ref, model = TiedResidualMLP(), TiedResidualMLP()
    fsdp = FSDP(model, comm, strategy=strategy, units=tied_units(model, order))
    owner = "emb" if order == "embedding_first" else "norm+head"
    infos = {u.label: u for u in fsdp.units}
    assert "emb.weight" in infos[owner].params  # owned once, by the first unit listing it
    user = "norm+head" if order == "embedding_first" else "emb"
    assert infos[user].uses == (owner,)
    opt, ref_opt = Adam(fsdp.parameters(), lr=1e-2), Adam(list(ref.parameters()), lr=1e-2)
    crit = nn.CrossEntropyLoss()
    for x, y in token_batches(4):
        crit(fsdp(my_slice(comm, x)), my_slice(comm, y)).backward()
        opt.step()
        opt.zero_grad()
        crit(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert fsdp.memory_stats()["gathered_bytes"] == fsdp.memory_stats()["unsharded_grad_bytes"] == 0
    assert model.head.weight is model.emb.weight
    assert_matches(comm, fsdp, ref)


def test_tied_weight_gradient_equals_the_sum_of_both_uses(comm):
    """The tied weight's shard gradient equals finite differences of the loss (both uses together)."""
    model, ref = TiedResidualMLP(blocks=1), TiedResidualMLP(blocks=1)
    fsdp = FSDP(model, comm, units=tied_units(model, "embedding_first"))
    x, y = next(token_batches(1))
    crit = nn.CrossEntropyLoss()
    crit(fsdp(x), y).backward()  # every rank the whole batch: the mean gradient is the one-process gradient
    weight = ref.emb.weight
    numeric = np.zeros_like(weight.data)
    for idx in np.ndindex(weight.data.shape):
        old = weight.data[idx]
        weight.data[idx] = old + 1e-6
        up = crit(ref(x), y).item()
        weight.data[idx] = old - 1e-6
        down = crit(ref(x), y).item()
        weight.data[idx] = old
        numeric[idx] = (up - down) / 2e-6
    layout = {s.label: s for s in fsdp.shard_layout()}["emb"]
    piece = layout.pieces()[0]
    assert piece.name == "emb.weight"
    got = layout.parameter.grad[piece.offset: piece.offset + piece.count]
    np.testing.assert_allclose(got, numeric.ravel()[piece.start: piece.start + piece.count], rtol=0, atol=1e-8)


# -- activation checkpointing -----------------------------------------------------------------------------
def train_blocks(comm, checkpointing, p, steps=3, units="blocks"):
    """Train a TiedResidualMLP with dropout under FSDP; return its full state dict (rank 0) and grads seen."""
    nn.manual_seed(100 + comm.Get_rank())  # the masks differ by rank, and are the same in both runs
    model = TiedResidualMLP(blocks=3, p=p)
    for block in model.blocks:
        block.activation_checkpointing = checkpointing
    # "blocks": each checkpointed block is a unit; "inside": one unit holds the whole model and the
    # checkpointed blocks run inside it.
    fsdp = FSDP(model, comm, units=tied_units(model, "embedding_first") if units == "blocks" else [model])
    opt = Adam(fsdp.parameters(), lr=1e-2)
    crit = nn.CrossEntropyLoss()
    grads = []
    for x, y in token_batches(steps):
        crit(fsdp(my_slice(comm, x)), my_slice(comm, y)).backward()
        grads.append([s.grad.copy() for s in fsdp.parameters()])
        opt.step()
        opt.zero_grad()
    return fsdp, grads


@pytest.mark.parametrize("units", ["blocks", "inside"])
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_activation_checkpointing_per_block_gives_the_same_gradients(comm, p, units):
    plain, plain_grads = train_blocks(comm, False, p, units=units)
    ckpt, ckpt_grads = train_blocks(comm, True, p, units=units)
    for step, (a, b) in enumerate(zip(plain_grads, ckpt_grads)):
        for unit, ga, gb in zip(plain.units, a, b):
            np.testing.assert_allclose(gb, ga, rtol=0, atol=1e-12, err_msg=f"step {step}, unit {unit.label}")
    with plain.summon_full_params() as m1, ckpt.summon_full_params() as m2:
        for (name, q1), (_, q2) in zip(m1.named_parameters(), m2.named_parameters()):
            np.testing.assert_allclose(q2.data, q1.data, rtol=0, atol=1e-12, err_msg=name)
    if p == 0.0:  # without dropout both equal one process on the whole batch
        ref = TiedResidualMLP(blocks=3)
        ref_opt = Adam(list(ref.parameters()), lr=1e-2)
        crit = nn.CrossEntropyLoss()
        for x, y in token_batches(3):
            crit(ref(x), y).backward()
            ref_opt.step()
            ref_opt.zero_grad()
        assert_matches(comm, ckpt, ref)


def test_checkpointing_around_units_is_refused(comm):
    model = TiedResidualMLP()
    fsdp = FSDP(model, comm, units=[model.emb, *model.blocks, [model.norm, model.head]])
    model.blocks.activation_checkpointing = True  # ModuleList is not called, but the root is
    model.activation_checkpointing = True
    with pytest.raises(ValueError, match=r"activation checkpointing is set on '<root>', which contains FSDP units"):
        fsdp(next(token_batches(1))[0])


# -- hooks only -------------------------------------------------------------------------------------------
def _methods(obj):
    """Return the callables stored on the instance itself (a replaced method would be one)."""
    return {k: v for k, v in vars(obj).items() if callable(v) and not isinstance(v, (nn.Module, nn.Parameter))}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_fsdp_never_replaces_a_method_on_the_users_modules(comm, strategy):
    model = TiedResidualMLP(p=0.2)
    model.blocks[0].activation_checkpointing = True
    objects = list(model.modules()) + list(model.parameters())
    before = [(type(o), _methods(o)) for o in objects]
    fsdp = FSDP(model, comm, strategy=strategy, units=tied_units(model, "embedding_first"))
    opt = Adam(fsdp.parameters(), lr=1e-2)
    x, y = next(token_batches(1))
    nn.CrossEntropyLoss()(fsdp(x), y).backward()
    opt.step()
    fsdp.full_state_dict()
    with fsdp.no_sync():
        nn.CrossEntropyLoss()(fsdp(x), y).backward()
    fsdp.sync_gradients()
    after = [(type(o), _methods(o)) for o in objects]
    assert after == before
    # What FSDP attached is hooks, in the registries Module and Parameter keep for them.
    assert all(m._forward_pre_hooks for m in (model.emb, model.blocks[0], model.norm, model.head, model))
    assert all(p._post_accumulate_grad_hooks for p in model.parameters())


def test_shard_layout_pieces_rebuild_every_parameter(comm):
    """The public layout, gathered from all ranks, puts every element of every parameter exactly once."""
    model = TiedResidualMLP()
    fsdp = FSDP(model, comm, units=tied_units(model, "embedding_first"))
    mine = [(piece.name, piece.start, piece.count, s.parameter.data[piece.offset: piece.offset + piece.count].copy())
            for s in fsdp.shard_layout() for piece in s.pieces()]
    everyone = comm.allgather(mine)
    reference = TiedResidualMLP()
    for name, param in reference.named_parameters():
        rebuilt = np.full(param.data.size, np.nan)
        hits = np.zeros(param.data.size, dtype=int)
        for pieces in everyone:
            for pname, start, count, values in pieces:
                if pname == name:
                    rebuilt[start: start + count] = values
                    hits[start: start + count] += 1
        assert (hits == 1).all(), name
        np.testing.assert_array_equal(rebuilt.reshape(param.data.shape), param.data, err_msg=name)


@pytest.mark.world_sizes(1, 2, 3)
@pytest.mark.parametrize("order", ["embedding_first", "head_first"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_tied_weights_with_no_sync_accumulation_equal_one_big_batch(comm, strategy, order):
    ref, model = TiedResidualMLP(), TiedResidualMLP()
    fsdp = FSDP(model, comm, strategy=strategy, units=tied_units(model, order))
    opt, ref_opt = Adam(fsdp.parameters(), lr=1e-2), Adam(list(ref.parameters()), lr=1e-2)
    crit = nn.CrossEntropyLoss()
    for x, y in token_batches(3):
        xs, ys = np.split(my_slice(comm, x), 3), np.split(my_slice(comm, y), 3)
        for i in range(3):
            with (contextlib.nullcontext() if i == 2 else fsdp.no_sync()):
                (crit(fsdp(xs[i]), ys[i]) * (1 / 3)).backward()
        opt.step()
        opt.zero_grad()
        crit(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert_matches(comm, fsdp, ref)


class WithIdleParts(nn.Module):
    """A frozen weight, a module never called inside a used unit, and a unit never called at all."""

    def __init__(self, seed=0):
        super().__init__()
        rng = np.random.default_rng(seed)
        self.a = nn.Linear(4, 9, rng=rng, dtype=np.float64)
        self.a.weight.requires_grad_(False)
        self.b = nn.Linear(9, 5, rng=rng, dtype=np.float64)
        self.spare = nn.Linear(9, 5, rng=rng, dtype=np.float64)  # in b's unit, never called
        self.unused = nn.Linear(5, 5, rng=rng, dtype=np.float64)  # a unit of its own, never called

    def forward(self, x):
        return self.b(nn.functional.tanh(self.a(x)))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_frozen_and_unused_parameters_train_like_one_process(comm, strategy):
    """Units whose parameters get no gradient are finished at the end of backward (zeros, on every rank)."""
    ref, model = WithIdleParts(), WithIdleParts()
    fsdp = FSDP(model, comm, strategy=strategy, units=[model.a, [model.b, model.spare], model.unused])
    opt, ref_opt = Adam(fsdp.parameters(), lr=1e-2), Adam([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    for x, y in batches(3):
        fsdp_step(comm, fsdp, opt, x, y)
        ref_step(ref, ref_opt, x, y)
        stats = fsdp.memory_stats()
        assert stats["gathered_bytes"] == stats["unsharded_grad_bytes"] == 0
    assert_matches(comm, fsdp, ref)
    assert model.a.weight.requires_grad is False
