"""Checkpoints across layouts: N-dimensional chunks of tensor-parallel blocks, padding, replicas that disagree.

Layouts are built by hand from a reference model trained in one process: each rank's parameters and Adam
moments are numpy slices of the reference's global tensors (padding rows zero), with ``Shard``/``Replicate``
placements over sub-communicators made by ``comm.Split`` (tensor-parallel ranks innermost). A checkpoint
saved at one layout and loaded at another must give every rank exactly those slices again.
"""

import json
import os
import zlib
from collections import namedtuple

import numpy as np
import pytest

import mpidist
from mpidist import checkpoint, nn, optim
from mpidist.checkpoint import CheckpointError
from mpidist.nn.placement import Replicate, Shard, set_placement

# Layer bounds per number of pipeline stages: make_model's layers are Linear, Tanh, Linear.
STAGES = {1: [(0, 3)], 2: [(0, 2), (2, 3)]}
ADAM_STEPS = 3
GARBAGE = 7.5  # what load layouts start from: every element, padding included, must be overwritten


def make_model(seed=0):
    rng = np.random.default_rng(seed)
    # 250 outputs over 4 tensor-parallel ranks: 63-row blocks, the last with 2 rows of padding.
    return nn.Sequential(nn.Linear(7, 11, rng=rng, dtype=np.float64), nn.Tanh(),
                         nn.Linear(11, 250, rng=rng, dtype=np.float64))


def reference():
    """Return {layer key: {"param", "exp_avg", "exp_avg_sq": global array}} after 3 Adam steps in one process."""
    model = make_model()
    opt = optim.Adam(model.parameters(), lr=0.01)
    crit = nn.CrossEntropyLoss()
    for step in range(ADAM_STEPS):
        rng = np.random.default_rng([3, step])
        opt.zero_grad()
        crit(model(rng.standard_normal((16, 7))), rng.integers(0, 250, 16)).backward()
        opt.step()
    out = {}
    for i, (key, p) in enumerate(model.named_parameters()):
        assert opt.state[i]["step"] == ADAM_STEPS
        out[key] = {"param": p.data.copy(), "exp_avg": opt.state[i]["exp_avg"].copy(),
                    "exp_avg_sq": opt.state[i]["exp_avg_sq"].copy()}
    return out


REFERENCE = reference()
UNPADDED_BYTES = sum(v.nbytes for per in REFERENCE.values() for v in per.values())


class Layout(namedtuple("Layout", "dp tp pp dim fsdp", defaults=(0, False))):
    """(dp, tp, pp): data-parallel replicas x tensor-parallel ranks x pipeline stages; weights split along ``dim``.

    With ``dim == 1`` a bias (1-D) is replicated over the tensor-parallel ranks; with ``dim == 0`` it is split
    too. ``fsdp``: each tensor-parallel block is FSDP-sharded over the data-parallel ranks.
    """

    @property
    def size(self):
        return self.dp * self.tp * self.pp

    def __repr__(self):
        return f"dp{self.dp}-tp{self.tp}-pp{self.pp}" + (f"-dim{self.dim}" if self.tp > 1 else "") + \
            ("-fsdp" if self.fsdp else "")


def local_block(global_array, dim, tp, tp_rank):
    """Return (block, start): rows ``start ..`` of ``global_array`` along ``dim``, zero-padded to ceil(n / tp) rows."""
    rows = -(-global_array.shape[dim] // tp)
    start = tp_rank * rows
    shape = list(global_array.shape)
    shape[dim] = rows
    block = np.zeros(shape, dtype=global_array.dtype)
    real = global_array.take(np.arange(start, min(start + rows, global_array.shape[dim])), axis=dim)
    block[tuple(slice(0, n) for n in real.shape)] = real
    return block, start


def build(comm, layout, filled):
    """Build this rank's part of ``layout`` over ``comm``; return (state, expected values per optimizer parameter).

    ``filled``: the reference's slices in parameters and Adam state (a layout to save); otherwise every
    element is GARBAGE and the optimizer has no state (a layout to load into).
    """
    from mpidist.parallel.ddp import DDP
    from mpidist.parallel.fsdp import FSDP
    from mpidist.parallel.pipeline import Pipeline
    rank = comm.Get_rank()
    tp_rank, pp_rank, dp_rank = rank % layout.tp, rank // layout.tp % layout.pp, rank // (layout.tp * layout.pp)
    tp_comm = comm.Split(rank // layout.tp, rank)
    pp_comm = comm.Split(dp_rank * layout.tp + tp_rank, rank)
    dp_comm = comm.Split(pp_rank * layout.tp + tp_rank, rank)
    first, stop = STAGES[layout.pp][pp_rank]
    stage = nn.Sequential(*list(make_model(seed=99))[first:stop])
    expected = []
    for name, p in stage.named_parameters():
        index, rest = name.split(".", 1)
        per = REFERENCE[f"{first + int(index)}.{rest}"]
        shape = per["param"].shape
        if layout.tp == 1 or (len(shape) == 1 and layout.dim == 1):
            blocks = {k: v.copy() for k, v in per.items()}
            placement = Replicate(tp_comm) if layout.tp > 1 else None
        else:
            blocks = {k: local_block(v, layout.dim, layout.tp, tp_rank)[0] for k, v in per.items()}
            start = local_block(per["param"], layout.dim, layout.tp, tp_rank)[1]
            placement = Shard(layout.dim, tp_comm, shape, start)
        p.data = blocks["param"].copy() if filled else np.full_like(blocks["param"], GARBAGE)
        set_placement(p, placement)
        expected.append(blocks)
    if layout.fsdp:
        model = FSDP(stage, dp_comm)
        expected = flat_shards(model, expected)
        params = list(model.parameters())
    elif layout.pp > 1:
        model = Pipeline(stage, pp_comm, num_microbatches=1, schedule="gpipe", loss_fn=nn.CrossEntropyLoss(),
                         dp_comm=dp_comm if layout.dp > 1 else None)
        params = list(stage.parameters())
    else:
        model = DDP(stage, dp_comm) if layout.dp > 1 else stage
        params = list(stage.parameters())
    opt = optim.Adam(params, lr=0.01)
    if filled:
        opt.state = {i: {"step": ADAM_STEPS, "exp_avg": e["exp_avg"].copy(), "exp_avg_sq": e["exp_avg_sq"].copy()}
                     for i, e in enumerate(expected)}
    return {"model": model, "optim": opt}, expected


def flat_shards(fsdp, blocks):
    """Return the expected flat shard values per unit, placing each block's flat range where FSDP's layout says."""
    by_name = dict(zip([n for n, _ in fsdp.module.named_parameters()], blocks))
    out = []
    for unit in fsdp.shard_layout():
        shard = {k: np.zeros(unit.shard_numel) for k in ("param", "exp_avg", "exp_avg_sq")}
        for piece in unit.pieces():
            for k, v in shard.items():
                v[piece.offset: piece.offset + piece.count] = by_name[piece.name][k].reshape(-1)[
                    piece.start: piece.start + piece.count]
        out.append(shard)
    return out


def check(state, expected):
    """Assert that this rank's parameters and Adam state equal the expected slices bit for bit."""
    opt = state["optim"]
    assert len(opt.params) == len(expected)
    for i, (p, e) in enumerate(zip(opt.params, expected)):
        np.testing.assert_array_equal(p.data, e["param"], err_msg=f"parameter {i}")
        assert opt.state[i]["step"] == ADAM_STEPS
        for k in ("exp_avg", "exp_avg_sq"):
            np.testing.assert_array_equal(opt.state[i][k], e[k], err_msg=f"parameter {i} {k}")


def on_ranks(comm, layout, fn):
    """Run ``fn(sub)`` on the first ``layout.size`` ranks of ``comm`` (a communicator of just those ranks)."""
    sub = comm.Split(0 if comm.Get_rank() < layout.size else 1, comm.Get_rank())
    if comm.Get_rank() < layout.size:
        fn(sub)
    comm.Barrier()


def shared_dir(comm, tmp_path):
    return comm.bcast(str(tmp_path) if comm.Get_rank() == 0 else None, root=0)


PLAIN = Layout(1, 1, 1)
LAYOUTS = {  # by world size: the layouts to load into; the first ones are also saved from
    4: [Layout(1, 2, 2, dim=1), Layout(1, 4, 1, dim=0), Layout(2, 2, 1, dim=0, fsdp=True),
        Layout(2, 1, 2), Layout(4, 1, 1), PLAIN],
    2: [Layout(1, 2, 1, dim=1), Layout(1, 1, 2), Layout(1, 2, 1, dim=0), Layout(2, 1, 1), PLAIN],
}
SAVED = {4: 3, 2: 2}


@pytest.mark.world_sizes(2, 4)
def test_saved_at_one_layout_loads_bitwise_at_every_other(comm, tmp_path):
    """The issue's (dp, tp, pp) = (1, 2, 2) with dim-1 shards, padded dim-0 shards, FSDP over tensor parallelism."""
    root, size = shared_dir(comm, tmp_path), comm.Get_size()
    for saved in LAYOUTS[size][:SAVED[size]]:
        where = os.path.join(root, repr(saved))

        def save(sub, saved=saved, where=where):
            state, _ = build(sub, saved, filled=True)
            checkpoint.save(where, state, sub, step=ADAM_STEPS)

        on_ranks(comm, saved, save)
        manifest = json.load(open(os.path.join(where, f"step_{ADAM_STEPS:08d}", "manifest.json")))
        # Each element once, padding never: parameters and both moments, 8 bytes each.
        assert sum(f["bytes"] for f in manifest["files"].values()) == UNPADDED_BYTES, saved
        for loaded in LAYOUTS[size]:
            def load(sub, loaded=loaded, where=where):
                state, expected = build(sub, loaded, filled=False)
                assert checkpoint.load(where, state, sub) == ADAM_STEPS
                check(state, expected)

            on_ranks(comm, loaded, load)


@pytest.mark.world_sizes(2)
def test_shards_along_dimension_1_are_stored_as_boxes_and_padding_is_left_out(comm, tmp_path):
    root = shared_dir(comm, tmp_path)
    state, _ = build(comm, Layout(1, 2, 1, dim=1), filled=True)
    checkpoint.save(root, state, comm, step=1)
    tensors = json.load(open(os.path.join(root, "step_00000001", "manifest.json")))["tensors"]
    boxes = {key: [(c["offsets"], c["sizes"]) for c in entry["chunks"]] for key, entry in tensors.items()}
    # 7 columns over 2 ranks in 4-column blocks: the second block's 4th column is padding.
    assert boxes["model.0.weight"] == boxes["optim.model.0.weight.exp_avg"] == [([0, 0], [11, 4]), ([0, 4], [11, 3])]
    assert boxes["model.2.weight"] == [([0, 0], [250, 6]), ([0, 6], [250, 5])]
    assert boxes["model.0.bias"] == [([0], [11])]  # replicated over the two ranks: written once


@pytest.mark.world_sizes(2, 4)
def test_ranks_with_different_values_under_one_key_fail_the_save_on_every_rank(comm, tmp_path):
    root = shared_dir(comm, tmp_path)
    model = make_model(seed=comm.Get_rank() % 2)  # ranks 0, 2 agree; ranks 1, 3 hold another model
    with pytest.raises(CheckpointError, match=r"ranks 0,1(,2,3)? hold different values for 'model.0.weight' \(the whole "
                                              r"tensor, shape \(11, 7\)\) \(ranks? 0(,2)?: crc32 0x[0-9a-f]{8}; ranks? "
                                              r"1(,3)?: crc32 0x[0-9a-f]{8}\); saving would keep one of them"):
        checkpoint.save(root, {"model": model}, comm, step=1)
    # A Replicate placement does not make them equal either.
    for p in model.parameters():
        set_placement(p, Replicate(comm))
    with pytest.raises(CheckpointError, match=r"hold different values for 'model.0.weight'"):
        checkpoint.save(root, {"model": model}, comm, step=1)
    assert checkpoint.list_steps(root) == []


def shard_rows(comm, rows, start, global_shape=(11, 7)):
    """A Linear(7, 11)-shaped parameter whose block is ``rows`` rows of a global tensor, from row ``start``."""
    p = nn.Parameter(np.zeros((rows,) + tuple(global_shape[1:])))
    return set_placement(p, Shard(0, comm, global_shape, start))


class Holder(nn.Module):
    def __init__(self, p):
        super().__init__()
        self.weight = p


@pytest.mark.world_sizes(2)
def test_a_shard_of_pieces_along_columns_loads_into_a_plain_model(comm, tmp_path):
    """A fused q/k/v split by heads along dimension 1 (each rank: its columns of q, of k and of v) is saved as
    its pieces; a plain one-rank model loads the global tensor."""
    root, rank = shared_dir(comm, tmp_path), comm.Get_rank()
    full = np.arange(5 * 12, dtype=np.float64).reshape(5, 12)
    pieces = tuple((which * 4 + rank * 2, which * 2, 2) for which in range(3))
    mine = full[:, np.concatenate([np.arange(g, g + n) for g, _, n in pieces])]
    checkpoint.save(root, {"model": Holder(set_placement(nn.Parameter(mine), Shard(1, comm, full.shape, 2 * rank,
                                                                                   pieces)))}, comm, step=1)
    plain, alone = Holder(nn.Parameter(np.zeros_like(full))), comm.Split(rank, 0)
    try:
        checkpoint.load(root, {"model": plain}, alone)
    finally:
        alone.Free()
    np.testing.assert_array_equal(plain.weight.data, full)


@pytest.mark.world_sizes(2)
def test_placements_that_do_not_split_a_tensor_into_a_tiling_are_refused(comm, tmp_path):
    root, rank = shared_dir(comm, tmp_path), comm.Get_rank()
    cases = [
        (shard_rows(comm, 6, 4 * rank), r"'model.weight' has overlapping chunks that are not the same chunk: \(chunk "
                                        r"at offsets \(0, 0\) of sizes \(6, 7\) in shape \(11, 7\)\) on rank 0, \(chunk "
                                        r"at offsets \(4, 0\) of sizes \(6, 7\) in shape \(11, 7\)\) on rank 1"),
        (shard_rows(comm, 4, 4 * rank), r"the chunks of 'model.weight' cover 56 of its 77 elements \(shape \(11, 7\)\)"),
        (set_placement(nn.Parameter(np.zeros((6, 5))), Shard(0, comm, (11, 7), 6 * rank)),
         r"'model.weight' holds a block of shape \(6, 5\) that does not fit its placement Shard\(dim=0, "
         r"global_shape=\(11, 7\), start=\d\)"),
        (shard_rows(comm, 6, 6 * rank, global_shape=(11 + rank, 7)),
         r"ranks disagree on the global shape or dtype of 'model.weight' \(rank 0: shape \(11, 7\), dtype float64; "
         r"rank 1: shape \(12, 7\)"),
    ]
    for param, message in cases:
        with pytest.raises(CheckpointError, match=message):
            checkpoint.save(root, {"model": Holder(param)}, comm, step=1)
    assert checkpoint.list_steps(root) == []


def write_flat_format_checkpoint(root, step=ADAM_STEPS):
    """Write the reference as a ``mpidist-checkpoint-1`` checkpoint: flat pieces split mid-row over two files."""
    directory = os.path.join(root, f"step_{step:08d}")
    os.makedirs(directory)
    tensors, files, data = {}, {}, {"rank00000.bin": [], "rank00001.bin": []}
    optimizer = optim.Adam(make_model().parameters(), lr=0.01)
    for key, per in REFERENCE.items():
        for what, array in per.items():
            name = f"model.{key}" if what == "param" else f"optim.model.{key}.{what}"
            flat = array.reshape(-1)
            cut = flat.size // 2 + 1  # not at a row boundary of any of these shapes
            pieces = []
            for fname, (start, stop) in zip(data, [(cut, flat.size), (0, cut)]):
                offset = sum(len(b) for b in data[fname])
                data[fname].append(flat[start:stop].tobytes())
                pieces.append({"file": fname, "start": start, "count": stop - start, "offset": offset})
            tensors[name] = {"shape": list(array.shape), "dtype": "<f8", "pieces": pieces}
    for fname, blobs in data.items():
        blob = b"".join(blobs)
        open(os.path.join(directory, fname), "wb").write(blob)
        files[fname] = {"bytes": len(blob), "crc32": zlib.crc32(blob)}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    params = {f"model.{key}": {"scalars": {"step": ADAM_STEPS}, "arrays": ["exp_avg", "exp_avg_sq"]} for key in REFERENCE}
    manifest = {"format": "mpidist-checkpoint-1", "step": step, "commit": 1, "world_size": 2, "created": 0.0,
                "files": files, "tensors": tensors, "json": {"optim": {"param_groups": groups, "params": params}}}
    open(os.path.join(directory, "manifest.json"), "w").write(json.dumps(manifest))


@pytest.mark.mpi_skip
@pytest.mark.parametrize("layout", [PLAIN, Layout(1, 2, 1, dim=1), Layout(1, 4, 1, dim=0), Layout(1, 2, 2, dim=1)],
                         ids=repr)
def test_checkpoints_of_the_flat_format_still_load_at_any_layout(tmp_path, layout):
    # No checkpoint of the old format is kept as a fixture: this writes one as that format's save did.
    root = str(tmp_path)
    write_flat_format_checkpoint(root)

    def load(comm):
        state, expected = build(comm, layout, filled=False)
        assert checkpoint.load(root, state, comm) == ADAM_STEPS
        check(state, expected)

    mpidist.simulate(layout.size, load)


# -- the real thing: a tensor-parallel GPT over a 3-D mesh ------------------------------------------------------
def _gpt_config():
    from mpidist.models import GPTConfig
    return GPTConfig(vocab_size=250, n_layer=2, n_embd=16, n_head=4, block_size=8, dtype="float64")


def _gpt_layout(comm, dp, tp, pp, sequence_parallel=True):
    """This rank's model (what it trains and checkpoints) and optimizer at (dp, tp, pp), built from seed 0."""
    from mpidist.models import GPT
    from mpidist.models import tensor_parallel
    from mpidist.parallel import DDP, Pipeline, mesh
    grid = mesh(comm, dp=dp, pp=pp, tp=tp)
    model = GPT(_gpt_config(), rng=np.random.default_rng(0))
    if tp > 1:
        tensor_parallel(model, grid.tp_comm, sequence_parallel=sequence_parallel)
    if pp > 1:
        stage = model.pipeline_stages(pp)[grid.pp_rank]
        wrapped = Pipeline(stage, grid.pp_comm, 2, "1f1b", loss_fn=model.loss,
                           dp_comm=grid.dp_comm if dp > 1 else None, tied_parameters=stage.tied)
    else:
        wrapped = DDP(model, grid.dp_comm)
    opt = optim.AdamW(list(wrapped.parameters()), lr=0.01)
    return grid, model, wrapped, opt


def _gpt_train(grid, model, wrapped, opt, steps=2):
    rng = np.random.default_rng(5)
    x, y = rng.integers(0, 250, (8, 8)), rng.integers(0, 250, (8, 8))
    n = 8 // grid.dp
    mine = slice(grid.dp_rank * n, (grid.dp_rank + 1) * n)
    for _ in range(steps):
        opt.zero_grad()
        if isinstance(wrapped, mpidist.Pipeline):
            wrapped.step(x[mine], y[mine])
        else:
            model.loss(wrapped(x[mine]), y[mine]).backward()
        opt.step()


def _global_view(param, array):
    """Pairs (global index, local index) of the real blocks of ``array`` (a parameter's local data or state)."""
    where = getattr(param, "placement", None)
    if not isinstance(where, Shard):
        return [(tuple(slice(None) for _ in array.shape), tuple(slice(None) for _ in array.shape))]
    return [(tuple(slice(o, o + n) for o, n in zip(off, size)), tuple(slice(o, o + n) for o, n in zip(loc, size)))
            for off, size, loc in where.chunks(array.shape)]


@pytest.mark.world_sizes(4)
@pytest.mark.parametrize("load_at", [(2, 1, 2), (4, 1, 1), (1, 2, 2), (1, 4, 1), (2, 2, 1)])
def test_tensor_parallel_gpt_checkpoint_loads_at_every_layout(comm, tmp_path_factory, load_at):
    """Saved at (dp, tp, pp) = (1, 2, 2) with sequence parallelism; loaded at another layout, every rank's
    parameters and AdamW moments equal (bitwise) the slices of the same checkpoint loaded into a plain GPT on
    one rank (the (1, 1, 1) layout), which itself equals single-process training of the same steps."""
    from mpidist.models import GPT
    root = str(tmp_path_factory.getbasetemp() / f"tp_gpt_{comm.Get_size()}")
    root = comm.bcast(root, root=0)
    grid, model, wrapped, opt = _gpt_layout(comm, 1, 2, 2)
    _gpt_train(grid, model, wrapped, opt)
    checkpoint.save(root, {"model": wrapped, "optim": opt}, comm, step=2)
    grid.free()

    # The plain model on every rank: the global tensors to compare against.
    plain = GPT(_gpt_config(), rng=np.random.default_rng(1))
    plain_opt = optim.AdamW(list(plain.parameters()), lr=0.01)
    plain_opt.step()  # allocate the moments (zero gradients) so they can be loaded into
    for p in plain.parameters():
        p.grad = np.zeros_like(p.data)
    plain_opt.step()
    one = comm.Split(comm.Get_rank(), 0)
    checkpoint.load(root, {"model": plain, "optim": plain_opt}, one, log=lambda *a: None)
    one.Free()
    expected = {n: (p, plain_opt.state[i]) for i, (n, p) in enumerate(plain.named_parameters())}
    single = GPT(_gpt_config(), rng=np.random.default_rng(0))
    single_opt = optim.AdamW(list(single.parameters()), lr=0.01)
    _gpt_train(type("OneRank", (), {"dp": 1, "dp_rank": 0})(), single, single, single_opt)
    for n, p in single.named_parameters():
        np.testing.assert_allclose(expected[n][0].data, p.data, rtol=0, atol=1e-12, err_msg=n)

    dp, tp, pp = load_at
    grid, model, wrapped, opt = _gpt_layout(comm, dp, tp, pp)
    params = list(wrapped.parameters())
    for p in params:  # allocate moments that the load must overwrite
        p.grad = np.full_like(p.data, 0.5)
    opt.step()
    checkpoint.load(root, {"model": wrapped, "optim": opt}, comm, log=lambda *a: None)
    names = {id(placed.parameter): placed.name for placed in wrapped.placed_parameters()}
    for i, p in enumerate(params):
        name = names[id(p)]
        ref_param, ref_state = expected[name]
        for g, local in _global_view(p, p.data):
            assert np.array_equal(p.data[local], ref_param.data[g]), name
            for k in ("exp_avg", "exp_avg_sq"):
                assert np.array_equal(opt.state[i][k][local], ref_state[k][g]), (name, k)
    grid.free()
