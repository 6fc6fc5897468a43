"""Checkpoint saves survive a crash at any instant.

A job saving on simulated ranks is killed (SIGKILL, every rank at once, as a node failure or the OOM killer
would) right after its k-th file operation, for k = 1, 2, ... until the save finishes first; the instants are
found with ``checkpoint.file_operation_hook``. After each kill, every checkpoint ``list_steps`` shows loads
with exactly the values saved in it, the newest is either the previous complete checkpoint or the new one,
and a requeued job saves, prunes and loads over whatever the killed one left.

The saving job runs in a forked child of the test process, so these tests run once, on simulated ranks.
"""

import json
import os
import shutil
import signal
import threading
import traceback

import numpy as np
import pytest

import mpidist
from mpidist import checkpoint, nn, optim

pytestmark = [pytest.mark.mpi_skip, pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")]

RANKS = 2  # two rank files written at once, and rank 0's manifest, pruning and clean-up


def make_state(seed):
    """Return (model, SGD with momentum) after one step: parameters and momentum buffers that depend on ``seed``."""
    rng = np.random.default_rng(seed)
    model = nn.Sequential(nn.Linear(3, 2, rng=rng, dtype=np.float64))
    opt = optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    nn.CrossEntropyLoss()(model(rng.standard_normal((6, 3))), rng.integers(0, 2, size=6)).backward()
    opt.step()
    return model, opt


def arrays_of(model, opt):
    """Return copies of every array (model.state_dict() and each optimizer buffer) by name."""
    found = {f"model.{k}": np.array(v, copy=True) for k, v in model.state_dict().items()}
    for i, buffers in opt.state.items():
        found.update({f"optim.{i}.{k}": np.array(v, copy=True) for k, v in buffers.items() if hasattr(v, "shape")})
    return found


# The reference: what each seed's state holds, taken in memory, not from any checkpoint.
REFERENCE = {seed: arrays_of(*make_state(seed)) for seed in (1, 2, 3, 4, 5)}


def save(root, seed, step, keep_last, comm, hook=None):
    model, opt = make_state(seed)
    with checkpoint.file_operation_hook(hook):
        checkpoint.save(root, {"model": model, "optim": opt}, comm, step=step, keep_last=keep_last)


def save_killed_at(root, seed, step, keep_last, kill_at):
    """Save in a forked job that SIGKILLs itself right after its ``kill_at``-th file operation (of any rank).

    Return True if it was killed, False if the save finished before that many operations.
    """
    pid = os.fork()
    if pid == 0:  # the saving job: it must never return into pytest
        status = 1
        try:
            count, lock = [0], threading.Lock()

            def kill_here(operation, path):
                with lock:  # no other rank moves on through a hook while this one dies
                    count[0] += 1
                    if count[0] == kill_at:
                        os.kill(os.getpid(), signal.SIGKILL)

            mpidist.simulate(RANKS, lambda comm: save(root, seed, step, keep_last, comm, kill_here))
            status = 0
        except BaseException:  # noqa: BLE001 - reported, and the child ends here whatever happened
            traceback.print_exc()
        finally:
            os._exit(status)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
        return True
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, \
        f"the saving job failed without being killed (wait status {status:#x}; its traceback is above)"
    return False


def load(root, step=None):
    """Return (step loaded, arrays) of a load into a state of other values."""
    model, opt = make_state(99)
    loaded = mpidist.simulate(1, lambda comm: checkpoint.load(root, {"model": model, "optim": opt}, comm, step=step,
                                                              log=None))[0]
    return loaded, arrays_of(model, opt)


def same(arrays, seed):
    reference = REFERENCE[seed]
    return arrays.keys() == reference.keys() and all(np.array_equal(arrays[k], reference[k]) for k in reference)


def unaccounted(root):
    """Return what under ``root`` is no committed checkpoint's manifest or listed file."""
    found = []
    for entry in sorted(os.listdir(root)):
        directory = os.path.join(root, entry)
        manifest = os.path.join(directory, "manifest.json")
        if not os.path.exists(manifest):
            found.append(entry)
            continue
        listed = set(json.load(open(manifest))["files"]) | {"manifest.json"}
        found += [f"{entry}/{name}" for name in sorted(os.listdir(directory)) if name not in listed]
    return found


# (checkpoints there before: [(step, seed)] in commit order, the save: (step, seed, keep_last)). Each save
# prunes: its file operations are those of a save that does not, then the pruning's.
SCENARIOS = {
    "new step": ([(2, 1), (4, 2)], (6, 3, 2)),
    "same step again": ([(2, 1), (4, 2), (6, 5)], (4, 3, 2)),
}


@pytest.mark.slow
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_a_save_killed_after_any_file_operation_leaves_the_previous_or_the_new_checkpoint(tmp_path, scenario):
    existing, (step, seed, keep_last) = SCENARIOS[scenario]
    template = str(tmp_path / "template")
    for old_step, old_seed in existing:
        mpidist.simulate(RANKS, lambda comm, s=old_step, d=old_seed: save(template, d, s, None, comm))
    before = dict(existing)  # step -> seed
    # The reference after the save, from the commit order: the re-saved step moves to the end, then pruning.
    order = [s for s, _ in existing if s != step] + [step]
    after = {s: (seed if s == step else before[s]) for s in order[-keep_last if keep_last else 0:]}
    old_newest = existing[-1][0]

    kills = 0
    for kill_at in range(1, 200):
        root = str(tmp_path / f"killed_at_{kill_at}")
        shutil.copytree(template, root)
        killed = save_killed_at(root, seed, step, keep_last, kill_at)
        where = f"{scenario}, killed after file operation {kill_at}"
        listed = checkpoint.list_steps(root)
        newest, arrays = load(root)
        if not killed:  # the save finished: exactly the new set of checkpoints
            assert listed == sorted(after) and newest == step and same(arrays, seed), where
            assert unaccounted(root) == [], where
            break
        kills += 1
        committed = newest == step and same(arrays, seed)
        assert committed or (newest == old_newest and same(arrays, before[old_newest])), (where, newest)
        if committed:  # pruning may have begun: what it has not yet removed is whole
            assert set(after) <= set(listed) <= set(after) | set(before), (where, listed)
        else:
            assert listed == sorted(before), (where, listed)
        for s in listed:  # every checkpoint listed loads, with the values saved in it
            loaded, arrays = load(root, step=s)
            expected = seed if (s == step and committed) else before[s]
            assert loaded == s and same(arrays, expected), (where, s)

        # A requeued job saves over whatever the killed one left, prunes, and clears its leftovers.
        mpidist.simulate(RANKS, lambda comm: save(root, 4, 8, 2, comm))
        assert checkpoint.list_steps(root) == sorted({newest, 8}), where
        assert unaccounted(root) == [], where
        for s, expected in ((newest, seed if committed else before[newest]), (8, 4)):
            loaded, arrays = load(root, step=s)
            assert loaded == s and same(arrays, expected), (where, s)
        assert load(root)[0] == 8, where
    else:
        pytest.fail(f"{scenario}: the save did not finish within 200 file operations")
    # Every file operation of the save was an instant to die at (two rank files, the manifest, removals).
    assert kills >= 20, kills
