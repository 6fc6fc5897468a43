"""Deferred parameters and initialization by (seed, name): nothing allocated, any box drawn alone, bitwise."""
import math
import tracemalloc

import numpy as np
import pytest

import mpidist
from mpidist import nn
from mpidist.models.gpt import GPT, GPTConfig
from mpidist.nn.deferred import DeferredArray, deferred_bytes, fill_boxes
from mpidist.nn.init import Constant, Normal, Uniform, draw_box, philox_key
from mpidist.nn.placement import FlatShard

CFG = GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=32, dtype="float64")


def deferred_gpt(config=CFG, seed=11):
    with nn.deferred(seed=seed):
        return GPT(config)


# -- 1. deferred parameters ---------------------------------------------------------------------------------

def test_deferred_build_allocates_nothing():
    config = GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=128, dtype="float64")
    deferred_gpt(config)  # imports and caches out of the measurement
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        model = deferred_gpt(config)
        deferred_peak = tracemalloc.get_traced_memory()[1] - base
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        eager = GPT(config)
        eager_peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    model_bytes = sum(p.data.nbytes for p in eager.parameters())
    assert deferred_bytes(model) == model_bytes
    assert all(isinstance(p.data, DeferredArray) for p in model.parameters())
    assert eager_peak >= model_bytes  # the measurement sees a whole model when one is allocated
    assert deferred_peak < model_bytes / 20, (deferred_peak, model_bytes)


def test_deferred_parameter_records_shape_dtype_name_and_initializer():
    model = deferred_gpt()
    eager = GPT(CFG)
    for (name, p), (eager_name, q) in zip(model.named_parameters(), eager.named_parameters()):
        assert name == eager_name == p.data.name
        assert p.shape == q.shape and p.dtype == q.dtype and p.requires_grad
    inits = {name: p.data.init for name, p in model.named_parameters()}
    assert inits["embed.wte.weight"] == Normal(0.0, 0.02)
    assert inits["blocks.1.attn.proj.weight"] == Normal(0.0, 0.02 / math.sqrt(2 * CFG.n_layer))
    assert inits["blocks.0.attn.qkv.bias"] == Constant(0.0)
    assert inits["blocks.0.ln1.weight"] == Constant(1.0)
    # the tied head is the embedding's Parameter, named once
    assert model.head.weight is model.embed.wte.weight


def test_deferred_names_are_those_of_the_outermost_module():
    with nn.deferred():
        seq = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Sequential(nn.Linear(4, 2)))
    assert [p.data.name for p in seq.parameters()] == [n for n, _ in seq.named_parameters()] == \
        ["0.weight", "0.bias", "2.0.weight", "2.0.bias"]


@pytest.mark.parametrize("use", ["forward", "state_dict", "optimizer", "numpy"])
def test_using_a_deferred_parameter_raises_naming_it(use):
    model = deferred_gpt()
    ids = np.zeros((1, 4), dtype=np.int64)
    with pytest.raises(nn.DeferredParameterError, match=r"'embed\.wte\.weight'.*materializ"):
        if use == "forward":
            model(ids)
        elif use == "state_dict":
            model.state_dict()
        elif use == "optimizer":
            model.embed.wte.weight.grad = np.ones(model.embed.wte.weight.shape)
            mpidist.optim.SGD(model.parameters(), lr=0.1).step()
        else:
            np.exp(model.embed.wte.weight.data)


def test_materialize_leaves_nothing_deferred_and_trains():
    model = nn.materialize(deferred_gpt())
    assert not any(nn.is_deferred(p) for p in model.parameters())
    ids = np.arange(8).reshape(1, 8) % CFG.vocab_size
    loss = model.loss(model(ids), ids)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


# -- 2. initialization by (seed, name), any box alone ---------------------------------------------------------

def reference_draw(init, seed, name, shape):
    """The keyed draw of a whole tensor from the plain sequential Philox stream and the textbook formulas."""
    n = math.prod(shape)
    gen = np.random.Generator(np.random.Philox(key=philox_key(seed, name)))
    if isinstance(init, Uniform):
        return (init.low + (init.high - init.low) * gen.random(n)).reshape(shape)
    u = gen.random(2 * n).reshape(n, 2)
    z = np.sqrt(-2.0 * np.log(1.0 - u[:, 0])) * np.cos(2.0 * np.pi * u[:, 1])
    return (init.mean + init.std * z).reshape(shape)


@pytest.mark.parametrize("init", [Uniform(-0.25, 0.25), Normal(0.0, 0.02), Normal(1.0, 3.0)])
def test_keyed_draw_is_the_philox_stream(init):
    shape = (37, 11)
    whole = draw_box(init, 5, "blocks.0.mlp.fc.weight", (0, 0), shape, shape, np.float64)
    np.testing.assert_allclose(whole, reference_draw(init, 5, "blocks.0.mlp.fc.weight", shape), rtol=1e-13,
                               atol=1e-15)
    big = draw_box(init, 5, "w", (0,), (200_000,), (200_000,), np.float64)
    mean, std = ((init.low + init.high) / 2, (init.high - init.low) / math.sqrt(12)) if isinstance(init, Uniform) \
        else (init.mean, init.std)
    assert abs(big.mean() - mean) < 5 * std / math.sqrt(big.size) and abs(big.std() / std - 1) < 0.01


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("shape", [(41,), (13, 9), (5, 7, 6)])
def test_any_box_equals_the_same_elements_of_the_whole_draw(shape, dtype):
    rng = np.random.default_rng(hash((shape, np.dtype(dtype).name)) % 2**32)
    for init in (Normal(0.0, 0.02), Uniform(-1.0, 1.0)):
        whole = draw_box(init, 3, "p", (0,) * len(shape), shape, shape, dtype)
        assert whole.dtype == dtype
        for _ in range(40):
            offsets = tuple(int(rng.integers(0, n)) for n in shape)
            sizes = tuple(int(rng.integers(1, n - o + 1)) for o, n in zip(offsets, shape))
            box = draw_box(init, 3, "p", offsets, sizes, shape, dtype)
            expect = whole[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
            assert box.tobytes() == np.ascontiguousarray(expect).tobytes(), (offsets, sizes)


def test_values_depend_on_seed_and_name_only():
    a = nn.materialize(deferred_gpt(seed=4))
    b = nn.materialize(deferred_gpt(seed=4))
    c = nn.materialize(deferred_gpt(seed=5))
    deeper = nn.materialize(deferred_gpt(GPTConfig(**{**CFG.to_dict(), "n_layer": 3}), seed=4))
    for (name, p), (_, q), (_, r) in zip(a.named_parameters(), b.named_parameters(), c.named_parameters()):
        assert p.data.tobytes() == q.data.tobytes(), name
        if not isinstance(p.data, np.ndarray) or name.endswith(("bias", "ln1.weight", "ln2.weight", "ln_f.weight")):
            continue
        assert not np.array_equal(p.data, r.data), name
    # the same name in a different model draws the same values
    assert a.blocks[1].mlp.fc.weight.data.tobytes() == deeper.blocks[1].mlp.fc.weight.data.tobytes()
    # different names draw different values
    assert not np.array_equal(a.blocks[0].mlp.fc.weight.data, a.blocks[1].mlp.fc.weight.data)


def test_seed_defaults_to_manual_seed():
    mpidist.manual_seed(21)
    with nn.deferred():
        model = GPT(CFG)
    assert {p.data.seed for p in model.parameters()} == {21}
    assert {p.data.seed for p in deferred_gpt(seed=8).parameters()} == {8}


@pytest.mark.parametrize("num_shards", [1, 2, 3, 5])
def test_flat_shards_materialized_alone_make_the_whole_model(num_shards):
    """What FSDP does: each rank draws its flat range of a unit's parameters, and only that."""
    model = deferred_gpt()
    whole = nn.materialize(deferred_gpt())
    params = list(model.named_parameters())
    numel = sum(p.size for _, p in params)
    shard = -(-numel // num_shards)
    flat_shards = []
    for index in range(num_shards):
        local = np.zeros(shard)
        lo, hi, offset = index * shard, (index + 1) * shard, 0
        for _, p in params:
            start, stop = max(lo, offset), min(hi, offset + p.size)
            if stop > start:
                where = FlatShard(None, p.shape, start - offset, stop - start, start - lo)
                fill_boxes(p.data, where, local)
            offset += p.size
        flat_shards.append(local)
    flat = np.concatenate(flat_shards)[:numel]
    expect = np.concatenate([p.data.reshape(-1) for _, p in whole.named_parameters()])
    assert flat.tobytes() == expect.tobytes()


# -- eager models keep mpidist.manual_seed's sequential draws --------------------------------------------------

def test_eager_layers_draw_in_order_from_the_seeded_generator():
    mpidist.manual_seed(7)
    lin = nn.Linear(5, 3)
    emb = nn.Embedding(4, 2)
    rng = np.random.default_rng(7)
    bound = 1 / math.sqrt(5)
    np.testing.assert_array_equal(lin.weight.data, rng.uniform(-bound, bound, (3, 5)).astype(np.float32))
    np.testing.assert_array_equal(lin.bias.data, rng.uniform(-bound, bound, (3,)).astype(np.float32))
    np.testing.assert_array_equal(emb.weight.data, rng.standard_normal((4, 2)).astype(np.float32))
