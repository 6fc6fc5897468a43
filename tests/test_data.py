"""mpidist.data: windows against slices of the byte stream, shards, shuffles, resume, prefetch, corpora."""

import hashlib
import itertools
import json
import math
import os
import sysconfig
import threading
from pathlib import Path

import numpy as np
import pytest

from mpidist import checkpoint
from mpidist.data import (DataLoader, TokenDataset, global_batches, stdlib_corpus, text_corpus,
                          unigram_entropy_bits)

CONTEXT = 4
N_WINDOWS = 50


def counting_dataset():
    """Windows whose first input byte is 4 * index: a batch tells which windows it holds (bytes 0..200 are distinct)."""
    return TokenDataset(np.arange(CONTEXT * N_WINDOWS + 1, dtype=np.uint8), CONTEXT)


def window_ids(x):
    return (np.asarray(x)[:, 0] // CONTEXT).tolist()


def shared_dir(comm, tmp_path):
    """One directory every rank sees (rank 0's tmp_path under MPI)."""
    return comm.bcast(str(tmp_path) if comm.Get_rank() == 0 else None, root=0)


# -- TokenDataset -----------------------------------------------------------------------------------
@pytest.mark.parametrize("context,stride", [(7, None), (7, 3), (7, 7), (5, 11), (1, 1)])
def test_windows_are_slices_of_the_stream(tmp_path, context, stride):
    stream = np.random.default_rng(0).integers(0, 256, size=103, dtype=np.uint8)
    path = tmp_path / "stream.bin"
    path.write_bytes(stream.tobytes())
    step = context if stride is None else stride
    starts = [s for s in range(0, len(stream), step) if s + context + 1 <= len(stream)]
    for source in (path, str(path), stream.tobytes(), stream, stream.astype(np.int32)):
        ds = TokenDataset(source, context, stride)
        assert len(ds) == len(starts)
        for i, s in enumerate(starts):
            x, y = ds[i]
            assert x.dtype == y.dtype == np.int64
            np.testing.assert_array_equal(x, stream[s:s + context])
            np.testing.assert_array_equal(y, stream[s + 1:s + context + 1])
        np.testing.assert_array_equal(ds[-1][1], stream[starts[-1] + 1:starts[-1] + context + 1])
        picks = [len(starts) - 1, 0, len(starts) // 2, 0]
        bx, by = ds.batch(picks)
        assert bx.shape == by.shape == (4, context) and bx.dtype == np.int64
        np.testing.assert_array_equal(bx, np.stack([stream[starts[i]:starts[i] + context] for i in picks]))
        np.testing.assert_array_equal(by, np.stack([stream[starts[i] + 1:starts[i] + context + 1] for i in picks]))
    assert isinstance(TokenDataset(path, context).tokens, np.memmap)


def test_default_stride_makes_every_byte_after_the_first_a_target_once():
    stream = np.random.default_rng(1).integers(0, 256, size=8 * 12 + 1, dtype=np.uint8)
    ds = TokenDataset(stream, 8)
    targets = np.concatenate([ds[i][1] for i in range(len(ds))])
    np.testing.assert_array_equal(targets, stream[1:])


def test_unigram_baseline_against_the_formula():
    assert unigram_entropy_bits(b"aabb") == pytest.approx(1.0)
    assert unigram_entropy_bits(b"aaab") == pytest.approx(-(0.75 * math.log2(0.75) + 0.25 * math.log2(0.25)))
    assert unigram_entropy_bits(np.arange(256, dtype=np.uint8)) == pytest.approx(8.0)
    assert unigram_entropy_bits(b"zzzz") == 0.0
    ds = TokenDataset(b"abcd" * 10, 3)
    assert ds.unigram_bits_per_byte() == pytest.approx(2.0)
    assert ds.unigram_loss() == pytest.approx(2.0 * math.log(2))  # nats, the unit of a cross-entropy loss


def test_bad_streams_are_refused_with_their_values(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"TokenDataset: '.*nothing\.txt' does not exist"):
        TokenDataset(tmp_path / "nothing.txt", 8)
    with pytest.raises(FileNotFoundError, match=r"is a directory, not a file"):
        TokenDataset(tmp_path, 8)
    with pytest.raises(ValueError, match=r"the stream has 5 bytes, fewer than context \+ 1 = 9"):
        TokenDataset(b"hello", 8)
    (tmp_path / "empty").write_bytes(b"")
    with pytest.raises(ValueError, match=r"the stream has 0 bytes, fewer than context \+ 1 = 3"):
        TokenDataset(tmp_path / "empty", 2)
    for bad in (0, -3, 2.5, True, None):
        with pytest.raises(ValueError, match=rf"context must be a positive int \(got {bad!r}\)"):
            TokenDataset(b"x" * 100, bad)
    with pytest.raises(ValueError, match=r"stride must be a positive int \(got 0\)"):
        TokenDataset(b"x" * 100, 4, stride=0)
    with pytest.raises(ValueError, match=r"must be 1-D \(got an array of shape \(2, 50\)\)"):
        TokenDataset(np.zeros((2, 50), np.uint8), 4)
    with pytest.raises(ValueError, match=r"must lie in 0..255 \(got min -1, max 300\)"):
        TokenDataset(np.array([-1, 300] * 10), 4)
    with pytest.raises(TypeError, match=r"dtype must be an integer type \(got float64\)"):
        TokenDataset(np.zeros(20), 4)
    ds = TokenDataset(b"x" * 21, 4)
    with pytest.raises(IndexError, match=r"index 5 out of range for 5 windows"):
        ds[5]
    with pytest.raises(IndexError, match=r"indices must lie in 0..4 \(got min 0, max 7\)"):
        ds.batch([0, 7])
    with pytest.raises(ValueError, match="the stream is empty"):
        unigram_entropy_bits(b"")


# -- DataLoader: shards and shuffles --------------------------------------------------------------
@pytest.mark.parametrize("drop_last", [True, False])
def test_unshuffled_shards_follow_the_formula(comm, drop_last):
    size, rank = comm.Get_size(), comm.Get_rank()
    ds = counting_dataset()
    loader = DataLoader(ds, 3, comm, shuffle=False, drop_last=drop_last)
    per_rank = N_WINDOWS // size if drop_last else -(-N_WINDOWS // size)
    assert len(loader) == (per_rank // 3 if drop_last else -(-per_rank // 3))
    # Rank r's j-th sample of the epoch is window r + size * j (padded from the start when not drop_last).
    mine = [rank + size * j for j in range(per_rank)]
    mine = [i % N_WINDOWS for i in mine][:len(loader) * 3]
    got = [i for x, _ in loader for i in window_ids(x)]
    assert got == mine


@pytest.mark.parametrize("drop_last", [True, False])
def test_shards_are_disjoint_and_cover_the_epoch(comm, drop_last):
    size = comm.Get_size()
    ds = counting_dataset()
    loader = DataLoader(ds, 4, comm, seed=7, drop_last=drop_last)
    for _epoch in range(2):
        batches = list(loader)
        for x, y in batches:  # every row is the window it claims to be
            for row_x, row_y, i in zip(x, y, window_ids(x)):
                np.testing.assert_array_equal(row_x, ds.tokens[4 * i:4 * i + 4])
                np.testing.assert_array_equal(row_y, ds.tokens[4 * i + 1:4 * i + 5])
        everyone = comm.allgather([i for x, _ in batches for i in window_ids(x)])
        assert len({len(s) for s in everyone}) == 1  # the same number of samples (and batches) on every rank
        flat = [i for s in everyone for i in s]
        if drop_last:
            assert len(flat) == len(set(flat)) == (N_WINDOWS // size) // 4 * 4 * size
        else:
            assert set(flat) == set(range(N_WINDOWS))


def test_shuffle_is_deterministic_per_epoch_and_differs_across_epochs(comm):
    ds = counting_dataset()

    def epochs(seed, n=3):
        loader = DataLoader(ds, 2, comm, seed=seed)
        return [[window_ids(x) for x, _ in loader] for _ in range(n)]

    first = epochs(seed=3)
    assert epochs(seed=3) == first
    assert first[0] != first[1] != first[2]
    assert epochs(seed=4)[0] != first[0]
    # set_epoch as with PyTorch: a loader moved straight to epoch 2 gives that epoch's batches.
    loader = DataLoader(ds, 2, comm, seed=3)
    loader.set_epoch(2)
    assert [window_ids(x) for x, _ in loader] == first[2]


@pytest.mark.parametrize("drop_last", [True, False])
def test_global_batches_are_all_ranks_batches_in_rank_order(comm, drop_last):
    size = comm.Get_size()
    ds = counting_dataset()
    loader = DataLoader(ds, 3, comm, seed=11, drop_last=drop_last)
    steps = 2 * len(loader) + 1  # across two epoch boundaries
    reference = list(itertools.islice(global_batches(ds, 3, size, seed=11, drop_last=drop_last), steps))
    for (x, y), (gx, gy) in zip(itertools.islice(loader.iter_forever(), steps), reference):
        np.testing.assert_array_equal(np.concatenate(comm.allgather(x)), gx)
        np.testing.assert_array_equal(np.concatenate(comm.allgather(y)), gy)
    # Starting later is the tail of the same sequence.
    later = global_batches(ds, 3, size, seed=11, drop_last=drop_last, epoch=1, position=1)
    np.testing.assert_array_equal(next(later)[0], reference[len(loader) + 1][0])


# -- DataLoader: resume and prefetch --------------------------------------------------------------
def test_a_restored_loader_yields_exactly_the_rest(comm):
    ds = counting_dataset()
    n = len(DataLoader(ds, 3, comm))
    total = 4 * n
    uninterrupted = [window_ids(x) for x, _ in itertools.islice(DataLoader(ds, 3, comm, seed=5).iter_forever(), total)]
    for used in (0, 2, n - 1, n, n + 1, 2 * n + 3):
        first = DataLoader(ds, 3, comm, seed=5, prefetch=used % 3)
        seen = [window_ids(x) for x, _ in itertools.islice(first.iter_forever(), used)]
        state = json.loads(json.dumps(first.state_dict()))  # what a checkpoint stores
        assert (state["epoch"], state["position"]) == divmod(used, n)
        resumed = DataLoader(ds, 3, comm, seed=5, prefetch=2)
        resumed.load_state_dict(state)
        assert [window_ids(x) for x, _ in resumed] == uninterrupted[used:(used // n + 1) * n]  # rest of the epoch
        rest = [window_ids(x) for x, _ in itertools.islice(resumed.iter_forever(), total - (used // n + 1) * n)]
        assert seen + uninterrupted[used:(used // n + 1) * n] + rest == uninterrupted


def test_set_epoch_keeps_the_position_of_the_current_epoch(comm):
    ds = counting_dataset()
    loader = DataLoader(ds, 2, comm, seed=1)
    whole = [window_ids(x) for x, _ in loader]
    assert (loader.sampler.epoch, loader.position) == (1, 0)  # a finished epoch moves the loader on
    loader = DataLoader(ds, 2, comm, seed=1)
    for x, _ in loader:
        break
    loader.set_epoch(0)  # the PyTorch habit at the top of an epoch, after a resume mid-epoch
    assert [window_ids(x) for x, _ in loader] == whole[1:]
    assert (loader.state_dict()["epoch"], loader.state_dict()["position"]) == (1, 0)  # moved on by itself
    loader.set_epoch(1)
    second = [window_ids(x) for x, _ in loader]
    fresh = DataLoader(ds, 2, comm, seed=1)
    fresh.set_epoch(1)
    assert second == [window_ids(x) for x, _ in fresh] and comm.allgather(second) != comm.allgather(whole)
    loader.set_epoch(0)  # asked for explicitly: epoch 0 again from its start
    assert [window_ids(x) for x, _ in loader] == whole
    for k, _ in enumerate(loader):  # into epoch 1; another epoch asked for from its middle starts at its beginning
        if k == 2:
            break
    fresh.set_epoch(2)
    loader.set_epoch(2)
    assert [window_ids(x) for x, _ in loader] == [window_ids(x) for x, _ in fresh]


def test_a_loader_in_a_checkpoint_resumes_at_the_same_sample(comm, tmp_path):
    root = shared_dir(comm, tmp_path)
    ds = counting_dataset()
    loader = DataLoader(ds, 2, comm, seed=9)
    batches = iter(loader)
    for _ in range(3):
        next(batches)
    checkpoint.save(root, {"data": loader}, comm, step=3)
    expected = [window_ids(x) for x, _ in batches]
    fresh = DataLoader(ds, 2, comm, seed=9)
    assert checkpoint.load(root, {"data": fresh}, comm) == 3
    assert [window_ids(x) for x, _ in fresh] == expected


@pytest.mark.parametrize("prefetch", [1, 3])
def test_prefetch_gives_the_same_batches(comm, prefetch):
    ds = counting_dataset()
    plain = [(x, y) for x, y in itertools.islice(DataLoader(ds, 3, comm, seed=2).iter_forever(), 25)]
    ahead = DataLoader(ds, 3, comm, seed=2, prefetch=prefetch)
    got = list(itertools.islice(ahead.iter_forever(), 25))
    for (x, y), (px, py) in zip(plain, got, strict=True):
        np.testing.assert_array_equal(x, px)
        np.testing.assert_array_equal(y, py)
    # Breaking out counts the batches handed out, not those loaded ahead.
    ahead = DataLoader(ds, 3, comm, seed=2, prefetch=prefetch)
    for k, _ in enumerate(ahead):
        if k == 1:
            break
    assert ahead.state_dict()["position"] == 2
    np.testing.assert_array_equal(next(iter(ahead))[0], plain[2][0])


def test_prefetch_thread_stops_and_errors_reach_the_caller():
    before = threading.active_count()
    loader = DataLoader(counting_dataset(), 2, prefetch=2)
    for k, _ in enumerate(loader):
        if k == 0:
            break
    assert threading.active_count() == before
    iter(loader)  # a new iterator ends the previous one and its thread
    next(iter(loader))
    iter(loader).close()
    assert threading.active_count() == before

    class Broken:
        def __len__(self):
            return 10

        def __getitem__(self, i):
            if i == 7:
                raise KeyError(f"sample {i} is unreadable")
            return np.full(3, i), i

    with pytest.raises(KeyError, match="sample 7 is unreadable"):
        list(DataLoader(Broken(), 2, shuffle=False, prefetch=2))
    assert threading.active_count() == before
    # A dataset without batch(): its items are stacked, tuples field by field.
    x, labels = next(iter(DataLoader(Broken(), 4, shuffle=False)))
    np.testing.assert_array_equal(x, np.repeat(np.arange(4), 3).reshape(4, 3))
    np.testing.assert_array_equal(labels, [0, 1, 2, 3])


def test_bad_loader_settings_are_refused_with_their_values(comm):
    size = comm.Get_size()
    ds = counting_dataset()
    with pytest.raises(ValueError, match=r"batch_size must be a positive int \(got 0\)"):
        DataLoader(ds, 0, comm)
    with pytest.raises(ValueError, match=r"prefetch must be a non-negative int \(got -1\)"):
        DataLoader(ds, 2, comm, prefetch=-1)
    with pytest.raises(ValueError, match=rf"50 samples give {50 // size} per rank on {size} ranks, fewer than "
                                         rf"batch_size=64"):
        DataLoader(ds, 64, comm)
    with pytest.raises(TypeError, match=r"DataLoader: comm must be an mpi4py intracommunicator"):
        DataLoader(ds, 2, comm=7)
    state = DataLoader(ds, 2, comm, seed=1).state_dict()
    with pytest.raises(ValueError, match=r"seed=1 \(this loader: 2\)"):
        DataLoader(ds, 2, comm, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match=r"batch_size=2 \(this loader: 3\)"):
        DataLoader(ds, 3, comm, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match=rf"position 99 is outside an epoch of {(50 // size) // 2} batches"):
        DataLoader(ds, 2, comm, seed=1).load_state_dict(dict(state, position=99))


@pytest.mark.world_sizes(2, 4)
def test_a_state_from_another_world_size_is_refused(comm):
    size = comm.Get_size()
    state = DataLoader(counting_dataset(), 2, seed=1).state_dict()  # one process
    with pytest.raises(ValueError, match=rf"world_size=1 \(this loader: {size}\)"):
        DataLoader(counting_dataset(), 2, comm, seed=1).load_state_dict(state)


# -- corpora ----------------------------------------------------------------------------------------
def test_text_corpus_splits_one_file_by_bytes_and_several_by_file(tmp_path):
    text = bytes(np.random.default_rng(3).integers(0, 256, size=1000, dtype=np.uint8))
    (tmp_path / "one.txt").write_bytes(text)
    assert bytes(text_corpus(tmp_path / "one.txt", "train")) == text[:900]
    assert bytes(text_corpus([tmp_path / "one.txt"], "val", val_fraction=0.25)) == text[750:]
    files = []
    for k in range(20):
        files.append(tmp_path / f"f{k:02d}.txt")
        files[-1].write_bytes(f"file {k}\n".encode() * (k + 1))
    cache = tmp_path / "cache"
    val = bytes(text_corpus(files, "val", cache_dir=cache))
    assert val == files[9].read_bytes() + files[19].read_bytes()  # every 10th file
    train = bytes(text_corpus(files, "train", cache_dir=cache))
    assert train == b"".join(files[k].read_bytes() for k in range(20) if k not in (9, 19))
    # 7 files, 30%: round(2.1) = 2 validation files, the last of each half: indices 3 and 6.
    assert bytes(text_corpus(files[:7], "val", val_fraction=0.3, cache_dir=cache)) == (
        files[3].read_bytes() + files[6].read_bytes())
    with pytest.raises(FileNotFoundError, match=r"text_corpus: '.*missing\.txt' does not exist"):
        text_corpus([files[0], tmp_path / "missing.txt"])
    with pytest.raises(ValueError, match=r"split must be 'train' or 'val' \(got 'test'\)"):
        text_corpus(files, "test")
    with pytest.raises(ValueError, match=r"val_fraction must lie strictly between 0 and 1 \(got 1.0\)"):
        text_corpus(files, "val", val_fraction=1.0)


def stdlib_listing(max_bytes):
    """The standard library's .py files as the docs describe them, found independently of mpidist.data."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in ("site-packages", "dist-packages", "test", "tests",
                                                      "idle_test", "__pycache__")]
        found += [Path(directory, n) for n in names if n.endswith(".py")]
    found.sort(key=lambda p: str(p.relative_to(root)).replace(os.sep, "/"))
    total, prefix = 0, []
    for p in found:
        if total + p.stat().st_size > max_bytes:
            break
        total += p.stat().st_size
        prefix.append(p)
    return prefix


def test_stdlib_corpus_is_the_sorted_sources_split_by_file_and_identical_on_every_rank(comm, tmp_path):
    cache = Path(shared_dir(comm, tmp_path)) / "corpus"
    max_bytes = 2_000_000  # past ctypes/test, the first directory left out
    val = stdlib_corpus("val", max_bytes=max_bytes, cache_dir=cache)  # every rank at once: one file results
    train = stdlib_corpus("train", max_bytes=max_bytes, cache_dir=cache)
    digests = comm.allgather((hashlib.sha256(train).hexdigest(), hashlib.sha256(val).hexdigest()))
    assert len(set(digests)) == 1
    if comm.Get_rank() != 0:
        return  # the contents are checked once; every rank already agreed on them
    files = stdlib_listing(max_bytes)
    assert len(files) > 10 and all("site-packages" not in f.parts for f in files)
    n_val = round(len(files) * 0.1)
    val_ids = [k for k in range(len(files)) if (k + 1) * n_val // len(files) > k * n_val // len(files)]
    assert len(val_ids) == n_val and val_ids[-1] == len(files) - 1
    assert bytes(val) == b"".join(files[k].read_bytes() for k in val_ids)
    assert bytes(train) == b"".join(f.read_bytes() for k, f in enumerate(files) if k not in val_ids)
    cached = Path(train.filename)
    stamp = cached.stat().st_mtime_ns
    again = stdlib_corpus("train", max_bytes=max_bytes, cache_dir=cache)
    assert Path(again.filename) == cached and cached.stat().st_mtime_ns == stamp  # read from the cache
    assert sorted(p.name for p in cache.iterdir() if ".tmp." in p.name) == []  # no temporary file left
    with pytest.raises(ValueError, match=r"max_bytes=10 admits 0 of the standard library's files"):
        stdlib_corpus(max_bytes=10, cache_dir=cache)
