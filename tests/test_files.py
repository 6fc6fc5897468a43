"""mpidist.files: the one atomic, durable writer, and every writer of mpidist going through it."""

import json
import os
import threading
import zlib

import numpy as np
import pytest
import safetensors.numpy

import mpidist
from mpidist import files, guard
from mpidist.data import text_corpus
from mpidist.export import config_path, save_safetensors
from mpidist.guard import flight
from mpidist.trace import chrome
from mpidist.trace.recorder import Recorder


def _recorded(fn):
    """Return (fn's result, [(operation, file name)] the file-operation hook heard while fn ran)."""
    heard = []
    with files.file_operation_hook(lambda operation, path: heard.append((operation, os.path.basename(path)))):
        result = fn()
    return result, heard


def _assert_went_through_the_writer(heard, name):
    """Assert that ``name`` was written to a temporary name, fsynced, renamed into place, its directory fsynced."""
    created = [n for op, n in heard if op == "create" and n.startswith(name + files.TMP_MARK)]
    assert len(created) == 1, heard
    after = heard[heard.index(("create", created[0])):]
    ops = [op for op, n in after if n in (created[0], name) or op == "fsync_dir"]
    assert ops.index("fsync") < ops.index("rename") < ops.index("fsync_dir"), heard
    assert ("fsync", created[0]) in heard and ("rename", name) in heard


def test_write_atomic_writes_the_chunks_and_returns_their_size_and_crc(tmp_path):
    chunks = [b"hello ", bytearray(b"world"), np.arange(3, dtype="<i4")]
    expected = b"hello world" + np.arange(3, dtype="<i4").tobytes()
    path = tmp_path / "out.bin"
    path.write_bytes(b"old content")
    assert files.write_atomic(path, iter(chunks)) == (len(expected), zlib.crc32(expected))
    assert path.read_bytes() == expected
    assert os.listdir(tmp_path) == ["out.bin"]  # no temporary file left behind
    assert files.write_text_atomic(tmp_path / "t.txt", "é\n") == 3
    assert (tmp_path / "t.txt").read_text(encoding="utf-8") == "é\n"


def test_a_writer_failing_midway_leaves_the_old_content_and_no_temporary_file(tmp_path):
    path = tmp_path / "out.bin"
    path.write_bytes(b"old content")

    def chunks():
        yield b"new, half"
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError, match="disk on fire"):
        files.write_atomic(path, chunks())
    assert path.read_bytes() == b"old content"
    assert os.listdir(tmp_path) == ["out.bin"]

    with pytest.raises(ValueError, match="library failed"):
        with files.atomic_path(path) as temporary:
            with open(temporary, "wb") as f:
                f.write(b"new, half")
            raise ValueError("library failed")
    assert path.read_bytes() == b"old content"
    assert os.listdir(tmp_path) == ["out.bin"]


def test_a_crash_at_any_operation_leaves_old_or_new_content_never_a_mix(tmp_path):
    path = tmp_path / "out.bin"
    for stop in range(6):  # create, write, write, fsync, rename, fsync_dir
        path.write_bytes(b"old")
        count = iter(range(stop + 1))

        def crash(operation, name):
            if next(count) == stop:
                raise KeyboardInterrupt(operation)

        with pytest.raises(KeyboardInterrupt):
            with files.file_operation_hook(crash):
                files.write_atomic(path, [b"new ", b"content"])
        assert path.read_bytes() == (b"new content" if stop >= 4 else b"old")
        for leftover in os.listdir(tmp_path):  # a crash cleans nothing up: the temporary file may stay
            if leftover != "out.bin":
                assert files.TMP_MARK in leftover
                os.remove(tmp_path / leftover)


@pytest.mark.parametrize("durable", [True, False])
def test_write_atomic_fsyncs_the_file_and_its_directory(tmp_path, monkeypatch, durable):
    real_fsync, synced = os.fsync, []

    def recording_fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    path = tmp_path / "out.bin"
    files.write_atomic(path, [b"x"], fsync=durable)
    with files.atomic_path(tmp_path / "lib.bin", fsync=durable) as temporary:
        with open(temporary, "wb") as f:
            f.write(b"y")
    if not durable:
        assert synced == []
        return
    assert len(synced) == 4, synced
    file_synced, dir_synced, lib_synced, lib_dir_synced = synced
    assert os.path.basename(file_synced).startswith("out.bin" + files.TMP_MARK)  # before the rename
    assert os.path.basename(lib_synced).startswith("lib.bin" + files.TMP_MARK)
    assert dir_synced == lib_dir_synced == str(tmp_path)


def test_threads_writing_one_path_at_once_use_distinct_temporary_names(tmp_path):
    # SimComm ranks are threads of one process (as data.py's cache writers are): the pid alone would collide.
    path, content, errors = tmp_path / "cache.bin", bytes(range(256)) * 64, []

    def write():
        try:
            for _ in range(20):
                files.write_atomic(path, (content[i:i + 1000] for i in range(0, len(content), 1000)))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=write) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and path.read_bytes() == content and os.listdir(tmp_path) == ["cache.bin"]


def test_writers_on_other_hosts_with_the_same_pid_never_share_a_temporary_file(tmp_path, monkeypatch):
    """Containers on two nodes may run writers with the same pid over one shared directory (a data cache): the
    temporary name carries the host and a random part, and the file is created exclusively, never truncated."""
    target = tmp_path / "cache.bin"
    names = []
    real_open = open

    def recording_open(path, mode="r", *args, **kwargs):
        if files.TMP_MARK in str(path):
            names.append(str(path))
            assert mode == "xb", mode  # O_EXCL: a clash fails loudly instead of truncating the other writer's file
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr("builtins.open", recording_open)
    for host in ("node1", "node2"):
        monkeypatch.setattr(files.socket, "gethostname", lambda host=host: host)
        monkeypatch.setattr(files, "_temporary_numbers", iter([0]))  # a fresh process on each node
        files.write_atomic(str(target), [host.encode()])
    assert len(names) == 2 and names[0] != names[1]
    assert ".node1." in names[0] and ".node2." in names[1]
    assert target.read_bytes() == b"node2"


@pytest.mark.parametrize("code", ["EINVAL", "ENOTSUP"])
def test_a_directory_that_cannot_be_fsynced_does_not_fail_a_write_that_happened(tmp_path, monkeypatch, code):
    """Object-store FUSE mounts refuse fsync on a directory; the rename already happened, so the write succeeded."""
    import errno

    real_fsync = os.fsync

    def fsync(fd):
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            raise OSError(getattr(errno, code), os.strerror(getattr(errno, code)))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    files.write_text_atomic(str(tmp_path / "out.json"), "{}")
    assert (tmp_path / "out.json").read_text() == "{}"


def test_a_directory_fsync_failing_otherwise_is_reported(tmp_path, monkeypatch):
    import errno

    real_fsync = os.fsync

    def fsync(fd):
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            raise OSError(errno.EIO, "I/O error")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(OSError, match="I/O error"):
        files.write_text_atomic(str(tmp_path / "out.json"), "{}")


def test_checkpoint_reexports_the_hook():
    from mpidist import checkpoint
    assert checkpoint.file_operation_hook is files.file_operation_hook
    assert checkpoint.FILE_OPERATIONS == files.FILE_OPERATIONS


# -- every writer of mpidist goes through the one writer -------------------------------------------------
def test_trace_rank_files_and_merged_trace_are_written_atomically(tmp_path):
    recorder = Recorder(0, 1, limit=10)
    recorder.add("compute", "compute", "step", 1.0, 2.5)
    path, heard = _recorded(lambda: chrome.write_rank(str(tmp_path), recorder, 0.0, 0.0))
    _assert_went_through_the_writer(heard, "rank00000.json")
    with open(path) as f:
        assert [e["name"] for e in json.load(f)["traceEvents"] if e["ph"] == "X"] == ["step"]
    merged, heard = _recorded(lambda: chrome.merge(str(tmp_path)))
    _assert_went_through_the_writer(heard, chrome.MERGED)
    with open(merged) as f:
        assert [e["dur"] for e in json.load(f)["traceEvents"] if e["ph"] == "X"] == [pytest.approx(1.5e6)]
    assert sorted(os.listdir(tmp_path)) == sorted(["rank00000.json", chrome.MERGED])


def test_flight_record_is_written_atomically(tmp_path):
    before = guard.settings.flight_dir
    guard.configure(flight_dir=str(tmp_path))
    try:
        mpidist.simulate(1, lambda c: mpidist.allreduce(np.ones(2), c))
        path, heard = _recorded(lambda: flight.dump("test"))
    finally:
        guard.configure(flight_dir=before)
    _assert_went_through_the_writer(heard, os.path.basename(path))
    with open(path) as f:
        assert json.load(f)["reason"] == "test"
    assert os.listdir(os.path.dirname(path)) == [os.path.basename(path)]


def test_data_cache_is_written_atomically(tmp_path):
    texts = [tmp_path / f"{k}.txt" for k in range(3)]
    for k, t in enumerate(texts):
        t.write_bytes(f"file {k}\n".encode() * (k + 1))
    cache = tmp_path / "cache"
    train, heard = _recorded(lambda: text_corpus(texts, val_fraction=0.1, cache_dir=cache))
    assert bytes(train) == texts[0].read_bytes() + texts[1].read_bytes()  # 3 files, 10%: the last is validation
    names = os.listdir(cache)
    assert len(names) == 1
    _assert_went_through_the_writer(heard, names[0])


def test_safetensors_export_and_config_are_written_atomically(tmp_path):
    state = {"w": np.arange(6.0).reshape(2, 3), "b": np.ones(3, np.float32)}
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"an old export")
    _, heard = _recorded(lambda: save_safetensors(state, str(path), config={"n": 1}))
    _assert_went_through_the_writer(heard, "model.safetensors")
    _assert_went_through_the_writer(heard, os.path.basename(config_path(str(path))))
    loaded = safetensors.numpy.load_file(str(path))
    assert sorted(loaded) == ["b", "w"] and all(np.array_equal(loaded[k], state[k]) for k in state)
    assert sorted(os.listdir(tmp_path)) == sorted(["model.safetensors", os.path.basename(config_path(str(path)))])


def test_benchmark_json_and_csv_are_written_atomically(tmp_path):
    import csv
    from mpidist import bench
    results = [bench.Result("allreduce", 1024, 256, "float32", 2, 10, 2e-6, 1e-6)]
    _, heard = _recorded(lambda: bench.write_json(str(tmp_path / "b.json"), results, {"host": "h"}))
    _assert_went_through_the_writer(heard, "b.json")
    with open(tmp_path / "b.json") as f:
        content = json.load(f)
    assert content["meta"] == {"host": "h"} and content["rows"][0]["bytes"] == 1024
    assert content["rows"][0]["ratio"] == pytest.approx(0.5)
    _, heard = _recorded(lambda: bench.write_csv(str(tmp_path / "b.csv"), results))
    _assert_went_through_the_writer(heard, "b.csv")
    with open(tmp_path / "b.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 1 and rows[0]["op"] == "allreduce" and float(rows[0]["mpidist_us"]) == pytest.approx(2.0)
    assert sorted(os.listdir(tmp_path)) == ["b.csv", "b.json"]
