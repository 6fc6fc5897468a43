"""Checkpoints: round trips, resharding across world sizes, atomicity and clear errors."""

import json
import os

import numpy as np
import pytest

import mpidist
from mpidist import checkpoint, nn, optim
from mpidist.checkpoint import CheckpointError
from mpidist.data import DistributedSampler
from mpidist.parallel.ddp import DDP


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
        crit(model(x), y)
        model.backward(crit.backward())
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
def test_failure_in_the_middle_of_a_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    root = str(tmp_path)
    model = make_model()
    mpidist.simulate(3, lambda comm: checkpoint.save(root, {"model": model}, comm, step=2))
    real_write = checkpoint._write_rank_file

    def flaky(path, pieces):
        if path.endswith("rank00001.bin"):
            with open(path + ".tmp.partial", "wb") as f:
                f.write(b"half a file")
            raise OSError("disk full (injected)")
        return real_write(path, pieces)

    monkeypatch.setattr(checkpoint, "_write_rank_file", flaky)
    with pytest.raises(CheckpointError, match=r"rank 1: OSError: disk full \(injected\)"):
        mpidist.simulate(3, lambda comm: checkpoint.save(root, {"model": model}, comm, step=4))
    assert checkpoint.list_steps(root) == [2]
    fresh = make_model(seed=3)
    assert mpidist.simulate(2, lambda comm: checkpoint.load(root, {"model": fresh}, comm)) == [2, 2]
    for k, v in model.state_dict().items():
        np.testing.assert_array_equal(fresh.state_dict()[k], v)
    monkeypatch.setattr(checkpoint, "_write_rank_file", real_write)
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
    path = os.path.join(directory, "rank00001.bin")
    raw = bytearray(open(path, "rb").read())
    raw[3] ^= 0xFF
    open(path, "wb").write(bytes(raw))
    with pytest.raises(CheckpointError, match=r"checksum mismatch in .*rank00001.bin"):
        load_into(make_model())
    # truncated file
    open(path, "wb").write(bytes(raw[:-8]))
    with pytest.raises(CheckpointError, match=r"rank00001.bin is truncated or altered: \d+ bytes on disk, manifest says \d+"):
        load_into(make_model())
    # missing shard
    os.remove(path)
    with pytest.raises(CheckpointError, match=r"missing shard file .*rank00001.bin"):
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
def test_resaving_a_step_that_crashes_before_commit_leaves_no_broken_checkpoint(tmp_path, monkeypatch):
    root = str(tmp_path)
    model = make_model()
    for step in (4, 6):
        mpidist.simulate(2, lambda comm, s=step: checkpoint.save(root, {"model": model}, comm, step=s))
    saved4 = {k: v.copy() for k, v in model.state_dict().items()}
    for p in model.parameters():
        p.data += 1.0
    real = checkpoint._write_atomic

    def crash_at_commit(path, chunks):
        if path.endswith("manifest.json"):
            raise OSError("power cut (injected)")
        return real(path, chunks)

    monkeypatch.setattr(checkpoint, "_write_atomic", crash_at_commit)
    with pytest.raises(CheckpointError, match="power cut"):
        mpidist.simulate(2, lambda comm: checkpoint.save(root, {"model": model}, comm, step=6))
    monkeypatch.setattr(checkpoint, "_write_atomic", real)
    assert checkpoint.list_steps(root) == [4]  # step 6 was withdrawn, not left half-rewritten
    fresh = make_model(seed=3)
    assert mpidist.simulate(2, lambda comm: checkpoint.load(root, {"model": fresh}, comm)) == [4, 4]
    for k, v in saved4.items():
        np.testing.assert_array_equal(fresh.state_dict()[k], v)


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
    with pytest.raises(CheckpointError, match="does not match this state|has no saved state for parameter"):
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
def test_latest_is_the_most_recent_commit_after_a_rollback(tmp_path):
    import time
    root = str(tmp_path)
    model = make_model()
    for step in (2, 4, 6):
        mpidist.simulate(1, lambda comm, s=step: checkpoint.save(root, {"model": model}, comm, step=s, keep_last=3))
    time.sleep(0.01)
    # Rolled back to step 4 and trained on: the new step-5 checkpoint is the one to resume from, and
    # pruning removes the least recently committed, not the highest step.
    mpidist.simulate(1, lambda comm: checkpoint.save(root, {"model": model}, comm, step=5, keep_last=3))
    assert checkpoint.latest_step(root) == 5
    assert checkpoint.list_steps(root) == [4, 5, 6]
