"""The recording side of tracing: per-rank rings of timed events, fed by hooks that exist anyway.

Glossary:
- event: one timed thing a rank did, kept as a tuple (row, category, name, start, end, args); start and
  end are ``time.monotonic`` seconds of the process (the flight recorder's clock), args a dict or None.
- row: the Chrome-trace thread an event is drawn on inside its rank's process row: ``COMPUTE`` (module
  forward/backward, optimizer steps, pipeline actions, user spans), ``COMM`` (blocking calls and the
  posting of nonblocking ones) or ``IN_FLIGHT`` (a nonblocking call from its start until it completed).
  Separate rows keep every row's events properly nested, which Chrome's viewer requires.
- recorder: one rank's bounded ring of events (the last ``limit``) and the count of all it was given,
  so a file says how many were dropped.
- binding: which recorder the calling thread records into. ``start`` binds the calling thread (a
  simulated rank is a thread); any other thread is bound on its first event to its simulated rank, or
  to this process's rank of ``MPI.COMM_WORLD``.
- depth: modules are timed down to ``depth`` calls deep (0: only the outermost call, e.g. the model).

Sources: collectives and point-to-point calls through the flight recorder's ``on_hold``/``on_leave``
(``guard.record``), module calls through ``nn.module``'s global forward hooks (backward through hooks
on the module's output and input tensors), optimizer steps through ``optim``'s global step hooks,
pipeline actions through ``span`` in the executor. With tracing off none of them is registered and
the executor checks one flag (``on``).
"""

import collections
import threading
import time
import weakref

from mpidist.comm import world_comm
from mpidist.guard import record as _record
from mpidist.nn import autograd as _autograd
from mpidist.nn import module as _module
from mpidist import optim as _optim

__all__ = ["on", "Recorder", "span", "add", "COMPUTE", "COMM", "IN_FLIGHT", "ROW_NAMES"]

COMPUTE, COMM, IN_FLIGHT = 0, 1, 2
ROW_NAMES = {COMPUTE: "compute", COMM: "communication (blocking)", IN_FLIGHT: "communication in flight"}

on = False                  # the one flag hot paths outside this package check
_clock = time.monotonic     # the flight recorder's clock: its records' times need no conversion
_local = threading.local()
_lock = threading.Lock()
_recorders = {}             # rank -> Recorder of this process (several under the simulator)
_started = set()            # ranks of this process that called start and not yet stop
_generation = 0             # bumped by every start: bindings of an earlier session are stale
_depth = 1
_limit = 1 << 20
_handles = []               # hook handles to remove when the last rank stops
_held = {}                  # id(flight record) -> time its nonblocking call returned a handle
_waited = {}                # id(flight record) -> time its handle's wait() was called


class Recorder:
    """One rank's events: the last ``limit`` of them, and how many there were."""

    def __init__(self, rank, size, limit):
        self.rank, self.size = rank, size
        self.events = collections.deque(maxlen=limit)
        self.count = 0
        self.names = {}   # id(root module) -> (weak reference, {id(module): qualified name})
        self.meta = {}    # what the rank's file says about the run (set by start)
        self.pipelines = {}  # id(Pipeline) -> its number in the order this rank first traced it

    def add(self, row, category, name, start, end, args=None):
        self.events.append((row, category, name, start, end, args))
        self.count += 1

    @property
    def dropped(self):
        return self.count - len(self.events)

    def module_name(self, root, module):
        """Return ``module``'s qualified name inside ``root`` ("blocks.0.attn"), or its class name."""
        known = self.names.get(id(root))
        if known is None or known[0]() is not root:
            known = (weakref.ref(root), {id(m): n for n, m in root.named_modules()})
            self.names[id(root)] = known
        return known[1].get(id(module)) or type(module).__name__


class _Binding:
    """What one thread records into, and its open module calls (thread-local: ranks may be threads)."""

    __slots__ = ("recorder", "generation", "calls", "backward", "callback_queued")

    def __init__(self, recorder):
        self.recorder = recorder
        self.generation = _generation
        self.calls = []            # [module, start] of this thread's module calls in progress, outermost first
        self.backward = []         # module backward spans started and not yet ended
        self.callback_queued = False


def _world_rank():
    world = world_comm()
    return world.Get_rank(), world.Get_size()


def recorder_for(rank, size):
    """Return this process's recorder of ``rank`` (made on first use)."""
    with _lock:
        recorder = _recorders.get(rank)
        if recorder is None:
            recorder = _recorders[rank] = Recorder(rank, size, _limit)
        return recorder


def bind(recorder):
    """Make the calling thread record into ``recorder``; return its binding."""
    binding = _local.binding = _Binding(recorder)
    return binding


def binding():
    """Return the calling thread's binding (binding it to its rank on first use)."""
    current = getattr(_local, "binding", None)
    if current is None or current.generation != _generation:
        current = bind(recorder_for(*_world_rank()))
    return current


def pipeline_number(pipeline):
    """Return ``pipeline``'s number on this rank (the order of first traced use: the same on every rank)."""
    numbers = binding().recorder.pipelines
    return numbers.setdefault(id(pipeline), len(numbers))


def add(row, category, name, start, end, args=None):
    """Record one event on the calling thread's rank."""
    binding().recorder.add(row, category, name, start, end, args)


class span:
    """Time the block as one event (``with trace.span("data", "compute"): ...``); nothing when tracing is off."""

    __slots__ = ("name", "category", "args", "start")

    def __init__(self, name, category="compute", args=None):
        self.name, self.category, self.args = name, category, args

    def __enter__(self):
        self.start = _clock() if on else None
        return self

    def __exit__(self, *exc):
        if self.start is not None and on:
            add(COMPUTE, self.category, self.name, self.start, _clock(), self.args)
        return False


# -- collectives and point-to-point (the flight recorder's records) ------------------------------------
def _on_hold(rec):
    _held[id(rec)] = _clock()


def _on_wait(rec):
    _waited[id(rec)] = _clock()


def _on_leave(rec):
    posted = _held.pop(id(rec), None) if _held else None
    waited = _waited.pop(id(rec), None) if _waited else None
    end = rec[_record.END]
    entry = rec[_record.COMM]
    args = {"comm": entry.name, "bytes": rec[_record.BYTES], "peer": rec[_record.PEER], "seq": rec[_record.SEQ]}
    if rec[_record.REDUCTION]:
        args["reduction"] = rec[_record.REDUCTION]
    if posted is None:
        add(COMM, "comm", rec[_record.OP], rec[_record.START], end, args)
    else:
        # A nonblocking call: the rank was busy in it until ``posted``; the rest was in flight.
        args["posted_us"] = round((posted - rec[_record.START]) * 1e6, 3)
        if waited is not None:  # the caller blocked in wait() from here to the end: exposed communication
            args["wait_us"] = round((waited - rec[_record.START]) * 1e6, 3)
        add(IN_FLIGHT, "comm", rec[_record.OP], rec[_record.START], end, args)


# -- modules: forward through the global hooks, backward through tensor hooks --------------------------
def _first_tensor(value, need_graph):
    if isinstance(value, _autograd.Tensor):
        return value if value.requires_grad and (value.grad_fn is not None or not need_graph) else None
    if isinstance(value, (tuple, list)):
        for item in value:
            found = _first_tensor(item, need_graph)
            if found is not None:
                return found
    return None


def _forward_pre(module, args):
    binding().calls.append([module, _clock()])


def _forward_post(module, args, out):
    state = binding()
    calls = state.calls
    while calls:  # a forward that raised left its call open: drop it
        called, start = calls.pop()
        if called is module:
            break
    else:
        return
    depth = len(calls)
    if depth > _depth:
        return
    end = _clock()
    recorder = state.recorder
    name = type(module).__name__ if depth == 0 else recorder.module_name(calls[0][0], module)
    recorder.add(COMPUTE, "forward", name, start, end, {"depth": depth, "module": type(module).__name__})
    if not _autograd.is_grad_enabled():
        return
    output = _first_tensor(out, True)
    if output is None:
        return
    # A module's backward starts when its output's gradient arrives and ends when its input's gradient
    # is computed; a module whose inputs need no gradient (the first layer) ends with the backward pass.
    # [name, depth, start, handle of the input's hook]: a leaf input keeps its hooks across backwards, so
    # that one is removed once it has served.
    timing = [name, depth, None, None]
    output.register_hook(lambda grad: _backward_started(timing))
    source = _first_tensor(args, False)
    if source is not None:
        timing[3] = source.register_hook(lambda grad: _backward_ended(timing))


def _backward_started(timing):
    timing[2] = _clock()
    state = binding()
    state.backward.append(timing)
    if not state.callback_queued:
        state.callback_queued = True
        _autograd.queue_callback(lambda: _backward_done(state))


def _backward_ended(timing):
    start, handle = timing[2], timing[3]
    timing[2] = timing[3] = None
    if handle is not None:
        handle.remove()
    if start is None:
        return
    state = binding()
    try:
        state.backward.remove(timing)
    except ValueError:
        return
    state.recorder.add(COMPUTE, "backward", timing[0], start, _clock(), {"depth": timing[1]})


def _backward_done(state):
    # Queued when the first module's backward started: runs before callbacks queued later in the pass
    # (DDP's final wait), so the wait shows as communication, not as backward.
    end = _clock()
    state.callback_queued = False
    for timing in state.backward:
        name, depth, start, handle = timing
        timing[2] = timing[3] = None
        if handle is not None:
            handle.remove()
        if start is not None:
            state.recorder.add(COMPUTE, "backward", name, start, end, {"depth": depth})
    state.backward.clear()


# -- optimizer ------------------------------------------------------------------------------------------
def _step_pre(optimizer, args, kwargs):
    binding().calls.append([optimizer, _clock()])


def _step_post(optimizer, args, kwargs):
    state = binding()
    calls = state.calls
    while calls:
        called, start = calls.pop()
        if called is optimizer:
            state.recorder.add(COMPUTE, "optimizer", f"{type(optimizer).__name__}.step", start, _clock())
            return


# -- switching on and off ------------------------------------------------------------------------------
def install(depth, limit, rank=None):
    """Register the hooks (once per process, whichever rank starts first); bump the session.

    ``rank``: the rank whose ``stop`` will end the session (the last of them to stop switches off).
    """
    global on, _depth, _limit, _generation
    with _lock:
        if rank is not None:
            _started.add(rank)
        if not _handles:
            _depth, _limit = depth, limit
            _generation += 1
            _held.clear()
            _waited.clear()
            _handles.extend([_module.register_module_forward_pre_hook(_forward_pre),
                             _module.register_module_forward_hook(_forward_post),
                             _optim.register_optimizer_step_pre_hook(_step_pre),
                             _optim.register_optimizer_step_post_hook(_step_post)])
            _record.on_hold, _record.on_wait, _record.on_leave = _on_hold, _on_wait, _on_leave
            on = True


def take(rank):
    """Remove and return ``rank``'s recorder; the last started rank to be taken switches tracing off."""
    global on
    with _lock:
        recorder = _recorders.pop(rank, None)
        _started.discard(rank)
        if not _started and _handles:
            on = False
            _record.on_hold = _record.on_wait = _record.on_leave = None
            for handle in _handles:
                handle.remove()
            _handles.clear()
            _recorders.clear()  # threads bound lazily after their rank stopped
        return recorder


def take_all():
    """Remove and return every recorder of this process and switch tracing off (the end of the process)."""
    global on
    with _lock:
        recorders = list(_recorders.values())
        _recorders.clear()
        _started.clear()
        on = False
        _record.on_hold = _record.on_wait = _record.on_leave = None
        for handle in _handles:
            handle.remove()
        _handles.clear()
        return recorders
