"""bfloat16 models through full_state_dict, load_full_state_dict and safetensors export, at every layout.

MPI has no bfloat16: the full-state transfers move it as its uint16 bit patterns (nothing is reduced). Reference:
one process's ``GPT(CONFIG, rng=np.random.default_rng(0))`` with ``Policy("bf16")`` applied (each parameter
rounded to bfloat16 once), cast with numpy where a test asks for another dtype. Every layout of
tests/test_full_state.py builds the same model the same way, so gathers and loads must be bitwise. Runs on SimComm
worlds 1, 2, 4 and under mpiexec -n 2 / -n 4.
"""
import numpy as np
import pytest

import test_full_state as full_state_tests
from mpidist.export import load_safetensors, read_safetensors, save_safetensors
from mpidist.models import GPT
from mpidist.nn.precision import Policy, apply_policy, bfloat16
from mpidist.parallel import FSDP, full_optimizer_state_dict, full_state_dict, iter_full_state, load_full_state_dict

LAYOUTS = [(kind, None) for kind in full_state_tests.KINDS] + [("mesh", (1, 2, 2)), ("mesh", (2, 2, 1))]
LAYOUT_IDS = [kind if dims is None else "x".join(map(str, dims)) for kind, dims in LAYOUTS]
BF16 = Policy("bf16")


def config_of(kind):
    return full_state_tests.UNTIED if kind == "pp" else full_state_tests.CONFIG


def one_process_bf16(config, seed=0):
    """Return one process's bfloat16 GPT state (float64 init, each parameter rounded to bfloat16 once)."""
    model = GPT(config, rng=np.random.default_rng(seed))
    apply_policy(model, BF16)
    return model.state_dict()


def cast(state, dtype):
    """Return ``state`` with its floating arrays cast to ``dtype`` by numpy (the independent reference)."""
    return {name: value.astype(dtype) if value.dtype.kind == "f" or value.dtype == bfloat16 else value
            for name, value in state.items()}


def assert_bitwise(got, want):
    """Names, order, dtypes and every bit (bfloat16 compared as its uint16 patterns) as ``want``."""
    assert list(got) == list(want), "names or order differ from the unsplit model's state_dict()"
    for name, value in want.items():
        assert got[name].dtype == value.dtype, (name, got[name].dtype, value.dtype)
        bits = (lambda a: a.view(np.uint16)) if value.dtype == bfloat16 else (lambda a: a)
        np.testing.assert_array_equal(bits(got[name]), bits(value), err_msg=name)


def build(comm, kind, dims, seed=0):
    if dims is not None and comm.Get_size() != int(np.prod(dims)):
        pytest.skip(f"the ({', '.join(map(str, dims))}) mesh needs {int(np.prod(dims))} ranks")
    return full_state_tests.Layout(comm, kind, dims, seed=seed, policy=BF16)


def rank_of(layout):
    return 0 if layout.comm is None else layout.comm.Get_rank()


@pytest.mark.world_sizes(1, 2, 4)
@pytest.mark.parametrize("kind, dims", LAYOUTS, ids=LAYOUT_IDS)
def test_bf16_full_state_and_load_equal_one_process_at_every_layout(comm, kind, dims):
    layout = build(comm, kind, dims)
    assert any(p.data.dtype == bfloat16 for p in layout.wrapped.parameters())
    config, me = config_of(kind), rank_of(layout)
    size = 1 if layout.comm is None else layout.comm.Get_size()
    want = one_process_bf16(config)
    root = size - 1  # not rank 0: the lowest holders send to it
    got = full_state_dict(layout.wrapped, layout.comm, rank=root)
    if me == root:
        assert_bitwise(got, want)
    else:
        assert got == {}
    assert_bitwise(full_state_dict(layout.wrapped, layout.comm, all_ranks=True, dtype="fp32"), cast(want, np.float32))
    streamed = dict(iter_full_state(layout.wrapped, layout.comm, rank=root, dtype=np.float32))
    if me == root:
        assert_bitwise(streamed, cast(want, np.float32))
    # Load another bfloat16 state (sent as bits), then a float32 one (cast to the model's bfloat16 on the root).
    other = one_process_bf16(config, seed=4)
    load_full_state_dict(layout.wrapped, other if me == 0 else None, layout.comm)
    assert_bitwise(full_state_dict(layout.wrapped, layout.comm, all_ranks=True), other)
    third = GPT(config, rng=np.random.default_rng(7)).state_dict()
    load_full_state_dict(layout.wrapped, cast(third, np.float32) if me == 0 else None, layout.comm)
    assert_bitwise(full_state_dict(layout.wrapped, layout.comm, all_ranks=True), cast(third, bfloat16))
    layout.close()


@pytest.mark.world_sizes(1, 2, 4)
@pytest.mark.parametrize("kind, dims", [("fsdp", None), ("dp_tp", None), ("pp", None), ("mesh", (2, 2, 1))],
                         ids=["fsdp", "dp_tp", "pp", "2x2x1"])
def test_bf16_export_equals_one_process_and_loads_back(comm, kind, dims, tmp_path):
    layout = build(comm, kind, dims)
    config, me = config_of(kind), rank_of(layout)
    want = one_process_bf16(config)
    save_safetensors(layout.wrapped, tmp_path / "bf16" / "model.safetensors", comm=layout.comm)
    save_safetensors(layout.wrapped, tmp_path / "fp32" / "model.safetensors", comm=layout.comm, dtype="float32")
    if me == 0:  # dict order is the file's, not the model's
        got = read_safetensors(tmp_path / "bf16" / "model.safetensors")
        assert_bitwise({name: got[name] for name in want}, want)
        got = read_safetensors(tmp_path / "fp32" / "model.safetensors")
        assert_bitwise({name: got[name] for name in want}, cast(want, np.float32))
    layout.close()
    fresh = build(comm, kind, dims, seed=9)
    load_safetensors(tmp_path / "bf16" / "model.safetensors", fresh.wrapped, fresh.comm)
    assert_bitwise(full_state_dict(fresh.wrapped, fresh.comm, all_ranks=True), want)
    fresh.close()


@pytest.mark.world_sizes(1, 2, 4)
def test_fsdp_float32_shards_export_as_bf16_equal_the_cast_reference(comm, tmp_path):
    """FSDP(param_dtype="bf16") keeps float32 shards: the default export is float32, ``dtype="bf16"`` rounds them."""
    config = full_state_tests.CONFIG
    model = GPT(config, rng=np.random.default_rng(0))
    wrapped = FSDP(model, comm, units=model.fsdp_units(), param_dtype="bf16")
    want = GPT(config, rng=np.random.default_rng(0)).state_dict()
    assert_bitwise(full_state_dict(wrapped, comm, all_ranks=True), want)
    assert_bitwise(full_state_dict(wrapped, comm, all_ranks=True, dtype=bfloat16), cast(want, bfloat16))
    save_safetensors(wrapped, tmp_path / "model.safetensors", comm=comm, dtype="bf16")
    if comm.Get_rank() == 0:
        got = read_safetensors(tmp_path / "model.safetensors")
        assert_bitwise({name: got[name] for name in want}, cast(want, bfloat16))
    wrapped.remove()


def test_a_state_mapping_exports_with_its_floating_arrays_cast_to_dtype(tmp_path):
    """A mapping is written by this process: ``dtype`` casts its floating arrays (bfloat16 too), not the others."""
    rng = np.random.default_rng(3)
    state = {"w": rng.standard_normal((3, 4)).astype(np.float32), "b": rng.standard_normal(5).astype(bfloat16),
             "steps": np.arange(4, dtype=np.int64)}
    for dtype, name in ((bfloat16, "bf16"), (np.dtype(np.float32), "fp32")):
        save_safetensors(state, tmp_path / f"{name}.safetensors", dtype=name)
        got = read_safetensors(tmp_path / f"{name}.safetensors")  # safetensors orders the names
        assert_bitwise({key: got[key] for key in state}, cast(state, dtype))


@pytest.mark.world_sizes(1, 2)
def test_a_dtype_option_that_is_not_a_float_dtype_raises_on_every_rank(comm, tmp_path):
    model = GPT(full_state_tests.CONFIG, rng=np.random.default_rng(0))
    for call, fn in ((lambda: full_state_dict(model, comm, dtype="int8"), "full_state_dict"),
                     (lambda: next(iter_full_state(model, comm, dtype="float64")), "iter_full_state"),
                     (lambda: save_safetensors(model, tmp_path / "m.safetensors", comm=comm, dtype="int8"),
                      "save_safetensors")):
        with pytest.raises(ValueError, match=rf"{fn}: dtype: dtype must be float16, bfloat16 or float32"):
            call()


@pytest.mark.world_sizes(1, 2, 4)
@pytest.mark.parametrize("kind, dims", LAYOUTS, ids=LAYOUT_IDS)
def test_optimizer_state_of_a_bf16_model_gathers_float32_masters(comm, kind, dims):
    """After a step, the unsplit float32 masters round to the unsplit bfloat16 parameters (tested bitwise above
    against one process), and the moments are float32 of the parameters' shapes."""
    layout = build(comm, kind, dims)
    layout.train(1)
    params = full_state_dict(layout.wrapped, layout.comm)
    state = full_optimizer_state_dict(layout.wrapped, layout.opt, layout.comm)
    if rank_of(layout) == 0:
        names = [name for name, value in params.items() if value.dtype == bfloat16]
        assert names and sorted(state["state"]) == sorted(names)
        for name in names:
            entry = state["state"][name]
            assert {entry[k].dtype for k in ("master_param", "exp_avg", "exp_avg_sq")} == {np.dtype(np.float32)}
            assert entry["exp_avg"].shape == params[name].shape
            np.testing.assert_array_equal(entry["master_param"].astype(bfloat16).view(np.uint16),
                                          params[name].view(np.uint16), err_msg=name)
    layout.close()


@pytest.mark.world_sizes(2, 4)
def test_a_pipeline_of_bf16_activations_evaluates_the_one_process_loss(comm):
    """Policy("bf16") sends bfloat16 activations between stages (as bits): the pipeline's loss is one process's
    (its micro-batches' mean in float32: within 1e-3 of the whole batch's)."""
    layout = build(comm, "pp", None)
    x, y = full_state_tests.batch()
    got = layout.wrapped.evaluate(x, y, broadcast_loss=True)
    model = GPT(full_state_tests.UNTIED, rng=np.random.default_rng(0))
    apply_policy(model, BF16)
    want = float(model.loss(model(x), y).data)
    assert abs(got - want) <= 1e-3 * abs(want)
    layout.close()
