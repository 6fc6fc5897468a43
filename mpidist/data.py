"""Data for training: which samples each rank reads, byte-level token streams, corpora and a loader.

Words used here:

- *stream*: a 1-D ``uint8`` array of bytes (a memory-mapped file, or an array in memory). Every byte is a
  token, so the vocabulary has 256 entries and no tokenizer is needed.
- *window* ``i``: the ``context + 1`` bytes starting at ``i * stride``; its input ``x`` is the first
  ``context`` bytes and its target ``y`` the last ``context`` (``x`` shifted by one).
- *shard*: the dataset indices one rank reads in an epoch (:class:`DistributedSampler`).
- *position*: how many batches of the current epoch the loader has handed out; with the epoch it is all a
  checkpoint needs to continue at the same sample.
- *global batch* of a step: every rank's batch of that step, concatenated in rank order.

Usage (every rank runs the same lines)::

    from mpidist.data import TokenDataset, DataLoader, stdlib_corpus, global_batches

    train = TokenDataset(stdlib_corpus("train"), context=128)   # memory-mapped, no download
    val = TokenDataset(stdlib_corpus("val"), context=128)
    print("unigram baseline", val.unigram_loss(), "nats,", val.unigram_bits_per_byte(), "bits/byte")
    loader = DataLoader(train, batch_size=16, comm=comm, seed=0, prefetch=2)
    for x, y in itertools.islice(loader.iter_forever(), steps):   # x, y: (16, 128) int64
        ...
        checkpoint.save(root, {"model": ddp, "optim": opt, "data": loader}, comm, step)   # saves the position

    # One process, the same global batches as ``comm.Get_size()`` ranks (a parity reference):
    for x, y in itertools.islice(global_batches(train, 16, world_size=4, seed=0), steps): ...

``for x, y in loader`` iterates the rest of the current epoch and then moves the loader to the next one, so
``for epoch in range(n): for x, y in loader:`` sees a new shuffle each epoch without ``set_epoch``
(calling it as with PyTorch's sampler does no harm).
"""

import hashlib
import math
import os
import queue
import sys
import sysconfig
import tempfile
import threading
import weakref
from pathlib import Path

import numpy as np
from mpi4py import MPI

from .comm import check_comm
from .files import write_atomic

__all__ = ["DistributedSampler", "TokenDataset", "DataLoader", "global_batches", "unigram_entropy_bits",
           "stdlib_corpus", "text_corpus"]


class DistributedSampler:
    """Split ``n_samples`` indices into disjoint per-rank shards of equal length.

    Every rank gets ``ceil(n / size)`` indices (padded by repeating the first indices of the
    permutation) or, with ``drop_last``, ``floor(n / size)`` (the tail is dropped), so every rank runs
    the same number of batches. The permutation depends only on ``(seed, epoch)``, never on the rank.
    """

    def __init__(self, n_samples, comm, shuffle=True, seed=0, drop_last=False):
        if not isinstance(n_samples, (int, np.integer)) or n_samples < 0:
            raise ValueError(f"DistributedSampler: n_samples must be a non-negative int (got {n_samples!r})")
        # No messages here: anything that says its rank and size will do, but not COMM_NULL or an intercomm.
        if isinstance(comm, MPI.Comm) or not (hasattr(comm, "Get_rank") and hasattr(comm, "Get_size")):
            check_comm("DistributedSampler", comm)
        self.n_samples = int(n_samples)
        self.size = comm.Get_size()
        self.rank = comm.Get_rank()
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        if drop_last:
            self.num_samples = self.n_samples // self.size
        else:
            self.num_samples = -(-self.n_samples // self.size)
        if self.num_samples == 0 and self.n_samples > 0:
            raise ValueError(f"DistributedSampler: drop_last with {self.n_samples} samples on {self.size} ranks leaves every rank empty")

    def set_epoch(self, epoch):
        """Use the permutation of ``epoch`` on the next iteration."""
        self.epoch = int(epoch)

    def global_order(self):
        """Return the padded or truncated index order shared by all ranks."""
        if self.shuffle:
            order = np.random.default_rng([self.seed, self.epoch]).permutation(self.n_samples)
        else:
            order = np.arange(self.n_samples)
        total = self.num_samples * self.size
        if total > len(order):
            order = np.concatenate([order, np.resize(order, total - len(order))])
        return order[:total]

    def indices(self):
        """Return this rank's indices for the current epoch."""
        return self.global_order()[self.rank::self.size]

    def __iter__(self):
        return iter(self.indices().tolist())

    def __len__(self):
        return self.num_samples


# -- byte streams -----------------------------------------------------------------------------------
def _byte_stream(fn, source):
    """Return ``source`` (a path, bytes, or a 1-D array of byte values) as a 1-D uint8 array, files memory-mapped."""
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if not path.is_file():
            what = "is a directory, not a file" if path.is_dir() else "does not exist"
            raise FileNotFoundError(f"{fn}: {str(path)!r} {what}")
        if path.stat().st_size == 0:
            return np.zeros(0, dtype=np.uint8)  # np.memmap refuses empty files
        return np.memmap(path, dtype=np.uint8, mode="r")
    if isinstance(source, (bytes, bytearray, memoryview)):
        return np.frombuffer(source, dtype=np.uint8)
    if isinstance(source, np.ndarray):
        if source.ndim != 1:
            raise ValueError(f"{fn}: a token stream must be 1-D (got an array of shape {source.shape})")
        if source.dtype == np.uint8:
            return source
        if source.dtype.kind not in "iu":
            raise TypeError(f"{fn}: a token stream holds byte values, so its dtype must be an integer type "
                            f"(got {source.dtype})")
        if source.size and (source.min() < 0 or source.max() > 255):
            raise ValueError(f"{fn}: byte values must lie in 0..255 (got min {source.min()}, max {source.max()})")
        return source.astype(np.uint8)
    raise TypeError(f"{fn}: expected a file path, bytes or a 1-D array of byte values "
                    f"(got {type(source).__name__})")


def _positive_int(fn, name, value):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{fn}: {name} must be a positive int (got {value!r})")
    return int(value)


def unigram_entropy_bits(stream):
    """Return the entropy in bits per byte of the byte distribution of ``stream`` (a path, bytes or array).

    This is the lowest cross-entropy any model that ignores context (one fixed distribution over the 256
    byte values) reaches on ``stream``: a language model has learnt something once it is below it. Multiply
    by ``ln 2`` for nats, the unit of a cross-entropy loss.
    """
    counts = np.bincount(_byte_stream("unigram_entropy_bits", stream), minlength=256)
    total = counts.sum()
    if total == 0:
        raise ValueError("unigram_entropy_bits: the stream is empty")
    p = counts[counts > 0] / total
    return float(-(p * np.log2(p)).sum())


class TokenDataset:
    """Windows of ``context + 1`` bytes over a byte stream: ``ds[i]`` is ``(x, y)``, y being x shifted by one.

    ``source`` is a file path (memory-mapped, read-only: every rank maps the same file and reads only its
    windows), bytes, or a 1-D array of byte values. Window ``i`` starts at byte ``i * stride``. The default
    ``stride = context`` makes every byte after the first a target exactly once per epoch (neighbouring
    windows share one byte: the last target of one is the first input of the next); a smaller stride
    gives overlapping windows. ``len(ds)`` counts the windows that fit entirely.
    """

    vocab_size = 256

    def __init__(self, source, context, stride=None):
        self.context = _positive_int("TokenDataset", "context", context)
        self.stride = self.context if stride is None else _positive_int("TokenDataset", "stride", stride)
        self.tokens = _byte_stream("TokenDataset", source)
        n = len(self.tokens)
        if n < self.context + 1:
            raise ValueError(f"TokenDataset: the stream has {n} bytes, fewer than context + 1 = {self.context + 1} "
                             f"needed for one window; use a smaller context or more text")
        self._offsets = np.arange(self.context + 1)
        self._len = (n - self.context - 1) // self.stride + 1

    def __len__(self):
        return self._len

    def __getitem__(self, i):
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
            raise TypeError(f"TokenDataset: index must be an int (got {type(i).__name__}); use batch() for many")
        if not -self._len <= i < self._len:
            raise IndexError(f"TokenDataset: index {i} out of range for {self._len} windows")
        start = (int(i) % self._len) * self.stride
        window = np.asarray(self.tokens[start: start + self.context + 1], dtype=np.int64)
        return window[:-1], window[1:]

    def batch(self, indices):
        """Return ``(x, y)`` of shape ``(len(indices), context)``, int64, for the windows ``indices``."""
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        if indices.size and (indices.min() < 0 or indices.max() >= self._len):
            raise IndexError(f"TokenDataset.batch: indices must lie in 0..{self._len - 1} "
                             f"(got min {indices.min()}, max {indices.max()})")
        windows = np.asarray(self.tokens[indices[:, None] * self.stride + self._offsets], dtype=np.int64)
        return windows[:, :-1], windows[:, 1:]

    def unigram_bits_per_byte(self):
        """Return the unigram baseline of this stream in bits per byte (see :func:`unigram_entropy_bits`)."""
        return unigram_entropy_bits(self.tokens)

    def unigram_loss(self):
        """Return the unigram baseline in nats per byte, comparable with a cross-entropy loss."""
        return self.unigram_bits_per_byte() * math.log(2)

    def __repr__(self):
        return (f"TokenDataset({len(self.tokens)} bytes, context={self.context}, stride={self.stride}, "
                f"{self._len} windows)")


# -- corpora ----------------------------------------------------------------------------------------
# Directories left out of the standard-library corpus: installed packages are not the standard library, and
# the test suites are half of its size and mostly repetitive assertions.
_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})


def _val_file_indices(n_files, val_fraction):
    """Return the indices of the files that go to validation: the last file of each of ``n_val`` equal groups.

    ``n_val = round(n * val_fraction)`` (at least one, and never all), so with 0.1 it is every 10th file
    (indices 9, 19, ...), and the last file is always validation text.
    """
    n_val = min(n_files - 1, max(1, round(n_files * val_fraction)))
    return {k for k in range(n_files) if (k + 1) * n_val // n_files > k * n_val // n_files}


def _check_split(fn, split, val_fraction):
    if split not in ("train", "val"):
        raise ValueError(f"{fn}: split must be 'train' or 'val' (got {split!r})")
    if not 0 < val_fraction < 1:
        raise ValueError(f"{fn}: val_fraction must lie strictly between 0 and 1 (got {val_fraction!r})")


def _default_cache_dir():
    return Path(tempfile.gettempdir()) / "mpidist-corpus"


def _concatenated(files, cache_dir, name):
    """Return a read-only memory map of the concatenated ``files``, written once to ``cache_dir/name``.

    Ranks that find no file write their own copy under a unique temporary name and rename it into place
    (``files.write_atomic``): the contents are identical, so whichever rename lands last leaves the same
    bytes, and no rank ever maps a half-written file.
    """
    cache_dir = Path(cache_dir)
    path = cache_dir / name
    expected = sum(f.stat().st_size for f in files)
    if not (path.is_file() and path.stat().st_size == expected):
        cache_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(path, (f.read_bytes() for f in files))
    return _byte_stream("corpus", path)


def _stdlib_files(max_bytes):
    """Return the standard library's .py files, sorted by relative path, while their total fits ``max_bytes``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in _SKIPPED_DIRS]
        found += [Path(directory, n) for n in names if n.endswith(".py")]
    found.sort(key=lambda p: p.relative_to(root).as_posix())
    chosen, total = [], 0
    for path in found:
        size = path.stat().st_size
        if total + size > max_bytes:
            break  # a prefix of the sorted list: the same files on every rank and for every max_bytes above
        chosen.append(path)
        total += size
    return root, chosen


def stdlib_corpus(split="train", val_fraction=0.1, max_bytes=8_000_000, cache_dir=None):
    """Return the Python standard library's own source as a memory-mapped byte stream (no download).

    The ``.py`` files under ``sysconfig.get_paths()["stdlib"]`` (no site-packages, no test directories),
    sorted by relative path, the longest prefix of that list within ``max_bytes``, are split by file: with
    ``val_fraction=0.1`` every 10th file is validation text, the rest training text. The files of a split are
    concatenated once into ``cache_dir`` (default: ``<tmp>/mpidist-corpus``), named by Python version, split
    and limits, and every rank maps that file; ranks of one installation read identical bytes.
    """
    _check_split("stdlib_corpus", split, val_fraction)
    max_bytes = _positive_int("stdlib_corpus", "max_bytes", max_bytes)
    root, files = _stdlib_files(max_bytes)
    if len(files) < 2:
        raise ValueError(f"stdlib_corpus: max_bytes={max_bytes} admits {len(files)} of the standard library's "
                         f"files under {str(root)!r}; a train/val split needs at least 2 (raise max_bytes)")
    val = _val_file_indices(len(files), val_fraction)
    picked = [f for k, f in enumerate(files) if (k in val) == (split == "val")]
    # The name changes with anything that changes the bytes: the files, their sizes and modification times.
    listing = "\n".join(f"{f.relative_to(root).as_posix()} {f.stat().st_size} {f.stat().st_mtime_ns}" for f in picked)
    digest = hashlib.sha256(f"{root}\n{listing}".encode()).hexdigest()[:12]
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    name = f"stdlib-py{version}-{split}-val{val_fraction}-max{max_bytes}-{digest}.bin"
    return _concatenated(picked, cache_dir or _default_cache_dir(), name)


def text_corpus(paths, split="train", val_fraction=0.1, cache_dir=None):
    """Return the user's text files as a memory-mapped byte stream for ``split``.

    One file: its first ``1 - val_fraction`` of the bytes are training text and the rest validation text
    (no copy). Several files, in the order given: split by file as :func:`stdlib_corpus` does, and the files
    of the split concatenated once into ``cache_dir``.
    """
    _check_split("text_corpus", split, val_fraction)
    paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    if not paths:
        raise ValueError("text_corpus: no files given")
    for p in paths:
        if not Path(p).is_file():
            what = "is a directory, not a file" if Path(p).is_dir() else "does not exist"
            raise FileNotFoundError(f"text_corpus: {str(p)!r} {what}")
    if len(paths) == 1:
        stream = _byte_stream("text_corpus", paths[0])
        cut = len(stream) - int(len(stream) * val_fraction)
        return stream[:cut] if split == "train" else stream[cut:]
    files = [Path(p).resolve() for p in paths]
    val = _val_file_indices(len(files), val_fraction)
    picked = [f for k, f in enumerate(files) if (k in val) == (split == "val")]
    listing = "\n".join(f"{f} {f.stat().st_size} {f.stat().st_mtime_ns}" for f in picked)
    digest = hashlib.sha256(listing.encode()).hexdigest()[:16]
    return _concatenated(picked, cache_dir or _default_cache_dir(), f"text-{split}-{digest}.bin")


# -- loading batches --------------------------------------------------------------------------------
class _Layout:
    """A rank and a world size, without messages: all that DistributedSampler asks of a communicator."""

    def __init__(self, rank, size):
        self.rank, self.size = rank, size

    def Get_rank(self):  # noqa: N802 - mpi4py's name
        return self.rank

    def Get_size(self):  # noqa: N802 - mpi4py's name
        return self.size


def _sampler(fn, dataset, batch_size, layout, shuffle, seed, drop_last):
    """Return the DistributedSampler of ``layout`` and the number of batches per epoch, refusing an empty epoch."""
    n, size = len(dataset), layout.Get_size()
    sampler = DistributedSampler(n, layout, shuffle=shuffle, seed=seed, drop_last=drop_last)
    per_rank = len(sampler)
    n_batches = per_rank // batch_size if drop_last else -(-per_rank // batch_size)
    if n_batches == 0:
        raise ValueError(f"{fn}: {n} samples give {per_rank} per rank on {size} ranks, fewer than batch_size="
                         f"{batch_size}, so drop_last=True leaves no batch; use a smaller batch_size or "
                         f"drop_last=False")
    return sampler, n_batches


def _fetch(dataset, indices):
    """Return the batch of ``indices``: ``dataset.batch(indices)`` when it has one, else its items stacked."""
    if hasattr(dataset, "batch"):
        return dataset.batch(indices)
    items = [dataset[int(i)] for i in indices]
    if isinstance(items[0], tuple):
        return tuple(np.stack(parts) for parts in zip(*items))
    return np.stack(items)


class DataLoader:
    """Batches of ``batch_size`` samples for this rank; with ``comm``, each rank reads its own shard.

    - Shards and shuffles come from :class:`DistributedSampler`: one permutation per ``(seed, epoch)``
      shared by all ranks, rank ``r`` taking every ``size``-th index from ``r``. ``drop_last`` drops the tail
      that does not fill a batch on every rank (otherwise shards are padded and the last batch is short).
    - ``for x, y in loader`` yields the rest of the current epoch, then moves to the next epoch;
      ``len(loader)`` is the number of batches in a whole epoch. :meth:`iter_forever` goes on across epochs.
      Starting a new iteration ends the previous iterator (they would share one position).
    - ``prefetch=k`` loads up to ``k`` batches ahead on a background thread; the batches are the same.
    - :meth:`state_dict` / :meth:`load_state_dict` carry the epoch and the position (batches handed out), so a
      restored loader yields exactly the batches an uninterrupted one would. ``checkpoint.save`` stores it.

    The dataset needs ``len()`` and ``dataset[i]``; a ``dataset.batch(indices)`` method, if present, loads a
    whole batch at once (:class:`TokenDataset` has one).
    """

    # No ``epoch`` attribute on purpose: checkpoint treats an object with ``set_epoch`` and ``epoch`` as a bare
    # sampler and would store the epoch without the position. The epoch is in state_dict() and sampler.epoch.

    def __init__(self, dataset, batch_size, comm=None, shuffle=True, seed=0, drop_last=True, prefetch=0):
        self.batch_size = _positive_int("DataLoader", "batch_size", batch_size)
        if isinstance(prefetch, bool) or not isinstance(prefetch, (int, np.integer)) or prefetch < 0:
            raise ValueError(f"DataLoader: prefetch must be a non-negative int (got {prefetch!r})")
        if comm is None:
            layout = _Layout(0, 1)
        else:
            check_comm("DataLoader", comm)
            layout = comm
        self.dataset = dataset
        self.prefetch = int(prefetch)
        self.sampler, self._n_batches = _sampler("DataLoader", dataset, self.batch_size, layout, shuffle, seed,
                                                 drop_last)
        self.position = 0
        # The iterator that owns the position, weakly: one dropped by a ``break`` is closed at once, which stops
        # its prefetch thread.
        self._active = lambda: None

    def __len__(self):
        return self._n_batches

    def set_epoch(self, epoch):
        """Move to ``epoch``; a different epoch starts at its first batch, the current one keeps its position.

        Keeping the position makes the PyTorch habit ``loader.set_epoch(epoch)`` at the top of each epoch safe
        after a resume in the middle of an epoch.
        """
        epoch = int(epoch)
        if epoch != self.sampler.epoch:
            self.sampler.set_epoch(epoch)
            self.position = 0

    def _roll_over(self):
        """Count a finished epoch as the start of the next one."""
        if self.position >= self._n_batches:
            self.sampler.set_epoch(self.sampler.epoch + 1)
            self.position = 0

    def state_dict(self):
        """Return the JSON-able position: epoch, batches handed out in it, and the layout they count in."""
        self._roll_over()
        sampler = self.sampler
        return {"epoch": sampler.epoch, "position": self.position, "seed": sampler.seed, "shuffle": sampler.shuffle,
                "drop_last": sampler.drop_last, "batch_size": self.batch_size, "world_size": sampler.size,
                "num_samples": sampler.n_samples}

    def load_state_dict(self, state):
        """Continue from ``state`` (from :meth:`state_dict` of a loader with the same dataset and layout)."""
        mine = self.state_dict()
        differ = [f"{k}={state[k]!r} (this loader: {mine[k]!r})" for k in mine
                  if k not in ("epoch", "position") and k in state and state[k] != mine[k]]
        if differ:
            raise ValueError(f"DataLoader.load_state_dict: the state counts batches of another layout: "
                             f"{', '.join(differ)}; build the loader with the saved settings")
        if not 0 <= state["position"] <= self._n_batches:
            raise ValueError(f"DataLoader.load_state_dict: position {state['position']} is outside an epoch of "
                             f"{self._n_batches} batches")
        self.sampler.set_epoch(state["epoch"])
        self.position = int(state["position"])

    def __iter__(self):
        previous = self._active()
        if previous is not None:
            previous.close()  # its prefetch thread stops; it would otherwise move our position too
        self._roll_over()
        batches = self._epoch()
        self._active = weakref.ref(batches)
        return batches

    def iter_forever(self):
        """Yield batches epoch after epoch, from the current position (``itertools.islice`` takes n steps)."""
        while True:
            yield from iter(self)

    def _epoch(self):
        shard = self.sampler.indices()
        steps = [shard[s * self.batch_size:(s + 1) * self.batch_size] for s in range(self.position, self._n_batches)]
        batches = _load_ahead(self.dataset, steps, self.prefetch) if self.prefetch else (
            _fetch(self.dataset, ix) for ix in steps)
        try:
            for batch in batches:
                self.position += 1  # before the yield: a checkpoint in the loop body counts this batch as used
                yield batch
        finally:
            batches.close()
        self._roll_over()

    def __repr__(self):
        return (f"DataLoader({len(self.dataset)} samples, batch_size={self.batch_size}, "
                f"world_size={self.sampler.size}, epoch={self.sampler.epoch}, position={self.position}/{self._n_batches})")


def _load_ahead(dataset, steps, depth):
    """Yield the batches of ``steps`` in order, loaded up to ``depth`` ahead on a background thread."""
    ready = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def load():
        try:
            for indices in steps:
                if stop.is_set():
                    return
                ready.put(("batch", _fetch(dataset, indices)))
            ready.put(("end", None))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            ready.put(("error", exc))

    worker = threading.Thread(target=load, name="mpidist-data-prefetch", daemon=True)
    worker.start()
    try:
        while True:
            kind, value = ready.get()
            if kind == "end":
                return
            if kind == "error":
                raise value
            yield value
    finally:
        stop.set()
        # Keep taking what the worker puts, so a put it is blocked in returns, until it sees ``stop`` and ends.
        while worker.is_alive():
            try:
                ready.get(timeout=0.01)
            except queue.Empty:
                pass
        worker.join()


def global_batches(dataset, batch_size, world_size, shuffle=True, seed=0, drop_last=True, epoch=0, position=0):
    """Yield the global batches of ``world_size`` ranks' DataLoaders, one process, epoch after epoch.

    Each item is ``(x, y)`` with ``world_size * batch_size`` rows: rank 0's batch of the step, then rank 1's,
    and so on, exactly what ``DataLoader(dataset, batch_size, comm, shuffle, seed, drop_last)`` gives each rank
    of a ``world_size`` communicator from ``(epoch, position)``. A single-process reference trains on these to
    check a distributed run. It never ends: take ``n`` steps with ``itertools.islice``.
    """
    batch_size = _positive_int("global_batches", "batch_size", batch_size)
    world_size = _positive_int("global_batches", "world_size", world_size)
    sampler, n_batches = _sampler("global_batches", dataset, batch_size, _Layout(0, world_size), shuffle, seed,
                                  drop_last)
    if not 0 <= position <= n_batches:
        raise ValueError(f"global_batches: position {position} is outside an epoch of {n_batches} batches")
    while True:
        sampler.set_epoch(epoch)
        order = sampler.global_order()
        shards = [order[r::world_size] for r in range(world_size)]
        for step in range(position, n_batches):
            indices = np.concatenate([s[step * batch_size:(step + 1) * batch_size] for s in shards])
            yield _fetch(dataset, indices)
        epoch, position = epoch + 1, 0
