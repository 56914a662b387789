"""The consumer-side driver of delivery: Ahead prepares each batch in the
consumer's own next(), `depth` batches ahead, through a step of _delivery; no
thread, no queue. fastpin.Loader uses it where the source has worker processes
(they run ahead already) and with depth=0; install(device=...) mixes Delivering
into a DataLoader iterator (deliver_from), whose _next_data() is then Ahead's.
"""
from __future__ import annotations

import collections
import contextvars
import select
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Optional

if TYPE_CHECKING:
    from ._delivery import Stats


# True while Ahead prepares a batch beyond the one it is to hand over.
preparing_ahead: contextvars.ContextVar = contextvars.ContextVar("fastpin_preparing_ahead",
                                                                 default=False)


class NoRoomAhead(Exception):
    """Raised by a step preparing a batch ahead (preparing_ahead) that would
    have to wait for room in its arena: the room may be held by the batches
    prepared before it, which only this same thread would hand over, so the
    wait could only time out. The batch waits for its turn instead, and
    `later()` prepares it then (waiting for room as the policy says)."""

    def __init__(self, later: Callable[[], Any]):
        super().__init__("no room for a batch ahead")
        self.later = later


class _Later:
    """A batch taken from the source but prepared only in its turn (NoRoomAhead)."""

    __slots__ = ("prepare",)

    def __init__(self, prepare: Callable[[], Any]):
        self.prepare = prepare


class Ahead:
    """Delivery in the consumer's own next(), `depth` batches ahead: take the
    source's next batches until `depth` are prepared beyond the one to hand
    over (prepare: received, unpacked, its copy issued on the copy stream),
    then hand over the oldest (deliver). With worker processes behind the
    source this is all the main process does per batch: no thread, no queue.

    The source's end and its errors come in order: the batches prepared before
    them are handed over first; then StopIteration, or the error (once).
    After either the driver starts afresh: a DataLoader iterator whose worker
    raised goes on with its next batch, persistent workers with their next
    epoch. Ctrl-C (any BaseException but StopIteration) is raised at once,
    the prepared batches kept. Not thread-safe: one consumer at a time."""

    __slots__ = ("step", "depth", "stats", "pending", "error", "ended", "pulling")

    def __init__(self, step, depth: int, stats: Optional["Stats"] = None):
        self.step = step
        self.depth = depth
        self.stats = stats  # where the time spent waiting and preparing is added
        self.pending: collections.deque = collections.deque()  # prepared items, oldest first
        self.error: Optional[BaseException] = None  # the source's, raised after `pending`
        self.ended = False     # the source said StopIteration (or raised) this round
        self.pulling = False   # inside pull(): the source may shut itself down there

    def next(self, pull: Callable[[], Any], ready: Optional[Callable[[], bool]] = None):
        """The next batch; pull() gives the source's next one (StopIteration at
        its end). ready(), where given, says whether pull() would return
        without waiting: batches beyond the one to hand over are taken only
        while it says so, so that a slow or hung worker never holds back a
        batch that has arrived (a DataLoader's: batch_ready)."""
        if not self.ended:
            self.fill(pull, ready)
        if self.pending:
            item = self.pending[0]
            if type(item) is _Later:
                try:
                    prepared = item.prepare()  # its turn: room may wait
                except Exception:
                    self.pending.popleft()  # its error in its turn, as fill's are
                    raise
                # Ctrl-C while it waits: it stays first, to be prepared next time.
                item = self.pending[0] = prepared
            self.pending.popleft()
            return self.step.deliver(item)
        return self.finish()

    def fill(self, pull: Callable[[], Any], ready: Optional[Callable[[], bool]]) -> None:
        pending, prepare = self.pending, self.step.prepare_here
        if pending and type(pending[-1]) is _Later:
            return  # the room is short: nothing is taken before it is prepared
        clock = time.perf_counter
        waited = prepared = 0.0
        try:
            while len(pending) <= self.depth:
                if pending and ready is not None and not ready():
                    return
                t0 = clock()
                self.pulling = True
                try:
                    batch = pull()
                except StopIteration:
                    self.ended = True
                    return
                except Exception as exc:  # noqa: BLE001 - raised in its turn (finish)
                    self.ended, self.error = True, exc
                    return
                finally:
                    self.pulling = False
                    t1 = clock()
                    waited += t1 - t0
                token = preparing_ahead.set(True) if pending else None
                try:
                    pending.append(prepare(batch))
                except NoRoomAhead as later:
                    # Prepared in its turn; nothing more is taken before it.
                    pending.append(_Later(later.later))
                    return
                except Exception as exc:  # noqa: BLE001 - raised in its turn (finish)
                    self.ended, self.error = True, exc
                    return
                finally:
                    if token is not None:
                        preparing_ahead.reset(token)
                    batch = None  # a zero-copy batch's block is free to go once copied
                    prepared += clock() - t1
        finally:
            stats = self.stats
            if stats is not None:
                with stats.lock:
                    stats.wait_seconds += waited
                    stats.copy_seconds += prepared

    def finish(self):
        """Nothing prepared is left: the source's end, or its error, once."""
        error, self.error, self.ended = self.error, None, False
        if error is None:
            raise StopIteration
        try:
            raise error
        finally:
            # No cycle through this frame: the error's traceback holds the
            # source's frames, freed with the error.
            del error

    def clear(self) -> None:
        """Drop what is prepared (a new epoch, the source shut down): the
        batches' device memory goes back as they die. Safe from any thread."""
        self.pending.clear()
        self.error, self.ended = None, False


class Delivering:
    """Mixed into a DataLoader iterator by install(device=...) (one subclass per
    iterator class, made once: delivering()): its batches come from an Ahead
    (the iterator's `_fastpin_ahead`) over the iterator's own _next_data. The
    iterator keeps its workers, its order, its ends; what is prepared ahead is
    dropped when it is reset for a new epoch (persistent workers), shut down or
    dropped. No reference cycle: dropping the iterator shuts its workers down
    at once, as the stock one does."""

    _fastpin_ahead: Ahead
    _fastpin_poll: Ready

    def _next_data(self):
        return self._fastpin_ahead.next(super()._next_data, self._fastpin_ready)

    def _fastpin_ready(self) -> bool:
        return self._fastpin_poll(self)

    def _reset(self, *args, **kwargs):
        ahead = self.__dict__.get("_fastpin_ahead")
        if ahead is not None:
            ahead.clear()  # the previous epoch's batches, prepared ahead
        super()._reset(*args, **kwargs)

    def _shutdown_workers(self):
        ahead = self.__dict__.get("_fastpin_ahead")
        # The source shuts itself down at its end, inside pull(): what is
        # prepared is still to be handed over then.
        if ahead is not None and not ahead.pulling:
            ahead.clear()
        super()._shutdown_workers()


class Ready:
    """Ready()(it): whether DataLoader iterator `it` (with workers) has its next batch here:
    arrived out of order and kept, or something in its result queue (with
    in_order, that may be a later batch: next() then waits for the one it
    needs, as it would have). Called before every batch taken ahead, so it
    asks the queue's pipe with one poll(2) on a poll object made once: the
    queue's own empty() builds a selector each call (4 us against 0.6 us on a
    2-core CPU machine). It holds no reference to the iterator, which may
    keep it."""

    __slots__ = ("queue", "poller")

    def __init__(self):
        self.queue = self.poller = None

    def __call__(self, it) -> bool:
        info = it._task_info.get(it._rcvd_idx)
        if info is not None and len(info) == 2:
            return True
        queue = it._data_queue
        try:
            if queue is not self.queue:
                self.queue, self.poller = queue, _poller(queue)
            if self.poller is None:
                return not queue.empty()
            # Readable, hung up or closed: next() returns at once or says why.
            return bool(self.poller.poll(0))
        except (OSError, ValueError):  # closed: next() says why
            return True


def _poller(queue) -> Optional["select.poll"]:
    """A poll object on a multiprocessing queue's reading end; None for any
    other queue (a pin thread's queue.Queue, whose empty() is cheap)."""
    reader = getattr(queue, "_reader", None)
    if reader is None or not hasattr(select, "poll"):
        return None
    poller = select.poll()
    poller.register(reader.fileno(), select.POLLIN)
    return poller


def batch_ready(it) -> bool:
    """Ready()(it) once (a test's, or a caller's that asks rarely)."""
    return Ready()(it)


def ready_of(source) -> Optional[Callable[[], bool]]:
    """A Ready for `source`, a DataLoader iterator with workers; None for any
    other source (Ahead then takes its batches ahead as they come)."""
    if all(hasattr(source, name) for name in ("_task_info", "_rcvd_idx", "_data_queue")):
        ready = Ready()
        return lambda: ready(source)
    return None


_delivering: dict = {}   # iterator class -> its Delivering subclass
_delivering_lock = threading.Lock()


def delivering(cls: type) -> type:
    """`cls` (a DataLoader iterator class) with Delivering mixed in: same name,
    isinstance of `cls`, made once."""
    sub = _delivering.get(cls)
    if sub is None:
        with _delivering_lock:
            sub = _delivering.get(cls)
            if sub is None:
                sub = type(cls.__name__, (Delivering, cls),
                           {"__module__": cls.__module__, "__qualname__": cls.__qualname__})
                _delivering[cls] = sub
    return sub


def deliver_from(it, step, depth: int) -> None:
    """Make DataLoader iterator `it` (in its __init__, before it starts a pin
    thread) hand over its batches through `step`, `depth` ahead, in the
    consumer's next()."""
    it._pin_memory = False  # no pin thread: the batch goes from the worker to `step`
    it._fastpin_ahead = Ahead(step, depth, step.stats)
    it._fastpin_poll = Ready()
    it.__class__ = delivering(type(it))
