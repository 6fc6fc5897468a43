"""Loading straight into shards: a deferred model reads only its boxes of a checkpoint or safetensors file.

A model trained and saved at one layout (FSDP over the world) is loaded into a deferred GPT at another layout
(tensor x pipeline mesh, FSDP, DDP): the gathered state equals the saved one bitwise, and each rank's bytes read
are exactly the bytes of the boxes its placements hold (its share; no chunk read whole), well under the model.
"""
import math

import numpy as np
import pytest
import safetensors.numpy

from mpidist import checkpoint, nn, optim
from mpidist.models import GPT, GPTConfig, tensor_parallel
from mpidist.nn.placement import boxes
from mpidist.parallel import DDP, FSDP, Pipeline, full_state_dict, mesh
from mpidist.sources import CheckpointSource, SafetensorsSource

CONFIG = GPTConfig(vocab_size=61, block_size=8, n_layer=4, n_head=4, n_embd=32, dtype="float64")


def deferred_gpt(seed=3):
    with nn.deferred(seed=seed):
        return GPT(CONFIG)


def saved_fsdp(comm, root):
    """Train an FSDP GPT a step and save it at (fsdp=world); return its full state (on every rank)."""
    model = deferred_gpt()
    fsdp = FSDP(model, comm, units=model.fsdp_units())
    opt = optim.AdamW(list(fsdp.parameters()), lr=0.01)
    ids = np.random.default_rng(comm.Get_rank()).integers(0, CONFIG.vocab_size, (2, CONFIG.block_size))
    model.loss(fsdp(ids), ids).backward()
    opt.step()
    checkpoint.save(root, {"model": fsdp}, comm, step=1)
    state = full_state_dict(fsdp, comm, rank=0, all_ranks=True)
    fsdp.remove()
    return state


def wrap(comm, kind, model):
    """Wrap a deferred ``model`` at ``kind`` (which materializes this rank's part); return the wrapper, mesh."""
    if kind == "fsdp":
        return FSDP(model, comm, units=model.fsdp_units()), None
    if kind == "ddp":
        return DDP(model, comm), None
    grid = mesh(comm, dp=1, pp=2, tp=comm.Get_size() // 2)
    tensor_parallel(model, grid.tp_comm, sequence_parallel=False)
    stage = model.pipeline_stages(2)[grid.pp_rank]
    return Pipeline(stage, grid.pp_comm, 2, "1f1b", loss_fn=model.loss, tied_parameters=stage.tied), grid


def share_bytes(wrapper):
    """The bytes of every box this rank's placements hold (each listed parameter, tied copies included)."""
    total = 0
    for placed in wrapper.placed_parameters():
        shape = placed.parameter.data.shape
        total += sum(math.prod(b.sizes) for b in boxes(placed.placement, shape)) * placed.parameter.data.itemsize
    return total


def whole_bytes():
    return sum(p.data.full_nbytes for p in deferred_gpt().parameters())


def check_loaded(comm, kind, source, want):
    model = nn.load_deferred(deferred_gpt(seed=99), source, prefix=source.prefix)
    wrapper, grid = wrap(comm, kind, model)
    got = full_state_dict(wrapper, comm, rank=0)
    if comm.Get_rank() == 0:
        assert list(got) == list(want)
        for name, value in want.items():
            assert got[name].tobytes() == value.tobytes(), name
    assert source.bytes_read == share_bytes(wrapper), (source.bytes_read, share_bytes(wrapper))
    if kind != "ddp" and comm.Get_size() == 4:
        assert source.bytes_read < 0.45 * whole_bytes()
    wrapper.remove()
    if grid is not None:
        grid.free()


@pytest.mark.world_sizes(2, 4)
@pytest.mark.parametrize("kind", ["tp_pp", "fsdp", "ddp"])
def test_checkpoint_saved_by_fsdp_loads_into_a_deferred_layout_reading_its_share(comm, kind, tmp_path_factory):
    if kind == "tp_pp" and comm.Get_size() < 4:
        pytest.skip("tp x pp needs 4 ranks")
    root = comm.bcast(str(tmp_path_factory.mktemp("ckpt")) if comm.Get_rank() == 0 else None)
    want = saved_fsdp(comm, root)
    source = CheckpointSource(root)
    source.prefix = "model."
    check_loaded(comm, kind, source, want)


@pytest.mark.world_sizes(1, 2, 4)
@pytest.mark.parametrize("kind", ["fsdp", "tp_pp"])
def test_safetensors_loads_into_a_deferred_layout_reading_its_share(comm, kind, tmp_path_factory):
    if kind == "tp_pp" and comm.Get_size() < 4:
        pytest.skip("tp x pp needs 4 ranks")
    want = nn.materialize(deferred_gpt(seed=5)).state_dict()
    path = comm.bcast(str(tmp_path_factory.mktemp("st") / "model.safetensors") if comm.Get_rank() == 0 else None)
    if comm.Get_rank() == 0:
        safetensors.numpy.save_file(dict(want), path)
    comm.Barrier()
    source = SafetensorsSource(path)
    source.prefix = ""
    check_loaded(comm, kind, source, want)


def test_load_deferred_names_what_does_not_match(tmp_path):
    state = nn.materialize(deferred_gpt()).state_dict()
    state.pop("blocks.1.mlp.fc.bias")
    state["embed.wpe.weight"] = state["embed.wpe.weight"][:4]
    path = str(tmp_path / "m.safetensors")
    safetensors.numpy.save_file(dict(state), path)
    with pytest.raises(ValueError) as raised:
        nn.load_deferred(deferred_gpt(), SafetensorsSource(path))
    assert "'blocks.1.mlp.fc.bias' is not in the source" in str(raised.value)
    assert "'embed.wpe.weight' is (4, 32) float64 in the source, (8, 32) float64 in the model" in str(raised.value)
