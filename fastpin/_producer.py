"""The thread side of a fastpin.Loader's epoch, and how epochs end.

Where the source works in this process (num_workers=0, generators, lists), an
epoch's _Producer runs a background thread that takes the source's batches,
prepares each through the epoch's step (_delivery) and queues it, `depth`
ahead of the consumer (_loader._Epoch). Leaving an epoch never waits on the
source: a thread still inside it is left there, a daemon that drops whatever
it gets (_Producer.shutdown). A source with worker processes runs no thread
(the consumer drives its epoch, _ahead): its workers are shut down here as a
DataLoader iterator's own __del__ would (_end_here). At interpreter exit the producers still
running are stopped and parked before Python finalizes (_at_exit). Under a
cgroup memory limit a DataLoader's workers are made the kernel's first choice
when memory runs out (_workers_first_to_go).
"""
from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
from typing import TYPE_CHECKING, Optional

from . import _install, _numa, _queues
from ._runtime import memory_room, process

if TYPE_CHECKING:
    from ._loader import Loader

log = logging.getLogger("fastpin")

_STOP = object()  # end of the epoch
_POLL = 0.1       # seconds between checks of the stop flag while blocked
# How long a closing epoch waits for a producer that is not inside the source
# (queueing or preparing a batch: bounded work) before abandoning it.
_GRACE = 1.0


@atexit.register
def _at_exit() -> None:
    """Stop the producers still running (process.producers) before Python
    finalizes: from then on a thread that takes the GIL back is ended where it
    stands, and inside a torch call (which releases the GIL) or a tensor's
    free, that end aborts the process (a C++ destructor). So each thread gets
    the short grace a closing epoch gives it to leave what it is doing and
    park, holding what it has, freeing nothing (_Producer.park): preparing or
    queueing a batch, and reading its source, which runs in this process (a
    DataLoader without workers, a generator: its fetch and collate call torch
    in this very thread, and end with the batch). A source with worker
    processes runs no thread (see _loader._Epoch)."""
    process.exiting = True
    producers = list(process.producers)
    for producer in producers:
        producer.halt()  # its queued batches go here, in the main thread
    deadline = time.monotonic() + _GRACE
    for producer in producers:
        while (producer.thread.is_alive() and time.monotonic() < deadline
               and not producer.parked.wait(0.01)):
            pass


# The thread of a producer not started: never alive.
_UNSTARTED = threading.Thread(name="fastpin-loader (not started)")


class _Failure:
    """An exception raised while producing a batch, re-raised by next()."""

    def __init__(self, exc: BaseException):
        self.exc = exc

class _Producer:
    """The background half of one epoch: takes batches from the source,
    prepares them and queues them, `depth` ahead of the consumer. It holds no
    reference to the consumer's iterator, so dropping that (a break) stops it."""

    def __init__(self, owner: Loader, previous: "Optional[_Producer]" = None, start: bool = True):
        self.mode = owner._mode()  # what is done to each batch (_delivery)
        self.stats = owner._stats
        self.placement = owner._placement
        self.queue: queue.Queue = queue.Queue(maxsize=owner.depth)
        self.stop = threading.Event()
        # True while the thread is inside next(source): there it may stay for as
        # long as the source likes (a slow dataset, a worker that hangs), so a
        # closing epoch does not wait for it (see shutdown).
        self.in_source = False
        self.parked = threading.Event()  # set by the thread once it is parked (see park)
        source = owner._source  # zero-copy: the Loader's view of the DataLoader
        if previous is not None and (previous.source is source or previous.source is
                                     getattr(source, "_iterator", None)):
            # The source is the previous epoch's own iterator (an iterator given
            # as the loader, a DataLoader's persistent workers): one thread at a
            # time may be inside it. The plain DataLoader waits here as well (its
            # _reset waits for every worker to resume).
            previous.wait()
            previous = None
        with _install.loader_source():
            self.source = iter(source)
        # A source whose batches come from worker processes: the consumer
        # drives its epoch (no thread is started for it).
        if _worker_backed(self.source):
            _workers_first_to_go(self.source)
            if source is not owner.loader:  # the Loader's own view: its workers are its own
                _queues.pipes_closed_at_end(self.source)
        # Another iterator over the same dataset, run in this process by a
        # previous epoch's thread that is still inside it (0 workers, a plain
        # iterable): this thread waits for it to leave before reading the source,
        # so the dataset is never read by two threads at once.
        self.previous = previous if previous is not None and not _worker_backed(previous.source) else None
        # Made by start(): a thread made and never started would hold this
        # producer (its run) in a reference cycle, and with it the epoch's
        # mode and the DataLoader, until a gc pass (an epoch over workers is
        # driven by the consumer and never starts it).
        self.thread: threading.Thread = _UNSTARTED
        if start:
            self.start()

    def start(self) -> None:
        process.producers.add(self)
        self.thread = threading.Thread(target=self.run, name="fastpin-loader", daemon=True)
        self.thread.start()

    def run(self) -> None:
        source = self.source
        _numa.name_this_thread(self.thread.name)  # in /proc and perf too, not only in Python
        mode = self.mode
        try:
            mode.in_thread()  # before any other CUDA call of this thread
            # This thread copies its share of every batch (the pool helps).
            _numa.pin_this_thread(self.placement)
            if self.previous is not None:
                while self.previous.thread.is_alive() and not self.stop.is_set():
                    self.previous.thread.join(_POLL)
                self.previous = None
            while True:
                self.hold_back()
                self.in_source = True
                if self.stop.is_set():
                    return
                try:
                    batch = next(source)
                except StopIteration:
                    self.in_source = False
                    self.put(_STOP)
                    return
                self.in_source = False
                if self.stop.is_set():
                    return  # abandoned while in the source: the batch is dropped here
                t0 = time.perf_counter()
                item = mode.prepare(batch)
                batch = None  # a zero-copy batch's block is free to go once copied
                dt = time.perf_counter() - t0
                with self.stats.lock:
                    self.stats.copy_seconds += dt
                self.put(item)
                item = None
        except BaseException as exc:  # noqa: BLE001 - re-raised by the consumer
            self.in_source = False
            if not self.stop.is_set():
                self.put(_Failure(exc))
        finally:
            self.in_source = False
            if process.exiting:
                self.park()
            # Dropping the last reference to a DataLoader iterator shuts its
            # workers down (a no-op if the consumer did so already).
            self.source = source = None
            if self.stop.is_set():
                self.drain()  # what a stopped epoch queued goes, never to nobody
            if not process.exiting:
                mode.end()

    def hold_back(self) -> None:
        """Under a cgroup memory limit that leaves less than two batches of room
        (_runtime.memory_room), take no batch ahead of the consumer: each one
        queued is held here on top of what the source holds, and a process that
        holds more than its workers is the one the kernel kills, without a word,
        where the DataLoader alone would lose a worker and raise."""
        stats = self.stats
        while not self.stop.is_set() and not self.queue.empty():
            room = memory_room()
            if room is None or (stats.batches and room >= 2 * stats.bytes // stats.batches):
                return
            time.sleep(_POLL / 10)

    def park(self) -> None:
        """The interpreter is exiting: block here for good, holding every
        reference the thread has (its batches, the source), so that it frees
        nothing and calls into torch no more while Python finalizes (see
        _at_exit). The process ends with the thread parked."""
        self.parked.set()
        threading.Event().wait()

    def put(self, item) -> None:
        """Queue `item` for the consumer; once the epoch is stopped, drop it."""
        while not self.stop.is_set():
            try:
                self.queue.put(item, timeout=_POLL)
                return
            except queue.Full:
                continue

    def drain(self) -> None:
        """Drop what is queued (the batches' memory goes back as they die)."""
        while True:
            try:
                self.queue.get_nowait()
            except queue.Empty:
                return

    def halt(self) -> None:
        """Ask the thread to stop and drop what it queued; waits for nothing.
        What the thread produces from now on it drops itself."""
        self.stop.set()
        self.drain()

    def wait(self) -> None:
        """Wait for the (halted) thread to end, interruptibly (Ctrl-C)."""
        while (self.thread.is_alive() and not self.parked.is_set()
               and threading.current_thread() is not self.thread):
            self.drain()
            self.thread.join(_POLL)

    def shutdown(self) -> None:
        """End the epoch's thread, and never wait on a thread that may never
        return: a thread busy queueing or preparing a batch gets a short grace;
        one inside the source (or past the grace) is left there, a daemon that
        drops whatever it gets from then on, and ends the epoch's step
        (mode.end) itself when it leaves. Safe from any thread."""
        self.halt()
        if process.exiting or threading.current_thread() is self.thread or not self.thread.is_alive():
            return
        deadline = time.monotonic() + _GRACE
        while self.thread.is_alive() and not self.in_source and time.monotonic() < deadline:
            self.drain()
            self.thread.join(0.01)
        self.drain()
        if not self.thread.is_alive():
            self.mode.forget()

def _worker_backed(source) -> bool:
    """A DataLoader iterator with worker processes: a thread inside its next()
    only waits on its queues, and reads no dataset in this process."""
    return hasattr(source, "_shutdown_workers")


# Added to a DataLoader worker's oom_score_adj under a cgroup memory limit
# (the kernel's scale: -1000 never, +1000 first).
_WORKER_OOM_ADJ = 500


def _workers_first_to_go(source) -> None:
    """Under a cgroup memory limit, make the DataLoader iterator's workers the
    kernel's first choice when the cgroup runs out (raising a process's
    oom_score_adj needs no privilege). The Loader's process holds the batches
    it prepares ahead, the copies and the arena, so it is the largest, and the
    kernel would kill it without a word; a killed worker is what the
    DataLoader alone would lose, and its iterator then raises, saying so."""
    if memory_room() is None:
        return
    for worker in getattr(source, "_workers", ()):
        try:
            with open(f"/proc/{worker.pid}/oom_score_adj", "r+") as f:
                now = int(f.read().strip() or 0)
                f.seek(0)
                f.write(str(min(now + _WORKER_OOM_ADJ, 1000)))
        except (OSError, ValueError, AttributeError):
            pass  # gone already, or /proc refused: the kernel chooses as before


def _end_here(producer: _Producer) -> None:
    """A consumer-side epoch is dropped: its DataLoader iterator's workers are
    shut down now, as its own __del__ would (unless persistent: they outlive
    the epoch), then the blocks of workers that died before their batches
    arrived are reclaimed. Nothing runs in a source here: nothing to wait for."""
    source, producer.source = producer.source, None
    if process.exiting:
        return
    shutdown = getattr(source, "_shutdown_workers", None)
    if shutdown is not None and not getattr(source, "_persistent_workers", False):
        try:
            shutdown()
        except Exception as exc:  # noqa: BLE001 - a half shut-down iterator: its __del__ retries
            log.debug("fastpin.Loader: shutting down the DataLoader's workers: %r", exc)
    source = None
    producer.mode.forget()
    producer.mode.end()
