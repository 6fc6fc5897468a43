"""The elastic job: a fault-tolerant communicator, the failure guard around each step, and the training loop.

``Elastic.train`` runs ``step_fn`` once per step; a lost rank surfaces on every survivor as an MPI error inside
some collective, which ``guard`` turns into one ``RankFailure`` (revoke, shrink, agree on the commit). The loop
then rolls the ``State`` back to the agreed commit, throws away the wrapper built on the dead communicator and
calls ``build(comm)`` for a new one over the survivors: DDP re-broadcasts the (identical) restored parameters
and lays out its buckets afresh, so nothing in DDP knows about failures.

Ending is agreed too: a collective can complete on some ranks and fail on others, so a rank that finished its
last step might leave while the others recover and wait for it in Shrink. The loop ends only after a
``Comm.Agree`` (ULFM's fault-tolerant consensus, which gives every survivor the same answer) succeeds.

Leaving: after two failures Open MPI 5.0.11's ``MPI_Finalize`` never returns (measured with plain mpi4py too;
acknowledging the failures first does not help), so a process that survived a failure ends at exit with its
output flushed and ``os._exit(0)``, skipping MPI_Finalize, as the dead ranks did.
"""

import atexit
import contextlib
import os
import sys
import time

from mpi4py import MPI

from .. import optim
from ..parallel.interface import as_wrapper
from .failure import RankFailure, process_failure, recover
from .fault import faults_from_env, install_kill_on_error
from .support import check_support

__all__ = ["Elastic", "init"]


class Elastic:
    """A job that survives the loss of ranks (ULFM); refused with ``FaultToleranceUnavailable`` where it cannot.

    ``comm``: the world to start from (``MPI.COMM_WORLD`` by default); ``self.comm`` is a duplicate with
    ``ERRORS_RETURN``, replaced by the survivors' communicator after each failure. ``kill_on_error``: an uncaught
    exception on this rank prints its traceback and SIGKILLs it, so the others are told and continue.
    ``faults``: the ``Fault``s to inject (default: those of ``MPIDIST_FAULT``).
    """

    def __init__(self, comm=None, *, kill_on_error=True, faults=None, log=True):
        check_support(comm)
        base = MPI.COMM_WORLD if comm is None else comm
        self.world_rank = MPI.COMM_WORLD.Get_rank()
        self.comm = base.Dup()
        self.comm.Set_errhandler(MPI.ERRORS_RETURN)
        self.faults = faults_from_env() if faults is None else tuple(faults)
        self.failures = []  # every RankFailure survived, oldest first
        self._tracked = []  # communicators derived from self.comm (a mesh's), revoked on a failure
        self.log = log
        if kill_on_error:
            install_kill_on_error(self.world_rank)
        # Registered after mpi4py's own exit handler, so it runs first (atexit is last in, first out).
        atexit.register(self._exit_without_finalize)

    def _exit_without_finalize(self):
        if not self.failures:
            return
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

    def say(self, text):
        """Print ``text`` once per job (from the lowest live rank)."""
        if self.log and self.comm.Get_rank() == 0:
            print(f"[elastic] {text}", flush=True)

    def track(self, *comms):
        """Register communicators derived from ``self.comm`` (a mesh's pp and dp groups); return them.

        A rank blocked in a collective over a derived communicator with live members is told of a failure only
        when one of them revokes it: on a failure every rank revokes what it tracks, then ``self.comm``.
        Derived communicators inherit ``ERRORS_RETURN``. The list is cleared at each failure (build again).
        """
        for c in comms:
            if c is not None:
                c.Set_errhandler(MPI.ERRORS_RETURN)
                self._tracked.append(c)
        return comms[0] if len(comms) == 1 else comms

    def _track_wrapper(self, built):
        """Track the communicators the wrapper talks over (``mesh.comm`` where not ``self.comm``, and
        ``communicators()``: hybrid FSDP's groups, a pipeline's dp and tied-weight groups), then wait for every rank
        to have done so: a rank that went on into one of them while another was lost before tracking it would
        wait there, told by nobody."""
        wrapper = as_wrapper(built)
        own = [c for c in (wrapper.mesh.comm, *wrapper.communicators())
               if c is not None and c is not self.comm and not any(c is t for t in self._tracked)]
        if own:
            self.track(*own)
        # On every rank, also one holding none (a pipeline's middle stages hold no tied weight's group).
        self.comm.Barrier()
        return built

    @contextlib.contextmanager
    def guard(self, commit):
        """Turn a process failure raised inside the block into ``RankFailure`` on this rank (all survivors do).

        ``commit``: this rank's latest commit id, or a function returning it when the failure is handled (commits
        taken inside the block count); the survivors agree on the smallest. Other exceptions pass unchanged.
        """
        try:
            yield
        except Exception as exc:  # noqa: BLE001 - only process failures are handled; the rest is re-raised
            error = process_failure(exc, [self.comm, *self._tracked])
            if error is None:
                raise
            tracked, self._tracked = self._tracked, []
            for c in tracked:
                try:
                    c.Revoke()
                except MPI.Exception:  # already revoked by a peer
                    pass
            failure = recover(self.comm, commit() if callable(commit) else commit, error)
            self.comm = failure.comm
            self.failures.append(failure)
            raise failure from exc

    def train(self, state, build, step_fn, steps, commit_every=1, on_failure=None):
        """Run ``step_fn(wrapper, comm, state)`` until ``state.step == steps``; return the last wrapper.

        ``build(comm)`` returns the wrapper (``DDP(module, comm)``, ``FSDP(module, comm)``, a pipeline); it is
        called at the start and after each failure. ``state`` is a ``State`` (any layout, read through the wrapper
        interface): it builds the wrapper through ``build``, commits, and after a failure restores the agreed
        commit on the survivors and builds the wrapper again. ``step_fn`` takes one step and leaves ``state`` consistent (optimizer
        stepped, sampler advanced); the loop counts ``state.step`` and commits every ``commit_every`` steps and
        at the end. ``on_failure(failure)`` is called on every survivor after the restore.

        The restore runs under the guard too: a rank lost while the survivors restore (its collectives) is one
        more failure, and the restore starts again from the same commit over fewer ranks.
        """
        if commit_every < 1:
            raise ValueError(f"Elastic.train: commit_every must be >= 1 (got {commit_every})")
        if commit_every != 1 and state.roll_forward:
            raise ValueError(f"Elastic.train: commit_every={commit_every} with State(roll_forward=True): its commits "
                             f"keep no arrays, so a failure between commits would find every survivor past its "
                             f"latest commit; roll_forward needs a commit after every step (commit_every=1)")
        _check_save_faults(self.faults, state, steps)
        state.faults = self.faults  # at=save faults fire inside the state's checkpoint saves
        after_update = None
        if any(f.at == "update" for f in self.faults):
            after_update = optim.register_optimizer_step_post_hook(
                lambda opt, args, kwargs: [f.maybe_fail(self.world_rank, state.step, at="update") for f in self.faults])
        try:
            return self._train(state, build, step_fn, steps, commit_every, on_failure)
        finally:
            if after_update is not None:
                after_update.remove()

    def _train(self, state, build, step_fn, steps, commit_every, on_failure):
        wrapper, failure = None, None
        while True:
            try:
                with self.guard(lambda: state.committed_id):
                    if failure is None:
                        for fault in self.faults:
                            fault.maybe_fail(self.world_rank, 0, at="start")
                        wrapper = self._track_wrapper(state.start(build, self.comm))
                        state.commit()
                    else:
                        started = time.perf_counter()
                        if failure.commit is None:  # lost before the first commit: start again (see below)
                            wrapper = self._track_wrapper(state.start(build, self.comm))
                            state.commit()
                            failure.restored_from = "nothing to restore: lost before the first commit, started again"
                        else:
                            wrapper = self._track_wrapper(state.restore(failure, build, self.comm))
                        failure.restore_s = time.perf_counter() - started
                        failure.step = state.step
                        self.say(f"lost world rank(s) {failure.failed} (MPI error class {failure.error_class}); "
                                 f"shrink+agree {failure.shrink_s * 1e3:.1f} ms, back to the commit of step "
                                 f"{state.step}, restored and rebuilt in {failure.restore_s * 1e3:.1f} ms "
                                 f"({failure.restored_from}); continuing on {self.comm.Get_size()} ranks")
                        done, failure = failure, None
                        if on_failure is not None:
                            on_failure(done)
                    while state.step < steps:
                        for fault in self.faults:
                            fault.maybe_fail(self.world_rank, state.step)
                        step_fn(wrapper, self.comm, state)
                        state.step += 1
                        if state.step % commit_every == 0 or state.step == steps:
                            state.commit()
                    self.comm.Agree(1)  # everyone reached the end: uniform on every survivor
                return wrapper
            except RankFailure as lost:
                _release(wrapper)
                wrapper = None
                if lost.commit is None:
                    # Before the first commit nothing was trained: start again over the survivors, where the
                    # state still has what it started from (commits some ranks took are dropped).
                    why = state.cannot_start_again()
                    if why is not None:
                        raise RuntimeError(f"mpidist.elastic: {lost}, but before the first commit completed, and "
                                           f"{why}") from lost
                    state.forget_commits()
                if failure is not None:  # lost during a restore: restore again, reporting both as one failure
                    lost.failed = sorted(set(failure.failed) | set(lost.failed))
                    lost.old_size = failure.old_size
                    self.failures.remove(failure)  # never restored from: no timings of its own
                failure = lost


def _check_save_faults(faults, state, steps):
    """Refuse ``at=save`` faults that would never fire: the state saves no checkpoint, or none at that step;
    and ``at=commit`` ones: only a ``State`` with two buddies or more exchanges packets twice in a commit."""
    committing = [f for f in faults if f.at == "commit"]
    if committing and state.replicas < 3:
        raise ValueError(f"MPIDIST_FAULT: at=commit (rank {committing[0].rank}, step {committing[0].step}) fails "
                         f"between the first and second buddy exchanges of a State commit, which need "
                         f"replicas >= 3 (this State has replicas={state.replicas})")
    saving = [f for f in faults if f.at == "save"]
    if not saving:
        return
    every = state.checkpoint_every
    if every is None:
        raise ValueError(f"MPIDIST_FAULT: at=save (rank {saving[0].rank}, step {saving[0].step}) needs a state that "
                         f"saves disk checkpoints (State(checkpoint=DIR, checkpoint_every=N)); this State saves none")
    never = [f.step for f in saving if f.step % every or f.step > steps]
    if never:
        raise ValueError(f"MPIDIST_FAULT: at=save at step(s) {never}, but checkpoints are saved only after steps that "
                         f"are multiples of checkpoint_every={every}, up to steps={steps}")


def _release(built):
    """Detach a wrapper built on the dead communicator from its module (DDP's and FSDP's hooks)."""
    if built is not None:
        as_wrapper(built).remove()


def init(comm=None, **options):
    """Return an ``Elastic`` job over ``comm`` (the world by default), or raise ``FaultToleranceUnavailable``."""
    return Elastic(comm, **options)
