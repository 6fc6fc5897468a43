"""Point-to-point: the four send modes, receives, probes and matched probes, buffer and object forms.

An envelope is (source, tag, payload, kind, sync): payload is the packed bytes of a buffer message or the
pickled bytes of an object message (so a buffer receive can take an object message and the other way
round, as in MPI); ``sync`` is a one-item list set when a receive matches a synchronous send.

Seeded order (``simulate(..., seed=k)``, ``mpidist sim --seed k``): a receive or probe with ``ANY_SOURCE`` may
match the oldest matching message of any sender (MPI's non-overtaking rule binds one sender, communicator and
tag only). Which one it takes should depend on the seed, not on which rank thread the GIL ran first, so the
choice waits for a settled point: every other live rank blocked, polling with nothing to receive, or itself
waiting to choose (the lowest such rank chooses first). Then a generator seeded with k picks among the
candidates ordered by sender rank. Receives are matched in posting order (an earlier receive gets the
message first); messages stay queued until a receive asks for them. A rank that computes for more than
``_PATIENCE`` seconds while another waits to choose lets that choice be made without it (timing-dependent).
"""

import random
import time
import warnings

import numpy as np
from mpi4py import MPI

from . import spec
from .errors import mpi_error
from .request import SimMessage, SimPrequest, SimRequest, dumps, fill_status

__all__ = ["PointToPoint"]


def _show(value, wildcard=None):
    return "ANY" if value in (MPI.ANY_SOURCE, MPI.ANY_TAG) else value


class _Slot:
    __slots__ = ("source", "tag", "envelope")

    def __init__(self, source, tag):
        self.source, self.tag, self.envelope = source, tag, None


_RECV_WHAT = {}  # (source, tag, communicator name) -> what a blocked Recv waits in (the same few recur)


def _as_bytes(payload):
    return payload if isinstance(payload, np.ndarray) else np.frombuffer(payload, np.uint8)


class PointToPoint:
    """Point-to-point methods of ``SimComm`` (mixed in)."""

    # -- checks ----------------------------------------------------------------------------------------
    def _check_peer(self, name, peer, what, wildcard):
        """Return ``peer`` as an int (as mpi4py reads it); raise ERR_RANK unless it is a rank of this communicator."""
        size = self.Get_size()
        peer = spec.c_int(peer)
        if peer == MPI.PROC_NULL or (wildcard and peer == MPI.ANY_SOURCE):
            return peer
        if not 0 <= peer < size:
            raise mpi_error(MPI.ERR_RANK, f"SimComm.{name}: {what} {peer} out of range for communicator of size {size}")
        return peer

    def _check_tag(self, name, tag, wildcard):
        """Return ``tag`` as an int (as mpi4py reads it); raise ERR_TAG unless it is a valid tag."""
        tag = spec.c_int(tag)
        if wildcard and tag == MPI.ANY_TAG:
            return tag
        if not 0 <= tag <= _TAG_UB:
            raise mpi_error(MPI.ERR_TAG, f"SimComm.{name}: tag {tag} is not in 0..{_TAG_UB}")
        return tag

    # -- sends -----------------------------------------------------------------------------------------
    def _post(self, name, payload, kind, dest, tag, sync):
        """Deposit an envelope at ``dest``; return the request (a synchronous one completes when matched)."""
        ctx = self._live(name)
        dest = self._check_peer(name, dest, "dest", False)
        tag = self._check_tag(name, tag, False)
        u = ctx.universe
        if dest == MPI.PROC_NULL:
            return SimRequest(u, self._world_rank, lambda: True, lambda: (None, None), name)
        matched = [False]
        env = (self._rank, tag, payload, kind, matched if sync else None)
        with u.cond:
            ctx.deliver(dest, env)
            u.changed()
        if not sync:
            return SimRequest(u, self._world_rank, lambda: True, lambda: (None, None), name)
        what = f"{name}(dest={dest}, tag={tag}) on {ctx.name} (synchronous: waits for a matching receive)"
        seeded = _seeded(u)
        if seeded is None:
            ready = lambda: matched[0]  # noqa: E731
        else:  # receives posted at dest match when asked: ask now
            ready = lambda: _match_settled(ctx, dest, seeded, self._world_rank, lambda: matched[0])  # noqa: E731
        return SimRequest(u, self._world_rank, ready, lambda: (None, None), what)

    def _send_buffer(self, name, buf, dest, tag, sync=False):
        if dest == MPI.PROC_NULL:
            spec.simple(buf, readonly=True, null=True)
            return self._post(name, None, "buf", dest, tag, sync)
        return self._post(name, spec.simple(buf, readonly=True).pack(), "buf", dest, tag, sync)

    def Isend(self, buf, dest, tag=0):
        """Start a standard-mode send (buffered at once)."""
        return self._send_buffer("Isend", buf, dest, tag)

    def Send(self, buf, dest, tag=0):
        """Blocking send in standard mode."""
        ctx = self._ctx
        if (type(buf) is np.ndarray and ctx is not None and type(dest) is int and type(tag) is int
                and 0 <= dest < len(ctx.world_ranks) and 0 <= tag <= _TAG_UB):
            # Fast path (a numpy array to a rank): what _send_buffer(...).Wait() does, without the request.
            data = spec.numpy_bytes(buf, True)
            if data is not None:
                u = ctx.universe
                env = (self._rank, tag, data.copy(), "buf", None)
                with u.cond:
                    ctx.deliver(dest, env)
                    u.changed()
                return
        self._send_buffer("Send", buf, dest, tag).Wait()

    def Ibsend(self, buf, dest, tag=0):
        return self._send_buffer("Ibsend", buf, dest, tag)

    def Bsend(self, buf, dest, tag=0):
        """Blocking send in buffered mode."""
        self._send_buffer("Bsend", buf, dest, tag).Wait()

    def Irsend(self, buf, dest, tag=0):
        return self._send_buffer("Irsend", buf, dest, tag)

    def Rsend(self, buf, dest, tag=0):
        """Blocking send in ready mode."""
        self._send_buffer("Rsend", buf, dest, tag).Wait()

    def Issend(self, buf, dest, tag=0):
        """Start a synchronous send: it completes when a receive has matched it."""
        return self._send_buffer("Issend", buf, dest, tag, sync=True)

    def Ssend(self, buf, dest, tag=0):
        """Blocking synchronous send."""
        self._send_buffer("Ssend", buf, dest, tag, sync=True).Wait()

    def _send_object(self, name, obj, dest, tag, sync=False):
        return self._post(name, dumps(obj) if dest != MPI.PROC_NULL else None, "obj", dest, tag, sync)

    def isend(self, obj, dest, tag=0):
        return self._send_object("isend", obj, dest, tag)

    def send(self, obj, dest, tag=0):
        """Send a Python object."""
        self._send_object("send", obj, dest, tag).Wait()

    def ibsend(self, obj, dest, tag=0):
        return self._send_object("ibsend", obj, dest, tag)

    def bsend(self, obj, dest, tag=0):
        self._send_object("bsend", obj, dest, tag).Wait()

    def issend(self, obj, dest, tag=0):
        return self._send_object("issend", obj, dest, tag, sync=True)

    def ssend(self, obj, dest, tag=0):
        self._send_object("ssend", obj, dest, tag, sync=True).Wait()

    # -- receives ----------------------------------------------------------------------------------------
    def _receive(self, name, source, tag, deliver):
        """Post a receive; ``deliver(envelope)`` returns (result, nbytes) when it completes."""
        ctx = self._live(name)
        source = self._check_peer(name, source, "source", True)
        tag = self._check_tag(name, tag, True)
        u = ctx.universe
        if source == MPI.PROC_NULL:
            return SimRequest(u, self._world_rank, lambda: True,
                              lambda: (deliver(None)[0], (MPI.PROC_NULL, MPI.ANY_TAG, 0, False)), name)
        slot = _Slot(source, tag)
        seeded = _seeded(u)
        if seeded is not None:
            return self._seeded_receive(name, ctx, slot, seeded, deliver)
        with u.cond:
            env = ctx.take(self._rank, source, tag)
            if env is not None:
                slot.envelope = env
                if env[4] is not None:
                    env[4][0] = True
                    u.changed()
            else:
                ctx.posted[self._rank].append(slot)

        def ready():
            env = slot.envelope
            if env is not None and env[4] is not None and not env[4][0]:
                env[4][0] = True
                u.changed()
            return env is not None

        def finish():
            env = slot.envelope
            result, nbytes = deliver(env)
            return result, (env[0], env[1], nbytes, False)

        def cancel():
            posted = ctx.posted[self._rank]
            if slot in posted and slot.envelope is None:
                posted.remove(slot)
                return True
            return False
        def peek():
            env = slot.envelope
            return env[0], env[1], len(env[2]), False
        what = f"{name}(source={_show(source)}, tag={_show(tag)}) on {ctx.name}"
        return SimRequest(u, self._world_rank, ready, finish, what, cancel, peek)

    def _seeded_receive(self, name, ctx, slot, seeded, deliver):
        u, me, dest = ctx.universe, self._world_rank, self._rank
        key = (ctx.id, dest)
        with u.cond:
            seeded.pending.setdefault(key, []).append(slot)

        def ready():
            return _match_settled(ctx, dest, seeded, me, lambda: slot.envelope is not None)

        def finish():
            env = slot.envelope
            result, nbytes = deliver(env)
            return result, (env[0], env[1], nbytes, False)

        def cancel():
            pending = seeded.pending.get(key, [])
            if slot in pending and slot.envelope is None:
                pending.remove(slot)
                return True
            return False

        def peek():
            env = slot.envelope
            return env[0], env[1], len(env[2]), False
        what = f"{name}(source={_show(slot.source)}, tag={_show(slot.tag)}) on {ctx.name}"
        return SimRequest(u, me, ready, finish, what, cancel, peek)

    def _buffer_deliver(self, name, buf, source):
        msg = spec.simple(buf, readonly=False, null=source == MPI.PROC_NULL)

        def deliver(env):
            if env is None:
                return None, 0
            return None, msg.unpack(_as_bytes(env[2]), 0, f"SimComm.{name}")
        return deliver

    def Irecv(self, buf, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG):
        """Start a receive into ``buf``."""
        return self._receive("Irecv", source, tag, self._buffer_deliver("Irecv", buf, source))

    def Recv(self, buf, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=None):
        """Blocking receive into ``buf``; fill ``status`` (source, tag, count)."""
        ctx = self._ctx
        if (type(buf) is np.ndarray and ctx is not None and type(source) is int and type(tag) is int
                and (0 <= source < len(ctx.world_ranks) or source == ANY_SOURCE)
                and (0 <= tag <= _TAG_UB or tag == ANY_TAG) and ctx.universe.seed is None):
            # Fast path (a numpy array from a rank, FIFO matching): what _receive(...).Wait() does, without
            # the request and its closures.
            data = spec.numpy_bytes(buf, False)
            if data is not None:
                self._recv_fast(ctx, data, buf, source, tag, status)
                return
        self._receive("Recv", source, tag, self._buffer_deliver("Recv", buf, source)).Wait(status)

    def _recv_fast(self, ctx, data, buf, source, tag, status):
        u = ctx.universe
        rank = self._rank
        with u.cond:
            env = ctx.take(rank, source, tag)
            if env is None:
                slot = _Slot(source, tag)
                ctx.posted[rank].append(slot)
                what = _RECV_WHAT.get((source, tag, ctx.name))
                if what is None:
                    what = f"Recv(source={_show(source)}, tag={_show(tag)}) on {ctx.name}"
                    if len(_RECV_WHAT) < 4096:
                        _RECV_WHAT[source, tag, ctx.name] = what
                u.wait_until(ctx.world_ranks[rank], lambda: slot.envelope is not None, what)
                env = slot.envelope
            elif env[4] is not None:
                env[4][0] = True  # a synchronous send completes once a receive has matched it
                u.changed()
            payload = env[2]
            nbytes = len(payload)
            if nbytes > data.size:  # truncation: the general path raises MPI's error with its message
                spec.simple(buf, readonly=False).unpack(_as_bytes(payload), 0, "SimComm.Recv")
            if nbytes:
                data[:nbytes] = _as_bytes(payload)
        fill_status(status, env[0], env[1], nbytes)

    @staticmethod
    def _object_deliver(env, capacity=None, name="recv"):
        if env is None:
            return None, 0
        payload = env[2]
        data = payload.tobytes() if isinstance(payload, np.ndarray) else payload
        if capacity is not None and len(data) > capacity:
            raise mpi_error(MPI.ERR_TRUNCATE, f"SimComm.{name}: message truncated ({len(data)} bytes into a "
                                              f"buffer of {capacity} bytes)")
        return (MPI.pickle.loads(data) if len(data) else None), len(data)  # an empty message reads as None

    def _object_receiver(self, name, buf):
        """``deliver`` for an object receive into ``buf`` (None: any size; an int: that many bytes)."""
        if buf is None:
            return self._object_deliver
        capacity = int(buf) if isinstance(buf, (int, np.integer)) else memoryview(buf).nbytes
        return lambda env: self._object_deliver(env, capacity, name)

    def irecv(self, buf=None, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG):
        """Start receiving a Python object; ``wait()`` returns it."""
        return self._receive("irecv", source, tag, self._object_receiver("irecv", buf))

    def recv(self, buf=None, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=None):
        """Receive a Python object."""
        if buf is not None:
            warnings.warn("the 'buf' argument is deprecated", UserWarning, stacklevel=2)  # as mpi4py 4 warns
        return self._receive("recv", source, tag, self._object_receiver("recv", buf)).wait(status)

    # -- combined --------------------------------------------------------------------------------------------
    def Sendrecv(self, sendbuf, dest, sendtag=0, recvbuf=None, source=MPI.ANY_SOURCE, recvtag=MPI.ANY_TAG,
                 status=None):
        """Send to ``dest`` and receive from ``source`` without deadlock."""
        send = self._send_buffer("Sendrecv", sendbuf, dest, sendtag)
        self.Recv(recvbuf, source, recvtag, status)
        send.Wait()

    def Isendrecv(self, sendbuf, dest, sendtag=0, recvbuf=None, source=MPI.ANY_SOURCE, recvtag=MPI.ANY_TAG):
        """Start a send and a receive; the request completes when both have."""
        send = self._send_buffer("Isendrecv", sendbuf, dest, sendtag)
        return _joined(send, self.Irecv(recvbuf, source, recvtag))

    def Sendrecv_replace(self, buf, dest, sendtag=0, source=MPI.ANY_SOURCE, recvtag=MPI.ANY_TAG, status=None):
        """Send ``buf`` and receive into the same buffer."""
        self.Isendrecv_replace(buf, dest, sendtag, source, recvtag).Wait(status)

    def Isendrecv_replace(self, buf, dest, sendtag=0, source=MPI.ANY_SOURCE, recvtag=MPI.ANY_TAG):
        if dest == MPI.PROC_NULL:
            send = self._post("Isendrecv_replace", None, "buf", dest, sendtag, False)
        else:
            send = self._post("Isendrecv_replace", spec.simple(buf, readonly=False).pack(), "buf", dest, sendtag, False)
        return _joined(send, self._receive("Isendrecv_replace", source, recvtag,
                                           self._buffer_deliver("Isendrecv_replace", buf, source)))

    def sendrecv(self, sendobj, dest, sendtag=0, recvbuf=None, source=MPI.ANY_SOURCE, recvtag=MPI.ANY_TAG,
                 status=None):
        """Send and receive Python objects."""
        send = self._send_object("sendrecv", sendobj, dest, sendtag)
        got = self.recv(None, source, recvtag, status)
        send.Wait()
        return got

    # -- persistent --------------------------------------------------------------------------------------------
    def Send_init(self, buf, dest, tag=0):
        """Persistent standard send: each ``Start`` sends the buffer's current contents."""
        return SimPrequest(lambda: self._send_buffer("Send_init", buf, dest, tag), f"Send_init(dest={dest}, tag={tag})")

    def Bsend_init(self, buf, dest, tag=0):
        return SimPrequest(lambda: self._send_buffer("Bsend_init", buf, dest, tag), f"Bsend_init(dest={dest}, tag={tag})")

    def Rsend_init(self, buf, dest, tag=0):
        return SimPrequest(lambda: self._send_buffer("Rsend_init", buf, dest, tag), f"Rsend_init(dest={dest}, tag={tag})")

    def Ssend_init(self, buf, dest, tag=0):
        return SimPrequest(lambda: self._send_buffer("Ssend_init", buf, dest, tag, sync=True),
                           f"Ssend_init(dest={dest}, tag={tag})")

    def Recv_init(self, buf, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG):
        """Persistent receive into ``buf``."""
        return SimPrequest(lambda: self.Irecv(buf, source, tag), f"Recv_init(source={_show(source)}, tag={_show(tag)})")

    # -- probes ---------------------------------------------------------------------------------------------------
    def _peek(self, name, source, tag, status, take):
        ctx = self._live(name)
        source = self._check_peer(name, source, "source", True)
        tag = self._check_tag(name, tag, True)
        if source == MPI.PROC_NULL:
            fill_status(status, MPI.PROC_NULL, MPI.ANY_TAG, 0)
            return "proc_null"
        seeded = _seeded(ctx.universe)
        env = (ctx.take(self._rank, source, tag, remove=take) if seeded is None
               else self._seeded_peek(ctx, source, tag, take, seeded))
        if env is not None:
            fill_status(status, env[0], env[1], len(env[2]))
            if take and env[4] is not None:
                env[4][0] = True
        return env

    def _seeded_peek(self, ctx, source, tag, take, seeded):
        """(lock held) The envelope a probe finds now, chosen at a settled point among several senders."""
        u, me, dest = ctx.universe, self._world_rank, self._rank
        key = (ctx.id, dest)
        started = None
        try:
            while True:
                _match_pending(ctx, dest, seeded)   # earlier receives take their messages first
                queue = ctx.unexpected[dest]
                firsts = _firsts(queue, source, tag)
                probed = seeded.probed.get(key)
                if not firsts:
                    seeded.idle[me] = u.epoch
                    return None
                if source != ANY_SOURCE:
                    index = firsts[0]
                    break
                index = next((i for i in firsts if queue[i] is probed), None)
                if index is not None:
                    break
                if u.failure is not None or u.deadlock is not None:
                    return None
                seeded.deciding.add(me)
                started = started or time.monotonic()
                if _settled(u, seeded, me) or time.monotonic() - started > _PATIENCE:
                    index = _choose(seeded, queue, tag)
                    break
                _pause(u)
        finally:
            seeded.deciding.discard(me)
        env = queue[index]
        if take:
            del queue[index]
            if seeded.probed.get(key) is env:
                del seeded.probed[key]
        else:
            seeded.probed[key] = env   # a later wildcard receive takes the message this probe reported
        return env

    def Iprobe(self, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=None):
        """Return whether a matching message is waiting, leaving it there; fill ``status``."""
        with self._live("Iprobe").universe.cond:
            return self._peek("Iprobe", source, tag, status, False) is not None

    def Probe(self, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=None):
        """Block until a matching message is waiting, leaving it there; fill ``status``."""
        u = self._live("Probe").universe
        what = f"Probe(source={_show(source)}, tag={_show(tag)}) on {self._ctx.name}"
        with u.cond:
            u.wait_until(self._world_rank, lambda: self._peek("Probe", source, tag, status, False) is not None, what)
        return True

    def iprobe(self, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=None):
        return self.Iprobe(source, tag, status)

    def probe(self, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=None):
        return self.Probe(source, tag, status)

    def _message(self, env):
        if env == "proc_null":
            return SimMessage(no_proc=True)  # a fresh handle: receiving it turns it into MESSAGE_NULL
        return SimMessage(self, env)

    def Improbe(self, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=None):
        """Take the first matching message off the queue if there is one (a ``Message``), else return None."""
        with self._live("Improbe").universe.cond:
            env = self._peek("Improbe", source, tag, status, True)
        return None if env is None else self._message(env)

    def Mprobe(self, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=None):
        """Block until a matching message arrives and take it off the queue (a ``Message``)."""
        u = self._live("Mprobe").universe
        found = []

        def ready():
            env = self._peek("Mprobe", source, tag, status, True)
            if env is not None:
                found.append(env)
            return bool(found)
        what = f"Mprobe(source={_show(source)}, tag={_show(tag)}) on {self._ctx.name}"
        with u.cond:
            u.wait_until(self._world_rank, ready, what)
        return self._message(found[0])

    def improbe(self, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=None):
        return self.Improbe(source, tag, status)

    def mprobe(self, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=None):
        return self.Mprobe(source, tag, status)


# -- seeded wildcard matching ------------------------------------------------------------------------------------
ANY_SOURCE, ANY_TAG = MPI.ANY_SOURCE, MPI.ANY_TAG

# Seconds a wildcard choice waits for the other ranks to settle before it is made anyway: long enough for a
# rank's Python code between two calls, short enough that a rank polling with Test/Iprobe in a loop only delays.
_PATIENCE = 2.0


class _Seeded:
    """Seeded wildcard matching of one universe."""

    def __init__(self, seed):
        self.rng = random.Random(seed)
        self.deciding = set()   # world ranks waiting for a settled point to choose among senders
        self.idle = {}          # world rank -> epoch at which its last poll found nothing to receive
        self.pending = {}       # (context id, dest) -> receive slots not yet matched, in posting order
        self.probed = {}        # (context id, dest) -> the envelope the last wildcard probe reported


def _seeded(universe):
    """The universe's seeded matching state, or None in FIFO order (no seed)."""
    if universe.seed is None:
        return None
    state = universe.attrs.get("p2p.seeded")
    if state is None:
        state = universe.attrs["p2p.seeded"] = _Seeded(universe.seed)
    return state


def _firsts(queue, source, tag):
    """Indices of the oldest envelope of each sender that (source, tag) matches, by sender rank."""
    firsts = {}
    for i, env in enumerate(queue):
        if env[0] not in firsts and (source == ANY_SOURCE or env[0] == source) and (tag == ANY_TAG or env[1] == tag):
            firsts[env[0]] = i
    return [firsts[sender] for sender in sorted(firsts)]


def _choose(seeded, queue, tag):
    firsts = _firsts(queue, ANY_SOURCE, tag)
    return firsts[seeded.rng.randrange(len(firsts))] if len(firsts) > 1 else firsts[0]


def _assign(universe, slot, env):
    slot.envelope = env
    if env[4] is not None and not env[4][0]:
        env[4][0] = True   # a synchronous send completes once a receive has matched it
        universe.changed()


def _match_pending(ctx, dest, seeded):
    """(lock held) Match ``dest``'s pending receives in posting order; return the first wildcard receive that
    must choose among senders (later receives wait behind it), or None."""
    key = (ctx.id, dest)
    pending = seeded.pending.get(key)
    if not pending:
        return None
    queue = ctx.unexpected[dest]
    for slot in list(pending):
        if slot.source == ANY_SOURCE:
            firsts = _firsts(queue, ANY_SOURCE, slot.tag)
            probed = seeded.probed.get(key)
            index = next((i for i in firsts if queue[i] is probed), None)
            if index is not None:   # the message a wildcard probe reported
                del seeded.probed[key]
            elif firsts:
                return slot
            else:
                continue
        else:
            index = next((i for i, env in enumerate(queue)
                          if env[0] == slot.source and (slot.tag == ANY_TAG or env[1] == slot.tag)), None)
            if index is None:
                continue
        _assign(ctx.universe, slot, queue.pop(index))
        pending.remove(slot)
    return None


def _match_settled(ctx, dest, seeded, me, done):
    """(lock held) Match ``dest``'s pending receives, choosing among senders at settled points, until ``done()``
    (True) or nothing is left to choose (False: the caller waits)."""
    u = ctx.universe
    started = None
    try:
        while True:
            undecided = _match_pending(ctx, dest, seeded)
            if done():
                return True
            if undecided is None:   # nothing to choose among: the caller just waits
                seeded.idle[me] = u.epoch
                return False
            if u.failure is not None or u.deadlock is not None:
                return False
            seeded.deciding.add(me)
            started = started or time.monotonic()
            if _settled(u, seeded, me) or time.monotonic() - started > _PATIENCE:
                queue = ctx.unexpected[dest]
                _assign(u, undecided, queue.pop(_choose(seeded, queue, undecided.tag)))
                seeded.pending[(ctx.id, dest)].remove(undecided)
                u.changed()
                started = None
                continue
            _pause(u)
    finally:
        seeded.deciding.discard(me)


def _settled(universe, seeded, me):
    """Whether every other live rank is blocked, idle or choosing too, and ``me`` is the lowest one choosing."""
    epoch = universe.epoch
    still = {r for r, (e, _) in universe.waiting.items() if e == epoch}
    still |= seeded.deciding
    still |= {r for r, e in seeded.idle.items() if e == epoch}
    still.discard(me)
    return len(still) >= universe.alive - 1 and me == min(seeded.deciding)


def _pause(universe):
    """Let the other rank threads run for a moment (lock released)."""
    saved = universe.cond._release_save()
    try:
        time.sleep(0.0002)
    finally:
        universe.cond._acquire_restore(saved)


def _joined(first, second):
    """One request for two: ready when both are, status from the second (the receive)."""
    def ready():
        return (first._ready is None or first._ready()) and (second._ready is None or second._ready())

    def finish():
        if first._ready is not None:
            first._complete(None)
        status = MPI.Status()
        second._complete(status)
        return None, (status.Get_source(), status.Get_tag(), status.Get_count(MPI.BYTE), False)
    return SimRequest(second._universe, second._world_rank, ready, finish, second._what)


# Open MPI sets TAG_UB only on COMM_WORLD (COMM_SELF gives None); MPI guarantees at least 32767.
_TAG_UB = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB) or MPI.COMM_SELF.Get_attr(MPI.TAG_UB) or 32767
