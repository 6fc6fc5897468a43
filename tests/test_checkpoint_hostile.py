"""A checkpoint is untrusted input: a tampered checkpoint fails with CheckpointError naming the file and the field, on
every rank, with the state it was loaded into unchanged; nothing in a file mpidist writes runs code when read.

The tamperings start from a real checkpoint written by mpidist (FSDP and Adam on 2 simulated ranks, with a learning-
rate schedule, a sampler, per-rank generators and extras) and are loaded into an FSDP model at every world size.
"""

import ast
import base64
import copy
import json
import math
import os
import pathlib
import pickle
import re
import shutil

import numpy as np
import pytest

import mpidist
from mpidist import checkpoint, nn, optim, standard_json
from mpidist.checkpoint import CheckpointError
from mpidist.data import DistributedSampler
from mpidist.parallel.fsdp import FSDP

MANIFEST = "manifest.json"
SOURCE = pathlib.Path(mpidist.__file__).parent


def make_model(seed):
    rng = np.random.default_rng(seed)
    return nn.Sequential(nn.Linear(3, 5, rng=rng, dtype=np.float64), nn.Tanh(),
                         nn.Linear(5, 2, rng=rng, dtype=np.float64))


def train(model, opt, steps, comm, start=0):
    crit = nn.CrossEntropyLoss()
    per, rank = 8 // comm.Get_size(), comm.Get_rank()
    for step in range(start, start + steps):
        rng = np.random.default_rng([3, step])
        x, y = rng.standard_normal((8, 3)), rng.integers(0, 2, 8)
        opt.zero_grad()
        crit(model(x[rank * per:(rank + 1) * per]), y[rank * per:(rank + 1) * per]).backward()
        opt.step()


def make_state(comm, seed):
    """Return a training state of every kind a checkpoint holds, trained one step."""
    fsdp = FSDP(make_model(seed), comm)
    opt = optim.Adam(fsdp.parameters(), lr=0.01)
    train(fsdp, opt, 1, comm)
    sampler = DistributedSampler(40, comm, seed=1)
    sampler.set_epoch(seed % 5)
    return {"model": fsdp, "optim": opt, "sched": optim.StepLR(opt, step_size=2, gamma=0.5), "sampler": sampler,
            "rng": np.random.default_rng([seed, comm.Get_rank()]),  # per rank: the manifest gets json_per_rank
            "extra": {"best": 0.25 * seed}}


def save_steps(comm, root, seed=0, steps=(1, 2)):
    state = make_state(comm, seed)
    for step in steps:
        train(state["model"], state["optim"], 1, comm, start=step)
        state["sched"].step()
        checkpoint.save(root, state, comm, step=step, keep_last=None)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """Real checkpoints: steps 1 and 2 of one run, step 2 of another model, step 2 of the first saved at 4 ranks."""
    base = tmp_path_factory.mktemp("pristine")
    mpidist.simulate(2, save_steps, str(base / "run"))
    mpidist.simulate(2, save_steps, str(base / "other"), 3, (2,))
    mpidist.simulate(4, save_steps, str(base / "at4"), 0, (2,))
    return base


def shared(comm, path):
    """Return rank 0's ``path`` on every rank (under MPI each rank has its own temporary directories)."""
    return comm.bcast(str(path) if comm.Get_rank() == 0 else None, root=0)


def snapshot(state):
    """Return copies of everything a load may change, to compare bitwise afterwards."""
    opt = state["optim"]
    return {"params": [p.data.copy() for p in state["model"].parameters()],
            "opt_state": {i: {k: (v.copy() if hasattr(v, "copy") else v) for k, v in s.items()}
                          for i, s in opt.state.items()},
            "groups": copy.deepcopy([{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]),
            "sched": state["sched"].state_dict(), "epoch": state["sampler"].epoch,
            "rng": copy.deepcopy(state["rng"].bit_generator.state), "extra": copy.deepcopy(state["extra"])}


def assert_bitwise_equal(got, want):
    if isinstance(want, np.ndarray):
        assert isinstance(got, np.ndarray) and got.dtype == want.dtype and got.shape == want.shape
        assert got.tobytes() == want.tobytes()
    elif isinstance(want, dict):
        assert sorted(got) == sorted(want)
        for k in want:
            assert_bitwise_equal(got[k], want[k])
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert_bitwise_equal(g, w)
    else:
        assert type(got) is type(want) and got == want, (got, want)


# -- the tamperings ------------------------------------------------------------------------------------------
class Tampering:
    """One way to damage ``ROOT/step_00000002``; the error must match ``where`` (the file) and ``field``."""

    def __init__(self, name, damage, where, field, step=2):
        self.name, self.damage, self.where, self.field, self.step = name, damage, where, field, step

    def __repr__(self):
        return self.name


def _manifest(directory):
    return json.loads((directory / MANIFEST).read_text())


def _write(directory, manifest):
    (directory / MANIFEST).write_text(json.dumps(manifest))


def edit(fn):
    """A damage that changes the parsed manifest in place with ``fn(manifest)``."""
    def damage(directory, pristine):
        manifest = _manifest(directory)
        fn(manifest)
        _write(directory, manifest)
    return damage


def files(manifest):
    return sorted(manifest["files"])


def split_key(manifest):
    """The key with the most chunks (FSDP at 2 ranks splits its flat shards across tensors)."""
    return max(sorted(manifest["tensors"]), key=lambda k: len(manifest["tensors"][k]["chunks"]))


def chunk(manifest, i=0):
    return manifest["tensors"][split_key(manifest)]["chunks"][i]


def per_rank_entries(manifest):
    return [manifest["json"], *manifest.get("json_per_rank", [])]


def rename_file(manifest, new):
    """Rename the first shard file in the manifest (its record and every chunk naming it) to ``new``; return the old."""
    old = files(manifest)[0]
    manifest["files"][new] = manifest["files"].pop(old)
    for entry in manifest["tensors"].values():
        for c in entry["chunks"]:
            if c["file"] == old:
                c["file"] = new
    return old


def outside_copy(name_of):
    """Copy the first shard file out of the step directory, to ``name_of(directory)``, and name it there."""
    def damage(directory, pristine):
        manifest = _manifest(directory)
        name = name_of(directory)
        old = rename_file(manifest, name)
        shutil.copy(directory / old, directory / name)  # joined with an absolute name: that name
        _write(directory, manifest)
    return damage


def symlink_shard_outside(directory, pristine):
    first = files(_manifest(directory))[0]
    outside = directory.parent / "elsewhere.bin"
    shutil.copy(directory / first, outside)  # the same bytes: only the path is wrong
    os.remove(directory / first)
    os.symlink(outside, directory / first)


def symlink_manifest_outside(directory, pristine):
    outside = directory.parent / "manifest-elsewhere.json"
    shutil.move(directory / MANIFEST, outside)
    os.symlink(outside, directory / MANIFEST)


def fifo_shard(directory, pristine):
    first = files(_manifest(directory))[0]
    os.remove(directory / first)
    os.mkfifo(directory / first)  # opening it to read would wait for a writer forever


def truncate_manifest(directory, pristine):
    text = (directory / MANIFEST).read_text()
    (directory / MANIFEST).write_text(text[:len(text) // 2])


def nest_manifest(directory, pristine):
    (directory / MANIFEST).write_text("[" * 200_000 + "]" * 200_000)


def duplicate_key(key_of):
    """Write the manifest with one key twice in an object (``json`` would silently keep the second)."""
    def damage(directory, pristine):
        manifest = _manifest(directory)
        key = key_of(manifest)
        text = json.dumps(manifest)
        entry = {"shape": [1], "dtype": "<f8", "chunks": []}
        (directory / MANIFEST).write_text(text.replace('"tensors": {', f'"tensors": {{{json.dumps(key)}: '
                                                                       f'{json.dumps(entry)}, ', 1))
    return damage


def truncate_shard(directory, pristine):
    first = directory / files(_manifest(directory))[0]
    first.write_bytes(first.read_bytes()[:-8])


def flip_shard_byte(directory, pristine):
    first = directory / files(_manifest(directory))[0]
    raw = bytearray(first.read_bytes())
    raw[5] ^= 0x40
    first.write_bytes(bytes(raw))


def swap_shards(directory, pristine):
    a, b = (directory / f for f in files(_manifest(directory))[:2])
    tmp = directory / "swap"
    os.rename(a, tmp)
    os.rename(b, a)
    os.rename(tmp, b)


def shard_of_another_model(directory, pristine):
    """The same layout's file from a model trained from other values: same size, other bytes."""
    first = files(_manifest(directory))[0]
    other = pristine / "other" / "step_00000002"
    shutil.copy(other / files(_manifest(other))[0], directory / first)


def manifest_of_another_layout(directory, pristine):
    """The manifest of the same model and step saved at 4 ranks: its files are not these."""
    shutil.copy(pristine / "at4" / "step_00000002" / MANIFEST, directory / MANIFEST)


def pickle_manifest(directory, pristine):
    (directory / MANIFEST).write_bytes(pickle.dumps(Payload(str(directory.parent / "payload-ran"))))


class Payload:
    """Unpickling it creates a directory: proof that code from the file ran."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def _set(path, value):
    """An edit setting ``manifest[path[0]][path[1]]... = value``; a callable path item picks a key from the manifest."""
    def fn(manifest):
        node = manifest
        keys = [k(manifest) if callable(k) else k for k in path]
        for k in keys[:-1]:
            node = node[k]
        node[keys[-1]] = value
    return edit(fn)


def _optim_param(manifest):
    return sorted(manifest["json"]["optim"]["params"])[0]


M = r"step_00000002/manifest\.json"
SHARD = r"step_00000002/rank\d+[^ ]*\.bin"
TAMPERINGS = [
    Tampering("manifest truncated", truncate_manifest, M, r"not valid JSON \(.*line \d+ column \d+"),
    Tampering("manifest nested too deep", nest_manifest, M, r"not valid JSON \(nested deeper"),
    Tampering("manifest holds a pickle", pickle_manifest, M, r"not valid JSON"),
    Tampering("a tensor listed twice", duplicate_key(split_key), M, r"duplicate key 'model\.[^']+'"),
    Tampering("format", _set(["format"], "mpidist-checkpoint-9"), M, r"has format 'mpidist-checkpoint-9'"),
    Tampering("step of another checkpoint", _set(["step"], 7), M, r"step is 7 in the directory of step 2"),
    Tampering("commit not finite", _set(["commit"], 1e309), M, r"commit must be an int >= 0 \(got inf\)"),
    Tampering("commit a string", _set(["commit"], "3"), M, r"commit must be an int >= 0 \(got '3'\)"),
    Tampering("world_size zero", _set(["world_size"], 0), M, r"world_size must be an int >= 1"),
    Tampering("created not a time", _set(["created"], "yesterday"), M, r"created must be a finite number"),
    Tampering("file bytes negative", _set(["files", lambda m: files(m)[0], "bytes"], -1), M,
              r"files\['[^']+'\]\.bytes must be an int >= 0"),
    Tampering("file crc32 out of range", _set(["files", lambda m: files(m)[0], "crc32"], 1 << 40), M,
              r"files\['[^']+'\]\.crc32 must be an int >= 0 and < 4_294_967_296"),
    Tampering("file outside by ..", outside_copy(lambda d: "../escaped.bin"), M,
              r"files\['\.\./escaped\.bin'\] must be the plain name of a file"),
    Tampering("file by absolute path", outside_copy(lambda d: str(d.parent / "absolute.bin")), M,
              r"files\['/[^']*/absolute\.bin'\] must be the plain name"),
    Tampering("shard a symlink leaving the directory", symlink_shard_outside, M,
              r"files\['[^']+'\] names .*, a link to .*elsewhere\.bin, outside the checkpoint's directory"),
    Tampering("manifest a symlink leaving the directory", symlink_manifest_outside, M,
              r"is a link to .*manifest-elsewhere\.json, outside its directory"),
    Tampering("shard a fifo", fifo_shard, SHARD, r"is not a regular file \(.*files\['[^']+'\]\)"),
    Tampering("chunk names an unlisted file", _set(["tensors", split_key, "chunks", 0, "file"], "/etc/hostname"), M,
              r"tensors\['[^']+'\]\.chunks\[0\]\.file names '/etc/hostname', which the manifest's files do not list"),
    Tampering("chunk offset negative", _set(["tensors", split_key, "chunks", 0, "offset"], -8), M,
              r"tensors\['[^']+'\]\.chunks\[0\]\.offset must be an int >= 0"),
    Tampering("chunk offset past its file", _set(["tensors", split_key, "chunks", 0, "offset"], 10 ** 6), M,
              r"tensors\['[^']+'\]\.chunks\[0\]\.offset 1000000 \+ \d+ elements of 8 bytes reach byte"),
    Tampering("chunk offset a float", _set(["tensors", split_key, "chunks", 0, "offset"], 8.0), M,
              r"chunks\[0\]\.offset must be an int"),
    Tampering("chunk offsets of another rank", _set(["tensors", split_key, "chunks", 0, "offsets"], [0]), M,
              r"chunks\[0\]\.offsets must be a list of 2 ints"),
    Tampering("chunk sizes past the shape", _set(["tensors", split_key, "chunks", 0, "sizes"], [99, 99]), M,
              r"chunks\[0\] lies outside the tensor"),
    Tampering("chunk duplicated", edit(lambda m: m["tensors"][split_key(m)]["chunks"].append(dict(chunk(m)))), M,
              r"tensors\['[^']+'\]\.chunks\[0\] overlaps chunks\[\d+\]"),
    Tampering("chunk missing", edit(lambda m: m["tensors"][split_key(m)]["chunks"].pop()), M,
              r"tensors\['[^']+'\]\.chunks cover \d+ of the \d+ elements"),
    Tampering("chunk with an unknown field", _set(["tensors", split_key, "chunks", 0, "exec"], "rm -rf /"), M,
              r"chunks\[0\] must have the fields .*unknown: \['exec'\]"),
    Tampering("shape grown", _set(["tensors", split_key, "shape"], [6, 3]), M, r"tensors\['[^']+'\]\.chunks"),
    Tampering("shape a string", _set(["tensors", split_key, "shape"], "5x3"), M,
              r"tensors\['[^']+'\]\.shape must be a list of ints"),
    Tampering("dtype object", _set(["tensors", split_key, "dtype"], "|O"), M,
              r"tensors\['[^']+'\]\.dtype must name a number or bool dtype"),
    Tampering("dtype structured", _set(["tensors", split_key, "dtype"], "f8,i4"), M, r"\.dtype must name a number"),
    Tampering("lr a string", _set(["json", "optim", "param_groups", 0, "lr"], "fast"), M,
              r"json\['optim'\]\.param_groups\[0\]\.lr must be a number \(got 'fast'"),
    Tampering("lr NaN", _set(["json", "optim", "param_groups", 0, "lr"], {"__float__": "nan"}), M,
              r"json\['optim'\]\.param_groups\[0\]\.lr must be finite"),
    Tampering("betas of one", _set(["json", "optim", "param_groups", 0, "betas"], [0.9]), M,
              r"param_groups\[0\]\.betas must be a list of 2"),
    Tampering("optimizer step negative", _set(["json", "optim", "params", _optim_param, "scalars", "step"], -1), M,
              r"json\['optim'\]\.params\['[^']+'\]\.scalars\.step must be an int >= 0"),
    Tampering("optimizer arrays twice", _set(["json", "optim", "params", _optim_param, "arrays"],
                                             ["exp_avg", "exp_avg"]), M,
              r"json\['optim'\]\.params\['[^']+'\]\.arrays must be a list of distinct names"),
    Tampering("generator state garbage", edit(lambda m: [e.__setitem__("rng", {"__rng__": {"state": "x"}})
                                                         for e in per_rank_entries(m)]), M,
              r"json\['rng'\] does not restore into the state's Generator"),
    Tampering("schedule rate a string", edit(lambda m: [e["sched"]["__stateful__"].__setitem__("base_lrs", ["fast"])
                                                        for e in per_rank_entries(m)]), M,
              r"json\['sched'\] does not restore into the state's StepLR"),
    Tampering("sampler epoch negative", edit(lambda m: [e["sampler"]["__sampler__"].__setitem__("epoch", -2)
                                                        for e in per_rank_entries(m)]), M,
              r"json\['sampler'\]\.__sampler__\.epoch must be an int >= 0"),
    Tampering("json_per_rank of another world", edit(lambda m: m.__setitem__("json_per_rank", m["json_per_rank"][:1])),
              M, r"json_per_rank must be a list of 2 objects"),
    Tampering("an array of objects in the extras", edit(lambda m: [e.__setitem__(
        "extra", {"__array__": {"dtype": "|O", "shape": [1], "data": "AAAAAAAAAAA="}}) for e in per_rank_entries(m)]),
        M, r"json(_per_rank\[\d\])?\['extra'\]: __array__ dtype must name a number"),
    Tampering("shard truncated", truncate_shard, SHARD, r"truncated or altered: \d+ bytes on disk, manifest says \d+ "
                                                        r"\(.*files\['[^']+'\]\.bytes\)"),
    Tampering("shard byte flipped", flip_shard_byte, SHARD, r"checksum mismatch .*files\['[^']+'\]\.crc32"),
    Tampering("shards swapped", swap_shards, SHARD, r"files\['[^']+'\]\.(bytes|crc32)"),
    Tampering("shard of another model", shard_of_another_model, SHARD, r"checksum mismatch .*files\['[^']+'\]\.crc32"),
    Tampering("manifest of another layout", manifest_of_another_layout, r"step_00000002/rank0000\d",
              r"files\['rank0000\d[^']*'\]"),
]


@pytest.mark.world_sizes(1, 2, 4)  # the pristine checkpoint was saved at 2: loading at 1 and 4 reshards it
@pytest.mark.parametrize("tampering", TAMPERINGS, ids=repr)
def test_a_tampered_checkpoint_fails_naming_the_file_and_field_on_every_rank_and_changes_nothing(
        comm, tmp_path, pristine, tampering):
    root = pathlib.Path(shared(comm, tmp_path / "ckpt"))
    if comm.Get_rank() == 0:
        shutil.copytree(pristine / "run", root)
        tampering.damage(root / f"step_{tampering.step:08d}", pristine)
    comm.bcast(None if comm.Get_rank() else "damaged", root=0)
    state = make_state(comm, seed=7)
    before = snapshot(state)
    for step in (None, 2):  # found as the newest, and asked for by number
        with pytest.raises(CheckpointError) as caught:
            checkpoint.load(str(root), state, comm, step=step)
        message = str(caught.value)
        assert re.search(tampering.where, message), message
        assert re.search(tampering.field, message), message
        assert_bitwise_equal(snapshot(state), before)
    assert not (root / "payload-ran").exists()
    # The same state still loads the intact older checkpoint (and then differs from before).
    assert checkpoint.load(str(root), state, comm, step=1) == 1


def test_the_suite_has_at_least_25_distinct_tamperings():
    assert len({t.name for t in TAMPERINGS}) == len(TAMPERINGS) >= 25


# -- nothing executes: no pickle in any format, no reader that unpickles or evaluates ------------------------
UNSAFE_MODULES = {"pickle", "_pickle", "cPickle", "cloudpickle", "dill", "jsonpickle", "marshal", "shelve", "yaml"}
SIMULATOR = SOURCE / "comm" / "sim"  # carries mpi4py's object messages between simulated ranks in memory, no file


def unsafe_calls(path):
    """Return ``line: what`` for each import of a module that runs code when reading, and each call that does."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        modules = ([a.name for a in node.names] if isinstance(node, ast.Import)
                   else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        found += [f"{node.lineno}: imports {m}" for m in modules if m.split(".")[0] in UNSAFE_MODULES]
        if not isinstance(node, ast.Call):
            continue
        call = ast.unparse(node.func)
        if call in ("eval", "exec", "__import__", "importlib.import_module") and any(
                isinstance(a, ast.Constant) and str(a.value).split(".")[0] in UNSAFE_MODULES | {"os", "subprocess"}
                or call in ("eval", "exec") for a in node.args):
            found.append(f"{node.lineno}: {call}(...)")
        if "pickle" in call or call in ("yaml.load", "yaml.unsafe_load"):
            found.append(f"{node.lineno}: {call}(...)")
        for kw in node.keywords:
            if kw.arg == "allow_pickle" and not (isinstance(kw.value, ast.Constant) and kw.value.value is False):
                found.append(f"{node.lineno}: {call}(allow_pickle={ast.unparse(kw.value)})")
        if call.endswith("torch.load") and not any(kw.arg == "weights_only" and ast.unparse(kw.value) == "True"
                                                   for kw in node.keywords):
            found.append(f"{node.lineno}: {call}(...) without weights_only=True")
    return found


@pytest.mark.mpi_skip
def test_no_mpidist_module_unpickles_or_evaluates_what_it_reads(tmp_path):
    """Checkpoints, elastic states, flight records, traces and metrics: JSON and raw bytes, read without pickle."""
    problems = [f"{path.relative_to(SOURCE.parent)}:{line}" for path in sorted(SOURCE.rglob("*.py"))
                if SIMULATOR not in path.parents for line in unsafe_calls(path)]
    assert problems == []
    # The scan finds what it looks for (not a test that cannot fail).
    sample = tmp_path / "unsafe.py"
    sample.write_text("import pickle\nimport numpy as np\nnp.load('x', allow_pickle=True)\neval('1')\n"
                      "from yaml import load\nMPI.pickle.loads(b'')\nmodel.eval()\n")
    assert sorted(int(line.split(":")[0]) for line in unsafe_calls(sample)) == [1, 3, 4, 5, 6]


def pipeline_state(root, rng, extra):
    """A module-less State (one rank, real MPI) saving a disk checkpoint at every commit, and its build function."""
    from mpidist import elastic
    from mpidist.parallel import Pipeline

    def build(comm):
        model = make_model(0)
        return Pipeline(model, comm, 2, "1f1b", loss_fn=nn.CrossEntropyLoss())

    state = elastic.State(None, lambda params: optim.Adam(params, lr=0.01), lambda opt: optim.StepLR(opt, 2),
                          rngs=[rng], extra=extra, checkpoint=str(root), checkpoint_every=1)
    return state, build


def run_and_commit(state, build, comm, steps):
    pipe = state.start(build, comm) if state.wrapper is None else state.wrapper
    for step in range(state.step, state.step + steps):
        rng = np.random.default_rng([4, step])
        state.optimizer.zero_grad()
        pipe.step(rng.standard_normal((4, 3)), rng.integers(0, 2, 4))
        state.optimizer.step()
        state.scheduler.step()
        state.step += 1
        state.commit()


@pytest.mark.mpi_skip  # State asks MPI for world ranks: a real communicator of one rank
def test_a_pipeline_disk_checkpoint_holds_json_and_raw_bytes_and_restores_the_small_state(tmp_path):
    import types
    from mpi4py import MPI
    comm = MPI.COMM_SELF.Dup()
    try:
        rng = np.random.default_rng(5)
        extra = {"taken": [np.arange(3), np.arange(4.0)], "best": math.inf, "pair": (1, 2), "note": {"__float__": 1}}
        state, build = pipeline_state(tmp_path, rng, extra)
        run_and_commit(state, build, comm, 2)
        expected_draws, expected_lr = np.random.default_rng(5).__class__(rng.bit_generator.__class__()), None
        expected_draws.bit_generator.state = rng.bit_generator.state
        expected_lr = state.optimizer.lr
        text = (tmp_path / "step_00000002" / MANIFEST).read_text()
        json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
        # Lose everything in memory: the generator moves on, the extras change, the commits are gone.
        rng.random(5)
        state.extra["taken"].append(np.zeros(2))
        state.extra["best"] = 0.0
        failure = types.SimpleNamespace(restored_from=None)
        state._restore_from_disk(failure, build, comm, ["0.weight"])
        assert state.step == 2 and "disk checkpoint of step 2" in failure.restored_from
        assert rng.random() == expected_draws.random()
        assert state.optimizer.lr == expected_lr
        got = state.extra
        assert sorted(got) == ["best", "note", "pair", "taken"] and got["best"] == math.inf
        assert got["pair"] == [1, 2] and got["note"] == {"__float__": 1}  # tuples come back as lists, as with json
        assert [(a.dtype, a.tolist()) for a in got["taken"]] == [(np.dtype(int), [0, 1, 2]),
                                                                 (np.dtype(float), [0.0, 1.0, 2.0, 3.0])]
    finally:
        comm.Free()


@pytest.mark.mpi_skip
def test_a_pickle_payload_in_a_pipeline_checkpoint_is_refused_and_never_runs(tmp_path):
    """The format before this one kept the small state as a pickled string: such a state is refused unread."""
    import types
    from mpi4py import MPI
    comm = MPI.COMM_SELF.Dup()
    marker = tmp_path / "payload-ran"
    try:
        state, build = pipeline_state(tmp_path / "ckpt", np.random.default_rng(5), {})
        run_and_commit(state, build, comm, 1)
        directory = tmp_path / "ckpt" / "step_00000001"
        manifest = _manifest(directory)
        blob = base64.b64encode(pickle.dumps(Payload(str(marker)))).decode()
        for entries in per_rank_entries(manifest):
            entries["elastic"] = blob
        _write(directory, manifest)
        with pytest.raises(CheckpointError, match=r"json\['elastic'\] is a pickled state .* never unpickled"):
            state._restore_from_disk(types.SimpleNamespace(restored_from=None), build, comm, ["0.weight"])
        assert not marker.exists()
    finally:
        comm.Free()


def test_the_payload_would_run_if_unpickled(tmp_path):
    """The payload the tests above refuse does run code when unpickled (so they could fail)."""
    marker = tmp_path / "ran"
    pickle.loads(pickle.dumps(Payload(str(marker))))
    assert marker.is_dir()


# -- standard JSON ------------------------------------------------------------------------------------------
def test_saved_state_is_standard_json_and_non_finite_floats_come_back(comm, tmp_path):
    root = shared(comm, tmp_path)
    model = make_model(0)
    saved = {"best": math.inf, "worst": -math.inf, "loss": math.nan, "history": [1.5, math.nan],
             "looks_tagged": {"__float__": "nan"}, "pair": (1, 2)}
    checkpoint.save(root, {"model": model, "stats": saved}, comm, step=1)
    text = pathlib.Path(root, "step_00000001", MANIFEST).read_text()
    json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c} in the manifest"))
    state = {"model": make_model(1), "stats": None}
    assert checkpoint.load(root, state, comm) == 1
    got = state["stats"]
    assert got["best"] == math.inf and got["worst"] == -math.inf and math.isnan(got["loss"])
    assert got["history"][0] == 1.5 and math.isnan(got["history"][1])
    assert got["looks_tagged"] == {"__float__": "nan"} and got["pair"] == [1, 2]


def test_standard_json_round_trips_arrays_and_refuses_malformed_tags():
    value = {"a": np.arange(6, dtype=np.int32).reshape(2, 3), "s": np.float32(1.5), "z": np.zeros((0, 2)),
             "b": np.array([True, False]), "nan": math.nan, "nested": [{"__array__": 1}], 3: "three"}
    text = standard_json.dumps(value)
    back = standard_json.decode(json.loads(text, parse_constant=lambda c: pytest.fail(c)))
    assert back["a"].dtype == np.int32 and back["a"].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert type(back["s"]) is np.float32 and back["s"] == 1.5 and back["z"].shape == (0, 2)
    assert back["b"].tolist() == [True, False] and math.isnan(back["nan"])
    assert back["nested"] == [{"__array__": 1}] and back["3"] == "three"
    bad = [({"__array__": {"dtype": "|O", "shape": [1], "data": "AAAAAAAAAAA="}}, r"dtype must name a number"),
           ({"__array__": {"dtype": "<f8", "shape": [2], "data": "AAAAAAAAAAA="}}, r"holds 8 bytes, .* needs 16"),
           ({"__array__": {"dtype": "<f8", "shape": [-1], "data": ""}}, r"shape must be a list of ints >= 0"),
           ({"__array__": {"dtype": "<f8", "shape": [1], "data": "not base64!"}}, r"data must be base64"),
           ({"__float__": "1e999"}, r"__float__ must be 'nan', 'inf' or '-inf'")]
    for data, match in bad:
        with pytest.raises(ValueError, match=match):
            standard_json.decode({"x": data}, "value")
    with pytest.raises(TypeError, match=r"value\['f'\]: a function cannot be stored as JSON"):
        standard_json.encode({"f": lambda: 0})
    with pytest.raises(ValueError, match=r"duplicate key 'k'"):
        standard_json.loads('{"k": 1, "k": 2}')


# -- commit numbers, the newest checkpoint and falling back ---------------------------------------------------
@pytest.mark.parametrize("commit", [1e309, -1e309, 1e300, "7", 1.5, -3, True, None])
def test_a_commit_that_is_no_int_breaks_no_later_save_or_load(comm, tmp_path, commit):
    root = shared(comm, tmp_path)
    model, other = make_model(0), make_model(1)
    checkpoint.save(root, {"model": model}, comm, step=1)
    if comm.Get_rank() == 0:
        path = pathlib.Path(root, "step_00000001", MANIFEST)
        manifest = json.loads(path.read_text())
        manifest["commit"] = commit
        path.write_text(json.dumps(manifest))  # 1e309 is written as Infinity: what a hand edit could leave
    comm.Barrier()
    checkpoint.save(root, {"model": other}, comm, step=2, keep_last=None)  # no bare OverflowError
    assert checkpoint.list_steps(root) == [1, 2] and checkpoint.latest_step(root) == 2
    target = make_model(2)
    with pytest.raises(CheckpointError, match=r"cannot tell which checkpoint .* is the newest: 1 manifest\(s\) cannot "
                                              r"be read \(checkpoint: .*step_00000001/manifest\.json: commit must be an "
                                              r"int >= 0 .*pass fallback=True"):
        checkpoint.load(root, {"model": target}, comm)
    with pytest.warns(RuntimeWarning, match=r"passing over 1 unreadable manifest.*step_00000001/manifest\.json: commit") \
            if comm.Get_rank() == 0 else _no_warning():
        assert checkpoint.load(root, {"model": target}, comm, fallback=True) == 2
    for p, q in zip(target.parameters(), other.parameters()):
        assert p.data.tobytes() == q.data.tobytes()
    checkpoint.save(root, {"model": model}, comm, step=3, keep_last=1)  # pruning goes on too


class _no_warning:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def damage_newest_manifest(directory):
    text = (directory / MANIFEST).read_text()
    (directory / MANIFEST).write_text(text[:-10])


def damage_newest_field(directory):
    manifest = _manifest(directory)
    manifest["tensors"]["model.0.weight"]["chunks"][0]["offset"] = -1
    _write(directory, manifest)


def damage_newest_shard(directory):
    flip_shard_byte(directory, None)


@pytest.mark.parametrize("damage, field", [
    (damage_newest_manifest, r"step_00000002/manifest\.json.* not valid JSON"),
    (damage_newest_field, r"step_00000002/manifest\.json: tensors\['model\.0\.weight'\]\.chunks\[0\]\.offset"),
    (damage_newest_shard, r"checksum mismatch in .*step_00000002/.*files\['[^']+'\]\.crc32"),
], ids=["manifest not JSON", "manifest field", "shard"])
def test_a_damaged_newest_checkpoint_is_an_error_unless_fallback_loads_the_older_one_with_a_warning(
        comm, tmp_path, damage, field):
    root = shared(comm, tmp_path)
    first, second = make_model(0), make_model(1)
    checkpoint.save(root, {"model": first}, comm, step=1)
    checkpoint.save(root, {"model": second}, comm, step=2)
    if comm.Get_rank() == 0:
        damage(pathlib.Path(root, "step_00000002"))
    comm.Barrier()
    target = make_model(2)
    before = [p.data.copy() for p in target.parameters()]
    with pytest.raises(CheckpointError, match=field):  # silently loading step 1 would hide the loss of step 2
        checkpoint.load(root, {"model": target}, comm)
    assert all(p.data.tobytes() == b.tobytes() for p, b in zip(target.parameters(), before))
    with pytest.warns(RuntimeWarning, match=r"step_00000002") if comm.Get_rank() == 0 else _no_warning():
        assert checkpoint.load(root, {"model": target}, comm, fallback=True) == 1
    assert all(p.data.tobytes() == q.data.tobytes() for p, q in zip(target.parameters(), first.parameters()))
    with pytest.raises(CheckpointError, match=field):  # asked for by number: that step or an error
        checkpoint.load(root, {"model": target}, comm, step=2, fallback=True)


def test_fallback_must_be_a_bool(tmp_path):
    with pytest.raises(TypeError, match=r"checkpoint.load: fallback must be True or False \(got 'yes'\)"):
        mpidist.simulate(1, lambda comm: checkpoint.load(str(tmp_path), {}, comm, fallback="yes"))


# -- what stays allowed --------------------------------------------------------------------------------------
def to_flat_format(directory):
    """Rewrite a manifest in the older ``mpidist-checkpoint-1`` form: each chunk as a flat piece (start, count)."""
    manifest = _manifest(directory)
    manifest["format"] = "mpidist-checkpoint-1"
    for entry in manifest["tensors"].values():
        shape, pieces = entry["shape"], []
        for c in entry.pop("chunks"):
            inner = [d for d, (n, s) in enumerate(zip(c["sizes"], shape)) if n != s]
            assert all(c["sizes"][d] == 1 for d in inner[:-1]), "a chunk that is no flat range"
            start = int(np.ravel_multi_index(c["offsets"], shape)) if shape else 0
            pieces.append({"file": c["file"], "offset": c["offset"], "start": start, "count": math.prod(c["sizes"])})
        entry["pieces"] = pieces
    _write(directory, manifest)
    return manifest


@pytest.mark.world_sizes(1, 3)
def test_an_older_flat_format_checkpoint_loads_and_its_pieces_are_checked(comm, tmp_path, pristine):
    root = pathlib.Path(shared(comm, tmp_path / "ckpt"))
    if comm.Get_rank() == 0:
        shutil.copytree(pristine / "run", root)
        to_flat_format(root / "step_00000002")
    comm.Barrier()
    reference, state = make_state(comm, 7), make_state(comm, 7)
    checkpoint.load(str(pristine_for(comm, pristine)), reference, comm, step=2)
    assert checkpoint.load(str(root), state, comm, step=2) == 2
    assert_bitwise_equal(snapshot(state), snapshot(reference))
    if comm.Get_rank() == 0:
        manifest = _manifest(root / "step_00000002")
        manifest["tensors"]["model.0.weight"]["pieces"][0]["count"] = 10 ** 6
        _write(root / "step_00000002", manifest)
    comm.Barrier()
    with pytest.raises(CheckpointError, match=r"manifest\.json: tensors\['model\.0\.weight'\]\.pieces\[0\] covers "
                                              r"elements \[\d+, \d+\) of a tensor of 15"):
        checkpoint.load(str(root), state, comm, step=2)


def pristine_for(comm, pristine):
    return pathlib.Path(shared(comm, pristine)) / "run"


def test_a_symlink_to_a_file_inside_the_checkpoint_is_followed(comm, tmp_path, pristine):
    root = pathlib.Path(shared(comm, tmp_path / "ckpt"))
    if comm.Get_rank() == 0:
        shutil.copytree(pristine / "run", root)
        directory = root / "step_00000002"
        first = files(_manifest(directory))[0]
        os.rename(directory / first, directory / "moved.bin")
        os.symlink("moved.bin", directory / first)
    comm.Barrier()
    reference, state = make_state(comm, 7), make_state(comm, 7)
    checkpoint.load(str(pristine_for(comm, pristine)), reference, comm, step=2)
    assert checkpoint.load(str(root), state, comm) == 2
    assert_bitwise_equal(snapshot(state), snapshot(reference))


@pytest.mark.mpi_skip
def test_a_flight_record_that_is_no_json_object_is_refused_naming_it(tmp_path):
    from mpidist.guard import flight
    (tmp_path / "rank00000.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"rank00000\.json is not a flight record \(a JSON list, expected format"):
        flight.load(str(tmp_path))
