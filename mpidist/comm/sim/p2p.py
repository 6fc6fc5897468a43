"""Point-to-point: the four send modes, receives, probes and matched probes, buffer and object forms.

An envelope is (source, tag, payload, kind, sync): payload is the packed bytes of a buffer message or the
pickled bytes of an object message (so a buffer receive can take an object message and the other way
round, as in MPI); ``sync`` is a one-item list set when a receive matches a synchronous send.
"""

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


def _as_bytes(payload):
    return payload if isinstance(payload, np.ndarray) else np.frombuffer(payload, np.uint8)


class PointToPoint:
    """Point-to-point methods of ``SimComm`` (mixed in)."""

    # -- checks ----------------------------------------------------------------------------------------
    def _check_peer(self, name, peer, what, wildcard):
        size = self.Get_size()
        if peer == MPI.PROC_NULL or (wildcard and peer == MPI.ANY_SOURCE):
            return
        if not isinstance(peer, (int, np.integer)) or not 0 <= peer < size:
            raise mpi_error(MPI.ERR_RANK, f"SimComm.{name}: {what} {peer} out of range for communicator of size {size}")

    def _check_tag(self, name, tag, wildcard):
        if wildcard and tag == MPI.ANY_TAG:
            return
        if not isinstance(tag, (int, np.integer)) or not 0 <= tag <= _TAG_UB:
            raise mpi_error(MPI.ERR_TAG, f"SimComm.{name}: tag {tag} is not in 0..{_TAG_UB}")

    # -- sends -----------------------------------------------------------------------------------------
    def _post(self, name, payload, kind, dest, tag, sync):
        """Deposit an envelope at ``dest``; return the request (a synchronous one completes when matched)."""
        ctx = self._live(name)
        self._check_peer(name, dest, "dest", False)
        self._check_tag(name, tag, False)
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
        return SimRequest(u, self._world_rank, lambda: matched[0], lambda: (None, None), what)

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
        self._check_peer(name, source, "source", True)
        self._check_tag(name, tag, True)
        u = ctx.universe
        if source == MPI.PROC_NULL:
            return SimRequest(u, self._world_rank, lambda: True,
                              lambda: (deliver(None)[0], (MPI.PROC_NULL, MPI.ANY_TAG, 0, False)), name)
        slot = _Slot(source, tag)
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
        what = f"{name}(source={_show(source)}, tag={_show(tag)}) on {ctx.name}"
        return SimRequest(u, self._world_rank, ready, finish, what, cancel)

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
        self._receive("Recv", source, tag, self._buffer_deliver("Recv", buf, source)).Wait(status)

    @staticmethod
    def _object_deliver(env):
        if env is None:
            return None, 0
        payload = env[2]
        data = payload.tobytes() if isinstance(payload, np.ndarray) else payload
        return MPI.pickle.loads(data), len(data)

    def irecv(self, buf=None, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG):
        """Start receiving a Python object; ``wait()`` returns it."""
        return self._receive("irecv", source, tag, self._object_deliver)

    def recv(self, buf=None, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=None):
        """Receive a Python object."""
        return self._receive("recv", source, tag, self._object_deliver).wait(status)

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
        self._check_peer(name, source, "source", True)
        self._check_tag(name, tag, True)
        if source == MPI.PROC_NULL:
            fill_status(status, MPI.PROC_NULL, MPI.ANY_TAG, 0)
            return "proc_null"
        env = ctx.take(self._rank, source, tag, remove=take)
        if env is not None:
            fill_status(status, env[0], env[1], len(env[2]))
            if take and env[4] is not None:
                env[4][0] = True
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
            from .request import MESSAGE_NO_PROC
            return MESSAGE_NO_PROC
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
