"""Integer handles for simulated objects: ``handle``, ``toint``/``fromint``, ``py2f``/``f2py``, ``fromhandle``.

A simulated object's handles (``MPI.Comm(comm)`` makes a second one) share one state dict; the integer
handle is that dict's identity, so every handle on one object gives the same integer, as MPI's do, and
``fromhandle`` returns a new handle on it. Null objects answer the MPI library's own null handle.
"""

import weakref

__all__ = ["Handles"]

_LIVE = weakref.WeakValueDictionary()   # integer handle -> one live Python handle on that object


class Handles:
    """Mixin: integer handles for a class whose instances share ``__dict__`` between copies."""

    _NULL_HANDLE = 0  # the MPI library's null handle for this kind of object (set by each class)

    @property
    def handle(self):
        if not self:
            return self._NULL_HANDLE
        key = id(self.__dict__)
        _LIVE[key] = self
        return key

    def toint(self):
        return self.handle

    def py2f(self):
        return self.handle

    @classmethod
    def fromhandle(cls, handle):
        """A new handle on the simulated object whose ``handle`` is ``handle`` (of its own subclass)."""
        if handle == cls._NULL_HANDLE:
            return cls()
        found = _LIVE.get(handle)
        if found is None:
            raise ValueError(f"{cls.__name__}.fromhandle: no live simulated object has handle {handle:#x}")
        kind = type(found) if issubclass(type(found), cls) else cls
        new = object.__new__(kind)
        new.__dict__ = found.__dict__
        return new

    fromint = f2py = fromhandle
