"""The multiprocessing plumbing of a DataLoader iterator, as the main process of
install() or a Loader uses it (the workers keep torch's own):

- IndexQueue: the indices of a worker's next batches, written into the pipe
  by the thread that puts them, not by a feeder thread woken per batch;
- ResultQueue: the workers' batches; the main process puts into it only to
  wake the thread that reads it, and does that without a feeder thread
  (wake()), which could wait for good on a write lock that a dead worker
  held;
- pipes_closed_at_end: the pipes of the workers torch holds until exit.

Linux only, as fastpin: the pipes are asked with fcntl and ioctl, and a
non-blocking write opens the pipe again through /proc/self/fd.
"""
from __future__ import annotations

import collections
import fcntl
import math
import os
import queue
import select
import struct
import termios
import time
import weakref
from multiprocessing import queues as mp_queues
from multiprocessing.reduction import ForkingPickler
from typing import Optional

_PAGE = os.sysconf("SC_PAGE_SIZE")
_FRAME = struct.Struct("!i")  # multiprocessing.Connection's length prefix
_PIPE_BUF = 4096  # POSIX's atomic pipe write on Linux: never interleaved with another


def _unread(reader: int) -> int:
    """Bytes written into the pipe of `reader` and not read yet (FIONREAD)."""
    return struct.unpack("i", fcntl.ioctl(reader, termios.FIONREAD, b"\0" * 4))[0]


class _Pipe:
    """The write end of a pipe that one process alone writes to, and what it
    has written that the reader may not have read yet. A write the pipe has
    pages free for never blocks: Linux puts a write into the last page when
    it fits there and else into new pages, so a write of n bytes takes at
    most ceil(n / page) pages, which stay taken until it is read."""

    def __init__(self, writer: int, reader: int):
        self.writer, self.reader = writer, reader
        try:
            self.pages = fcntl.fcntl(writer, fcntl.F_GETPIPE_SZ) // _PAGE
        except OSError:  # not a pipe: every write goes to the feeder
            self.pages = 0
        self.written = 0
        self.unread: collections.deque = collections.deque()  # (end offset, pages) a write
        self.taken = 0  # pages the unread writes may hold

    def write(self, frame: bytes) -> bool:
        """Write `frame` whole if the pipe has room for it now; whether it did."""
        pages = -(-len(frame) // _PAGE)
        if self.taken + pages > self.pages:
            self._count_read()  # the kernel asked only when the writes alone fill it
            if self.taken + pages > self.pages:
                return False
        view = memoryview(frame)
        while view:  # one write; the loop only for a signal between
            view = view[os.write(self.writer, view):]
        self.written += len(frame)
        self.unread.append((self.written, pages))
        self.taken += pages
        return True

    def _count_read(self) -> None:
        """Drop the writes the reader has read whole (FIONREAD: the bytes unread)."""
        if not self.pages:
            return
        read = self.written - _unread(self.reader)
        while self.unread and self.unread[0][0] <= read:
            self.taken -= self.unread.popleft()[1]


class _OwnWrites(mp_queues.Queue):
    """A multiprocessing.Queue the main process writes into itself: with no
    feeder thread to close the pipe after the last message, close() does."""

    def close(self):
        super().close()
        if self._thread is None:
            self._reader.close()
            self._writer.close()


class IndexQueue(_OwnWrites):
    """A DataLoader iterator's index queue (the main process sends each worker
    the indices of its next batches) that writes each message into the pipe
    from the thread that puts it, where the pipe has room for all of it now:
    torch's multiprocessing.Queue hands every message to a feeder thread, and
    waking that thread cost the main process 35-60 us a batch on the CPU
    machine, as much as the rest of torch's own protocol. A message the pipe
    has no room for (a worker that lags, indices of a very large batch) goes
    to the feeder as before, and so does every later one: messages keep their
    order, and nothing blocks that would not have blocked before."""

    _pipe: Optional[_Pipe] = None

    def put(self, obj, block=True, timeout=None):
        if self._thread is None and not self._closed:
            data = ForkingPickler.dumps(obj)
            if not self._sem.acquire(block, timeout):
                raise queue.Full
            with self._wlock:
                if self._pipe is None:
                    self._pipe = _Pipe(self._writer.fileno(), self._reader.fileno())
                if self._pipe.write(_FRAME.pack(len(data)) + bytes(data)):
                    return
            self._sem.release()
        super().put(obj, block, timeout)


class ResultQueue(_OwnWrites):
    """A DataLoader iterator's result queue as the main process holds it. The
    workers write their batches into it; the main process puts into it only
    to wake the thread that reads it (torch's pin thread at the iterator's
    end). torch's put hands that message to a feeder thread, which takes the
    queue's write lock, shared with the workers: a worker that died while it
    wrote (killed, or leaving with its own feeder mid-write) never frees it,
    and the feeder then waits for good, holding both ends of the pipe. Here
    the message goes through wake(): written at once, or not needed. (With
    the lock lost, torch's pin thread wakes at its own poll's timeout, 5 s,
    as it does after torch's put.)"""

    _poller: Optional[select.poll] = None

    def put(self, obj, block=True, timeout=None):
        if self._closed:
            raise ValueError(f"Queue {self!r} is closed")
        wake(self, obj)

    def get(self, block=True, timeout=None):
        """torch's get, get(timeout=...), waits on a poll object made once:
        multiprocessing's builds a selector at each call (5.2-5.4 us a get
        against 2.6-2.7 on a 2-core CPU machine, benchmarks/queue_get.py)."""
        if self._closed or not block or timeout is None:
            return super().get(block, timeout)
        deadline = time.monotonic() + timeout
        if not self._rlock.acquire(True, timeout):
            raise queue.Empty
        try:
            if self._poller is None:
                self._poller = select.poll()
                self._poller.register(self._reader.fileno(), select.POLLIN)
            # Readable, hung up or failed: the read returns or says why, as
            # multiprocessing's own wait() has it.
            if not self._poller.poll(max(0, math.ceil((deadline - time.monotonic()) * 1000))):
                raise queue.Empty
            data = self._recv_bytes()
            self._sem.release()
        finally:
            self._rlock.release()
        return ForkingPickler.loads(data)


def wake(q, message) -> bool:
    """Write `message` into multiprocessing queue `q`'s pipe from this thread,
    to wake the thread that reads it; never blocks, starts no thread. Whether
    it wrote. It does not write where the reader needs no waking: the write
    lock held (a worker writes, and what it writes wakes the reader) or the
    pipe full (the reader has plenty to read)."""
    data = bytes(ForkingPickler.dumps(message))
    frame = _FRAME.pack(len(data)) + data
    if len(frame) > _PIPE_BUF:
        raise ValueError(f"a wake-up message of {len(frame)} bytes: at most {_PIPE_BUF}")
    if not q._sem.acquire(False):  # the queue's count of messages: full
        return False
    lock, wrote = q._wlock, False
    locked = lock is not None and lock.acquire(False)
    try:
        if locked or lock is None:
            wrote = _write_now(q._writer.fileno(), q._reader.fileno(), frame)
    finally:
        if locked:
            lock.release()
        if not wrote:
            q._sem.release()
    return wrote


def _write_now(writer: int, reader: int, frame: bytes) -> bool:
    """Write `frame` (at most PIPE_BUF bytes: all of it or nothing) into the
    pipe of `writer` if it has room now. The pipe's own descriptor is shared
    with the workers (made before they were), so O_NONBLOCK goes on a
    descriptor of its own; where /proc is not there, only into an empty pipe,
    which has room for it for sure."""
    try:
        fd = os.open(f"/proc/self/fd/{writer}", os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        if _unread(reader):
            return False
        fd = os.dup(writer)
    try:
        return os.write(fd, frame) == len(frame)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


# ---- the workers' own pipes -------------------------------------------------

def pipes_closed_at_end(it) -> None:
    """torch 2.11 and before register each persistent worker of an iterator
    with pin_memory (on a GPU) to be joined at exit, `atexit.register(
    _clean_up_worker, w)`: that holds the Process, and the two pipe ends its
    Popen keeps, until the interpreter exits. A Loader's view has workers of its
    own, so a new Loader every epoch would leave two descriptors a worker every
    epoch, and so would a DataLoader made anew (for each validation, say) under
    install(). Once the iterator is gone (its __del__ has joined them), the
    pipes of the workers that ended are closed: the exit hook's join then reads
    the exit code kept, as it would have."""
    if not getattr(it, "_persistent_workers", False) or "_fastpin_pipes" in vars(it):
        return
    it.__dict__["_fastpin_pipes"] = True  # one iterator for every epoch: once
    weakref.finalize(it, _close_pipes, list(getattr(it, "_workers", ()))).atexit = False


def _close_pipes(workers) -> None:
    for worker in workers:
        popen = getattr(worker, "_popen", None)
        if popen is not None and popen.returncode is not None:
            popen.close()  # its finalizer closes the pipes, once
