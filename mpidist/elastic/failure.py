"""From an MPI error about a dead rank to one ``RankFailure`` on every survivor: revoke, shrink, agree.

Words used here:

- *process failure*: an ``MPI.Exception`` of class ``ERR_PROC_FAILED`` / ``ERR_PROC_FAILED_PENDING`` (the dead
  rank's direct peers see it) or ``ERR_REVOKED`` (everyone else, once some rank revoked the communicator).
- *commit id*: the step number of a rank's latest in-memory commit (``State``). Ranks may be one commit apart
  when a failure hits (a collective can complete on some ranks and fail on others), so the survivors agree on
  the smallest and all roll back to it.

Every rank revokes on any failure: with point-to-point traffic only the dead rank's peer learns of it, and a
rank that does not revoke would leave the others waiting for it in a collective that can never complete.
"""

import time

from mpi4py import MPI

__all__ = ["RankFailure", "process_failure", "recover"]

FAILURE_CLASSES = tuple(getattr(MPI, name) for name in ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING", "ERR_REVOKED")
                        if hasattr(MPI, name))


class RankFailure(Exception):
    """Ranks were lost; the survivors hold a new communicator and the commit they all roll back to.

    Attributes: ``failed`` (world ranks lost), ``comm`` (the survivors' communicator), ``old_size``,
    ``commit`` (agreed commit id; None when some survivor had none yet), ``error_class`` (the MPI error
    class this rank saw), ``detected_at``
    (``time.time()`` when this rank saw the error), ``shrink_s`` (revoke + shrink + agreement, seconds),
    and, filled by ``Elastic.train``: ``restore_s`` (rollback and rebuilding the wrapper), ``step`` (the
    step training resumed from) and ``restored_from`` (what the state came back from, set by the state).
    """

    def __init__(self, failed, comm, old_size, commit, error_class, detected_at, shrink_s):
        self.failed, self.comm, self.old_size, self.commit = list(failed), comm, old_size, commit
        self.error_class, self.detected_at, self.shrink_s = error_class, detected_at, shrink_s
        self.restore_s = self.step = None
        self.restored_from = "in-memory commit"
        super().__init__(f"lost world rank(s) {self.failed}: continuing on {comm.Get_size()} of {old_size} ranks "
                         f"from the commit of step {commit}")


def process_failure(exc, comms=()):
    """Return the ``MPI.Exception`` reporting a dead rank or a revoked communicator in ``exc``'s chain, or None.

    The chain matters: mpidist's agreement helpers and handles re-raise MPI's error inside their own.
    ``comms``: the job's communicators. A nonblocking collective whose peer died fails in Open MPI 5.0.11's
    libnbc with ``ERR_OTHER`` ("an error 75 was found during schedule"), not ``ERR_PROC_FAILED``; any other MPI
    error counts as a process failure when one of ``comms`` is revoked or knows of failed ranks (ULFM's
    ``Is_revoked`` / ``Get_failed``, local queries).
    """
    seen, other = set(), None
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, MPI.Exception):
            if exc.Get_error_class() in FAILURE_CLASSES:
                return exc
            other = other or exc
        exc = exc.__cause__ or exc.__context__
    if other is not None and any(_has_failed(c) for c in comms):
        return other
    return None


def _has_failed(comm):
    try:
        if comm.Is_revoked():
            return True
        failed = comm.Get_failed()
        try:
            return failed.Get_size() > 0
        finally:
            failed.Free()
    except (MPI.Exception, NotImplementedError, AttributeError):
        return False


def _lost_world_ranks(old, new):
    lost = MPI.Group.Difference(old.Get_group(), new.Get_group())
    try:
        ranks = MPI.Group.Translate_ranks(lost, list(range(lost.Get_size())), MPI.COMM_WORLD.Get_group())
    finally:
        lost.Free()
    return sorted(int(r) for r in ranks)


def recover(comm, commit, error):
    """Revoke ``comm``, shrink it to the survivors and agree on the commit; return the ``RankFailure`` to raise.

    ``commit`` is this rank's latest commit id; ``error`` the MPI exception it saw. A further failure during the
    agreement shrinks again, so two failures in a row end in one ``RankFailure`` naming both.
    """
    detected_at = time.time()
    start = time.perf_counter()
    current, old_size = comm, comm.Get_size()
    while True:
        try:
            current.Revoke()
        except MPI.Exception:  # already revoked by a peer: nothing to add
            pass
        survivors = current.Shrink()
        survivors.Set_errhandler(MPI.ERRORS_RETURN)
        try:
            agreed = survivors.allreduce(-1 if commit is None else commit, op=MPI.MIN)
            break
        except MPI.Exception as again:
            if process_failure(again) is None:
                raise
            current = survivors
    return RankFailure(_lost_world_ranks(comm, survivors), survivors, old_size, None if agreed < 0 else agreed,
                       error.Get_error_class(),
                       detected_at, time.perf_counter() - start)
