"""Checkpoints: round trips, resharding across world sizes, atomicity and clear errors."""

import json
import os
import re

import numpy as np
import pytest

import mpidist
from mpidist import checkpoint, nn, optim
from mpidist.checkpoint import CheckpointError
from mpidist.data import DistributedSampler
from mpidist.parallel.ddp import DDP
from mpidist.parallel.interface import Wrapper


def make_model(seed=0):
    rng = np.random.default_rng(seed)
    # Prime sizes: no shard of any world size divides them evenly.
    return nn.Sequential(nn.Linear(7, 11, rng=rng, dtype=np.float64), nn.Tanh(),
                         nn.Linear(11, 13, rng=rng, dtype=np.float64), nn.LayerNorm(13, dtype=np.float64),
                         nn.Linear(13, 3, rng=rng, dtype=np.float64))


def batch(step, n=12):
    rng = np.random.default_rng([9, step])
    return rng.standard_normal((n, 7)), rng.integers(0, 3, size=n)


def train(model, opt, steps, start=0, comm=None):
    crit = nn.CrossEntropyLoss()
    for step in range(start, start + steps):
        x, y = batch(step)
        if comm is not None:
            per = len(x) // comm.Get_size()
            x, y = x[comm.Get_rank() * per:(comm.Get_rank() + 1) * per], y[comm.Get_rank() * per:(comm.Get_rank() + 1) * per]
        opt.zero_grad()
        crit(model(x), y).backward()
        opt.step()


def shared_dir(comm, tmp_path):
    """Return one directory every rank sees (rank 0's tmp_path under MPI)."""
    return comm.bcast(str(tmp_path) if comm.Get_rank() == 0 else None, root=0)


def full_params(model):
    return {k: v.copy() for k, v in model.state_dict().items()}


def test_round_trip_ddp_with_everything(comm, tmp_path):
    root = shared_dir(comm, tmp_path)
    ddp = DDP(make_model(), comm)
    opt = optim.Adam(ddp.parameters(), lr=0.01)
    sampler = DistributedSampler(100, comm, seed=3)
    sampler.set_epoch(4)
    rng = np.random.default_rng(5)
    rng.random(7)
    train(ddp, opt, 3, comm=comm)
    schedule = optim.StepLR(opt, step_size=2, gamma=0.5)
    for _ in range(3):
        schedule.step()
    state = {"model": ddp, "optim": opt, "sampler": sampler, "rng": rng, "step": 3, "extra": {"note": "hi"},
             "schedule": schedule}
    checkpoint.save(root, state, comm, step=3)
    expected_params, expected_opt = full_params(ddp), opt.state_dict()
    expected_draw = np.random.default_rng(5)
    expected_draw.random(7)

    fresh = DDP(make_model(seed=1), comm)
    fresh_opt = optim.Adam(fresh.parameters(), lr=0.5)
    fresh_sampler = DistributedSampler(100, comm, seed=3)
    fresh_rng = np.random.default_rng(0)
    fresh_schedule = optim.StepLR(fresh_opt, step_size=2, gamma=0.5)
    new_state = {"model": fresh, "optim": fresh_opt, "sampler": fresh_sampler, "rng": fresh_rng, "step": 0, "extra": None,
                 "schedule": fresh_schedule}
    assert checkpoint.load(root, new_state, comm) == 3
    assert fresh_schedule.last_epoch == 3 and fresh_schedule.get_last_lr() == [0.01 * 0.5] == schedule.get_last_lr()
    for k, v in expected_params.items():
        np.testing.assert_array_equal(fresh.state_dict()[k], v)
    got_opt = fresh_opt.state_dict()
    assert got_opt["param_groups"] == expected_opt["param_groups"]
    for i, s in expected_opt["state"].items():
        for k, v in s.items():
            np.testing.assert_array_equal(got_opt["state"][i][k], v)
    assert fresh_sampler.epoch == 4
    assert fresh_rng.random() == expected_draw.random()
    assert new_state["step"] == 3 and new_state["extra"] == {"note": "hi"}

    # Continuing from the checkpoint equals never having stopped.
    train(ddp, opt, 2, start=3, comm=comm)
    train(fresh, fresh_opt, 2, start=3, comm=comm)
    for k, v in full_params(ddp).items():
        np.testing.assert_array_equal(fresh.state_dict()[k], v)


def test_keep_last_and_latest(comm, tmp_path):
    root = shared_dir(comm, tmp_path)
    model = make_model()
    for step in (2, 4, 6, 8):
        checkpoint.save(root, {"model": model}, comm, step=step, keep_last=2)
    assert checkpoint.list_steps(root) == [6, 8]
    assert checkpoint.latest_step(root) == 8
    assert checkpoint.load(os.path.join(root, "nothing-here"), {"model": model}, comm) is None


def train_and_save_fsdp(comm, root):
    """Train an FSDP model 3 Adam steps on ``comm`` and checkpoint it as step 3; return its full state dict."""
    from mpidist.parallel.fsdp import FSDP
    fsdp = FSDP(make_model(), comm)
    opt = optim.Adam(fsdp.parameters(), lr=0.01)
    train(fsdp, opt, 3, comm=comm)
    checkpoint.save(root, {"model": fsdp, "optim": opt}, comm, step=3)
    return fsdp.full_state_dict()


@pytest.mark.mpi_skip
@pytest.mark.parametrize("load_size", [1, 2, 3, 4])
def test_reshard_fsdp_saved_at_4(tmp_path, load_size):
    from mpidist.parallel.fsdp import FSDP
    root = str(tmp_path)

    reference = mpidist.simulate(4, train_and_save_fsdp, root)[0]

    def load(comm, root):
        fsdp = FSDP(make_model(seed=8), comm)
        opt = optim.Adam(fsdp.parameters(), lr=0.01)
        checkpoint.load(root, {"model": fsdp, "optim": opt}, comm)
        return fsdp.full_state_dict()

    full = mpidist.simulate(load_size, load, root)[0]
    for k, v in reference.items():
        np.testing.assert_array_equal(full[k], v)


@pytest.mark.mpi_skip
@pytest.mark.parametrize("load_size", [1, 3])
def test_fsdp_optimizer_state_reshards_bitwise(tmp_path, load_size):
    """Saved at 4 and continued at ``load_size`` equals a plain single-process run continued (same batches)."""
    from mpidist.parallel.fsdp import FSDP
    root = str(tmp_path)

    mpidist.simulate(4, train_and_save_fsdp, root)
    # Load the FSDP checkpoint into a plain model + Adam (world of one): layout-independent keys.
    plain = make_model(seed=5)
    plain_opt = optim.Adam(plain.parameters(), lr=0.01)
    mpidist.simulate(1, lambda comm: checkpoint.load(root, {"model": plain, "optim": plain_opt}, comm))
    reference = make_model()
    ref_opt = optim.Adam(reference.parameters(), lr=0.01)
    train(reference, ref_opt, 3)
    for k, v in reference.state_dict().items():
        np.testing.assert_allclose(plain.state_dict()[k], v, rtol=0, atol=1e-12)
    ref_state, got_state = ref_opt.state_dict()["state"], plain_opt.state_dict()["state"]
    for i in ref_state:
        for k in ("exp_avg", "exp_avg_sq"):
            np.testing.assert_allclose(got_state[i][k], ref_state[i][k], rtol=0, atol=1e-12)
        assert got_state[i]["step"] == ref_state[i]["step"]

    def resume(comm, root):
        fsdp = FSDP(make_model(seed=8), comm)
        opt = optim.Adam(fsdp.parameters(), lr=0.01)
        checkpoint.load(root, {"model": fsdp, "optim": opt}, comm)
        train(fsdp, opt, 2, start=3, comm=comm)
        return fsdp.full_state_dict()

    got = mpidist.simulate(load_size, resume, root)[0]
    train(plain, plain_opt, 2, start=3)
    for k, v in plain.state_dict().items():
        np.testing.assert_allclose(got[k], v, rtol=0, atol=1e-10)


@pytest.mark.mpi_skip
def test_failure_in_the_middle_of_a_save_keeps_the_previous_checkpoint(tmp_path):
    root = str(tmp_path)
    model = make_model()
    mpidist.simulate(3, lambda comm: checkpoint.save(root, {"model": model}, comm, step=2))

    def disk_full(operation, path):
        if operation == "write":  # after the first part of rank 1's file reached its temporary name
            raise OSError("disk full (injected)")

    def save_failing_on_rank_1(comm):
        with checkpoint.file_operation_hook(disk_full if comm.Get_rank() == 1 else None):
            checkpoint.save(root, {"model": model}, comm, step=4)

    with pytest.raises(CheckpointError, match=r"rank 1: OSError: disk full \(injected\)"):
        mpidist.simulate(3, save_failing_on_rank_1)
    assert checkpoint.list_steps(root) == [2]
    fresh = make_model(seed=3)
    assert mpidist.simulate(2, lambda comm: checkpoint.load(root, {"model": fresh}, comm)) == [2, 2]
    for k, v in model.state_dict().items():
        np.testing.assert_array_equal(fresh.state_dict()[k], v)
    mpidist.simulate(3, lambda comm: checkpoint.save(root, {"model": model}, comm, step=4))
    assert checkpoint.list_steps(root) == [2, 4]


@pytest.mark.mpi_skip
def test_clear_errors(tmp_path):
    root = str(tmp_path)
    model = make_model()
    mpidist.simulate(2, lambda comm: checkpoint.save(root, {"model": model}, comm, step=1))
    directory = os.path.join(root, "step_00000001")

    def load_into(target):
        return mpidist.simulate(2, lambda comm: checkpoint.load(root, {"model": target}, comm))

    # manifest from another model
    other = nn.Sequential(nn.Linear(7, 5, dtype=np.float64))
    with pytest.raises(CheckpointError, match=r"does not match this state.*'model.0.weight' has shape \(11, 7\) in the checkpoint, \(5, 7\) in the model"):
        load_into(other)
    # checksum mismatch
    rank1 = next(f for f in json.load(open(os.path.join(directory, "manifest.json")))["files"] if f.startswith("rank00001."))
    path = os.path.join(directory, rank1)
    raw = bytearray(open(path, "rb").read())
    raw[3] ^= 0xFF
    open(path, "wb").write(bytes(raw))
    with pytest.raises(CheckpointError, match=rf"checksum mismatch in .*{re.escape(rank1)}"):
        load_into(make_model())
    # truncated file
    open(path, "wb").write(bytes(raw[:-8]))
    with pytest.raises(CheckpointError, match=rf"{re.escape(rank1)} is truncated or altered: \d+ bytes on disk, manifest says \d+"):
        load_into(make_model())
    # missing shard
    os.remove(path)
    with pytest.raises(CheckpointError, match=rf"missing shard file .*{re.escape(rank1)}"):
        load_into(make_model())
    # not a checkpoint
    with pytest.raises(CheckpointError, match=r"no manifest at"):
        mpidist.simulate(1, lambda comm: checkpoint.load(root, {"model": model}, comm, step=7))
    manifest = json.load(open(os.path.join(directory, "manifest.json")))
    assert manifest["world_size"] == 2 and manifest["step"] == 1


@pytest.mark.mpi_skip
@pytest.mark.parametrize("load_size", [1, 2, 3])
def test_fsdp_saved_at_4_resharded_to_n_keeps_optimizer_state_bitwise(tmp_path, load_size):
    """4 ranks save; N ranks load and save again; both checkpoints hold bit-identical params and Adam state."""
    from mpidist.parallel.fsdp import FSDP
    first, second = str(tmp_path / "at4"), str(tmp_path / f"at{load_size}")

    def reshard(comm):
        fsdp = FSDP(make_model(seed=8), comm)
        opt = optim.Adam(fsdp.parameters(), lr=0.5)
        checkpoint.load(first, {"model": fsdp, "optim": opt}, comm)
        checkpoint.save(second, {"model": fsdp, "optim": opt}, comm, step=3)

    mpidist.simulate(4, train_and_save_fsdp, first)
    mpidist.simulate(load_size, reshard)

    def read(root):
        model = make_model(seed=2)
        opt = optim.Adam(model.parameters(), lr=0.1)
        mpidist.simulate(1, lambda comm: checkpoint.load(root, {"model": model, "optim": opt}, comm))
        return model.state_dict(), opt.state_dict()

    (p1, o1), (p2, o2) = read(first), read(second)
    for k in p1:
        assert (p1[k] == p2[k]).all(), k
    assert o1["param_groups"] == o2["param_groups"]
    for i in o1["state"]:
        for k, v in o1["state"][i].items():
            assert np.array_equal(v, o2["state"][i][k]), (i, k)


@pytest.mark.mpi_skip
def test_resaving_a_step_that_crashes_before_commit_keeps_its_previous_save(tmp_path):
    root = str(tmp_path)
    model = make_model()
    for step in (4, 6):
        mpidist.simulate(2, lambda comm, s=step: checkpoint.save(root, {"model": model}, comm, step=s))
    saved6 = {k: v.copy() for k, v in model.state_dict().items()}
    for p in model.parameters():
        p.data += 1.0

    def power_cut_at_commit(operation, path):
        if operation == "create" and path.startswith(os.path.join(root, "step_00000006", "manifest.json")):
            raise OSError("power cut (injected)")

    def save_again(comm):
        with checkpoint.file_operation_hook(power_cut_at_commit):
            checkpoint.save(root, {"model": model}, comm, step=6)

    with pytest.raises(CheckpointError, match="power cut"):
        mpidist.simulate(2, save_again)
    # Both ranks' new files are complete; until a manifest lists them, step 6 is the one saved before.
    assert checkpoint.list_steps(root) == [4, 6]
    fresh = make_model(seed=3)
    assert mpidist.simulate(2, lambda comm: checkpoint.load(root, {"model": fresh}, comm)) == [6, 6]
    for k, v in saved6.items():
        np.testing.assert_array_equal(fresh.state_dict()[k], v)
    mpidist.simulate(2, lambda comm: checkpoint.save(root, {"model": model}, comm, step=6))  # and then saved whole
    assert mpidist.simulate(1, lambda comm: checkpoint.load(root, {"model": fresh}, comm)) == [6]
    for k, v in model.state_dict().items():
        np.testing.assert_array_equal(fresh.state_dict()[k], v)
    # Only the third commit's files are left (steps 4 and 6 were commits 1 and 2; the failed save committed nothing).
    assert sorted(os.listdir(os.path.join(root, "step_00000006"))) == ["manifest.json", "rank00000.commit3.bin",
                                                                        "rank00001.commit3.bin"]


@pytest.mark.mpi_skip
def test_failed_load_changes_nothing(tmp_path):
    root = str(tmp_path)
    small = nn.Sequential(nn.Linear(7, 5, dtype=np.float64))
    small_opt = optim.Adam(list(small.parameters()), lr=0.01)
    mpidist.simulate(1, lambda comm: checkpoint.save(root, {"model": small, "optim": small_opt}, comm, step=1))
    model = make_model()
    opt = optim.Adam(list(model.parameters()), lr=0.01)
    train(model, opt, 2)
    params = {k: v.copy() for k, v in model.state_dict().items()}
    opt_state = opt.state_dict()
    # Named by the parameters that differ, not by the optimizer state that cannot fit either.
    with pytest.raises(CheckpointError, match=r"does not match this state.*'model.0.weight' has shape \(5, 7\) in "
                                              r"the checkpoint, \(11, 7\) in the model; .*'model.2.weight' missing"):
        mpidist.simulate(1, lambda comm: checkpoint.load(root, {"model": model, "optim": opt}, comm))
    with pytest.raises(CheckpointError, match=r"does not match this state.*'model.0.weight' has shape \(5, 7\) in the checkpoint"):
        mpidist.simulate(1, lambda comm: checkpoint.load(root, {"model": model}, comm))
    for k, v in params.items():
        np.testing.assert_array_equal(model.state_dict()[k], v)
    after = opt.state_dict()
    assert after["param_groups"] == opt_state["param_groups"]
    for i, s in opt_state["state"].items():
        for k, v in s.items():
            np.testing.assert_array_equal(after["state"][i][k], v)


@pytest.mark.mpi_skip
def test_latest_is_the_most_recent_commit_after_a_rollback_whatever_the_file_times(tmp_path):
    root = str(tmp_path)
    model = make_model()
    for step in (2, 4, 6):
        mpidist.simulate(1, lambda comm, s=step: checkpoint.save(root, {"model": model}, comm, step=s, keep_last=3))
    # Rolled back to step 4 and trained on: the new step-5 checkpoint is the one to resume from, and
    # pruning removes the least recently committed, not the highest step.
    mpidist.simulate(1, lambda comm: checkpoint.save(root, {"model": model}, comm, step=5, keep_last=3))
    commit_order = [4, 6, 5]  # the reference: the order this test committed them in
    assert checkpoint.list_steps(root) == [4, 5, 6]
    # File times say nothing about that order (a copy, a restore from backup, a clock step, a 1 s
    # file-system granularity): make them claim the opposite of the commit order.
    for age, step in enumerate(commit_order):
        directory = os.path.join(root, f"step_{step:08d}")
        for name in os.listdir(directory):
            os.utime(os.path.join(directory, name), (2_000_000_000 - 1000 * age,) * 2)
        os.utime(directory, (2_000_000_000 - 1000 * age,) * 2)
    assert checkpoint.latest_step(root) == commit_order[-1]
    fresh = make_model(seed=3)
    assert mpidist.simulate(1, lambda comm: checkpoint.load(root, {"model": fresh}, comm)) == [5]
    mpidist.simulate(1, lambda comm: checkpoint.save(root, {"model": model}, comm, step=8, keep_last=2))
    assert checkpoint.list_steps(root) == [5, 8] and checkpoint.latest_step(root) == 8


def leftovers(root):
    """Return the paths under ``root`` that no committed checkpoint accounts for."""
    found = []
    for directory, _, files in os.walk(root):
        committed = os.path.exists(os.path.join(directory, "manifest.json"))
        found += [os.path.join(directory, f) for f in files if ".tmp." in f or not committed]
    return sorted(found)


@pytest.mark.mpi_skip
def test_a_failed_save_leaves_no_temporary_files_and_the_next_save_clears_older_ones(tmp_path, monkeypatch):
    root = str(tmp_path)
    model = make_model()
    mpidist.simulate(3, lambda comm: checkpoint.save(root, {"model": model}, comm, step=2))
    real_write = checkpoint._write_rank_file

    def disk_full_midway(path, pieces):
        if os.path.basename(path).startswith(("rank00001.", "rank00002.")):
            def chunks():
                yield b"half a file"
                raise OSError(28, "No space left on device (injected)")
            checkpoint._write_atomic(path, chunks())
        return real_write(path, pieces)

    monkeypatch.setattr(checkpoint, "_write_rank_file", disk_full_midway)
    with pytest.raises(CheckpointError, match=r"No space left on device \(injected\)"):
        mpidist.simulate(3, lambda comm: checkpoint.save(root, {"model": model}, comm, step=4))
    assert [p for p in leftovers(root) if ".tmp." in p] == []
    assert checkpoint.list_steps(root) == [2]
    monkeypatch.setattr(checkpoint, "_write_rank_file", real_write)

    # What a killed save leaves (a process cannot clean up after SIGKILL): temporary files beside a
    # committed checkpoint, and a step directory that never got its manifest (step 4's rank 0 file above).
    for stale in ("step_00000002/rank00001.bin.tmp.4242", "step_00000002/manifest.json.tmp.4242",
                  "step_00000003/rank00000.bin.tmp.4242"):
        os.makedirs(os.path.dirname(os.path.join(root, stale)), exist_ok=True)
        open(os.path.join(root, stale), "wb").write(b"x" * 100)
    assert len(leftovers(root)) == 4
    mpidist.simulate(2, lambda comm: checkpoint.save(root, {"model": model}, comm, step=6))
    assert leftovers(root) == []
    assert sorted(os.listdir(root)) == ["step_00000002", "step_00000006"]
    fresh = make_model(seed=3)
    assert mpidist.simulate(2, lambda comm: checkpoint.load(root, {"model": fresh}, comm, step=2)) == [2, 2]
    for k, v in model.state_dict().items():
        np.testing.assert_array_equal(fresh.state_dict()[k], v)


@pytest.mark.mpi_skip
def test_the_same_failure_on_several_ranks_is_reported_once_naming_them(tmp_path, monkeypatch):
    def disk_full(path, pieces):
        raise OSError(28, "No space left on device (injected)")

    monkeypatch.setattr(checkpoint, "_write_rank_file", disk_full)
    with pytest.raises(CheckpointError) as caught:
        mpidist.simulate(3, lambda comm: checkpoint.save(str(tmp_path), {"model": make_model()}, comm, step=4))
    assert str(caught.value).split("\n")[0].endswith(
        "checkpoint save of step 4 (writing rank files) failed: ranks 0,1,2: OSError: [Errno 28] No space left on "
        "device (injected)")


@pytest.fixture
def read_only_dir(tmp_path):
    """Return a directory no rank can write to (a 0o555 directory; as root, which ignores modes, read-only sysfs)."""
    path = tmp_path / "read-only"
    path.mkdir()
    path.chmod(0o555)
    try:
        (path / "probe").write_bytes(b"")
    except OSError:
        yield str(path)
    else:
        (path / "probe").unlink()
        try:
            os.remove(open("/sys/kernel/mpidist-probe", "wb").name)
        except OSError:
            yield "/sys/kernel"
        else:
            pytest.skip("running as root and no read-only file system to test on")
    finally:
        path.chmod(0o755)


@pytest.mark.mpi_skip
def test_an_unwritable_checkpoint_directory_fails_before_training_naming_the_path(tmp_path, read_only_dir):
    with pytest.raises(CheckpointError, match=rf"checkpoint directory check failed: ranks 0,1: CheckpointError: "
                                              rf"checkpoint directory '{read_only_dir}' is not writable \("):
        mpidist.simulate(2, lambda comm: checkpoint.check_writable(read_only_dir, comm))
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory")
    with pytest.raises(CheckpointError, match=rf"checkpoint directory '{a_file / 'ckpt'}' is not writable"):
        mpidist.simulate(2, lambda comm: checkpoint.check_writable(str(a_file / "ckpt"), comm))
    created = tmp_path / "new" / "ckpt"
    mpidist.simulate(2, lambda comm: checkpoint.check_writable(str(created), comm))
    assert created.is_dir() and os.listdir(created) == []  # created, and the probes are gone


@pytest.mark.mpi_skip
def test_a_path_without_a_checkpoint_says_starting_from_scratch_once(tmp_path, capsys):
    model = make_model()
    missing = tmp_path / "typo"
    assert mpidist.simulate(3, lambda comm: checkpoint.load(str(missing), {"model": model}, comm)) == [None] * 3
    out = capsys.readouterr().out
    assert out == f"checkpoint: {missing} does not exist yet: starting from scratch\n"
    os.makedirs(missing / "step_00000004")  # a save that never committed
    lines = []
    mpidist.simulate(2, lambda comm: checkpoint.load(str(missing), {"model": model}, comm, log=lines.append))
    assert lines == [f"checkpoint: no checkpoint in {missing} (1 step directories without a manifest: saves that "
                     f"never finished): starting from scratch"]
    mpidist.simulate(2, lambda comm: checkpoint.save(str(tmp_path), {"model": model}, comm, step=3))
    step_dir = tmp_path / "step_00000003"
    with pytest.raises(CheckpointError, match=rf"{step_dir} is a single checkpoint .* pass the directory that holds "
                                              rf"the step_\* directories: {tmp_path}\n"):
        mpidist.simulate(2, lambda comm: checkpoint.load(str(step_dir), {"model": model}, comm))
    assert capsys.readouterr().out == ""


# -- pipelines: keys are the unsplit model's parameter names, whatever the number of stages ----------
# Layer bounds of make_model's 5 layers (Linear, Tanh, Linear, LayerNorm, Linear) per number of stages;
# every stage holds parameters, so every rank has an optimizer.
STAGE_BOUNDS = {2: [0, 2, 5], 3: [0, 2, 4, 5], 4: [0, 2, 3, 4, 5]}


def pipeline_on(comm, seed):
    """Return (pipeline, Adam, first layer index) of make_model(seed) split into comm's size stages."""
    from mpidist.parallel.pipeline import Pipeline
    bounds, rank = STAGE_BOUNDS[comm.Get_size()], comm.Get_rank()
    layers = list(make_model(seed))[bounds[rank]:bounds[rank + 1]]
    stage = nn.Sequential(*layers)
    pipe = Pipeline(stage, comm, num_microbatches=3, schedule="1f1b", loss_fn=nn.CrossEntropyLoss())
    return pipe, optim.Adam(list(stage.parameters()), lr=0.01), stage, bounds[rank]


def train_pipeline(comm, pipe, opt, stage, steps, start):
    last = comm.Get_size() - 1
    for step in range(start, start + steps):
        x, y = batch(step)
        opt.zero_grad()
        pipe.step(x if comm.Get_rank() == 0 else None, y if comm.Get_rank() == last else None)
        opt.step()


def gathered(comm, stage, first):
    """The whole model's parameters on rank 0 under make_model's names (from the stage bounds, not the pipeline)."""
    mine = {}
    for key, value in stage.state_dict().items():
        index, rest = key.split(".", 1)
        mine[f"{first + int(index)}.{rest}"] = value.copy()
    parts = comm.gather(mine, root=0)
    return {k: v for part in parts for k, v in part.items()} if comm.Get_rank() == 0 else None


@pytest.mark.mpi_skip
@pytest.mark.parametrize("load_stages", [1, 3, 4])
def test_pipeline_checkpoint_saved_with_2_stages_loads_with_any_number_of_stages(tmp_path, load_stages):
    root = str(tmp_path)

    def save(comm):
        pipe, opt, stage, first = pipeline_on(comm, seed=0)
        train_pipeline(comm, pipe, opt, stage, 3, start=0)
        checkpoint.save(root, {"model": pipe, "optim": opt, "step": 3}, comm, step=3)
        return gathered(comm, stage, first)

    saved = mpidist.simulate(2, save)[0]
    # The reference: one process, the unsplit model, the same 5 full batches.
    reference = make_model()
    ref_opt = optim.Adam(reference.parameters(), lr=0.01)
    train(reference, ref_opt, 5)

    if load_stages == 1:  # into the plain model
        plain = make_model(seed=7)
        plain_opt = optim.Adam(plain.parameters(), lr=0.01)
        mpidist.simulate(1, lambda comm: checkpoint.load(root, {"model": plain, "optim": plain_opt}, comm))
        loaded = plain.state_dict()
        train(plain, plain_opt, 2, start=3)
        final = plain.state_dict()
    else:
        def resume(comm):
            pipe, opt, stage, first = pipeline_on(comm, seed=7)
            state = {"model": pipe, "optim": opt, "step": 0}
            assert checkpoint.load(root, state, comm) == 3 and state["step"] == 3
            at_load = gathered(comm, stage, first)
            train_pipeline(comm, pipe, opt, stage, 2, start=3)
            return at_load, gathered(comm, stage, first)
        loaded, final = mpidist.simulate(load_stages, resume)[0]
    assert loaded.keys() == saved.keys() == reference.state_dict().keys()
    for k, v in saved.items():
        np.testing.assert_array_equal(loaded[k], v)  # parameters bit for bit
    for k, v in reference.state_dict().items():  # and Adam's moments: training goes on as in one process
        np.testing.assert_allclose(final[k], v, rtol=0, atol=1e-10, err_msg=k)


@pytest.mark.mpi_skip
def test_pipeline_checkpoint_into_a_different_model_names_the_parameter(tmp_path):
    root = str(tmp_path)

    def save(comm):
        pipe, opt, _, _ = pipeline_on(comm, seed=0)
        checkpoint.save(root, {"model": pipe, "optim": opt}, comm, step=1)

    mpidist.simulate(2, save)
    rng = np.random.default_rng(0)
    wider = nn.Sequential(nn.Linear(7, 11, rng=rng, dtype=np.float64), nn.Tanh(),
                          nn.Linear(11, 17, rng=rng, dtype=np.float64), nn.LayerNorm(17, dtype=np.float64),
                          nn.Linear(17, 3, rng=rng, dtype=np.float64), nn.Tanh(), nn.Linear(3, 3, dtype=np.float64))
    opt = optim.Adam(wider.parameters(), lr=0.01)
    with pytest.raises(CheckpointError, match=r"does not match this state \(from another model\?\): 'model.2.weight' "
                                              r"has shape \(13, 11\) in the checkpoint, \(17, 11\) in the model; .*"
                                              r"'model.6.weight' missing"):
        mpidist.simulate(1, lambda comm: checkpoint.load(root, {"model": wider, "optim": opt}, comm))


class TiedModel(nn.Module):
    """Embedding, a hidden layer and a head whose weight is the embedding's (one Parameter, two units)."""

    def __init__(self, seed=0):
        super().__init__()
        rng = np.random.default_rng(seed)
        self.emb = nn.Embedding(13, 5, rng=rng, dtype=np.float64)
        self.hidden = nn.Linear(5, 5, rng=rng, dtype=np.float64)
        self.head = nn.Linear(5, 13, bias=False, dtype=np.float64)
        self.head.weight = self.emb.weight

    def forward(self, tokens):
        return self.head(nn.functional.tanh(self.hidden(self.emb(tokens))))


def train_tied(model, opt, steps, comm=None):
    crit = nn.CrossEntropyLoss()
    for step in range(steps):
        rng = np.random.default_rng([4, step])
        x, y = rng.integers(0, 13, 12), rng.integers(0, 13, 12)
        if comm is not None:
            per = len(x) // comm.Get_size()
            x, y = x[comm.Get_rank() * per:(comm.Get_rank() + 1) * per], y[comm.Get_rank() * per:(comm.Get_rank() + 1) * per]
        crit(model(x), y).backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.mpi_skip
@pytest.mark.parametrize("load_size, strategy, grouping", [(1, "full_shard", "one_unit"), (2, "no_shard", "per_layer"),
                                                           (4, "shard_grad_op", "one_unit"), (4, "full_shard", "per_layer")])
def test_fsdp_with_tied_weights_reshards_to_other_sizes_strategies_and_units(tmp_path, load_size, strategy, grouping):
    """Keys name parameters, not units: any world size, strategy or unit choice loads; training goes on as in one process."""
    from mpidist.parallel.fsdp import FSDP
    root = str(tmp_path)

    def units(model, grouping):
        return [model] if grouping == "one_unit" else [model.emb, model.hidden, model.head]

    def save(comm):
        model = TiedModel()
        fsdp = FSDP(model, comm, units=units(model, "per_layer"))
        opt = optim.Adam(fsdp.parameters(), lr=0.01)
        train_tied(fsdp, opt, 3, comm)
        checkpoint.save(root, {"model": fsdp, "optim": opt}, comm, step=3)

    mpidist.simulate(3, save)

    def resume(comm):
        model = TiedModel(seed=9)
        fsdp = FSDP(model, comm, strategy=strategy, units=units(model, grouping))
        opt = optim.Adam(fsdp.parameters(), lr=0.01)
        checkpoint.load(root, {"model": fsdp, "optim": opt}, comm)
        train_tied(fsdp, opt, 2, comm)
        return fsdp.full_state_dict()

    got = mpidist.simulate(load_size, resume)[0]
    reference = TiedModel()
    ref_opt = optim.Adam(reference.parameters(), lr=0.01)
    train_tied(reference, ref_opt, 3)
    train_tied(reference, ref_opt, 2)
    assert list(got) == list(reference.state_dict()) == ["emb.weight", "hidden.weight", "hidden.bias"]
    for k, v in reference.state_dict().items():
        np.testing.assert_allclose(got[k], v, rtol=0, atol=1e-10, err_msg=k)


class PublicOnly(Wrapper):
    """Stand-in for an FSDP that answers the Wrapper interface and refuses every other attribute: what checkpoint
    may use is that interface."""

    def __init__(self, fsdp):
        self.__dict__["wrapped"] = fsdp
        self.__dict__["mesh"] = fsdp.mesh

    def __getattr__(self, name):
        raise AttributeError(f"checkpoint read FSDP.{name}, which is not in the Wrapper interface")

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


def test_checkpoint_reads_fsdp_only_through_the_wrapper_interface(comm, tmp_path):
    from mpidist.parallel.fsdp import FSDP
    root = shared_dir(comm, tmp_path)
    fsdp = FSDP(make_model(), comm)
    opt = optim.Adam(fsdp.parameters(), lr=0.01)
    train(fsdp, opt, 2, comm=comm)
    checkpoint.save(root, {"model": PublicOnly(fsdp), "optim": opt}, comm, step=2)
    expected = fsdp.full_state_dict()
    fresh = FSDP(make_model(seed=4), comm)
    fresh_opt = optim.Adam(fresh.parameters(), lr=0.01)
    assert checkpoint.load(root, {"model": PublicOnly(fresh), "optim": fresh_opt}, comm) == 2
    got = fresh.full_state_dict()
    assert list(got) == list(expected)
    for k, v in expected.items():
        np.testing.assert_array_equal(got[k], v)


# -- arguments: step and keep_last are checked before anything is written ----------------------------------
BAD_STEPS = [-1, 2.5, 3.0, np.float64(3.0), True, "3", None]
BAD_KEEP_LAST = [0, -1, 1.5, True, "2"]


def test_a_bad_step_or_keep_last_is_refused_on_every_rank_before_anything_is_written(comm, tmp_path):
    root = shared_dir(comm, tmp_path)
    model = make_model()
    checkpoint.save(root, {"model": model}, comm, step=2, keep_last=None)
    for step in BAD_STEPS:
        with pytest.raises(CheckpointError, match=rf"checkpoint.save: step must be an int >= 0 \(got {re.escape(repr(step))}\)"):
            checkpoint.save(root, {"model": model}, comm, step=step)
    for keep_last in BAD_KEEP_LAST:
        with pytest.raises(CheckpointError, match=rf"checkpoint.save: keep_last must be an int >= 1, or None to keep "
                                                  rf"every checkpoint \(got {re.escape(repr(keep_last))}\)"):
            checkpoint.save(root, {"model": model}, comm, step=4, keep_last=keep_last)
    for step in BAD_STEPS[:-1]:  # (None: the newest)
        with pytest.raises(CheckpointError, match=rf"checkpoint.load: step must be an int >= 0 \(got {re.escape(repr(step))}\)"):
            checkpoint.load(root, {"model": model}, comm, step=step)
    comm.barrier()
    assert sorted(os.listdir(root)) == ["step_00000002"] and checkpoint.list_steps(root) == [2]
    assert checkpoint.save(root, {"model": model}, comm, step=np.int64(4), keep_last=np.int64(1)).endswith("step_00000004")
    assert checkpoint.list_steps(root) == [4]


@pytest.mark.world_sizes(2, 4)
def test_step_and_keep_last_must_be_the_same_on_every_rank(comm, tmp_path):
    root = shared_dir(comm, tmp_path)
    model, last = make_model(), comm.Get_size() - 1
    with pytest.raises(CheckpointError, match=rf"rank {last}: CheckpointError: checkpoint.save: step must be an int "
                                              rf">= 0 \(got -4\)"):
        checkpoint.save(root, {"model": model}, comm, step=-4 if comm.Get_rank() == last else 4)
    with pytest.raises(CheckpointError, match=rf"ranks disagree on step and keep_last \(ranks? [\d,]+: step 4, keep_last "
                                              rf"3; rank {last}: step 5, keep_last 3\)"):
        checkpoint.save(root, {"model": model}, comm, step=5 if comm.Get_rank() == last else 4)
    comm.barrier()
    assert os.listdir(root) == []


# -- loading is strict: keys only one side has, optimizers of another type or grouping -------------------
def shorter(seed=0):
    """make_model's first three layers."""
    return nn.Sequential(*list(make_model(seed))[:3])


def longer(seed=0):
    """make_model and two more layers."""
    rng = np.random.default_rng(seed + 100)
    return nn.Sequential(*list(make_model(seed)), nn.Tanh(), nn.Linear(3, 3, rng=rng, dtype=np.float64))


def test_a_strict_load_names_the_keys_only_one_side_has_on_every_rank(comm, tmp_path):
    root = shared_dir(comm, tmp_path)
    model = make_model()
    opt = optim.Adam(model.parameters(), lr=0.01)
    train(model, opt, 2)
    checkpoint.save(root, {"model": model, "optim": opt}, comm, step=2)
    small = shorter(seed=4)
    small_opt = optim.Adam(small.parameters(), lr=0.01)
    small_before = full_params(small)
    with pytest.raises(CheckpointError, match=r"does not match this state \(from another model\?\): 'model.3.bias' not "
                                              r"in this state; 'model.3.weight' not in this state; 'model.4.bias' not "
                                              r"in this state; 'model.4.weight' not in this state; "
                                              r"'optim.model.3.bias.exp_avg' not in this state; .*\(\d+ more\); "
                                              r"load\(..., strict=False\) loads the keys both have"):
        checkpoint.load(root, {"model": small, "optim": small_opt}, comm)
    for k, v in small_before.items():
        np.testing.assert_array_equal(small.state_dict()[k], v)
    assert small_opt.state == {}
    big = longer(seed=4)
    with pytest.raises(CheckpointError, match=r"'model.6.bias' missing; 'model.6.weight' missing; 'optim.model.6.bias' "
                                              r"missing; 'optim.model.6.weight' missing; load\(..., strict=False\)"):
        checkpoint.load(root, {"model": big, "optim": optim.Adam(big.parameters(), lr=0.01)}, comm)
    # A layer inserted: keys on both sides, named together.
    shifted = nn.Sequential(*list(make_model(seed=4))[:4], nn.Tanh(), list(make_model(seed=4))[4])
    with pytest.raises(CheckpointError, match=r"'model.5.bias' missing; 'model.5.weight' missing; 'model.4.bias' not "
                                              r"in this state; 'model.4.weight' not in this state"):
        checkpoint.load(root, {"model": shifted}, comm)
    # The entries of a checkpoint that the state does not name are not read: the weights alone load strictly.
    weights = make_model(seed=4)
    assert checkpoint.load(root, {"model": weights}, comm) == 2
    for k, v in full_params(model).items():
        np.testing.assert_array_equal(weights.state_dict()[k], v)
    # A JSON entry the state has and the checkpoint lacks is missing too.
    with pytest.raises(CheckpointError, match=r"'sampler_epoch' missing"):
        checkpoint.load(root, {"model": weights, "sampler_epoch": 0}, comm)


def test_strict_false_loads_the_keys_both_have_and_lists_the_others(comm, tmp_path):
    from mpidist.parallel.fsdp import FSDP
    root = shared_dir(comm, tmp_path)
    model = make_model()
    opt = optim.Adam(model.parameters(), lr=0.01)
    train(model, opt, 2)
    checkpoint.save(root, {"model": model, "optim": opt, "epoch": 7}, comm, step=2)
    saved, saved_opt = full_params(model), opt.state_dict()
    names = [name for name, _ in model.named_parameters()]

    # Into a longer model under FSDP: the extra layer's values (and its place in every flat shard) stay as they were.
    fsdp = FSDP(longer(seed=4), comm)
    fsdp_opt = optim.Adam(fsdp.parameters(), lr=0.5)
    train(fsdp, fsdp_opt, 1, comm=comm)  # so that its Adam state exists, and is kept for what the checkpoint lacks
    extra = {k: v.copy() for k, v in fsdp.full_state_dict().items() if k.startswith("6.")}
    state = {"model": fsdp, "optim": fsdp_opt, "epoch": 0, "note": "mine"}
    result = checkpoint.load(root, state, comm, strict=False)
    assert result == checkpoint.LoadResult(2, ["model.6.bias", "model.6.weight", "note", "optim.model.6.bias",
                                               "optim.model.6.weight"], [])
    assert state["epoch"] == 7 and state["note"] == "mine" and fsdp_opt.param_groups[0]["lr"] == 0.01
    got = fsdp.full_state_dict()  # (whole on rank 0)
    if comm.Get_rank() == 0:
        for k, v in saved.items():
            np.testing.assert_array_equal(got[k], v)
        for k, v in extra.items():
            np.testing.assert_array_equal(got[k], v)

    # Into a shorter plain model: the checkpoint's other keys are listed, the shared ones loaded with Adam's state.
    small = shorter(seed=4)
    small_opt = optim.Adam(small.parameters(), lr=0.5)
    result = checkpoint.load(root, {"model": small, "optim": small_opt}, comm, strict=False)
    assert result.step == 2 and result.missing_keys == []
    kept = len(list(small.parameters()))  # the first layers' parameters
    assert result.unexpected_keys == sorted([f"model.{n}" for n in names[kept:]] + [
        f"optim.model.{n}.{k}" for n in names[kept:] for k in ("exp_avg", "exp_avg_sq")])
    for k, v in small.state_dict().items():
        np.testing.assert_array_equal(v, saved[k])
    got_opt = small_opt.state_dict()
    for i in range(kept):
        for k in ("exp_avg", "exp_avg_sq", "step"):
            np.testing.assert_array_equal(got_opt["state"][i][k], saved_opt["state"][i][k])


@pytest.mark.world_sizes(2, 4)
def test_a_key_no_rank_reads_is_unexpected_whichever_ranks_hold_its_entry(comm, tmp_path):
    """Ranks whose state has no optimizer (a pipeline stage without parameters has none) hide nothing."""
    root = shared_dir(comm, tmp_path)
    model = make_model()
    opt = optim.Adam(model.parameters(), lr=0.01)
    train(model, opt, 2)
    checkpoint.save(root, {"model": model, "optim": opt}, comm, step=2)
    small = shorter(seed=4)
    state = {"model": small}
    if comm.Get_rank() == 0:
        state["optim"] = optim.Adam(small.parameters(), lr=0.01)
    result = checkpoint.load(root, state, comm, strict=False)
    others = [name for name, _ in model.named_parameters()][len(list(small.parameters())):]
    assert result == checkpoint.LoadResult(2, [], sorted([f"model.{n}" for n in others] + [
        f"optim.model.{n}.{k}" for n in others for k in ("exp_avg", "exp_avg_sq")]))


def test_an_optimizer_checkpoint_of_another_type_or_grouping_is_refused_naming_both(comm, tmp_path):
    root = shared_dir(comm, tmp_path)

    def saved_with(make_optimizer, step):
        model = make_model()
        opt = make_optimizer(model)
        train(model, opt, 2)
        checkpoint.save(root, {"model": model, "optim": opt}, comm, step=step, keep_last=None)

    def refused(make_optimizer, step, match):
        model = make_model(seed=4)
        opt = make_optimizer(model)
        train(model, opt, 1)
        params, opt_state = full_params(model), opt.state_dict()
        with pytest.raises(CheckpointError, match=match):
            checkpoint.load(root, {"model": model, "optim": opt}, comm, step=step)
        for k, v in params.items():  # nothing changed
            np.testing.assert_array_equal(model.state_dict()[k], v)
        after = opt.state_dict()
        assert after["param_groups"] == opt_state["param_groups"] and after["state"].keys() == opt_state["state"].keys()
        for i, s in opt_state["state"].items():
            for k, v in s.items():
                np.testing.assert_array_equal(after["state"][i][k], v)

    adam = lambda model: optim.Adam(model.parameters(), lr=0.01)  # noqa: E731
    sgd = lambda model: optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # noqa: E731
    adamw = lambda model: optim.AdamW(model.parameters(), lr=0.01)  # noqa: E731
    saved_with(adam, 1)
    saved_with(sgd, 2)
    refused(sgd, 1, r"json\['optim'\].type is 'Adam', but optimizer 'optim' of this state is of type SGD")
    refused(adamw, 1, r"json\['optim'\].type is 'Adam', but optimizer 'optim' of this state is of type AdamW")
    refused(adam, 2, r"json\['optim'\].type is 'SGD', but optimizer 'optim' of this state is of type Adam")

    # Saved before optimizers recorded their type: the groups' hyperparameter names tell them apart.
    if comm.Get_rank() == 0:
        path = os.path.join(root, "step_00000002", "manifest.json")
        manifest = json.load(open(path))
        for entry in [manifest["json"]] + manifest.get("json_per_rank", []):
            del entry["optim"]["type"], entry["optim"]["group_keys"]
        open(path, "w").write(json.dumps(manifest))
    comm.barrier()
    refused(adam, 2, r"json\['optim'\].param_groups\[0\] has the hyperparameters \['dampening', 'lr', 'momentum', "
                     r"'nesterov', 'weight_decay'\] \(of an optimizer of another type\?\); optimizer 'optim' of this "
                     r"state, of type Adam, has \['betas', 'eps', 'lr', 'weight_decay'\]")

    # The same type, another grouping of the parameters: weights and biases swapped between two groups.
    def grouped(weights_first):
        def make(model):
            weights = [p for name, p in model.named_parameters() if name.endswith("weight")]
            biases = [p for name, p in model.named_parameters() if not name.endswith("weight")]
            groups = [weights, biases] if weights_first else [biases, weights]
            return optim.SGD([{"params": groups[0]}, {"params": groups[1], "lr": 0.05}], lr=0.1, momentum=0.9)
        return make

    saved_with(grouped(weights_first=True), 3)
    refused(grouped(weights_first=False), 3, r"json\['optim'\].group_keys puts 'model.0.bias' in parameter group 1, "
                                             r"optimizer 'optim' of this state in group 0")
