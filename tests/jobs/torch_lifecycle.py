"""split_group, monitored_barrier, abort and shutdown of the mpidist torch backend, against references.

    mpiexec -n 4 python tests/jobs/torch_lifecycle.py SCENARIO [SCENARIO ...]   (split monitor abort abort_thread shutdown)

- split: ``dist.split_group`` on a CPU-only job (our route) and through torch's own route (an accelerator
  faked, so torch's code calls the backend's split_group); every subgroup's allreduce equals the sum over
  its members computed with numpy; ranks in no split get None; a split of a subgroup.
- monitor: monitored_barrier passes when all arrive; with rank 2 (then ranks 2 and 3) missing, rank 0
  raises naming them within its timeout and the ranks that arrived raise with rank 0's names.
- abort: a rank blocked in a collective a peer never joins (in ``wait()``, with a timeout under ``thread``,
  and in a future's wait) is released by ``_abort_process_group`` from another thread; a pending receive
  fails; later calls on the group raise; the default group's futures still complete.
- abort_thread: the same in ``thread`` progress mode with MPIDIST_TORCH_ABORTABLE on: the progress thread,
  blocked inside MPI on the aborted allreduce, is released and ends.
- shutdown: destroy_process_group waits for a pending operation, and 1100 new_group/destroy cycles (2200
  communicators, more than MPICH's 2048 context ids) run: shutdown frees each group's communicators.
split and monitor need 4 ranks, abort, abort_thread and shutdown 2 or more. Prints "<scenario> ok" on every rank; exits non-zero with the failed check otherwise.
"""

import sys
import threading
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

import mpidist.torch
from mpidist.torch import _work
from mpidist.torch._work import AbortedError

c10d = dist.distributed_c10d


def contribution(rank):
    return torch.arange(6, dtype=torch.float64) * (rank + 1) + 10 ** rank


def expect_sum(group, members):
    """allreduce over ``group`` must equal numpy's sum of the members' (global ranks) contributions."""
    t = contribution(dist.get_rank())
    dist.all_reduce(t, group=group)
    want = np.sum([contribution(r).numpy() for r in members], axis=0)
    assert np.array_equal(t.numpy(), want), (dist.get_rank(), members, t, want)
    assert dist.get_process_group_ranks(group) == members, (dist.get_process_group_ranks(group), members)


def split():
    rank, n = dist.get_rank(), dist.get_world_size()
    halves = [list(range(0, n // 2)), list(range(n // 2, n))]
    group = dist.split_group(split_ranks=halves)
    assert isinstance(group, mpidist.torch.ProcessGroupMPI), group
    expect_sum(group, halves[rank >= n // 2])
    assert dist.get_backend(group) == "mpidist"
    # a partial split: ranks in no split get None and take no part
    pair = [0, n - 1]
    group = dist.split_group(split_ranks=[pair])
    if rank in pair:
        expect_sum(group, pair)
    else:
        assert group is None, group
    # a split of a subgroup: split_ranks name ranks of the parent ([1..n-1] -> parent ranks 0 and 2 = 1, 3)
    parent = dist.new_group(list(range(1, n)))
    if rank:  # the parent's members only: rank 0 is not in it
        group = dist.split_group(parent, split_ranks=[[0, 2]])
        if rank in (1, 3):
            expect_sum(group, [1, 3])
        else:
            assert group is None, group
        dist.destroy_process_group(parent)
    # torch's own route, as on a GPU node: torch checks the accelerator and the bound device, then calls
    # the parent's split_group (the backend's) and registers the result itself.
    calls = []
    original = mpidist.torch.ProcessGroupMPI.split_group

    def counted(self, *args, **kwargs):
        calls.append(kwargs.get("group_name"))
        return original(self, *args, **kwargs)
    mpidist.torch.ProcessGroupMPI.split_group = counted
    torch.accelerator.is_available, available = (lambda: True), torch.accelerator.is_available
    torch.accelerator.current_accelerator, current = (lambda *a, **k: torch.device("cpu", 0)), torch.accelerator.current_accelerator
    c10d._get_default_group().bound_device_id = torch.device("cpu", 0)
    try:
        group = mpidist.torch._c10d._torch_split_group(split_ranks=[[r] for r in range(n)][::-1])
    finally:
        torch.accelerator.is_available, torch.accelerator.current_accelerator = available, current
        mpidist.torch.ProcessGroupMPI.split_group = original
        c10d._get_default_group().bound_device_id = None
    assert len(calls) == 1 and group.group_name == calls[0], (calls, group)
    expect_sum(group, [rank])
    expect_sum(None, list(range(n)))


def monitor():
    rank = dist.get_rank()
    dist.monitored_barrier(timeout=timedelta(seconds=30))
    dist.monitored_barrier(timeout=timedelta(seconds=30), wait_all_ranks=True)
    limit = 1.0
    for missing, wait_all in (([2], False), ([2, 3], True)):
        dist.barrier()
        if rank in missing:
            continue
        start = time.monotonic()
        try:
            dist.monitored_barrier(timeout=timedelta(seconds=limit), wait_all_ranks=wait_all)
        except RuntimeError as exc:
            message, elapsed = str(exc), time.monotonic() - start
        else:
            raise AssertionError(f"rank {rank}: monitored_barrier passed with ranks {missing} missing")
        named = (f"Ranks {', '.join(map(str, missing))} failed to pass monitoredBarrier in 1000 ms" if wait_all
                 else f"Rank {missing[0]} failed to pass monitoredBarrier in 1000 ms")
        assert named in message, (rank, message)
        if rank == 0:
            # it waited its timeout, and not much longer (a loaded 2-core machine: 2 s of slack)
            assert limit <= elapsed < limit + 2.0, (elapsed, message)
        else:
            assert f"Rank {rank} successfully reached monitoredBarrier" in message and "rank 0 reports" in message, message
            assert elapsed < limit + 2.0, elapsed
    dist.barrier()
    dist.monitored_barrier(timeout=timedelta(seconds=30))  # the skipped calls left nothing behind
    # a group rank 0 of which is global rank 1
    sub = dist.new_group([1, 2, 3])
    if rank in (1, 2):
        try:
            dist.monitored_barrier(sub, timeout=0.5)
        except RuntimeError as exc:
            assert ("Rank 2 failed to pass" if rank == 1 else "Rank 1 successfully reached") in str(exc), str(exc)
        else:
            raise AssertionError("monitored_barrier on the subgroup passed with its rank 2 missing")
    dist.barrier()


def abort():
    # Waits that test between sleeps (poll; the job runs with MPIDIST_TORCH_PROGRESS=poll) are released by abort.
    _work.PROGRESS = "poll"
    abort_one()


def abort_thread():
    # thread mode: the progress thread waits inside MPI; with MPIDIST_TORCH_ABORTABLE=1 abort ends that wait
    # (and the thread), and a caller's wait with a timeout is released (a plain wait() inside MPI_Wait is not)
    progress, abortable = _work.PROGRESS, _work.ABORTABLE
    _work.PROGRESS, _work.ABORTABLE = "thread", True
    try:
        abort_one()
    finally:
        _work.PROGRESS, _work.ABORTABLE = progress, abortable


def abort_one():
    rank = dist.get_rank()
    group = dist.new_group([0, 1])
    if rank in (0, 1):
        t = torch.ones(4)
        dist.all_reduce(t, group=group)
        assert t.tolist() == [2.0] * 4
    dist.barrier()
    if rank == 0:  # rank 1 never joins these: without abort, both waits would block forever
        blocked = dist.all_reduce(torch.ones(1000), group=group, async_op=True)
        future = dist.all_reduce(torch.ones(8), group=group, async_op=True).get_future()
        progress_thread = _work._progress._thread  # now blocked on that future's allreduce
        receive = dist.irecv(torch.empty(3), src=1, group=group)  # never sent: abort cancels it
        released = {}

        def wait_future():
            try:
                future.wait()
            except Exception as exc:  # noqa: BLE001
                released["future"] = (time.monotonic(), exc)
        waiter = threading.Thread(target=wait_future)
        waiter.start()
        start = time.monotonic()
        aborter = threading.Timer(0.5, c10d._abort_process_group, args=(group,))
        aborter.start()
        try:
            # poll: a plain wait() returns; thread: a wait inside MPI_Wait cannot be woken (see _work), one
            # with a timeout tests between sleeps and does
            blocked.wait() if _work.PROGRESS == "poll" else blocked.wait(timedelta(seconds=60))
        except AbortedError as exc:
            elapsed = time.monotonic() - start
            assert "aborted" in str(exc), str(exc)
        else:
            raise AssertionError("wait() returned normally on an aborted group")
        assert 0.5 <= elapsed < 5, elapsed
        waiter.join(5)
        aborter.join(5)
        try:
            receive.wait()
        except AbortedError:
            pass
        else:
            raise AssertionError("a receive of an aborted group completed")
        assert "future" in released and "aborted" in str(released["future"][1]), released
        try:
            group.allreduce([torch.ones(1)]).wait()
        except AbortedError:
            pass
        else:
            raise AssertionError("an aborted group took a new operation")
        assert group not in c10d._world.pg_map
        if _work.PROGRESS == "thread" and _work.ABORTABLE:  # released from MPI_Waitany, the old thread ended
            progress_thread.join(5)
            assert not progress_thread.is_alive(), "the progress thread stayed blocked in the aborted allreduce"
    elif rank == 1:
        c10d._abort_process_group(group)
    # futures of the default group still complete (in thread mode the progress thread that is stuck in
    # MPI_Wait on the aborted group's allreduce was replaced)
    t = contribution(rank)
    dist.all_reduce(t, async_op=True).get_future().wait()
    assert np.array_equal(t.numpy(), np.sum([contribution(r).numpy() for r in range(dist.get_world_size())], axis=0))


def shutdown():
    rank, n = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(n)))
    t = torch.full((3,), float(rank))
    work = dist.all_reduce(t, group=group, async_op=True)
    dist.destroy_process_group(group)  # waits for the allreduce, then frees the communicators
    assert work.is_completed() and t.tolist() == [float(sum(range(n)))] * 3, t
    start = time.monotonic()
    for i in range(1100):
        group = dist.new_group([0, 1])
        dist.destroy_process_group(group)
    if rank == 0:
        print(f"1100 new_group/destroy_process_group cycles in {time.monotonic() - start:.1f} s", flush=True)
    expect_sum(None, list(range(n)))


def main():
    dist.init_process_group("mpidist")
    for scenario in sys.argv[1:]:
        {"split": split, "monitor": monitor, "abort": abort, "abort_thread": abort_thread, "shutdown": shutdown}[scenario]()
        dist.barrier()
        print(f"rank {dist.get_rank()}: {scenario} ok", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
