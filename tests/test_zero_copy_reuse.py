"""Zero-copy mode leaves the DataLoader as it was found: a DataLoader wrapped by
Loader(zero_copy=True) can be wrapped again every epoch, iterated plainly, and
wrapped by several Loaders, with fork, spawn and forkserver workers, persistent
or not; nothing (file descriptors, arenas) is left behind. CPU only: the shared
arena works without a GPU."""
import gc
import os
import sys
import time
import weakref
from multiprocessing import forkserver, resource_tracker

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import fastpin
from fastpin import _zerocopy

from conftest import assert_same, open_cuda, patterned, process_state

MB = 1 << 20
N, BATCH = 26, 4                    # an uneven last batch
NBATCHES = -(-N // BATCH)
METHODS = ["fork", "spawn", "forkserver"]

pytestmark = pytest.mark.timeout(120)


def expected(i):
    return patterned((3, 5), torch.float32, seed=i)


class Samples(Dataset):
    def __len__(self):
        return N

    def __getitem__(self, i):
        return {"x": expected(i), "i": i}


def dataloader(method, persistent, workers=2):
    return DataLoader(Samples(), batch_size=BATCH, num_workers=workers,
                      multiprocessing_context=method if workers else None,
                      persistent_workers=persistent and workers > 0)


def check(batches, n=N):
    """Every sample once, exact, in ordinary tensors."""
    seen = []
    for b in batches:
        assert type(b) is dict and isinstance(b["x"], torch.Tensor), type(b)
        assert isinstance(b["i"], torch.Tensor)
        for x, i in zip(b["x"], b["i"].tolist()):
            assert_same(x, expected(i))
            seen.append(i)
    assert sorted(seen) == list(range(n))


def zero_copy(dl, **kw):
    kw.setdefault("capacity", 2 * MB)
    return fastpin.Loader(dl, device=None, zero_copy=True, **kw)


def fds() -> set:
    """This process's descriptors as (number, what it is) pairs. The listing's
    own descriptor, gone by the time it is read, is left out: by number alone
    it showed up as left behind whenever a descriptor opened meanwhile took the
    number it had before, and that descriptor went unnamed."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.add((fd, os.readlink(f"/proc/self/fd/{fd}")))
        except OSError:
            pass
    return out


def live_arenas():
    return {t for t, a in list(_zerocopy._arenas.items())}


@pytest.fixture
def nothing_left_behind():
    """After the test (its Loaders, DataLoaders and batches gone), no file
    descriptor or zero-copy arena of its making is left in this process."""
    # The helpers multiprocessing starts once per process and keeps (their
    # pipes are not the test's).
    resource_tracker.ensure_running()
    forkserver.ensure_running()
    open_cuda()  # and the CUDA driver's, where a GPU is: the first test opens them
    gc.collect()
    before_fds, before_arenas = fds(), live_arenas()
    yield
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        gc.collect()
        left = fds() - before_fds, live_arenas() - before_arenas
        if not any(left):
            return
        time.sleep(0.1)
    pytest.fail(f"left behind: fds {dict(sorted(left[0]))}, arenas {left[1]}; "
                f"{unjoined_children()}; {thread_stacks()}")


def thread_stacks() -> str:
    """Every other thread of this process, by name, with the innermost lines
    of its stack (a thread that holds a pipe's ends shows where it waits)."""
    import threading
    import traceback

    threads = {t.ident: t for t in threading.enumerate()}
    rows = []
    for ident, frame in sys._current_frames().items():
        if ident == threading.get_ident():
            continue
        where = " <- ".join(f"{f.name} ({os.path.basename(f.filename)}:{f.lineno})"
                            for f in reversed(traceback.extract_stack(frame)[-4:]))
        thread = threads.get(ident)
        rows.append(f"{thread.name if thread else ident}: {where}{feeder_state(thread)}")
    return "threads: " + ("; ".join(rows) or "none")


def feeder_state(thread) -> str:
    """For a multiprocessing.Queue's feeder thread: the pipe it writes to and
    whether the queue's write lock (shared with every process that writes to
    the queue) is free."""
    if thread is None or thread.name != "QueueFeederThread":
        return ""
    try:  # Queue._feed's arguments: (buffer, notempty, send_bytes, wlock, ...)
        send, wlock = thread._args[2], thread._args[3]
        fd = send.__self__.fileno() if not send.__self__.closed else "closed"
        free = "none" if wlock is None else wlock._semlock._get_value() > 0
    except (AttributeError, IndexError, OSError) as exc:  # another Python's Queue
        return f" [{exc!r}]"
    return f" [writes to fd {fd}, write lock free: {free}]"


def unjoined_children() -> str:
    """multiprocessing's children not joined yet (their Popen keeps a pipe or
    two open until then): a worker that did not leave when told was
    terminated and never joined. Read without reaping them."""
    from multiprocessing import process

    rows = [f"{p.name} pid {p.pid} state {process_state(p.pid)} sentinel {p.sentinel}"
            for p in list(process._children)]
    return "children not joined: " + (", ".join(rows) or "none") + "; " + live_processes()


def live_processes() -> str:
    """Process objects still alive here (joined or not: their Popen keeps its
    pipes open until it dies), each with what holds it, up to three steps back
    (a frame named by its function and line)."""
    import multiprocessing.process as mp_process

    found = [o for o in gc.get_objects() if issubclass(type(o), mp_process.BaseProcess)
             and o is not mp_process.current_process()]
    ours = [found, sys._getframe()]  # the search's own lists and frames are not holders

    def holders(obj, depth: int) -> str:
        out = []
        referrers = gc.get_referrers(obj)
        ours.append(referrers)
        for r in referrers:
            if any(r is x for x in ours) or type(r).__name__ in ("cell", "list_iterator"):
                continue
            if type(r).__name__ == "frame":
                out.append(f"frame {r.f_code.co_name} ({r.f_code.co_filename}:{r.f_lineno})")
                continue
            what = type(r).__name__
            if isinstance(r, dict):
                what += str([k for k, v in r.items() if v is obj][:3])
            if depth > 1:
                what += " <- (" + holders(r, depth - 1) + ")"
            out.append(what)
            if len(out) == 3:
                break
        return ", ".join(out) or "nothing gc sees"

    def in_threads(obj) -> str:
        """The running functions (any thread) whose locals hold obj, or a
        tuple or list holding it: gc sees no frame of a function still running."""
        import threading

        names = {t.ident: t.name for t in threading.enumerate()}
        out = []
        for ident, frame in sys._current_frames().items():
            while frame is not None:
                if frame.f_code.co_filename == __file__:  # this search's own
                    frame = frame.f_back
                    continue
                for value in list(frame.f_locals.values()):
                    if value is obj or (isinstance(value, (tuple, list))
                                        and any(v is obj for v in value)):
                        out.append(f"{names.get(ident, ident)}: {frame.f_code.co_name} "
                                   f"({frame.f_code.co_filename}:{frame.f_lineno})")
                frame = frame.f_back
        return "; in running code: " + (", ".join(out) or "none")

    rows = [f"{p.name} held by {holders(p, 3)}{in_threads(p)}" for p in found]
    return "live Process objects: " + (" | ".join(rows) or "none")


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("method", METHODS)
def test_new_loader_every_epoch(method, persistent, nothing_left_behind):
    dl = dataloader(method, persistent)
    collate = dl.collate_fn
    for _ in range(2):
        check(zero_copy(dl))
        assert dl.collate_fn is collate
    del dl


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_plain_iteration_after_a_loader(method, persistent, nothing_left_behind):
    dl = dataloader(method, persistent)
    loader = zero_copy(dl)
    check(loader)
    check(dl)          # ordinary batches, not fastpin's descriptors
    check(loader)      # and the Loader still works after it
    check(dl)
    del dl, loader


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_wrap_again_after_the_first_loader_is_gone(method, persistent, nothing_left_behind):
    dl = dataloader(method, persistent)
    first = zero_copy(dl)
    batches = list(first)
    del first
    gc.collect()
    check(batches)     # batches outlive their Loader
    check(zero_copy(dl))
    check(batches)
    del dl, batches


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_two_loaders_over_one_dataloader(method, persistent, nothing_left_behind):
    dl = dataloader(method, persistent)
    a, b = zero_copy(dl), zero_copy(dl)
    for _ in range(2):
        check(a)
        check(b)
    del dl, a, b


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_zip_of_two_loaders_over_one_dataloader(method, persistent, nothing_left_behind):
    dl = dataloader(method, persistent)
    a, b = zero_copy(dl), zero_copy(dl)
    for _ in range(2):
        pairs = list(zip(a, b))
        assert len(pairs) == NBATCHES
        check(p[0] for p in pairs)
        check(p[1] for p in pairs)
        del pairs
    del dl, a, b


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_loader_then_plain_then_loader_interleaved_epochs(method, nothing_left_behind):
    # Persistent workers started by a plain iteration first: the Loader must
    # not reuse them (they run the DataLoader's own collate_fn).
    dl = dataloader(method, persistent=True)
    check(dl)
    loader = zero_copy(dl)
    check(loader)
    assert loader.stats()["fallbacks"] == 0   # zero-copy, not pinned by copy
    check(dl)
    del dl, loader


@pytest.mark.parametrize("copying", [False, True])
def test_a_dataloader_dropped_after_a_loader_goes_at_once(copying, nothing_left_behind):
    """Nothing of a finished epoch holds the DataLoader in a reference cycle: it
    goes, with its own persistent iterator, when the user drops it. Had it waited
    for a gc pass, multiprocessing's finalizers would close that iterator's
    queues before its __del__ could tell the workers to leave: each then took
    the 5 s join timeout and was terminated (never joined on torch 2.11)."""
    dl = dataloader("fork", persistent=True)
    loader = zero_copy(dl) if not copying else fastpin.Loader(dl, device=None, zero_copy=False)
    check(loader)
    check(dl)
    workers = list(dl._iterator._workers)
    gone = weakref.ref(dl)
    gc.disable()
    try:
        del dl, loader
        assert gone() is None, "the DataLoader waits for a gc pass"
    finally:
        gc.enable()
    assert [w.exitcode for w in workers] == [0, 0]  # left when told, joined


@pytest.mark.parametrize("workers", [0, 2])
def test_dataloader_attributes_are_untouched(workers, nothing_left_behind):
    dl = dataloader("fork", persistent=False, workers=workers)
    before = dict(vars(dl))
    loader = zero_copy(dl)
    it = iter(loader)
    next(it)
    assert vars(dl) == before
    check(loader)
    assert vars(dl) == before
    del dl, loader, it


def test_no_workers_every_epoch_a_new_loader(nothing_left_behind):
    dl = dataloader(None, persistent=False, workers=0)
    for _ in range(2):
        check(zero_copy(dl))
    check(dl)
    del dl


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")
@pytest.mark.parametrize("workers", [0, 2])
def test_stateful_dataloader_state_goes_through_the_loader(workers, nothing_left_behind):
    StatefulDataLoader = pytest.importorskip("torchdata.stateful_dataloader").StatefulDataLoader

    def make():
        return StatefulDataLoader(Samples(), batch_size=BATCH, num_workers=workers)

    loader = zero_copy(make(), depth=1)
    it = iter(loader)
    first = [next(it) for _ in range(2)]
    it.close()
    state = loader.state_dict()
    resumed = zero_copy(make())
    resumed.load_state_dict(state)
    rest = list(resumed)
    done = NBATCHES - len(rest)
    assert 2 <= done <= 4
    seen = [i for b in first + rest for i in b["i"].tolist()]
    assert seen[:8] == list(range(8)) and seen[8:] == list(range(done * BATCH, N))
    del loader, resumed, it, first, rest


@pytest.mark.parametrize("sized", ["capacity", "self-sizing"])
@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_the_issue_pattern_a_loader_made_in_the_for_statement(method, persistent, sized,
                                                              nothing_left_behind):
    # for epoch in range(2): for b in fastpin.Loader(dl, ...): nothing but the
    # epoch's iterator holds the Loader's arena.
    dl = dataloader(method, persistent)
    kw = {"capacity": 2 * MB} if sized == "capacity" else {"capacity": None}
    for _ in range(2):
        seen = []
        for b in fastpin.Loader(dl, device=None, zero_copy=True, **kw):
            gc.collect()
            assert type(b) is dict
            for x, i in zip(b["x"], b["i"].tolist()):
                assert_same(x, expected(i))
                seen.append(i)
        assert sorted(seen) == list(range(N))
        del b, x
    check(dl)
    del dl


@pytest.fixture
def torch_2_11_exit_hook(monkeypatch):
    """torch 2.11 and before, for a DataLoader iterator with persistent workers
    and pin_memory (on a GPU), register each worker at exit:
    `atexit.register(_clean_up_worker, w)`. That registration holds the Process,
    and with it the two pipe ends its Popen keeps, until the interpreter exits,
    after the iterator has joined it. Here for every persistent iterator (on
    the CPU its pin_memory is off). Yields the workers so registered."""
    import atexit

    from torch.utils.data import dataloader as dl_module

    registered = []

    def clean_up_worker(w):  # as torch's _MultiProcessingDataLoaderIter._clean_up_worker
        try:
            w.join(timeout=5.0)
        finally:
            if w.is_alive():
                w.terminate()

    cls = dl_module._MultiProcessingDataLoaderIter
    init = cls.__init__

    def patched(self, loader):
        init(self, loader)
        if self._persistent_workers:
            for w in self._workers:
                atexit.register(clean_up_worker, w)
                registered.append(w)

    monkeypatch.setattr(cls, "__init__", patched)
    yield registered
    atexit.unregister(clean_up_worker)
    for w in registered:  # what the interpreter's exit would run: no error
        clean_up_worker(w)


@pytest.mark.parametrize("copying", [False, True])
@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_every_epoch_a_new_loader_over_persistent_workers_held_at_exit(
        method, copying, torch_2_11_exit_hook, nothing_left_behind):
    """A new Loader every epoch over one DataLoader with persistent workers: each
    Loader's view has workers of its own, and torch (2.11 and before, on a GPU)
    holds each of them at exit. Once a Loader is gone its workers' pipes are
    closed, or every epoch would leave two descriptors a worker until the
    process ends (a long run reaches its limit of open files)."""
    dl = dataloader(method, persistent=True)
    for _ in range(3):
        loader = fastpin.Loader(dl, device=None, zero_copy=False) if copying else zero_copy(dl)
        check(loader)
        del loader
    assert len(torch_2_11_exit_hook) == 6
    del dl


@pytest.mark.parametrize("persistent", [False, True])
def test_a_new_loader_every_epoch_takes_the_arena_of_the_last(persistent, nothing_left_behind):
    """`for b in fastpin.Loader(dl)` every epoch: each Loader takes the shared
    arena the one before made (page-locked and, on a GPU, registered once, as
    install() keeps one per DataLoader) instead of making and registering its
    own every epoch; a Loader made while another one reads it makes its own.
    """
    dl = dataloader("fork", persistent)
    first = zero_copy(dl, capacity=None)  # self-sizing
    check(first)
    pool, arenas = first._pool, live_arenas()
    assert arenas
    del first
    for _ in range(2):
        again = zero_copy(dl, capacity=None)
        assert again._pool is pool
        check(again)
        assert live_arenas() == arenas
    reading = iter(again)
    next(reading)
    beside = zero_copy(dl, capacity=None)
    assert beside._pool is not pool
    check(beside)
    assert len(list(reading)) == NBATCHES - 1
    del reading, again, beside
    # Two made before either is read (zip(a, b)): each its own as well.
    a, b = zero_copy(dl, capacity=None), zero_copy(dl, capacity=None)
    assert a._pool is not b._pool
    for _ in range(2):
        pairs = list(zip(a, b))
        check(p[0] for p in pairs)
        check(p[1] for p in pairs)
        del pairs
    assert a.stats()["fallbacks"] == b.stats()["fallbacks"] == 0
    del a, b
    assert zero_copy(dl, capacity=None)._pool is pool  # and every epoch after, the kept one
    del dl
