"""The one way mpidist writes a file: atomically and durably, with a hook that can stop it after any operation.

Every file mpidist writes (checkpoint rank files and manifests, trace and flight-record files, the data
cache, safetensors exports) goes to a temporary name in the same directory, is fsynced, renamed over its
final name and then the directory is fsynced. So at every instant the final name holds either its old content
(or nothing) or all of the new, and once a writer returns, the new content survives a power cut.

``file_operation_hook`` lets a test stop a writer after any of its operations, as a crash would
(``mpidist.checkpoint`` re-exports it; ``tests/test_checkpoint_crash.py`` kills a save at each one).
This module imports nothing else of mpidist.
"""

import contextlib
import errno
import itertools
import os
import socket
import threading
import zlib

__all__ = ["write_atomic", "write_text_atomic", "atomic_path", "file_operation_hook", "FILE_OPERATIONS", "TMP_MARK",
           "fsync_dir", "make_dir", "remove_quietly", "remove_tree", "notify"]

FILE_OPERATIONS = ("mkdir", "create", "write", "fsync", "rename", "fsync_dir", "remove", "rmdir")
TMP_MARK = ".tmp."  # in the name of every file not yet renamed into place: "rank00003.bin.tmp.<host>.<pid>.<n>.<random>"
_this_thread = threading.local()  # .hook: the installed hook; .crashed: it raised (a simulated crash)
_temporary_numbers = itertools.count()  # SimComm ranks are threads of one process: the pid alone is not unique


@contextlib.contextmanager
def file_operation_hook(hook):
    """Call ``hook(operation, path)`` after each file operation of this thread's writers, inside the ``with`` block.

    ``operation`` is one of ``FILE_OPERATIONS`` and ``path`` the file or directory it acted on (for ``rename``,
    the new name; for ``write``, the temporary file a part of the data was just flushed to). A hook that
    raises (or ends the process) stops the writer at that instant, as a crash would: nothing after it runs,
    not even the removal of the temporary file being written (a checkpoint's next save removes it).
    Fault-injection tests and ``MPIDIST_FAULT=...,at=save`` stop saves this way. Only the calling thread is
    affected (a ``SimComm`` rank is a thread: install the hook inside the rank's function); an inner hook
    replaces an outer one until its block ends.
    """
    outer = getattr(_this_thread, "hook", None), getattr(_this_thread, "crashed", False)
    _this_thread.hook, _this_thread.crashed = hook, False
    try:
        yield
    finally:
        _this_thread.hook, _this_thread.crashed = outer


def notify(operation, path):
    """Tell this thread's file-operation hook (if any) that ``operation`` on ``path`` is done."""
    hook = getattr(_this_thread, "hook", None)
    if hook is None:
        return
    try:
        hook(operation, path)
    except BaseException:
        _this_thread.crashed = True  # what runs after this instant (clean-ups) would not run after a crash
        raise


def fsync_dir(path):
    """Make the entries of directory ``path`` (files created, renamed or removed in it) durable."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as exc:
        # Some file systems (FUSE object-store mounts, some CIFS) cannot fsync a directory; the rename is done,
        # so failing now would report a save that did happen as failed.
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.ENOSYS, errno.EBADF):
            raise
    finally:
        os.close(fd)
    notify("fsync_dir", path)


def _temporary_name(path):
    # Unique across the processes of every node sharing the directory: containers reuse pids across nodes.
    return f"{path}{TMP_MARK}{socket.gethostname()}.{os.getpid()}.{next(_temporary_numbers)}.{os.urandom(4).hex()}"


@contextlib.contextmanager
def _renamed_into_place(path, fsync):
    """Yield a temporary name for ``path``; once written, fsync it, rename it over ``path``, fsync the directory.

    If the block raises, the temporary file is removed (unless a hook simulated a crash: a crash cleans nothing).
    """
    tmp = _temporary_name(path)
    try:
        yield tmp
        if fsync:
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            notify("fsync", tmp)
        os.replace(tmp, path)
        notify("rename", path)
    except BaseException:
        if not getattr(_this_thread, "crashed", False):
            remove_quietly(tmp)
        raise
    if fsync:
        fsync_dir(os.path.dirname(path) or ".")


@contextlib.contextmanager
def atomic_path(path, *, fsync=True):
    """Yield a temporary name beside ``path`` to write with any library; then fsync it, rename it over ``path``.

    For writers that take a file name (``safetensors.numpy.save_file``); ``write_atomic`` writes byte chunks.
    If the block raises, the temporary file is removed and ``path`` keeps its old content.
    """
    with _renamed_into_place(os.fspath(path), fsync) as tmp:
        yield tmp
        notify("create", tmp)


def write_atomic(path, chunks, *, fsync=True):
    """Write byte chunks to ``path``: to a temporary name, fsync it, rename it over ``path``, fsync the directory.

    Return (bytes written, CRC32 of them). At every instant ``path`` holds either its old content (or
    nothing) or all of the new, and once this returns the new content survives a power cut (``fsync=False``
    skips both fsyncs: still atomic, not durable). On failure (a chunk iterator that raises, a full disk) the
    temporary file is removed (a full disk must not fill up further with each retry).
    """
    crc, total = 0, 0
    with _renamed_into_place(os.fspath(path), fsync) as tmp:
        with open(tmp, "xb") as f:
            notify("create", tmp)
            for chunk in chunks:
                view = memoryview(chunk).cast("B")
                f.write(view)
                f.flush()  # in the file, not in this process, when the hook hears of it
                notify("write", tmp)
                crc = zlib.crc32(view, crc)
                total += view.nbytes
    return total, crc


def write_text_atomic(path, text, *, fsync=True):
    """Write ``text`` to ``path`` atomically and durably (UTF-8); return the number of bytes written."""
    return write_atomic(path, [text.encode("utf-8")], fsync=fsync)[0]


def make_dir(path):
    """Create directory ``path`` and its parents if needed."""
    if not os.path.isdir(path):
        os.makedirs(path, exist_ok=True)
        notify("mkdir", path)


def remove_quietly(path):
    """Remove file ``path``; a file already gone or that cannot be removed is left (to a later clean-up)."""
    try:
        os.remove(path)
    except OSError:
        return
    notify("remove", path)


def remove_tree(path):
    """Remove directory ``path`` and what it holds, file by file (what is left on an error is left for later)."""
    try:
        entries = sorted(os.listdir(path))
    except OSError:
        return
    for entry in entries:
        inner = os.path.join(path, entry)
        if os.path.isdir(inner) and not os.path.islink(inner):
            remove_tree(inner)
        else:
            remove_quietly(inner)
    try:
        os.rmdir(path)
    except OSError:
        return
    notify("rmdir", path)
