"""Requests, persistent requests, matched messages and status: MPI's completion calls on simulated operations.

A request is active until a Wait/Test completes it; it then becomes null (false, equal to
``MPI.REQUEST_NULL``) like mpi4py's. Persistent requests stay valid (inactive) until ``Free``.
"""

import threading

from mpi4py import MPI

from .errors import mpi_error
from .handles import Handles

__all__ = ["SimRequest", "SimPrequest", "SimMessage", "fill_status", "REQUEST_NULL", "MESSAGE_NULL", "MESSAGE_NO_PROC"]


def fill_status(status, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, nbytes=0, cancelled=False):
    """Write a completed operation's source, tag and size into an ``MPI.Status`` (if given)."""
    if status is not None:
        status.Set_source(source)
        status.Set_tag(tag)
        status.Set_error(MPI.SUCCESS)
        status.Set_elements(MPI.BYTE, nbytes)
        status.Set_cancelled(cancelled)


class _Detached:
    """The universe of requests that are complete from the start (a matched message's receive)."""

    def __init__(self):
        self.cond = threading.Condition()

    def wait_until(self, world_rank, ready, what):
        if not ready():
            raise RuntimeError(f"{what}: a detached request was not ready")

    def changed(self):
        pass


_DETACHED = _Detached()


def _status_slots(statuses, n):
    """The statuses to fill for ``n`` requests: a list grows to ``n`` (as mpi4py's does), a tuple fills what it has."""
    if statuses is None:
        return [None] * n
    if isinstance(statuses, list):
        while len(statuses) < n:
            statuses.append(MPI.Status())
    return list(statuses[:n]) + [None] * (n - len(statuses))


class SimRequest(Handles):
    """Request of a nonblocking simulated operation (``Wait``/``Test``... like ``MPI.Request``)."""

    _NULL_HANDLE = MPI.REQUEST_NULL.handle

    def __new__(cls, *args, **kwargs):
        self = object.__new__(cls)
        if args and isinstance(args[0], SimRequest):
            self.__dict__ = args[0].__dict__  # MPI.Request(request): a second handle on the same request
        return self

    def __init__(self, universe=None, world_rank=None, ready=None, finish=None, what="", cancel=None, peek=None):
        if isinstance(universe, SimRequest):
            return
        if isinstance(universe, MPI.Request):
            if universe != MPI.REQUEST_NULL:
                raise TypeError(f"MPI.Request: expecting a simulated request (got {universe!r})")
            universe = None
        if universe is None and ready is not None:
            universe = _DETACHED
        self._universe, self._world_rank = universe, world_rank
        self._ready, self._finish, self._what, self._cancel = ready, finish, what, cancel
        self._peek = peek    # (source, tag, nbytes, cancelled) of a ready request before it completes, or None
        self._result = None
        self._status = None  # (source, tag, nbytes, cancelled) once complete

    # -- state ------------------------------------------------------------------------------------
    def _active(self):
        return self._ready is not None

    def __bool__(self):
        return self._ready is not None

    def __eq__(self, other):
        if isinstance(other, SimRequest):
            return self.__dict__ is other.__dict__ or (not self and not other)
        if isinstance(other, MPI.Request):
            return not self and other == MPI.REQUEST_NULL
        return NotImplemented

    def __ne__(self, other):
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    __hash__ = object.__hash__

    def __repr__(self):
        return f"<SimRequest {self._what or 'null'}{'' if self else ' (null)'}>"

    def __reduce__(self):
        if self is REQUEST_NULL:
            return "REQUEST_NULL"
        if self:
            raise ValueError(f"cannot pickle an active request ({self!r})")
        return SimRequest, ()

    def _complete(self, status):
        """Finish (lock held, ready) and turn null; fill ``status``."""
        if self._ready is None:
            fill_status(status)
            return self._result
        self._result, self._status = self._finish()  # (object result, (source, tag, nbytes, cancelled) or None)
        self._deactivate()
        if self._status is not None:
            fill_status(status, *self._status)
        else:
            fill_status(status)
        return self._result

    def _deactivate(self):
        self._ready = self._finish = self._cancel = self._peek = None

    # -- completion ---------------------------------------------------------------------------------
    def Wait(self, status=None):
        """Block until the operation completes."""
        if self._universe is not None:
            with self._universe.cond:
                if self._ready is not None:
                    self._universe.wait_until(self._world_rank, self._ready, self._what)
                self._complete(status)
        else:
            self._complete(status)
        return True

    def Test(self, status=None):
        """Complete the operation if it can complete now; return whether it did."""
        if self._ready is None:
            fill_status(status)
            return True
        with self._universe.cond:
            if not self._ready():
                return False
            self._complete(status)
        return True

    def Get_status(self, status=None):
        """Return whether the operation is complete, without completing it; fill ``status`` if it is."""
        if self._ready is None:
            fill_status(status)
            return True
        with self._universe.cond:
            return self._peek_status(status)

    def _peek_status(self, status):
        """(lock held) Whether this active request is ready; if so fill ``status`` without completing it."""
        if not self._ready():
            return False
        if self._peek is not None:
            fill_status(status, *self._peek())
        else:
            fill_status(status)
        return True

    def wait(self, status=None):
        """Block until the operation completes and return its object result."""
        self.Wait(status)
        result, self._result = self._result, None
        return result

    def test(self, status=None):
        """Return (completed, object result or None)."""
        if self.Test(status):
            result, self._result = self._result, None
            return True, result
        return False, None

    def get_status(self, status=None):
        return self.Get_status(status)

    def cancel(self):
        """Cancel a pending receive (as ``Cancel``)."""
        self.Cancel()

    def free(self):
        """Release the request (as ``Free``)."""
        self.Free()

    def Cancel(self):
        """Cancel a pending receive (sends here complete at once, so cancelling them does nothing)."""
        if not self:
            raise mpi_error(MPI.ERR_REQUEST, "Request.Cancel: the request is MPI.REQUEST_NULL")
        if self._cancel is not None:
            with self._universe.cond:
                if self._cancel():
                    self._ready, self._finish = (lambda: True), (lambda: (None, (MPI.ANY_SOURCE, MPI.ANY_TAG, 0, True)))
                    self._universe.changed()

    def Free(self):
        """Release the request (an active one completes in the background, as MPI lets it)."""
        if not self:
            raise mpi_error(MPI.ERR_REQUEST, "Request.Free: the request is MPI.REQUEST_NULL")
        self._deactivate()

    # -- many requests --------------------------------------------------------------------------------
    @staticmethod
    def _pick(requests, want_all, want_some):
        pass

    @classmethod
    def _universe_of(cls, requests):
        """(universe, world rank) of the active requests (None: none is active); a real universe wins over
        the detached one, whose requests are ready from the start."""
        found = None, None
        for r in requests:
            if isinstance(r, SimRequest) and r._ready is not None:
                if r._universe is not _DETACHED:
                    return r._universe, r._world_rank
                found = _DETACHED, None
        return found

    @classmethod
    def Waitall(cls, requests, statuses=None):
        """Wait for every request; fill ``statuses`` (a list) in order."""
        requests = list(requests)
        for req, status in zip(requests, _status_slots(statuses, len(requests))):
            req.Wait(status)
        return True

    @classmethod
    def Get_status_all(cls, requests, statuses=None):
        """Return whether every request is complete, completing none; fill ``statuses`` if they all are."""
        requests = list(requests)
        u, _ = cls._universe_of(requests)
        slots = _status_slots(statuses, len(requests))
        if u is None:
            for status in slots:
                fill_status(status)
            return True
        with u.cond:
            if not all(r._ready is None or r._ready() for r in requests):
                return False
            for r, status in zip(requests, slots):
                if r._ready is None:
                    fill_status(status)
                else:
                    r._peek_status(status)
        return True

    @classmethod
    def Get_status_any(cls, requests, status=None):
        """Return (index, flag) of a complete active request, completing none (``MPI.UNDEFINED``: none active)."""
        requests = list(requests)
        u, _ = cls._universe_of(requests)
        if u is None:
            fill_status(status)
            return MPI.UNDEFINED, True
        with u.cond:
            for i, r in enumerate(requests):
                if r._ready is not None and r._peek_status(status):
                    return i, True
        return MPI.UNDEFINED, False

    @classmethod
    def Get_status_some(cls, requests, statuses=None):
        """Return the indices of the complete active requests, completing none (None: none active)."""
        requests = list(requests)
        u, _ = cls._universe_of(requests)
        if u is None:
            return None
        with u.cond:
            done = [i for i, r in enumerate(requests) if r._ready is not None and r._ready()]
            for i, status in zip(done, _status_slots(statuses, len(done))):
                requests[i]._peek_status(status)
        return done

    get_status_all, get_status_any, get_status_some = Get_status_all, Get_status_any, Get_status_some

    @classmethod
    def waitall(cls, requests, statuses=None):
        requests = list(requests)
        cls.Waitall(requests, statuses)
        out = []
        for req in requests:
            out.append(req._result)
            req._result = None
        return out

    @classmethod
    def Testall(cls, requests, statuses=None):
        """Complete every request if all can complete now; return whether they did."""
        requests = list(requests)
        u, _ = cls._universe_of(requests)
        if u is not None:
            with u.cond:
                if not all(r._ready is None or r._ready() for r in requests):
                    return False
        cls.Waitall(requests, statuses)
        return True

    @classmethod
    def testall(cls, requests, statuses=None):
        requests = list(requests)
        if cls.Testall(requests, statuses):
            out = [r._result for r in requests]
            for r in requests:
                r._result = None
            return True, out
        return False, None

    @classmethod
    def _waitany(cls, requests, status, block):
        requests = list(requests)
        u, rank = cls._universe_of(requests)
        if u is None:
            fill_status(status)
            return MPI.UNDEFINED, True
        found = []

        def ready():
            for i, r in enumerate(requests):
                if r._ready is not None and r._ready():
                    found.append(i)
                    return True
            return False
        with u.cond:
            if block:
                u.wait_until(rank, ready, "Waitany(" + ", ".join(r._what for r in requests if r) + ")")
            elif not ready():
                return MPI.UNDEFINED, False
            i = found[0]
            requests[i]._complete(status)
        return i, True

    @classmethod
    def Waitany(cls, requests, status=None):
        """Wait for one request; return its index (``MPI.UNDEFINED`` if none is active)."""
        return cls._waitany(requests, status, True)[0]

    @classmethod
    def waitany(cls, requests, status=None):
        requests = list(requests)
        i = cls.Waitany(requests, status)
        if i == MPI.UNDEFINED:
            return i, None
        result, requests[i]._result = requests[i]._result, None
        return i, result

    @classmethod
    def Testany(cls, requests, status=None):
        """Complete one request if one can; return (index, flag)."""
        return cls._waitany(requests, status, False)

    @classmethod
    def testany(cls, requests, status=None):
        requests = list(requests)
        i, flag = cls.Testany(requests, status)
        if i == MPI.UNDEFINED or not flag:
            return i, flag, None
        result, requests[i]._result = requests[i]._result, None
        return i, flag, result

    @classmethod
    def _some(cls, requests, statuses, block):
        requests = list(requests)
        u, rank = cls._universe_of(requests)
        if u is None:
            return None
        done = []

        def ready():
            done[:] = [i for i, r in enumerate(requests) if r._ready is not None and r._ready()]
            return bool(done)
        with u.cond:
            if block:
                u.wait_until(rank, ready, "Waitsome(" + ", ".join(r._what for r in requests if r) + ")")
            elif not ready():
                return []
            for k, i in enumerate(done):
                st = None
                if isinstance(statuses, list):
                    while len(statuses) <= k:
                        statuses.append(MPI.Status())
                    st = statuses[k]
                requests[i]._complete(st)
        return list(done)

    @classmethod
    def Waitsome(cls, requests, statuses=None):
        """Wait for at least one request; return the indices completed (None if none is active)."""
        return cls._some(requests, statuses, True)

    @classmethod
    def Testsome(cls, requests, statuses=None):
        """Complete the requests that can complete now; return their indices (None if none is active)."""
        return cls._some(requests, statuses, False)

    @classmethod
    def waitsome(cls, requests, statuses=None):
        requests = list(requests)
        idx = cls.Waitsome(requests, statuses)
        if idx is None:
            return None, None
        out = [requests[i]._result for i in idx]
        return idx, out

    @classmethod
    def testsome(cls, requests, statuses=None):
        requests = list(requests)
        idx = cls.Testsome(requests, statuses)
        if idx is None:
            return None, None
        return idx, [requests[i]._result for i in idx]

    @classmethod
    def Cancelall(cls, requests):
        for r in requests:
            if r:
                r.Cancel()


class SimPrequest(SimRequest):
    """Persistent request: ``Start`` begins the operation again; it stays valid until ``Free``."""

    def __init__(self, start=None, what="persistent request"):
        if isinstance(start, SimRequest):
            return
        super().__init__(what=what)
        self._start = start
        self._inner = None
        self._persistent = True

    def __bool__(self):
        return self._start is not None

    def Start(self):
        """Begin one instance of the operation."""
        if self._start is None:
            raise mpi_error(MPI.ERR_REQUEST, f"Prequest.Start: request {self._what} was freed")
        inner = self._start()
        self._universe, self._world_rank = inner._universe, inner._world_rank
        self._ready, self._finish, self._cancel, self._peek = inner._ready, inner._finish, inner._cancel, inner._peek

    def _deactivate(self):
        self._ready = self._finish = self._cancel = self._peek = None  # inactive, not null

    def Free(self):
        self._deactivate()
        self._start = None

    @classmethod
    def Startall(cls, requests):
        for r in requests:
            r.Start()


class SimMessage(Handles):
    """A message taken off the queue by a matched probe; ``Recv`` delivers it (like ``MPI.Message``)."""

    _NULL_HANDLE = MPI.MESSAGE_NULL.handle

    def __new__(cls, *args, **kwargs):
        self = object.__new__(cls)
        if args and isinstance(args[0], SimMessage):
            self.__dict__ = args[0].__dict__  # MPI.Message(message): a second handle on the same message
        return self

    def __init__(self, comm=None, envelope=None, no_proc=False, constant=False):
        if isinstance(comm, SimMessage):
            if comm._constant:  # a copy of MESSAGE_NULL/MESSAGE_NO_PROC is a handle of its own
                self.__dict__ = dict(comm.__dict__, _constant=False)
            return
        if isinstance(comm, MPI.Message):
            no_proc = comm == MPI.MESSAGE_NO_PROC
            if not no_proc and comm != MPI.MESSAGE_NULL:
                raise TypeError(f"MPI.Message: expecting a simulated message (got {comm!r})")
            comm = None
        self._comm, self._env, self._no_proc = comm, envelope, no_proc
        self._constant = constant  # MESSAGE_NULL and MESSAGE_NO_PROC themselves never change

    def __bool__(self):
        return self._env is not None or self._no_proc

    def __eq__(self, other):
        if isinstance(other, SimMessage):
            return (self.__dict__ is other.__dict__ or (self._no_proc and other._no_proc)
                    or (not self and not other))
        if isinstance(other, MPI.Message):
            if self._no_proc:
                return other == MPI.MESSAGE_NO_PROC
            return not self and other == MPI.MESSAGE_NULL
        return NotImplemented

    def __ne__(self, other):
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    __hash__ = object.__hash__

    def __reduce__(self):
        if self._constant:
            return "MESSAGE_NO_PROC" if self._no_proc else "MESSAGE_NULL"  # the module's own constant
        if self._env is not None:
            raise ValueError(f"cannot pickle a pending message ({self!r})")
        return SimMessage, (None, None, self._no_proc)

    def __repr__(self):
        state = "MESSAGE_NO_PROC" if self._no_proc else "MESSAGE_NULL" if self._env is None else "pending"
        return f"<SimMessage {state}{' (constant)' if self._constant else ''}>"

    def free(self):
        """Drop the handle (a predefined message stays as it is)."""
        if not self._constant:
            self._env, self._no_proc = None, False

    def _take(self, what):
        if self._no_proc:
            if not self._constant:
                self._no_proc = False  # received: the handle is MESSAGE_NULL now, as in MPI
            return None
        if self._env is None:
            raise mpi_error(MPI.ERR_REQUEST, f"Message.{what}: the message was already received (MESSAGE_NULL)")
        env, self._env = self._env, None
        return env

    def Recv(self, buf, status=None):
        """Receive the matched message into ``buf``."""
        self.Irecv(buf).Wait(status)

    def Irecv(self, buf):
        """Start receiving the matched message into ``buf`` (it is already here: completes at once)."""
        from . import spec
        env = self._take("Irecv")
        if env is None:
            return SimRequest(None, None, lambda: True, lambda: (None, (MPI.PROC_NULL, MPI.ANY_TAG, 0, False)), "Message.Irecv")
        msg = spec.simple(buf, readonly=False)
        nbytes = msg.unpack(env[2], 0, "Message.Recv") if env[3] == "buf" else _object_size(env)
        info = (None, (env[0], env[1], nbytes, False))
        return SimRequest(None, None, lambda: True, lambda: info, "Message.Irecv")

    def recv(self, status=None):
        """Receive the matched message's Python object."""
        return self.irecv().wait(status)

    def irecv(self):
        env = self._take("irecv")
        if env is None:
            return SimRequest(None, None, lambda: True, lambda: (None, (MPI.PROC_NULL, MPI.ANY_TAG, 0, False)), "Message.irecv")
        obj = _load(env)
        info = (obj, (env[0], env[1], _object_size(env), False))
        return SimRequest(None, None, lambda: True, lambda: info, "Message.irecv")

    # the class-level probes of mpi4py's Message take a communicator
    @classmethod
    def Probe(cls, comm, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=None):
        return comm.Mprobe(source, tag, status)

    @classmethod
    def Iprobe(cls, comm, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=None):
        return comm.Improbe(source, tag, status)

    @classmethod
    def probe(cls, comm, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=None):
        return comm.mprobe(source, tag, status)

    @classmethod
    def iprobe(cls, comm, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=None):
        return comm.improbe(source, tag, status)


def _object_size(env):
    return len(env[2]) if isinstance(env[2], (bytes, bytearray)) else 0


def _load(env):
    payload = env[2]
    if env[3] == "obj":
        return MPI.pickle.loads(payload) if payload is not None else None
    return payload


def dumps(obj):
    """Pickle an object message the way mpi4py does (``MPI.pickle``), so custom picklers apply."""
    return MPI.pickle.dumps(obj)


REQUEST_NULL = SimRequest()
MESSAGE_NULL = SimMessage(constant=True)
MESSAGE_NO_PROC = SimMessage(no_proc=True, constant=True)
