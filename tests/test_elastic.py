"""mpidist.elastic: refusal where MPI cannot survive a lost rank, fault specs, the sampler, commit/rollback, and
(under Open MPI 5 with ULFM: ``make test-elastic``) jobs that lose ranks and still end with the parameters of a
one-process reference trained on the same global batches.

Under ``--with-ft`` Open MPI's mpiexec exits 0 even when ranks die or raise, so the launch tests judge the files
every survivor writes, never the exit status alone.
"""

import importlib.util
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

import launcher
from mpidist import elastic, nn, optim, simulate
from mpidist.elastic import Fault, FaultToleranceUnavailable

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "elastic.py"
LIBRARY = MPI.Get_library_version().replace("\0", "")  # Open MPI 4 ends it in the C string's NUL
OPEN_MPI_5 = "Open MPI v" in LIBRARY and LIBRARY.split("Open MPI v", 1)[1][:1].isdigit() and int(LIBRARY.split("Open MPI v", 1)[1].split(".")[0]) >= 5
needs_ulfm = pytest.mark.skipif(not OPEN_MPI_5, reason=f"needs Open MPI 5 with ULFM (this mpi4py runs "
                                f"{LIBRARY.splitlines()[0].strip()!r}): run `make test-elastic`")


# -- refusal -------------------------------------------------------------------------------------------
def test_fault_tolerance_problems_name_the_library_and_the_missing_flag():
    mpich = "MPICH Version:      4.3.0\nMPICH Release date: ..."
    ompi4 = "Open MPI v4.1.6, package: Debian OpenMPI, ident: 4.1.6, repo rev: v4.1.6, Sep 30, 2023\x00"  # Debian's, NUL included
    ompi5 = "Open MPI v5.0.11, package: Open MPI user@localhost Distribution, ident: 5.0.11"
    ft = {"OMPI_MCA_mpi_ft_enable": "1"}
    assert "MPICH Version:      4.3.0" in elastic.ft_problem(mpich, ft, 4)
    assert "--with-ft ulfm" in elastic.ft_problem(mpich, ft, 4)
    assert "Open MPI 5 or later" in elastic.ft_problem(ompi4, ft, 4)
    assert "Sep 30, 2023'; ULFM" in elastic.ft_problem(ompi4, ft, 4)  # the version is quoted without its NUL
    assert "add `--with-ft ulfm` to mpiexec" in elastic.ft_problem(ompi5, {}, 4)
    assert "OMPI_MCA_mpi_ft_enable='0'" in elastic.ft_problem(ompi5, {"OMPI_MCA_mpi_ft_enable": "0"}, 4)
    assert "1 process" in elastic.ft_problem(ompi5, ft, 1)
    assert elastic.ft_problem(ompi5, ft, 4) is None


def test_init_refuses_here_with_the_reason():
    """This process was not started by `mpiexec --with-ft ulfm` (MPICH, or Open MPI without the flag): refused."""
    if os.environ.get("OMPI_MCA_mpi_ft_enable") == "1" and OPEN_MPI_5 and MPI.COMM_WORLD.Get_size() > 1:
        pytest.skip("this pytest runs under mpiexec --with-ft ulfm, where elastic mode is allowed")
    expected = ("has no fault tolerance" if "Open MPI" not in LIBRARY else
                "ULFM needs Open MPI 5 or later" if not OPEN_MPI_5 else  # Open MPI 4 (Debian's, say): make test MPI=system
                "without fault tolerance" if os.environ.get("OMPI_MCA_mpi_ft_enable") != "1" else "1 process")
    with pytest.raises(FaultToleranceUnavailable, match=expected):
        elastic.init()

    def simulated(comm):
        with pytest.raises(FaultToleranceUnavailable, match="needs a real MPI communicator .got SimComm.: a simulated"):
            elastic.init(comm)
    simulate(2, simulated)


# -- fault specs ---------------------------------------------------------------------------------------
def test_fault_specs_parse_and_bad_ones_say_what_is_wrong():
    assert elastic.parse_faults("rank=2,step=5") == (Fault(2, 5, "sigkill"),)
    assert elastic.parse_faults(" rank=0, step=3, how=raise ;rank=1,step=7,how=exit") == (
        Fault(0, 3, "raise"), Fault(1, 7, "exit"))
    assert elastic.parse_faults("") == () and elastic.faults_from_env({}) == ()
    for text, message in [("rank=2", "step missing"), ("rank=x,step=1", "rank must be an integer"),
                          ("rank=1,step=1,how=segv", "how must be one of sigkill, exit, raise"),
                          ("rank=1,step=-1", "step must be >= 0"), ("rank=1,step=2,rank=3", "each once"),
                          ("rank=1,step=2;rank=1,step=2,how=raise", "given twice"),
                          ("rank=1,step=4,at=load", "at must be one of step, update, commit, save, start"),
                          ("rank=1,step=2,at=start", "at=start fails before the first step, so step must be 0"),
                          ("rank=1,step=4,at=save,how=raise", "how=raise cannot be combined with at=save"),
                          ("rank=1,step=4,where=save",
                           r"expected rank=R,step=S\[,how=sigkill\|exit\|raise\]\[,at=step\|update\|commit\|save\|start\]")]:
        with pytest.raises(ValueError, match=message):
            elastic.parse_faults(text)
    # The same rank and step at another point is another fault.
    assert elastic.parse_faults("rank=1,step=4;rank=1,step=4,at=save,how=exit") == (
        Fault(1, 4, "sigkill", "step"), Fault(1, 4, "exit", "save"))
    Fault(1, 4, "raise", "save").maybe_fail(world_rank=1, step=4)  # a save fault does not fire at the step's start
    Fault(1, 4).maybe_fail(world_rank=0, step=4)  # another rank's fault: nothing happens
    with pytest.raises(elastic.InjectedFault, match="rank 1 fails at step 4"):
        Fault(1, 4, "raise").maybe_fail(world_rank=1, step=4, stamp_path="")


def _saved(model, comm, root, step):
    from mpidist import checkpoint
    checkpoint.save(root, {"model": model}, comm, step)


@pytest.mark.mpi_skip  # simulated ranks only (the injection is per thread there)
def test_a_rank_failing_inside_a_save_leaves_a_half_written_file_and_the_previous_checkpoint_loads(tmp_path):
    """at=save, with how=raise so that it can run in-process: rank 1 fails while writing its rank file of step 4.
    (Under ULFM the rank dies instead: make test-elastic below.)"""
    from mpidist import checkpoint
    root = str(tmp_path)
    model = _model()
    before = {k: v.copy() for k, v in model.state_dict().items()}
    simulate(2, lambda comm: _saved(model, comm, root, 2))
    for p in model.parameters():
        p.data += 1.0
    faults = (Fault(1, 4, "raise", "save"),)

    def save_with_fault(comm):
        with elastic.fault.failing_save(faults, comm.Get_rank(), 4):
            _saved(model, comm, root, 4)

    with pytest.raises(checkpoint.CheckpointError, match=r"rank 1: InjectedFault: MPIDIST_FAULT: rank 1 fails in the "
                                                         r"checkpoint save of step 4"):
        simulate(2, save_with_fault)
    left = sorted(os.listdir(tmp_path / "step_00000004"))
    partial = [name for name in left if name.startswith("rank00001.") and ".tmp." in name]
    assert "manifest.json" not in left and partial, left
    half = (tmp_path / "step_00000004" / partial[0]).stat().st_size
    assert 0 < half < sum(v.nbytes for v in before.values()), (half, left)
    # Not a checkpoint: the newest is still step 2, and it loads with the values saved then.
    assert checkpoint.latest_step(root) == 2 and checkpoint.list_steps(root) == [2]
    fresh = _model()
    for p in fresh.parameters():
        p.data[...] = 0.0
    assert simulate(2, lambda comm: checkpoint.load(root, {"model": fresh}, comm)) == [2, 2]
    for k, v in before.items():
        np.testing.assert_array_equal(fresh.state_dict()[k], v, err_msg=k)
    # Another step's save is untouched by the fault, and it clears what the failed one left.
    def save_another_step(comm):
        with elastic.fault.failing_save(faults, comm.Get_rank(), 6):
            _saved(model, comm, root, 6)

    simulate(2, save_another_step)
    assert checkpoint.list_steps(root) == [2, 6] and not (tmp_path / "step_00000004").exists()


def test_save_faults_that_could_never_fire_are_refused_before_training():
    from mpidist.elastic.job import _check_save_faults
    model = _model()
    state = elastic.State(model, optim.SGD(model.parameters(), lr=0.1))
    _check_save_faults((Fault(1, 3),), state, 10)  # at=step faults need no checkpoint
    with pytest.raises(ValueError, match=r"at=save \(rank 1, step 4\) needs a state that saves disk checkpoints .*"
                                         r"this State saves none"):
        _check_save_faults((Fault(1, 4, at="save"),), state, 10)
    stages = elastic.State(None, lambda params: optim.SGD(params, lr=0.1), checkpoint="unused", checkpoint_every=4)
    _check_save_faults((Fault(1, 8, at="save"),), stages, 10)
    with pytest.raises(ValueError, match=r"at step\(s\) \[6, 12\], but checkpoints are saved only after steps that are "
                                         r"multiples of checkpoint_every=4, up to steps=10"):
        _check_save_faults((Fault(1, 6, at="save"), Fault(2, 8, at="save"), Fault(0, 12, at="save")), stages, 10)
    with pytest.raises(ValueError, match=r"at=commit \(rank 1, step 0\) fails between the first and second buddy "
                                         r"exchanges of a State commit, which need replicas >= 3 \(this State "
                                         r"has replicas=1\)"):
        _check_save_faults((Fault(1, 0, at="commit"),), state, 10)
    sharded = elastic.State(model, lambda params: optim.SGD(params, lr=0.1), replicas=2)
    with pytest.raises(ValueError, match=r"need replicas >= 3 \(this State has replicas=2\)"):
        _check_save_faults((Fault(1, 0, at="commit"),), sharded, 10)
    _check_save_faults((Fault(1, 0, at="commit"),), elastic.State(model, lambda ps: optim.SGD(ps, lr=0.1),
                                                                  replicas=3), 10)


# -- the sampler ---------------------------------------------------------------------------------------
def test_sampler_keeps_the_global_batch_and_loses_no_sample_when_ranks_are_lost():
    n, batch = 100, 12
    sampler = elastic.ElasticSampler(n, batch, seed=3)
    taken, sizes = [], [4, 4, 4, 3, 3, 2, 3, 3]  # ranks alive at each step: 8 steps = one epoch
    for size in sizes:
        pieces = [sampler.shard(rank, size) for rank in range(size)]
        ids = np.concatenate([p[0] for p in pieces])
        # Each rank's weight times its share's mean is its share's sum * size / batch: DDP's mean over ranks of
        # the weighted means is the mean over the global batch (a formula, checked on random per-sample values).
        values = np.random.default_rng(len(taken)).standard_normal(n)
        weighted = np.mean([w * values[i].mean() for i, w in pieces])
        assert np.isclose(weighted, values[ids].mean())
        assert max(len(i) for i, _ in pieces) - min(len(i) for i, _ in pieces) <= 1
        taken.append(ids)
        sampler.advance()
    order = np.random.default_rng([3, 0]).permutation(n)
    assert [list(t) for t in taken] == [list(order[k * batch:(k + 1) * batch]) for k in range(8)]
    assert sampler.epoch == 1 and sampler.position == 0  # 100 // 12 = 8 steps; the last 4 samples dropped
    with pytest.raises(ValueError, match="13 ranks cannot share a global batch of 12"):
        sampler.shard(0, 13)


def test_micro_batches_cap_the_forward_and_keep_the_global_batch_mean():
    n, batch, cap = 100, 12, 3
    sampler = elastic.ElasticSampler(n, batch, seed=3, max_micro_batch=cap)
    values = np.random.default_rng(0).standard_normal(n)
    for size, count in [(4, 1), (3, 2), (2, 2), (5, 1), (1, 4)]:
        micro = [sampler.micro_batches(rank, size) for rank in range(size)]
        assert {len(m) for m in micro} == {count}  # the same number on every rank (FSDP's collectives match)
        for rank, parts in enumerate(micro):
            assert list(np.concatenate([i for i, _ in parts])) == list(sampler.shard(rank, size)[0])
            assert all(1 <= len(i) <= cap for i, _ in parts), (size, rank, [len(i) for i, _ in parts])
        # DDP averages over ranks the gradient each rank accumulated (the weighted sum of its micro-batch means):
        # the result is the mean over the global batch (a formula, on random per-sample values).
        accumulated = [sum(w * values[i].mean() for i, w in parts) for parts in micro]
        assert np.isclose(np.mean(accumulated), values[sampler.global_batch_indices()].mean())
    plain = elastic.ElasticSampler(n, batch, seed=3)
    assert [len(plain.micro_batches(r, 3)) for r in range(3)] == [1, 1, 1]
    for bad in (1, 0, 2.5, True, "3"):
        with pytest.raises(ValueError, match=f"max_micro_batch must be None .grow the per-rank batch. or an int >= 2 "
                                             f".got {bad!r}."):
            elastic.ElasticSampler(n, batch, max_micro_batch=bad)


# -- commit and rollback -------------------------------------------------------------------------------
def _model():
    rng = np.random.default_rng(0)
    return nn.Sequential(nn.Linear(3, 5, rng=rng, dtype=np.float64), nn.Tanh(), nn.Linear(5, 2, rng=rng, dtype=np.float64))


def _train(model, opt, sched, sampler, rng, steps, x, y):
    crit = nn.CrossEntropyLoss()
    for _ in range(steps):
        ids = sampler.global_batch_indices()
        opt.zero_grad()
        crit(model(x[ids] + rng.standard_normal((len(ids), 3))), y[ids]).backward()
        opt.step()
        sched.step()
        sampler.advance()


def test_rollback_restores_every_part_of_the_state_bit_for_bit():
    data = np.random.default_rng(1)
    x, y = data.standard_normal((40, 3)), data.integers(0, 2, 40)
    model = _model()
    opt = optim.Adam(model.parameters(), lr=0.05)
    sched = optim.StepLR(opt, step_size=2, gamma=0.5)
    sampler, rng = elastic.ElasticSampler(40, 8, seed=1), np.random.default_rng(5)
    state = elastic.State(model, opt, sched, sampler, rngs=[rng], extra={"log": [1]})
    _train(model, opt, sched, sampler, rng, 3, x, y)
    state.step = 3
    state.commit()
    _train(model, opt, sched, sampler, rng, 4, x, y)  # crosses the epoch end (5 steps per epoch)
    first = [p.data.copy() for p in model.parameters()]
    state.extra["log"].append(2)
    state.step = 7
    state.commit()
    state.rollback(3)
    assert state.step == 3 and state.extra == {"log": [1]} and state.committed_steps == [3]
    _train(model, opt, sched, sampler, rng, 4, x, y)
    for a, b in zip(first, model.parameters()):
        assert np.array_equal(a, b.data)
    with pytest.raises(RuntimeError, match=r"no commit of step 5 is held \(held: \[3\]\)"):
        state.rollback(5)


@pytest.mark.mpi_skip  # one process's arrays (the checkpoint part runs on a simulated rank)
@pytest.mark.parametrize("make", [lambda ps: optim.SGD(ps, lr=0.1, momentum=0.9), lambda ps: optim.AdamW(ps, lr=0.05)])
def test_commits_hold_the_live_arrays_instead_of_copying_and_steps_write_elsewhere(make, tmp_path):
    """Copy-on-write commits (SGD/Adam/AdamW): a commit keeps the live parameter and optimizer arrays themselves
    (read-only), the next step writes new ones, training equals training without commits bit for bit, and
    a commit still holds its step's values after later steps; an in-place write by other code fails loudly,
    load_state_dict and DDP's broadcasts move a held parameter to a new array, and checkpoint.load refuses held
    arrays, naming them."""
    data = np.random.default_rng(1)
    x, y = data.standard_normal((40, 3)), data.integers(0, 2, 40)
    runs = []
    for committing in (False, True):
        model = _model()
        opt = make(model.parameters())
        sched = optim.StepLR(opt, step_size=2, gamma=0.5)
        sampler, rng = elastic.ElasticSampler(40, 8, seed=1), np.random.default_rng(5)
        state = elastic.State(model, opt, sched, sampler, rngs=[rng])
        values = {}
        for step in range(1, 10):
            # steps 4-6 commit by copying (an optimizer without copy-on-write): the copies must not reuse held arrays
            opt.copy_on_write = not 4 <= step <= 6
            _train(model, opt, sched, sampler, rng, 1, x, y)
            if committing:
                state.step = step
                state.commit()
                values[step] = [p.data.copy() for p in model.parameters()]
                held = state._commits[-1]["params"]
                assert all((a is p.data) == opt.copy_on_write and a.flags.writeable != opt.copy_on_write
                           for a, p in zip(held, model.parameters()))
                for c in state._commits:  # every kept commit still holds its step's values
                    for a, v in zip(c["params"], values[c["step"]]):
                        np.testing.assert_array_equal(a, v)
        runs.append([p.data.copy() for p in model.parameters()])
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)
    assert state.committed_steps == [8, 9]
    first = next(iter(model.parameters()))
    with pytest.raises(ValueError, match="read-only"):
        first.data += 1
    from mpidist import checkpoint
    simulate(1, lambda comm: _saved(model, comm, str(tmp_path), 9))
    with pytest.raises(checkpoint.CheckpointError, match=r"cannot load into 4 read-only array\(s\) of the model "
                                                         r"\(e\.g\. 'model\.0\.weight'.*an elastic commit holds the live parameters"):
        simulate(1, lambda comm: checkpoint.load(str(tmp_path), {"model": model}, comm))
    from mpidist import DDP
    simulate(1, lambda comm: DDP(model, comm))  # broadcasts into the parameters: moves them off the held arrays
    assert all(p.data.flags.writeable for p in model.parameters())
    for c in state._commits:
        assert not any(a.flags.writeable for a in c["params"])
        for a, v in zip(c["params"], values[c["step"]]):
            np.testing.assert_array_equal(a, v)
    first.data[...] = values[9][0]  # writable now
    model.load_state_dict({k: v + 1 for k, v in model.state_dict().items()})
    for a, v in zip(state._commits[1]["params"], values[9]):
        np.testing.assert_array_equal(a, v)
    np.testing.assert_array_equal(first.data, values[9][0] + 1)
    state.rollback(8)
    for p, v in zip(model.parameters(), values[8]):
        np.testing.assert_array_equal(p.data, v)
        assert p.data.flags.writeable


def test_without_a_copy_on_write_optimizer_commits_copy_and_parameters_stay_writable():
    """A State without an optimizer (the step updates parameters by hand, in place) must not hold them."""
    model = _model()
    state = elastic.State(model)
    start = [p.data.copy() for p in model.parameters()]
    state.commit()
    for p in model.parameters():
        p.data -= 0.5  # a hand-written update, in place
    state.step = 1
    state.commit()
    assert all(p.data.flags.writeable for p in model.parameters())
    state.rollback(0)
    for p, v in zip(model.parameters(), start):
        np.testing.assert_array_equal(p.data, v)


def test_starting_again_returns_to_the_first_commit_this_rank_took():
    """A rank lost before the first commit completed everywhere: a survivor that had committed step 0 and
    gone on into the step (parameters updated, sampler advanced) is back at that commit when it starts again;
    parameters it held are writable again; a parameter the optimizer does not own is copied, not held."""
    data = np.random.default_rng(1)
    x, y = data.standard_normal((40, 3)), data.integers(0, 2, 40)
    model = _model()
    frozen = nn.Parameter(np.ones(3))
    model.extra = frozen  # a parameter no optimizer updates (an EMA of weights, say)
    params = [p for p in model.parameters() if p is not frozen]
    opt = optim.SGD(params, lr=0.1, momentum=0.9)
    sched = optim.StepLR(opt, step_size=2, gamma=0.5)
    sampler, rng = elastic.ElasticSampler(40, 8, seed=1), np.random.default_rng(5)
    state = elastic.State(model, opt, sched, sampler, rngs=[rng])
    start = [p.data.copy() for p in model.parameters()]
    state.commit()
    assert frozen.data.flags.writeable  # not the optimizer's: copied
    frozen.data += 1.0
    _train(model, opt, sched, sampler, rng, 1, x, y)
    state.forget_commits()
    assert state.committed_steps == [] and state.step == 0 and sampler.state_dict() == \
        elastic.ElasticSampler(40, 8, seed=1).state_dict()
    for p, v in zip(model.parameters(), start):
        np.testing.assert_array_equal(p.data, v)
        assert p.data.flags.writeable


def _setup(roll_forward=True):
    model = _model()
    opt = optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = optim.StepLR(opt, step_size=2, gamma=0.5)
    sampler, rng = elastic.ElasticSampler(40, 8, seed=1), np.random.default_rng(5)
    state = elastic.State(model, opt, sched, sampler, rngs=[rng], roll_forward=roll_forward)
    return model, opt, sched, sampler, rng, state


def _state_after(steps, x, y):
    """Parameters, momentum and sampler position of the one-process reference after ``steps`` steps."""
    model, opt, sched, sampler, rng, _ = _setup(False)
    _train(model, opt, sched, sampler, rng, steps, x, y)
    return ([p.data.copy() for p in model.parameters()], [opt.state[i]["momentum_buffer"].copy() for i in range(4)],
            sampler.state_dict(), opt.lr)


def test_roll_forward_commits_keep_no_arrays_and_change_nothing():
    """roll_forward: commits hold and copy nothing (parameters stay writable, updates in place), training equals
    training without commits bit for bit, and a rollback is refused once parameters changed since the commit."""
    data = np.random.default_rng(1)
    x, y = data.standard_normal((40, 3)), data.integers(0, 2, 40)
    model, opt, sched, sampler, rng, state = _setup()
    first = next(iter(model.parameters())).data
    for step in range(1, 7):
        _train(model, opt, sched, sampler, rng, 1, x, y)
        state.step = step
        state.commit()
        assert state.held_bytes() == 0 and state.unchanged_since_commit()
    assert next(iter(model.parameters())).data is first and first.flags.writeable  # updated in place
    params, momentum, position, lr = _state_after(6, x, y)
    for p, v in zip(model.parameters(), params):
        np.testing.assert_array_equal(p.data, v)
    sampler.advance()  # into step 7, before its update: the commit of step 6 is still what the parameters hold
    state.extra["seen"] = 1
    state.rollback(6)
    assert sampler.state_dict() == position and state.extra == {} and state.step == 6
    _train(model, opt, sched, sampler, rng, 1, x, y)
    assert not state.unchanged_since_commit()
    with pytest.raises(RuntimeError, match=r"roll_forward commits keep no copy of the parameters, which changed since "
                                           r"the commit of step 6 \(latest: 6\)"):
        state.rollback(6)
    with pytest.raises(ValueError, match=r"State\(roll_forward=True\) needs the optimizer"):
        elastic.State(model, roll_forward=True)
    job = object.__new__(elastic.Elastic)  # train's argument checks come before anything touches MPI
    job.faults = ()
    with pytest.raises(ValueError, match=r"commit_every=2 with State\(roll_forward=True\).*needs a commit after "
                                         r"every step \(commit_every=1\)"):
        job.train(state, None, None, 10, commit_every=2)


@pytest.mark.mpi_skip  # the survivors are simulated ranks
@pytest.mark.parametrize("situations, expected", [
    # (commit step, optimizer steps taken since) per survivor -> the step everyone continues from
    ([(4, 0), (3, 1), (3, 0)], 4),   # one finished step 4: it carries the others forward, the stepped-past one too
    ([(3, 1), (3, 1), (3, 0)], 3),   # two stepped past commit 3: the one that did not brings them back
    ([(3, 0), (4, 0), (4, 0)], 4),
])
def test_roll_forward_survivors_continue_from_the_newest_commit_one_of_them_holds(situations, expected):
    """Survivors in different places of a DDP step (committed a step further; took optimizer.step() past their
    commit; fetched the next batch only) all end with the parameters, momentum, schedule and sampler position
    of the one-process reference at the newest commit someone held unchanged, and train on equal to it."""
    data = np.random.default_rng(1)
    x, y = data.standard_normal((40, 3)), data.integers(0, 2, 40)

    def survivor(comm):
        commit, stepped = situations[comm.Get_rank()]
        model, opt, sched, sampler, rng, state = _setup()
        _train(model, opt, sched, sampler, rng, commit, x, y)
        state.step = commit
        state.commit()
        _train(model, opt, sched, sampler, rng, stepped, x, y)  # replicas' updates are equal (DDP)
        sampler.advance()  # every one had moved on into its next step
        failure = types.SimpleNamespace(restored_from=None)
        state.restore(failure, lambda comm: model, comm)
        got = ([p.data.copy() for p in model.parameters()], [opt.state[i]["momentum_buffer"].copy() for i in range(4)],
               sampler.state_dict(), opt.lr, state.step, failure.restored_from)
        _train(model, opt, sched, sampler, rng, 2, x, y)
        return got, [p.data.copy() for p in model.parameters()]

    params, momentum, position, lr = _state_after(expected, x, y)
    later = _state_after(expected + 2, x, y)[0]
    for got, trained in simulate(len(situations), survivor):
        assert got[2:5] == (position, lr, expected) and f"the commit of step {expected}" in got[5]
        for a, b in zip(got[0] + got[1] + trained, params + momentum + later):
            np.testing.assert_array_equal(a, b)


@pytest.mark.mpi_skip
def test_roll_forward_restores_adam_state_hyperparameters_and_parameters_without_gradients():
    """Adam (an int step and two arrays per parameter), a parameter that never gets a gradient, and an lr set by
    hand after the commit: the survivors end with the commit's values, equal to the one-process reference."""
    data = np.random.default_rng(1)
    x, y = data.standard_normal((40, 3)), data.integers(0, 2, 40)
    no_schedule = types.SimpleNamespace(step=lambda: None)  # a schedule would set lr again on its own

    def setup():
        model = _model()
        model.unused = nn.Parameter(np.arange(3.0))  # in the optimizer, never in the forward
        opt = optim.Adam(model.parameters(), lr=0.05)
        sampler, rng = elastic.ElasticSampler(40, 8, seed=1), np.random.default_rng(5)
        return model, opt, sampler, rng

    def reference(steps):
        model, opt, sampler, rng = setup()
        _train(model, opt, no_schedule, sampler, rng, steps, x, y)
        return model, opt

    def survivor(comm):
        commit, stepped = [(3, 1), (3, 0), (2, 0)][comm.Get_rank()]
        model, opt, sampler, rng = setup()
        state = elastic.State(model, opt, None, sampler, rngs=[rng], roll_forward=True)
        _train(model, opt, no_schedule, sampler, rng, commit, x, y)
        state.step = commit
        state.commit()
        opt.lr = opt.lr / 2  # by hand, after the commit: not part of it
        _train(model, opt, no_schedule, sampler, rng, stepped, x, y)
        state.restore(types.SimpleNamespace(restored_from=None), lambda comm: model, comm)
        return model, opt, state.step

    ref_model, ref_opt = reference(3)
    for model, opt, step in simulate(3, survivor):
        assert step == 3 and opt.lr == ref_opt.lr == 0.05
        for p, q in zip(model.parameters(), ref_model.parameters()):
            np.testing.assert_array_equal(p.data, q.data)
        for i, s in ref_opt.state.items():
            assert opt.state[i]["step"] == s["step"]
            np.testing.assert_array_equal(opt.state[i]["exp_avg_sq"], s["exp_avg_sq"])


@pytest.mark.mpi_skip
def test_roll_forward_survivors_that_held_the_commit_stay_usable_after_a_restore_cut_short(monkeypatch):
    """A second failure in the middle of the broadcast: the survivor that was receiving a commit it did not hold
    is no root any more (half its arrays are new), while those that held it unchanged still are."""
    import threading
    from mpidist import collectives
    from mpidist.elastic import state as state_module
    data = np.random.default_rng(1)
    x, y = data.standard_normal((40, 3)), data.integers(0, 2, 40)
    calls = threading.local()

    def broken_off(array, comm, root=0):
        calls.n = getattr(calls, "n", 0) + 1
        if calls.n == 3:
            raise ConnectionError("a second rank lost in the middle of the broadcast")
        return collectives.broadcast(array, comm, root=root)

    monkeypatch.setattr(state_module, "collectives", types.SimpleNamespace(broadcast=broken_off))

    def survivor(comm):
        model, opt, sched, sampler, rng, state = _setup()
        _train(model, opt, sched, sampler, rng, 3, x, y)
        state.step = 3
        state.commit()
        if comm.Get_rank() == 1:
            _train(model, opt, sched, sampler, rng, 1, x, y)  # stepped past: receives
        with pytest.raises(ConnectionError):
            state.restore(types.SimpleNamespace(restored_from=None), lambda comm: model, comm)
        return state.unchanged_since_commit()

    assert simulate(3, survivor) == [True, False, True]


@pytest.mark.mpi_skip
def test_roll_forward_says_on_every_survivor_when_all_had_stepped_past_their_commit():
    data = np.random.default_rng(1)
    x, y = data.standard_normal((40, 3)), data.integers(0, 2, 40)

    def survivor(comm):
        model, opt, sched, sampler, rng, state = _setup()
        state.commit()
        _train(model, opt, sched, sampler, rng, 1, x, y)
        try:
            state.restore(types.SimpleNamespace(restored_from=None), lambda comm: model, comm)
        except RuntimeError as exc:
            return str(exc)

    for message in simulate(3, survivor):
        assert message is not None and "cannot recover: every survivor had taken optimizer.step() after its latest " \
            "commit (steps [0, 0, 0])" in message and "issue the step's collectives before optimizer.step()" in message


@pytest.mark.mpi_skip  # one process, over a real communicator of one rank
def test_sharded_state_starts_again_from_the_module_s_starting_values_until_the_first_commit_is_everyone_s():
    """A State over FSDP keeps the module's own arrays (and the small state) from before FSDP took it apart until a
    barrier after the first commit shows that every rank holds it; forget_commits puts them back, as often as
    needed, so that FSDP can be built again over fewer ranks."""
    from mpidist import FSDP

    def run(comm):
        model = _model()
        start = {n: p.data.copy() for n, p in model.named_parameters()}
        sampler = elastic.ElasticSampler(40, 8, seed=1)
        state = elastic.State(model, lambda ps: optim.SGD(ps, lr=0.1, momentum=0.9), sampler=sampler, replicas=2)
        results = []
        for attempt in range(2):  # a failure while FSDP is built (twice): no rank has committed
            fsdp = state.start(lambda c: FSDP(model, c), comm)
            sampler.advance()
            assert all(p.data.size == 0 for p in model.parameters())  # sharded: placeholders
            fsdp.remove()
            assert state.cannot_start_again() is None
            state.forget_commits()
            results.append(all(np.array_equal(p.data, start[n]) for n, p in model.named_parameters())
                           and sampler.state_dict() == elastic.ElasticSampler(40, 8, seed=1).state_dict())
        state.start(lambda c: FSDP(model, c), comm)
        state.commit()
        return results, state.cannot_start_again()

    comm = MPI.COMM_WORLD.Dup()
    try:
        results, why = run(comm)
    finally:
        comm.Free()
    assert results == [True, True]
    assert "no longer holds the module's starting values (dropped once every rank held the first commit)" in why


# -- jobs that lose ranks (Open MPI 5 + ULFM) ----------------------------------------------------------
def _reference(steps, samples, batch, lr):
    spec = importlib.util.spec_from_file_location("elastic_example", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example.reference(steps, samples, batch, lr)


STEPS, SAMPLES, BATCH, LR = 14, 120, 12, 0.1  # 10 steps per epoch: the run crosses an epoch end


def _launch(tmp_path, faults, *args, ranks=4):
    """Run the example on ``ranks`` ranks under ``mpiexec --with-ft ulfm`` with ``faults``; return (result, log)."""
    out = tmp_path / "run"
    command = [*launcher.mpiexec(ranks, sys.executable, str(EXAMPLE), "--steps", str(STEPS), "--samples", str(SAMPLES),
                                 "--batch", str(BATCH), "--lr", str(LR), "--out", str(out), *args)]
    command.insert(1, "--with-ft")
    command.insert(2, "ulfm")
    env = launcher.env(MPIDIST_FAULT=faults, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                       OMP_NUM_THREADS="1", MPIDIST_FAULT_STAMP=str(tmp_path / "stamp"))
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=150, cwd=ROOT)
    return result, (result.stdout + result.stderr).replace("\0", "")


def _check_survivors(tmp_path, result, log, lost, ranks=4):
    """Every survivor wrote its file, holds the reference's parameters and took the reference's batches."""
    survivors = sorted(set(range(ranks)) - set(lost))
    written = sorted(int(p.stem.split("rank")[1]) for p in tmp_path.glob("run-rank*.npz"))
    assert result.returncode == 0 and written == survivors, f"rc {result.returncode}, files of ranks {written}:\n{log[-4000:]}"
    assert f"finished {STEPS} steps on {len(survivors)} of {ranks} ranks" in log, log[-4000:]
    params, batches = _reference(STEPS, SAMPLES, BATCH, LR)
    for rank in survivors:
        run = np.load(tmp_path / f"run-rank{rank}.npz")
        assert int(run["final_size"]) == len(survivors)
        # Every committed step's global batch is exactly the reference's: none lost, none repeated.
        assert [sorted(t) for t in run["taken"]] == [sorted(b) for b in batches]
        for i, p in enumerate(params):
            np.testing.assert_allclose(run[f"param{i}"], p, rtol=0, atol=1e-12, err_msg=f"rank {rank} param{i}\n{log[-3000:]}")
    run = np.load(tmp_path / f"run-rank{survivors[0]}.npz")
    assert run["lost"].tolist() == sorted(lost)
    return run


@needs_ulfm
@launcher.needed
@pytest.mark.mpi_skip
@pytest.mark.parametrize("faults, lost", [
    ("rank=2,step=5", [2]),                           # SIGKILL mid-epoch
    ("rank=1,step=9,how=raise", [1]),                  # an uncaught exception: traceback once, then SIGKILL
    ("rank=0,step=3;rank=3,step=11", [0, 3]),          # rank 0, then a second failure after the epoch end
    ("rank=0,step=0,at=start", [0]),                   # before the first commit: the survivors start again
])
def test_survivors_finish_with_the_parameters_of_a_one_process_reference(faults, lost, tmp_path):
    result, log = _launch(tmp_path, faults)
    run = _check_survivors(tmp_path, result, log, lost)
    assert [int(f[0]) for f in run["failures"]] == lost  # one failure each, in this order
    if "raise" in faults:
        assert log.count("InjectedFault: MPIDIST_FAULT: rank 1 fails at step 9") == 1, log[-4000:]
    if "at=start" in faults:
        assert "lost before the first commit, started again" in log, log[-4000:]


@needs_ulfm
@launcher.needed
@pytest.mark.mpi_skip
@pytest.mark.parametrize("faults, lost", [
    ("rank=2,step=5", [2]),
    ("rank=0,step=3;rank=3,step=11", [0, 3]),
    ("rank=0,step=0,at=start", [0]),
])
def test_roll_forward_survivors_finish_with_the_reference_parameters(faults, lost, tmp_path):
    """Commits that keep no arrays (State(roll_forward=True)): the survivors take the newest commit one of them
    holds unchanged from it and end with the one-process reference's parameters."""
    result, log = _launch(tmp_path, faults, "--roll-forward")
    run = _check_survivors(tmp_path, result, log, lost)
    assert [int(f[0]) for f in run["failures"]] == lost
    assert "lost before the first commit" in log if "at=start" in faults else "roll_forward: the commit of step" in log


@needs_ulfm
@launcher.needed
@pytest.mark.mpi_skip
def test_a_rank_lost_after_everyone_updated_rolls_back_to_the_held_commit(tmp_path):
    """Rank 1 dies right after its optimizer step: the others update too and lose it in the step's later
    allgather, past their latest commit; the default commits hold the state to roll back to, and the job ends
    with the reference's parameters. With roll_forward the example gathers before the update (as roll_forward
    requires): the survivors finish the step, commit, and carry on from that commit."""
    result, log = _launch(tmp_path, "rank=1,step=6,at=update")
    assert "failing after its optimizer step in step 6" in log, log[-4000:]
    _check_survivors(tmp_path, result, log, [1])
    forward = tmp_path / "forward"
    forward.mkdir()
    result, log = _launch(forward, "rank=1,step=6,at=update", "--roll-forward")
    _check_survivors(forward, result, log, [1])


@needs_ulfm
@launcher.needed
@pytest.mark.mpi_skip
@pytest.mark.parametrize("faults, lost, replicas", [
    ("rank=2,step=5", [2], 2),                         # its shard comes back from its buddy, rank 3
    ("rank=1,step=4;rank=2,step=6", [1, 2], 2),         # neighbours: the second needs the re-sharded buddy copy
    ("rank=0,step=3;rank=1,step=3", [0, 1], 3),         # two at once (seen as one failure or two): 3 holders
])
def test_fsdp_survivors_restore_lost_shards_from_buddies_and_match_the_reference(faults, lost, replicas, tmp_path):
    result, log = _launch(tmp_path, faults, "--wrapper", "fsdp", "--replicas", str(replicas))
    _check_survivors(tmp_path, result, log, lost)
    assert "from their buddies, re-laid out 4 -> " in log, log[-4000:]


@needs_ulfm
@launcher.needed
@pytest.mark.mpi_skip
@pytest.mark.parametrize("faults, lost, replicas", [
    ("rank=2,step=5", [2], 1),                 # no buddies: its chunk comes from its replica in the other group
    ("rank=1,step=4;rank=2,step=7", [1, 2], 2),  # then fully sharded over 3 ranks, with buddies
])
def test_hybrid_fsdp_survivors_restore_lost_chunks_from_replicas_and_match_the_reference(faults, lost, replicas,
                                                                                          tmp_path):
    """HSDP, 2 shard groups of 2 ranks: each chunk already lives on two ranks, so a lost rank's chunk comes from
    its replica even without buddies; the survivors re-shard (3 ranks: fully sharded) and equal the reference."""
    result, log = _launch(tmp_path, faults, "--wrapper", "fsdp", "--hsdp", "2", "--replicas", str(replicas))
    _check_survivors(tmp_path, result, log, lost)
    assert "from their replicas or buddies, re-laid out 4 -> 3 ranks (2 chunks x 2 replicas before)" in log, log[-4000:]


def test_hybrid_sharding_needs_no_buddies_where_its_replicas_already_hold_enough_copies():
    """Buddy packets only where the layout keeps fewer copies of each chunk than ``replicas`` asks for."""
    from mpidist.elastic.state import holders_per_packet
    for world, copies, replicas in [(4, 2, 1), (4, 1, 2), (4, 4, 1), (1, 1, 1)]:  # HSDP 2x2, full, no_shard, alone
        assert holders_per_packet(2, world, copies) == replicas, (world, copies)
    assert holders_per_packet(3, 4, 2) == 3  # 2 copies are fewer than asked: buddies on top


@needs_ulfm
@launcher.needed
@pytest.mark.mpi_skip
def test_hybrid_fsdp_losing_every_holder_of_a_chunk_names_it(tmp_path):
    """Both replicas of chunk 0 (world ranks 0 and 2) lost at once, no buddies: every survivor says which."""
    result, log = _launch(tmp_path, "rank=0,step=3;rank=2,step=3", "--wrapper", "fsdp", "--hsdp", "2", "--replicas", "1")
    assert log.count("the shards of chunk 0 (positions [0, 2], world ranks [0, 2]) are lost: all 2 holder(s), world "
                     "ranks [0, 2], failed; use more replicas") == 2, log[-4000:]


@needs_ulfm
@launcher.needed
@pytest.mark.mpi_skip
def test_fsdp_without_a_buddy_names_the_lost_shard(tmp_path):
    result, log = _launch(tmp_path, "rank=2,step=3", "--wrapper", "fsdp", "--replicas", "1")
    assert "the shards of position 2 (world rank 2) are lost: all 1 holder(s), world ranks [2], failed; use more " \
           "replicas" in log, log[-4000:]


@needs_ulfm
@launcher.needed
@pytest.mark.mpi_skip
@pytest.mark.parametrize("faults, args, lost", [
    # between the first commit's buddy exchanges: FSDP has sharded the module, some survivors hold that commit
    ("rank=1,step=0,at=commit", ("--wrapper", "fsdp", "--replicas", "3"), [1]),
    ("rank=0,step=0,at=start", ("--wrapper", "fsdp"), [0]),  # FSDP's broadcasts come from rank 0
    ("rank=1,step=0,at=start", ("--wrapper", "pipeline"), [1]),
])
def test_fsdp_and_pipelines_losing_a_rank_before_the_first_commit_start_again(faults, args, lost, tmp_path):
    """Lost before the first commit completed everywhere: FSDP takes the module apart while it is built, so the
    survivors start again from the module's starting values (kept until every rank held the first commit); a
    pipeline's stages are built anew. Both end with the reference's parameters on 3 ranks."""
    result, log = _launch(tmp_path, faults, *args)
    _check_survivors(tmp_path, result, log, lost)
    assert "lost before the first commit, started again" in log, log[-4000:]


@needs_ulfm
@launcher.needed
@pytest.mark.mpi_skip
def test_pipeline_mesh_rebuilds_a_lost_stage_from_its_data_parallel_replica(tmp_path):
    """dp=2 x pp=2 on 4 ranks; world rank 2 (stage 0 of replica 1) dies: rank 0 still holds stage 0, and the
    survivors go on as one pipeline of 3 stages (the 5 layers re-split), equal to the reference."""
    result, log = _launch(tmp_path, "rank=2,step=5", "--wrapper", "pipeline", "--pp", "2")
    _check_survivors(tmp_path, result, log, [2])
    assert "from their replicas or buddies, re-laid out 4 -> 3 ranks (2 chunks x 2 replicas before)" in log, log[-4000:]


@needs_ulfm
@launcher.needed
@pytest.mark.mpi_skip
def test_pipeline_without_a_replica_falls_back_to_the_disk_checkpoint_at_the_new_layout(tmp_path):
    """pp=3 without replicas; world rank 1 dies at step 6: its stage exists nowhere else, so the two survivors
    load the step-4 checkpoint as a 2-stage pipeline, redo steps 4-5 and still equal the reference."""
    result, log = _launch(tmp_path, "rank=1,step=6", "--wrapper", "pipeline", "--pp", "3", "--checkpoint",
                          str(tmp_path / "ckpt"), "--checkpoint-every", "4", ranks=3)
    _check_survivors(tmp_path, result, log, [1], ranks=3)
    assert f"disk checkpoint of step 4 in {tmp_path / 'ckpt'} (no replica of 2 parameter(s) survived), loaded at " \
           f"2 ranks" in log, log[-4000:]


@needs_ulfm
@launcher.needed
@pytest.mark.mpi_skip
def test_pipeline_without_a_replica_restores_a_lost_stage_from_its_buddy(tmp_path):
    """pp=3 without data-parallel replicas, but replicas=2: world rank 1's packet is also held by rank 2, so the
    survivors restore its stage from memory (no disk checkpoint given) as a 2-stage pipeline, equal to the
    reference."""
    result, log = _launch(tmp_path, "rank=1,step=6", "--wrapper", "pipeline", "--pp", "3", "--replicas", "2",
                          ranks=3)
    _check_survivors(tmp_path, result, log, [1], ranks=3)
    assert "pieces of world rank(s) [1] from their buddies, re-laid out 3 -> 2 ranks" in log, log[-4000:]


@needs_ulfm
@launcher.needed
@pytest.mark.mpi_skip
@pytest.mark.parametrize("faults, lost", [
    ("rank=1,step=8,at=save", [1]),                    # a middle stage
    ("rank=0,step=8,at=save", [0]),                    # rank 0: the manifest writer, and the one that logs
])
def test_a_rank_lost_inside_a_checkpoint_save_leaves_the_previous_checkpoint_to_load(faults, lost, tmp_path):
    """pp=3 without replicas (3 ranks), a checkpoint every 4 steps; a rank dies half-way through writing its file of
    the step-8 checkpoint. That stage exists nowhere else, so the survivors need the disk: they pass over the
    step-8 directory (no manifest), load step 4 as a 2-stage pipeline, redo steps 4-7 (saving step 8 anew) and
    end equal to the reference."""
    from mpidist import checkpoint
    ckpt = tmp_path / "ckpt"
    result, log = _launch(tmp_path, faults, "--wrapper", "pipeline", "--pp", "3", "--checkpoint", str(ckpt),
                          "--checkpoint-every", "4", ranks=3)
    _check_survivors(tmp_path, result, log, lost, ranks=3)
    assert f"[rank {lost[0]}] mpidist.elastic: MPIDIST_FAULT: failing in the checkpoint save of step 8 (sigkill)" \
        in log, log[-4000:]
    assert f"disk checkpoint of step 4 in {ckpt} (no replica of 2 parameter(s) survived), loaded at 2 ranks; " \
           f"incomplete save(s) of step(s) [8] passed over" in log, log[-4000:]
    assert checkpoint.list_steps(str(ckpt)) == [4, 8, 12]  # step 8 saved again by the survivors; 0 pruned


@needs_ulfm
@launcher.needed
@pytest.mark.mpi_skip
def test_a_rank_lost_inside_a_save_with_a_replica_left_continues_from_memory_and_saves_again(tmp_path):
    """dp=2 x pp=2 with checkpoints every 4 steps; rank 0 dies writing the step-8 checkpoint. Its stage has a
    replica, so the survivors restore the in-memory commit of step 8 (no disk), save step 8 again over 3 ranks
    in place of the incomplete one, and end equal to the reference."""
    from mpidist import checkpoint
    ckpt = tmp_path / "ckpt"
    result, log = _launch(tmp_path, "rank=0,step=8,at=save", "--wrapper", "pipeline", "--pp", "2", "--checkpoint",
                          str(ckpt), "--checkpoint-every", "4")
    _check_survivors(tmp_path, result, log, [0])
    assert "back to the commit of step 8, restored and rebuilt in" in log and \
        "from their replicas or buddies, re-laid out 4 -> 3 ranks (2 chunks x 2 replicas before)" in log, log[-4000:]
    assert checkpoint.list_steps(str(ckpt)) == [4, 8, 12]
    assert not any(".tmp." in name for step in (4, 8, 12) for name in os.listdir(ckpt / f"step_{step:08d}"))


@needs_ulfm
@launcher.needed
@pytest.mark.mpi_skip
@pytest.mark.parametrize("wrapper", ["ddp", "fsdp"])
def test_survivors_can_accumulate_micro_batches_instead_of_growing_the_per_rank_batch(wrapper, tmp_path):
    """--max-micro-batch 3: the global batch of 12 is 3 per rank on 4 ranks (one forward); on 3 survivors each
    share of 4 runs as two accumulated micro-batches of 2 (no_sync on the first), and the result is still the
    one-process reference's."""
    result, log = _launch(tmp_path, "rank=2,step=5", "--wrapper", wrapper, "--max-micro-batch", "3")
    run = _check_survivors(tmp_path, result, log, [2])
    assert run["micro"].tolist() == [1] * 5 + [2] * (STEPS - 5)


# -- one State for every layout (simulated survivors) --------------------------------------------------------
ONE_CONFIG = dict(vocab_size=61, block_size=8, n_layer=2, n_head=12, n_embd=24, dtype="float64")  # 12 heads: tp 4 and 3
ONE_BATCH = 12  # divides among 4 and 3 ranks


def _layout_kind(kind):
    """Return ``(module or None, build(comm), train(built), replicas)`` for a layout over any number of ranks."""
    from mpidist import DDP, FSDP
    from mpidist.models import GPT, GPTConfig, tensor_parallel
    from mpidist.parallel import Pipeline, mesh
    config = GPTConfig(**ONE_CONFIG)
    fresh = lambda: GPT(config, rng=np.random.default_rng(0))  # noqa: E731
    module = fresh() if kind in ("plain", "ddp", "fsdp", "hybrid") else None
    rng = np.random.default_rng(7)
    x = rng.integers(0, config.vocab_size, (ONE_BATCH, config.block_size))
    y = rng.integers(0, config.vocab_size, (ONE_BATCH, config.block_size))
    where = {}  # this rank's share of the batch, set by build

    def build(comm):
        size, rank = comm.Get_size(), comm.Get_rank()
        where["part"] = slice(None)
        if kind == "plain":
            return module
        if kind == "tp":
            return tensor_parallel(fresh(), comm, sequence_parallel=False)
        if kind in ("pp_tied", "dp_pp"):
            dp = 2 if kind == "dp_pp" and size % 2 == 0 else 1
            grid = mesh(comm, dp=dp, pp=size // dp)
            n = ONE_BATCH // dp
            where["part"] = slice(grid.dp_rank * n, (grid.dp_rank + 1) * n)
            model = fresh()
            stage = model.pipeline_stages(size // dp)[grid.pp_rank]
            return Pipeline(stage, grid.pp_comm, 2, "1f1b", loss_fn=lambda out, t: model.loss(out, t) / dp,
                            dp_comm=grid.dp_comm if dp > 1 else None, tied_parameters=stage.tied)
        n = ONE_BATCH // size
        where["part"] = slice(rank * n, (rank + 1) * n)
        if kind == "ddp":
            return DDP(module, comm)
        extra = {"strategy": "hybrid_shard", "shard_size": 2} if kind == "hybrid" and size % 2 == 0 else {}
        return FSDP(module, comm, units=module.fsdp_units(), **extra)

    def train(built, state):
        part = where["part"]
        state.optimizer.zero_grad()
        if kind in ("pp_tied", "dp_pp"):
            built.step(x[part], y[part])
        else:
            model = built if kind in ("plain", "tp") else built.module
            model.loss(built(x[part]), y[part]).backward()
        state.optimizer.step()

    return module, build, train, 2 if kind in ("fsdp", "tp", "pp_tied") else 1


def _commit_then_lose_rank_2(comm, module, build, train, replicas, steps, read=lambda a: a):
    """Train ``steps`` steps and commit, take one more, lose rank 2, restore on the survivors; return what to compare.

    Rank 2 returns None; a survivor returns (want, want_opt, got, got_opt, step, restored_from): the full
    parameters (each through ``read``) and optimizer state gathered with full_state_dict at the commit, the same
    gathered after the restore over the survivors' own communicator, the restored step and the restore's account.
    """
    from mpidist.parallel import full_optimizer_state_dict, full_state_dict

    state = elastic.State(module, lambda params: optim.AdamW(params, lr=0.01), replicas=replicas)
    built = state.start(build, comm)
    for _ in range(steps):
        train(built, state)
        state.step += 1
    state.commit()
    want = {k: read(v) for k, v in full_state_dict(built, comm, all_ranks=True).items()}
    want_opt = full_optimizer_state_dict(built, state.optimizer, comm)
    train(built, state)  # past the commit: the restore must go back
    state.step += 1
    survivors = comm.Split(0 if comm.Get_rank() != 2 else 1)
    if comm.Get_rank() == 2:
        return None
    failure = types.SimpleNamespace(commit=state.committed_id, restored_from=None)
    again = state.restore(failure, build, survivors)
    got = {k: read(v) for k, v in full_state_dict(again, survivors, all_ranks=True).items()}
    got_opt = full_optimizer_state_dict(again, state.optimizer, survivors)
    return want, want_opt, got, got_opt, state.step, failure.restored_from


@pytest.mark.mpi_skip  # the survivors are simulated ranks
@pytest.mark.parametrize("kind", ["plain", "ddp", "fsdp", "hybrid", "tp", "pp_tied", "dp_pp"])
def test_one_state_restores_every_layout_over_the_survivors(kind):
    """One State class for every wrapper: 4 ranks train 2 AdamW steps and commit, take a third step, and rank 2
    is lost; the 3 survivors restore over a communicator of their own, in the layout build(comm) makes for 3
    (FSDP re-sharded, tensor-parallel slices and pipeline stages re-split), and hold exactly the committed full
    parameters and optimizer moments, gathered before the loss with full_state_dict (an independent reader)."""

    def run(comm):
        module, build, train, replicas = _layout_kind(kind)
        return _commit_then_lose_rank_2(comm, module, build, train, replicas, steps=2)

    results = simulate(4, run)
    assert results[2] is None
    want, want_opt = results[0][0], results[0][1]
    for rank, (_, _, got, got_opt, step, how) in enumerate(r for r in results if r is not None):
        assert step == 2 and ("re-laid out 4 -> 3 ranks" in how or "rebuilt 4 -> 3 ranks" in how), how
        assert list(got) == list(want)
        for name, value in want.items():
            np.testing.assert_array_equal(got[name], value, err_msg=f"{kind} {name}")
        if rank == 0:
            assert list(got_opt["state"]) == list(want_opt["state"])
            for name, entry in want_opt["state"].items():
                for key, value in entry.items():
                    np.testing.assert_array_equal(got_opt["state"][name][key], value, err_msg=f"{kind} {name} {key}")


@pytest.mark.mpi_skip
def test_bfloat16_fsdp_shards_restore_bitwise_from_the_buddies():
    """FSDP over bfloat16 parameters (Policy("bf16")), replicas=2: rank 2 is lost after a commit and a further
    step; the 3 survivors take its shards from their buddy packets and hold bit for bit the bfloat16 parameters
    and optimizer state gathered at the commit with full_state_dict (a packet once kept the dtype as '<V2')."""
    from mpidist.nn.precision import Policy, apply_policy

    def bits(a):
        a = np.asarray(a)
        return a.dtype.name, a.shape, np.ascontiguousarray(a).view(np.uint8).tobytes()

    def run(comm):
        module, build, train, _ = _layout_kind("fsdp")
        apply_policy(module, Policy("bf16"))
        return _commit_then_lose_rank_2(comm, module, build, train, replicas=2, steps=1, read=bits)

    results = simulate(4, run)
    want, want_opt = results[0][0], results[0][1]
    assert want and all(dtype == "bfloat16" for dtype, _, _ in want.values()), {k: v[0] for k, v in want.items()}
    for rank, (_, _, got, got_opt, _, how) in enumerate(r for r in results if r is not None):
        assert "re-laid out 4 -> 3 ranks" in how, how
        assert got == want
        if rank == 0:
            assert {n: {k: bits(v) for k, v in e.items()} for n, e in got_opt["state"].items()} == \
                {n: {k: bits(v) for k, v in e.items()} for n, e in want_opt["state"].items()}


@pytest.mark.mpi_skip
def test_a_piece_without_a_live_holder_is_named_on_every_survivor():
    """FSDP without buddies loses rank 2's shard: every survivor raises the same error naming it."""

    def run(comm):
        module, build, train, _ = _layout_kind("fsdp")
        state = elastic.State(module, lambda params: optim.AdamW(params, lr=0.01), replicas=1)
        built = state.start(build, comm)
        train(built, state)
        state.step = 1
        state.commit()
        survivors = comm.Split(0 if comm.Get_rank() != 2 else 1)
        if comm.Get_rank() == 2:
            return None
        with pytest.raises(RuntimeError) as info:
            state.restore(types.SimpleNamespace(commit=state.committed_id, restored_from=None), build, survivors)
        return str(info.value)

    messages = [m for m in simulate(4, run) if m is not None]
    assert len(set(messages)) == 1 and "the shards of position 2 (world rank 2) are lost: all 1 holder(s), world " \
        "ranks [2], failed" in messages[0] and "use more replicas or a disk checkpoint" in messages[0], messages


def test_state_arguments_that_cannot_work_are_refused_naming_them():
    model = _model()
    factory = lambda params: optim.SGD(params, lr=0.1)  # noqa: E731
    for kwargs, message in [
            ({"module": model, "optimizer": factory, "replicas": 0}, r"replicas must be an int >= 1 \(got 0\)"),
            ({"optimizer": optim.SGD(model.parameters(), lr=0.1)}, "an optimizer instance needs the module it steps"),
            ({"optimizer": factory, "checkpoint": "d"}, "give checkpoint and checkpoint_every together"),
            ({"optimizer": factory, "checkpoint": "d", "checkpoint_every": 0}, "checkpoint_every must be an int >= 1"),
            ({"module": model, "optimizer": factory, "roll_forward": True}, r"roll_forward=True\) needs the optimizer"),
            ({"module": model, "keep": 1}, "keep must be >= 2")]:
        with pytest.raises(ValueError, match=message):
            elastic.State(**kwargs)
