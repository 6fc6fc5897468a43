"""DDP: data-parallel training with bucketed, overlapped gradient averaging, attached through hooks.

Glossary:
- bucket: one flat array holding the gradients of several parameters of one dtype, filled in
  reverse parameter order (the order backward produces them). After a parameter's gradient is final,
  ``param.grad`` is a view into its bucket.
- ready: a parameter's gradient for this backward is final (its post-accumulate-grad hook fired; a
  tied parameter fires once, after its last use). When every parameter of a bucket is ready, the
  bucket's nonblocking mean-allreduce starts, while backward goes on computing the earlier layers.
- finalize: a callback queued on the running backward (``nn.queue_callback``) launches the buckets
  of parameters that got no gradient, waits for every bucket and runs the checks (step stamp,
  unused parameters, non-finite gradients) once backward has computed everything.
- sync mode: whether a backward averages gradients: not if any training forward since the last
  backward ran under ``no_sync`` (as in PyTorch, where the forward decides), nor if the backward starts
  under ``no_sync`` (as mpidist always did); a pipeline that runs several micro-batches' forwards and
  backwards inside ``no_sync`` accumulates them all.
- launch order: buckets are launched strictly in index order on every rank, because MPI matches
  nonblocking collectives on a communicator by the order they are started.
- join: ranks that run out of data keep matching the collectives of ranks that still have data.
- frozen parameter: one with ``requires_grad=False`` at construction. It is broadcast with the others at
  construction (replicas start equal) and never again: no bucket slot, no hook, no gradient, so an
  optimizer given it (weight decay included) leaves it as it is, as without a wrapper.

Nothing here replaces a method of the wrapped module: DDP reads gradients through
``Parameter.register_post_accumulate_grad_hook`` and ``queue_callback``, and runs the module by calling it.
DDP implements ``interface.Wrapper`` (what checkpoints, elastic and clipping read); ``grad_sync.GradSync`` holds
the no_sync mode, step stamp and non-finite/unused reports it shares with FSDP.
"""

import contextlib
import math
import threading
import time

import numpy as np

from .. import collectives
from ..collectives_hier import ALGORITHMS as ALLREDUCE_ALGORITHMS, HierarchicalAllreduce
from ..comm import calls_from_threads_allowed, is_simulated
from ..comm.agree import check_same, raise_if_any
from ..nn import is_grad_enabled, queue_callback
from ..nn.deferred import deferred_key, is_deferred, materialize
from ..xp import get_array_module, to_numpy
from .agreement import StepStamp, TrainableAtBuild, check_same_shards, check_same_structure
from . import comm_hooks
from .grad_sync import GradSync
from .zero import sharding_optimizer
from .interface import WholeModuleWrapper, dimensions, mesh_of, refuse_mesh

__all__ = ["DDP", "GradientBucket"]

_MB = 1024 * 1024


class GradientBucket:
    """A flat gradient buffer for a group of parameters, with its pending allreduce."""

    def __init__(self, index, params, names, extra=0):
        self.index = index
        self.params = params
        self.names = names
        xp = get_array_module(params[0].data)
        self.sizes = [p.data.size for p in params]
        # ``extra`` slots after the gradients carry the step stamp (agreement.StepStamp.encode) in the sum.
        self.flat = xp.zeros(sum(self.sizes) + extra, dtype=params[0].data.dtype)
        self.stamp_view = self.flat[sum(self.sizes):] if extra else None
        self.views = []
        offset = 0
        for p, n in zip(params, self.sizes):
            self.views.append(self.flat[offset: offset + n].reshape(p.data.shape))
            offset += n
        self.slot = {id(p): i for i, p in enumerate(params)}
        for p in params:
            if p.grad is not None:  # keep a gradient the parameter already holds
                self.attach(p)
        self.ready = set()
        self.scaled = [False] * len(params)  # divided by the world size for this synchronization
        self.handle = None
        self.local_nonfinite = [False] * len(params)

    @property
    def nbytes(self):
        return self.flat.nbytes

    def attach(self, param, scale=None):
        """Make ``param.grad`` its view into the bucket, holding the same values (zeros for None).

        ``scale``: multiply a gradient copied in by it on the way (the mean's 1/size, in the same pass);
        a gradient already in its view is left as it is. Returns whether ``scale`` was applied.
        """
        view = self.views[self.slot[id(param)]]
        grad = param.grad
        if grad is view:
            return False
        # Autograd hands a parameter without a gradient its own fresh array (set_to_none zeroing, the
        # default): one copy into the bucket, after which later backwards accumulate in place.
        if grad is None:
            view[...] = 0
        elif scale is None:
            view[...] = grad
        else:
            get_array_module(view).multiply(grad, scale, out=view)
        param.grad = view
        return scale is not None

    def attach_for_mean(self, param, size):
        """Attach ``param`` with its gradient divided by ``size`` (once per synchronization)."""
        i = self.slot[id(param)]
        if self.scaled[i]:
            return
        if not self.attach(param, 1.0 / size):
            self.views[i] *= 1.0 / size
        self.scaled[i] = True

    def attach_all(self):
        """Attach every parameter (before the bucket is reduced as a whole)."""
        for p in self.params:
            self.attach(p)


class _ProgressPoller:
    """A thread that tests a DDP's launched buckets every ``progress_poll_s`` seconds until stopped.

    Between two gradients (a layer's backward) nothing else calls into MPI, and a transfer larger than the
    socket buffers stalls until the next call; numpy's kernels release the GIL, so this thread's calls run
    meanwhile. It takes the DDP's lock, as the backward's own launches and tests do.
    """

    def __init__(self, ddp):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ddp,), name="mpidist-ddp-progress", daemon=True)
        self._thread.start()

    def _run(self, ddp):
        while not self._stop.wait(ddp.progress_poll_s):
            with ddp._progress_lock:
                try:
                    ddp._progress()
                except Exception:  # noqa: BLE001 - the handle keeps its error; the backward's wait() raises it
                    return

    def stop(self):
        self._stop.set()
        self._thread.join()


class DDP(WholeModuleWrapper):
    """Wrap ``module`` for data-parallel training over ``comm``: a communicator, or a 1-D ``DeviceMesh`` of them.

    Every rank holds a full replica; at construction parameters and buffers are broadcast from rank 0.
    Train as with the module itself: ``loss = crit(ddp(x), y); loss.backward()``; when backward
    returns, every ``param.grad`` holds the mean gradient over ranks. Parameters frozen
    (``requires_grad=False``) at construction get no gradient and no communication; set ``requires_grad``
    before wrapping, alike on every rank (a difference raises on every rank, a later change at the next backward).

    A mesh of more than one dimension raises on every rank naming them: pass the data-parallel one
    (``mesh.submesh("dp")``); a tensor-parallel model's ranks live in its placements.

    As a ``Wrapper``: ``mesh`` is the mesh given, or ``comm`` as dimension "dp"; ``placed_parameters()`` names
    the module's parameters with their tensor-parallel placements; ``grad_norm_comms()`` are those placements'
    communicators (the averaged gradients are the same on every rank of ``comm``, so a norm adds over the
    tensor-parallel ranks only).

    ``allreduce``: how buckets are summed across ranks: "flat" (MPI's own nonblocking allreduce, the default),
    "hierarchical" (``mpidist.collectives_hier``: within each node, across node leaders, back within the node;
    run when the bucket launches, so it does not overlap with the rest of backward) or "auto" (per bucket size,
    whichever measured faster on this run's ranks, flat keeping its overlap). Alike on every rank, as are the
    bucket sizes, ``broadcast_buffers``, ``unused_parameters`` and ``check_finite`` (a difference raises on every
    rank, naming each rank's value).

    ``progress_poll_s``: with overlap, a helper thread also tests the launched buckets every that many seconds
    during backward (None, the default: only at each gradient's arrival). MPI without an asynchronous progress
    thread (MPICH's default) moves a large bucket only inside MPI calls, so during a long layer's backward the
    transfer stalls; on the 2-node virtual cluster at 1 Gbit/s, 0.002 s raised the share of the allreduce hidden
    behind backward from ~0.3 to 0.43-0.61 with a rank per node (docs/cluster.md); where ranks already fill
    every core the thread competes with them (2 ranks per node on 2 cores: 0.17-0.65). Real MPI only, and needs
    MPI_THREAD_MULTIPLE (checked on every rank). It does nothing while a comm hook reduces the buckets: the
    compression hooks and ``allreduce="hierarchical"``/``"auto"`` progress in their own ``test()`` calls.
    Alike on every rank.
    """

    def __init__(self, module, comm, bucket_cap_mb=25, first_bucket_mb=1, overlap=True, broadcast_buffers=True,
                 unused_parameters="zero", check_finite=False, allreduce="flat", progress_poll_s=None):
        self.mesh = mesh_of(comm, "DDP", "dp")
        refuse_mesh(self.mesh, None if len(self.mesh.names) == 1 else
                    f"a mesh must have one dimension, the data-parallel ranks (got {dimensions(self.mesh)}); pass "
                    f"that dimension's mesh, e.g. mesh.submesh('dp')", "DDP")
        comm = self.mesh[self.mesh.names[0]]
        # Agreed before it is validated: a rank that alone rejected its value would leave the others waiting in
        # the first collective below; agreed, a bad value fails alike on every rank.
        check_same(comm, [allreduce], "DDP", what="allreduce choice")
        # Likewise the arguments that shape the collectives (bucket boundaries, buffer broadcasts, the error
        # checks' gathers): a rank-dependent value would also mismatch them later.
        check_same(comm, [("bucket_cap_mb", bucket_cap_mb), ("first_bucket_mb", first_bucket_mb),
                          ("broadcast_buffers", broadcast_buffers), ("unused_parameters", unused_parameters),
                          ("check_finite", check_finite), ("progress_poll_s", progress_poll_s)],
                   "DDP: every rank must pass the same arguments", what="argument")
        if bucket_cap_mb <= 0 or first_bucket_mb <= 0:
            raise ValueError(f"DDP: bucket sizes must be positive (bucket_cap_mb={bucket_cap_mb}, first_bucket_mb={first_bucket_mb})")
        if unused_parameters not in ("zero", "error"):
            raise ValueError(f"DDP: unused_parameters must be 'zero' or 'error' (got {unused_parameters!r})")
        if allreduce not in ALLREDUCE_ALGORITHMS:
            raise ValueError(f"DDP: allreduce must be one of {ALLREDUCE_ALGORITHMS} (got {allreduce!r})")
        if progress_poll_s is not None and (type(progress_poll_s) not in (int, float)
                                            or not 0 < progress_poll_s < math.inf):
            raise ValueError(f"DDP: progress_poll_s must be None or a positive, finite number of seconds "
                             f"(got {progress_poll_s!r})")
        if progress_poll_s is not None:  # agreed above, so every rank takes this collective or none does
            # The poller's MPI calls would run beside the main thread's (a tensor-parallel op's, a user's).
            raise_if_any(comm, None if calls_from_threads_allowed(comm) else
                         f"progress_poll_s={progress_poll_s!r} needs MPI_THREAD_MULTIPLE, which this process's "
                         f"MPI was not initialized with; leave it None or initialize MPI with it", "DDP")
        # SimComm's nonblocking collectives complete without progress calls: only real MPI gets the thread.
        self.progress_poll_s = None if is_simulated(comm) else progress_poll_s
        self._poller = None
        self._progress_lock = threading.Lock()
        self.module = module
        self.comm = comm
        self.overlap = overlap
        self.broadcast_buffers = broadcast_buffers
        self.unused_parameters = unused_parameters
        self.check_finite = check_finite
        self._join = None  # set while a join() context is active
        self.stats = {"backward_s": 0.0, "sync_wait_s": 0.0, "steps": 0}

        named = list(module.named_parameters())  # a tied parameter once
        # Before the first broadcast: different models would fail there with MPI's size error, or worse.
        check_same_structure(comm, named, "DDP")
        if not named:  # after the agreement: alike on every rank now (one rank without any raised there)
            raise ValueError(f"DDP: module {type(module).__name__} has no parameters")
        check_same_shards(comm, named, "DDP")
        # The step check reads the parameters' update counts every step: a list, not a walk of the module
        # tree (parameters() took 0.4 ms for 240 tensors, most of the check's cost on a narrow model).
        self._stamp_params = [p for _, p in named]
        # Deferred parameters (mpidist.nn.deferred) are drawn by (seed, name): nothing to send, provided every
        # rank deferred the same ones under the same seed (manual_seed(base + rank) would make replicas differ).
        check_same(comm, [deferred_key(name, p) for name, p in named], "DDP",
                   what="parameter (name, deferred seed or 'materialized')")
        drawn = {id(p) for _, p in named if is_deferred(p)}
        materialize(module)
        self._broadcast_state([p.make_writable() for _, p in named if id(p) not in drawn])  # in place: never into a commit's arrays
        if broadcast_buffers:
            self._broadcast_state([b for _, b in module.named_buffers()])
        self._trainable = TrainableAtBuild(named, "DDP")
        trainable = [(name, p) for name, p in named if p.requires_grad]
        self.buckets = self._build_buckets(trainable, bucket_cap_mb * _MB, first_bucket_mb * _MB)
        self._sync = GradSync(comm, "DDP", [name for b in self.buckets for name in b.names])
        self._stamp = self._sync.stamp
        # The step check rides in the last bucket's allreduce (launched last, so every count is final by
        # then): no message of its own. Where the bucket's dtype cannot hold the sums exactly (float16 on
        # many ranks), or every parameter is frozen (no bucket), it falls back to a small nonblocking
        # allreduce of its own.
        self._stamp_mod = None
        if self.buckets:
            last = self.buckets[-1]
            self._stamp_mod = StepStamp.modulus(last.flat.dtype, comm.Get_size())
            if self._stamp_mod is not None:
                self.buckets[-1] = GradientBucket(last.index, last.params, last.names, extra=StepStamp.SLOTS)
        self._stamp_pending = False
        self._bucket_of = {}
        for bucket in self.buckets:
            for p in bucket.params:
                self._bucket_of[id(p)] = bucket
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_ready) for _, p in trainable]
        self._next_launch = 0
        self._forward_sync = None  # False if a training forward since the last backward ran under no_sync
        self._backward = None  # (sync mode, start time) while a backward runs
        # register_comm_hook's (state, hook); None: the collectives' own sum (bfloat16 too: mpidist.wire)
        self._comm_hook = None
        self._hook_comms = comm_hooks.HookComms()  # the hooks' private communicators, freed by remove()
        # Its node communicators are freed by remove() (collective); a DDP dropped without it leaves them to the
        # ones later DDPs over this comm share (collectives_hier), not one pair per DDP.
        self._hierarchical = None
        if allreduce != "flat":
            self._hierarchical = HierarchicalAllreduce(comm, allreduce)
            self.register_comm_hook(self._hierarchical, _hierarchical_allreduce_hook)

    # -- construction -----------------------------------------------------------------------------
    def _broadcast_state(self, arrays, root=0):
        """Broadcast ``arrays`` from ``root`` in one message per dtype (not one per tensor)."""
        by_dtype = {}
        for a in arrays:
            by_dtype.setdefault(a.dtype.str, []).append(a)
        for group in by_dtype.values():
            xp = get_array_module(group[0])
            flat = xp.concatenate([a.reshape(-1) for a in group])
            collectives.broadcast(flat, self.comm, root=root)  # 16-bit floats travel as their bits (wire)
            offset = 0
            for a in group:
                a[...] = flat[offset: offset + a.size].reshape(a.shape)
                offset += a.size

    @staticmethod
    def _build_buckets(named, cap_bytes, first_cap_bytes):
        buckets, current, names, size, dtype = [], [], [], 0, None
        for name, p in reversed(named):
            cap = first_cap_bytes if not buckets else cap_bytes
            if current and (p.data.dtype != dtype or size + p.data.nbytes > cap):
                buckets.append(GradientBucket(len(buckets), current, names))
                current, names, size = [], [], 0
            current.append(p)
            names.append(name)
            size += p.data.nbytes
            dtype = p.data.dtype
        if current:
            buckets.append(GradientBucket(len(buckets), current, names))
        return buckets

    # -- the module interface -----------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def forward(self, *args, **kwargs):
        """Run the wrapped module (and keep a joined rank's collectives matched)."""
        self._stop_poller()  # a backward that raised never reached _end_backward, which stops it
        training = self.module.training and is_grad_enabled()
        if training:
            self._forward_sync = self._sync.syncing and self._forward_sync is not False
            if self._sync.syncing:
                root = 0
                if self._join is not None:
                    self._join.announce(active=True)
                    root = self._join.first_active_rank
                # Buffers are broadcast on synchronizing training forwards only (evaluation may differ by
                # rank), from a rank that still has data: a joined rank mirrors exactly these.
                self._sync_buffers(root)
        self._stamp.count_forward(training)
        return self.module(*args, **kwargs)

    def named_parameters(self, prefix=""):
        return self.module.named_parameters(prefix)

    def buffers(self):
        return self.module.buffers()

    def named_buffers(self, prefix=""):
        return self.module.named_buffers(prefix)

    def modules(self):
        return self.module.modules()

    def state_dict(self):
        return self.module.state_dict()

    def load_state_dict(self, state_dict, strict=True):
        return self.module.load_state_dict(state_dict, strict)

    @property
    def training(self):
        return self.module.training

    def train(self, mode=True):
        self.module.train(mode)
        return self

    def eval(self):
        return self.train(False)

    def zero_grad(self, set_to_none=True):
        """Set every gradient to None (the default), or zero it in place (the bucket views stay attached)."""
        if set_to_none:
            self.module.zero_grad(set_to_none=True)
            return
        for bucket in self.buckets:
            bucket.flat[...] = 0
            for p, view in zip(bucket.params, bucket.views):
                p.grad = view

    # -- the Wrapper interface (placed_parameters etc.: WholeModuleWrapper's) ----------------------------
    def remove(self):
        """Detach this DDP from the module's parameters, e.g. before wrapping the module again over another comm."""
        self._stop_poller()
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        if self._hierarchical is not None:
            self._hierarchical.free()
            self._hierarchical = None
        self._hook_comms.free()

    def register_comm_hook(self, state, hook):
        """Reduce each bucket with ``hook(state, bucket)`` instead of MPI's sum (PyTorch's shape; built-ins and
        the contract: ``mpidist.parallel.comm_hooks``). Once, before the first backward; alike on every rank."""
        if not callable(hook):
            raise TypeError(f"DDP.register_comm_hook: hook must be callable (got {type(hook).__name__})")
        if self._comm_hook is not None:
            raise RuntimeError("DDP.register_comm_hook: a communication hook is already registered")
        if self.stats["steps"] or self._backward is not None:
            raise RuntimeError(f"DDP.register_comm_hook: register before the first backward "
                               f"({self.stats['steps']} synchronizations ran)")
        if self._stamp_mod is not None:
            # The step check's exact sums cannot ride in a bucket a hook may compress: a message of its own.
            last = self.buckets[-1]
            self.buckets[-1] = GradientBucket(last.index, last.params, last.names)
            for p in last.params:
                self._bucket_of[id(p)] = self.buckets[-1]
            self._stamp_mod = None
        self._comm_hook = (state, hook)

    # -- gradient synchronization -------------------------------------------------------------------
    def _grad_ready(self, param):
        if self._backward is None:
            self._begin_backward()
        bucket = self._bucket_of[id(param)]
        if not self._backward[0]:
            bucket.attach(param)
            return
        if self._join is None:
            # The mean's division rides on the copy into the bucket (one pass over the gradient saved).
            bucket.attach_for_mean(param, self.comm.Get_size())
        else:
            bucket.attach(param)
        if bucket.handle is not None:
            name = bucket.names[bucket.slot[id(param)]]
            raise RuntimeError(f"DDP: parameter {name!r} received a gradient after its bucket {bucket.index} was "
                               f"already being reduced in this backward (two backwards at once through one DDP?)")
        bucket.ready.add(id(param))
        if self.overlap:
            with self._progress_lock:
                self._launch_ready_buckets()
                self._progress()
            if self.progress_poll_s is not None and self._poller is None and self._comm_hook is None:
                self._poller = _ProgressPoller(self)

    def _begin_backward(self):
        """The first gradient of a backward: count it, start the step check, and queue the finalize."""
        self._stop_poller()  # left by an earlier backward that raised
        self._trainable.check()
        sync = self._sync.syncing and self._forward_sync is not False
        self._backward = (sync, time.perf_counter())
        self._stamp.count_backward(sync)
        if sync and self._join is None:  # joined ranks mirror only the buckets' collectives
            self._start_stamp()
        queue_callback(self._end_backward)

    def _start_stamp(self):
        if self._stamp_mod is None:
            self._stamp.start(self._stamp_params)
        else:
            self._stamp_pending = True  # written into the last bucket when it launches

    def _end_backward(self):
        self._stop_poller()
        sync, start = self._backward
        self._backward = self._forward_sync = None
        if not sync:
            return
        computed = time.perf_counter()
        try:
            self._finish_sync()
        finally:
            self.stats["backward_s"] += computed - start
            self.stats["sync_wait_s"] += time.perf_counter() - computed

    def _launch(self, bucket):
        if self._join is None:
            size = self.comm.Get_size()
            for p in bucket.params:  # those attached earlier (no_sync, unused, sync_gradients)
                bucket.attach_for_mean(p, size)
        else:
            bucket.attach_all()  # summed, then divided by the ranks still active
        if self.check_finite:
            # Remember which rank produced a NaN/Inf before averaging spreads it to every rank.
            xp = get_array_module(bucket.flat)
            bucket.local_nonfinite = [not bool(xp.isfinite(v).all()) for v in bucket.views]
        if bucket.stamp_view is not None:
            values = self._stamp.encode(self._stamp_params, self._stamp_mod) if self._stamp_pending else None
            bucket.stamp_view[...] = 0 if values is None else get_array_module(bucket.flat).asarray(values)
            self._stamp_pending = values is not None  # now: whether to check the sums after the wait
        # Every gradient was divided by the world size on its way into the bucket: the sum is the mean.
        if self._comm_hook is None:
            bucket.handle = collectives.iallreduce(bucket.flat, self.comm, op="sum")
        else:
            bucket.handle = _HookHandle(self, bucket)

    def _launch_ready_buckets(self):
        while self._next_launch < len(self.buckets):
            bucket = self.buckets[self._next_launch]
            if len(bucket.ready) < len(bucket.params):
                return
            self._launch(bucket)
            self._next_launch += 1

    def _progress(self):
        # MPI libraries without an asynchronous progress thread only advance nonblocking
        # collectives inside MPI calls: testing the pending requests between layers is what
        # makes the overlap real.
        for bucket in self.buckets[: self._next_launch]:
            if bucket.handle is not None:
                bucket.handle.test()

    def _stop_poller(self):
        if self._poller is not None:
            self._poller.stop()
            self._poller = None

    def _finish_sync(self):
        unused = [name for b in self.buckets for p, name in zip(b.params, b.names) if id(p) not in b.ready]
        # Parameters that got no gradient keep their slot (zeros, or what no_sync accumulated); their
        # buckets launch now, in order. Every bucket is launched and completed before any other
        # collective (the unused-parameter check), so all ranks issue the same sequence whatever each
        # launched during backward.
        while self._next_launch < len(self.buckets):
            self._launch(self.buckets[self._next_launch])
            self._next_launch += 1
        for bucket in self.buckets:
            bucket.handle.wait()
            if self._join is not None:
                bucket.flat /= self._join.active
            bucket.handle = None
            bucket.ready.clear()
            bucket.scaled = [False] * len(bucket.params)
        self._next_launch = 0
        self.stats["steps"] += 1
        where = f"gradient synchronization #{self.stats['steps']}"
        if self._stamp_pending:
            self._stamp_pending = False
            self._stamp.check_sums(to_numpy(self.buckets[-1].stamp_view), where)
        elif self._stamp_mod is None:
            self._stamp.finish(where)
        if self.unused_parameters == "error" and self.buckets:
            self._sync.raise_if_unused([name in unused for name in self._sync.names])
        # The averaged gradients are identical on every rank, so every rank gathers the local flags together,
        # and only when the average is not finite (the check costs nothing in a healthy step).
        if self.check_finite and not all(bool(get_array_module(b.flat).isfinite(b.flat).all()) for b in self.buckets):
            self._sync.raise_if_nonfinite([flag for b in self.buckets for flag in b.local_nonfinite],
                                          f"step {self.stats['steps']}", reduced_nonfinite=True)

    def sync_gradients(self):
        """Average every gradient over ranks now (blocking), e.g. after backwards run under ``no_sync``."""
        for bucket in self.buckets:
            bucket.attach_all()
            bucket.ready.update(id(p) for p in bucket.params)
        self._next_launch = 0
        if self._join is None:
            self._start_stamp()
        self._finish_sync()

    def no_sync(self):
        """Accumulate gradients locally; the first synchronizing backward after the block averages the sum.

        A forward run inside the block gives a backward that does not synchronize, wherever that backward
        runs (as in PyTorch); a backward started inside the block does not synchronize either.
        """
        return self._sync.no_sync()

    @contextlib.contextmanager
    def join(self, optimizer=None):
        """Let ranks with fewer batches finish early without hanging the others.

        Inside the block every synchronizing forward announces that this rank is active; when a rank
        leaves the block it keeps answering the other ranks' collectives with zero gradients until every
        rank has left. Gradients are averaged over the ranks still active, and buffers are broadcast from
        the first rank still active. With ``optimizer``, joined ranks also step it with the averaged
        gradients, so parameters and optimizer state stay identical everywhere; without it, parameters
        are broadcast from the last rank to finish when everyone is done. Buffers (with
        ``broadcast_buffers``) are always taken from the last rank to finish.
        """
        if self._join is not None:
            raise RuntimeError("DDP.join: already inside a join() block")
        if optimizer is None and any(sharding_optimizer(p) is not None for p in self.module.parameters()):
            # (every rank calls join alike: every rank raises) a ZeroRedundancyOptimizer's step allgathers: ranks
            # that joined early must step it as well, or the ranks still training wait for them forever
            raise ValueError("DDP.join: a ZeroRedundancyOptimizer steps this model's parameters and its step "
                             "communicates over the replicas; pass it, join(optimizer=opt), so that ranks that run "
                             "out of batches step it too")
        self._join = _Join(self.comm)
        try:
            yield
            self._join.shadow(self, optimizer)
            # Ranks ran different numbers of steps inside the block, by design: count afresh from here.
            self._stamp.rebase(self._stamp_params)
        finally:
            self._join = None

    def _sync_buffers(self, root):
        if self.broadcast_buffers:
            buffers = [b for _, b in self.module.named_buffers()]
            if buffers:
                self._broadcast_state(buffers, root=root)

    def _shadow_step(self, optimizer):
        """What a joined rank does while others still train: the forward's buffers, zero gradients, the step."""
        self._sync_buffers(self._join.first_active_rank)
        for bucket in self.buckets:
            bucket.flat[...] = 0
            for p, view in zip(bucket.params, bucket.views):
                p.grad = view
        self.sync_gradients()
        if optimizer is not None:
            optimizer.step()


def _hierarchical_allreduce_hook(allreduce, bucket):
    """Sum a bucket with ``allreduce`` (a HierarchicalAllreduce): flat ones nonblocking, hierarchical ones now.

    Buckets the hierarchical path cannot take (device arrays, bfloat16) go through ``comm_hooks.allreduce_hook``.
    """
    flat = bucket.buffer()
    if type(flat) is not np.ndarray or flat.dtype not in collectives.SUPPORTED_DTYPES:
        return comm_hooks.allreduce_hook(None, bucket)
    if allreduce.algorithm_for(flat.nbytes, flat) == "flat":  # collective under "auto": buckets launch in order
        return comm_hooks.HookWork(collectives.iallreduce(flat, bucket.comm, op="sum"), lambda: flat)
    return comm_hooks.HookWork(value=allreduce(flat, "sum"))


class _HookHandle:
    """A bucket's reduction by DDP's communication hook: ``wait()`` puts the hook's result into the bucket."""

    def __init__(self, ddp, bucket):
        state, hook = ddp._comm_hook
        self.bucket = bucket
        self.work = hook(state, comm_hooks.HookBucket(bucket.flat, bucket.index, bucket.index == len(ddp.buckets) - 1,
                                                     bucket.params, bucket.views, ddp.comm, ddp._hook_comms))

    def test(self):
        return self.work.test()

    def wait(self):
        result = self.work.wait()
        if result is not self.bucket.flat:
            self.bucket.flat[...] = result


class _Join:
    """Per-step agreement on which ranks still have data."""

    def __init__(self, comm):
        self.comm = comm
        self.active = comm.Get_size()
        self.first_active_rank = 0
        self.last_active_rank = None

    def announce(self, active):
        """Tell every rank whether this one still has data; return how many do."""
        flags = np.empty(self.comm.Get_size(), dtype=np.int8)
        collectives.allgather(np.array([1 if active else 0], dtype=np.int8), self.comm, out=flags)
        self.active = int(flags.sum())
        if self.active:
            ranks = np.flatnonzero(flags)
            self.first_active_rank, self.last_active_rank = int(ranks[0]), int(ranks[-1])
        return self.active

    def shadow(self, ddp, optimizer):
        while self.announce(active=False):
            ddp._shadow_step(optimizer)
        if self.last_active_rank is None:
            return
        # Every rank leaves with the state of one rank that trained to the end.
        if optimizer is None:
            ddp._broadcast_state([p.make_writable() for p in ddp.module.parameters()], root=self.last_active_rank)
        ddp._sync_buffers(self.last_active_rank)
