"""Issue 13: a Loader never hangs the process. Every way out of an epoch
(break, Ctrl-C in next(), a new iter(), an exception in the loop, interpreter
exit) returns within the plain DataLoader's time in the same situation, measured
in the same test, plus a small margin, with a slow source and with workers that
hang forever; and leaves no thread, worker or arena block behind.

DataLoader's own shutdown joins each worker for MP_STATUS_CHECK_INTERVAL (5 s)
before it kills it; the in-process tests shorten that to 1 s for both loaders.
"""
from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import pytest
import torch
from torch.utils.data import DataLoader, Dataset
from torch.utils.data import _utils as dl_utils

import fastpin
from fastpin import _C

from conftest import children_gone, exits_of_forked_runs, patterned

MARGIN = 1.0  # seconds a fastpin exit may take beyond the plain DataLoader's (a shared, slow machine)
SLOW = 0.4    # seconds per sample of the slow source
# The fastpin this process imported (the installed one under `make test`, the
# source tree built in place otherwise): child processes import the same one,
# from a directory that holds no other.
FASTPIN_HOME = os.path.dirname(os.path.dirname(os.path.abspath(fastpin.__file__)))
# Every test here has a time limit: a hang fails it instead of stalling the run.
pytestmark = pytest.mark.timeout(60)


class Slow(Dataset):
    def __len__(self):
        return 100

    def __getitem__(self, i):
        time.sleep(SLOW)
        return patterned((16,), torch.int32, seed=i)


class Hang(Dataset):
    """Sample 0 arrives; every later one hangs its worker forever."""

    def __len__(self):
        return 100

    def __getitem__(self, i):
        if i > 0:
            time.sleep(10 ** 6)
        return patterned((16,), torch.int32, seed=i)


SOURCES = {"hang": (Hang, 2), "slow0": (Slow, 0), "slow2": (Slow, 2)}


@pytest.fixture(autouse=True)
def short_worker_joins(monkeypatch):
    monkeypatch.setattr(dl_utils, "MP_STATUS_CHECK_INTERVAL", 1.0)
    # A CI job started in the background inherits SIGINT ignored: Ctrl-C as at a terminal.
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)
    # Nothing of the test may outlive it.
    assert not wait_gone(), "a fastpin-loader thread outlived the test"
    assert not children_gone(), "a DataLoader worker outlived the test"


def loader_threads():
    return [t for t in threading.enumerate() if t.name == "fastpin-loader" and t.is_alive()]


def wait_gone(timeout=SLOW + 2 * MARGIN):
    deadline = time.monotonic() + timeout
    while loader_threads() and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.02)
    return loader_threads()


def make(kind, wrap, device="cpu", arena=None):
    dataset, workers = SOURCES[kind]
    dl = DataLoader(dataset(), batch_size=1, num_workers=workers)
    return fastpin.Loader(dl, device=device, arena=arena) if wrap else dl


def both(kind, scenario, device="cpu"):
    """Runs scenario(loader) -> seconds for the plain DataLoader, then for a
    Loader around the same kind of DataLoader; checks fastpin's time and that
    nothing is left behind."""
    # Forked workers inherit the garbage of earlier tests; one that frees a CUDA
    # tensor of it aborts (CUDA cannot be used after fork: seen on the H200 in
    # the plain DataLoader's run, in torch's caching allocator). Collect it first.
    gc.collect()
    plain = scenario(make(kind, False))
    gc.collect()
    arena = _C.Arena(1 << 20, cuda=False) if device is None else None
    ours = scenario(make(kind, True, device, arena))
    assert ours <= plain + MARGIN, f"fastpin took {ours:.2f} s, the plain DataLoader {plain:.2f} s"
    assert not wait_gone()
    gc.collect()
    if arena is not None:
        assert arena.stats()["blocks_in_use"] == 0
    return plain, ours


def first_is_right(batch):
    # On the device with device="cuda": compare on the host.
    assert torch.equal(batch.reshape(-1).cpu(), patterned((16,), torch.int32, seed=0))


# ---- break --------------------------------------------------------------------------

def _break(loader):
    for batch in loader:
        first_is_right(batch)
        time.sleep(0.3)  # the same situation for both: every worker busy or hung by now
        t0 = time.monotonic()
        break
    return time.monotonic() - t0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("device", ["cpu", None])
@pytest.mark.parametrize("kind", sorted(SOURCES))
def test_break_returns_as_fast_as_the_dataloader(kind, device):
    both(kind, _break, device)


# ---- Ctrl-C during next() -----------------------------------------------------------

def _sigint(loader):
    it = iter(loader)
    first_is_right(next(it))
    time.sleep(0.3)  # every worker busy or hung by now
    main = threading.main_thread().ident
    sent = []

    def interrupt():
        sent.append(time.monotonic())
        signal.pthread_kill(main, signal.SIGINT)

    timer = threading.Timer(0.3, interrupt)
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            while True:
                next(it)
        raised = time.monotonic() - sent[0]
    finally:
        timer.join()
    t0 = time.monotonic()
    del it  # the DataLoader's workers go now (its __del__; the epoch's finalizer)
    return raised + (time.monotonic() - t0)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", sorted(SOURCES))
def test_sigint_in_next_raises_as_fast_as_the_dataloader(kind):
    both(kind, _sigint)


def test_sigint_raises_at_once_while_the_producer_is_stuck():
    """KeyboardInterrupt in next() costs no wait on the source (the workers go
    when the epoch is dropped, as the DataLoader's do)."""
    it = iter(make("hang", True))
    next(it)
    main = threading.main_thread().ident
    threading.Timer(0.2, signal.pthread_kill, (main, signal.SIGINT)).start()
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        next(it)
    assert time.monotonic() - t0 < 0.2 + MARGIN
    with pytest.raises(StopIteration):
        next(it)  # the epoch is over
    del it


@pytest.mark.timeout(60)
def test_break_while_the_producer_waits_for_room_waits_only_briefly():
    """A producer busy past the grace (here: on_full="wait" for room in an arena
    the consumer's batch fills) is abandoned, not joined; it drops its batch."""
    policy = fastpin._arena.policy()
    fastpin.configure(on_full="wait", wait_timeout=3)
    try:
        arena = _C.Arena(64 << 10, cuda=False)
        batches = [patterned((10 << 10,), torch.int32, seed=k) for k in range(4)]  # 40 KiB each
        for batch in fastpin.Loader(batches, device=None, arena=arena, depth=1):
            time.sleep(0.2)  # the producer waits for room by now
            t0 = time.monotonic()
            break
        took = time.monotonic() - t0
        assert 0.5 < took < 1.0 + MARGIN, took  # the grace (1 s), not the 3 s wait
        assert torch.equal(batch, batches[0])
        del batch
        assert not wait_gone(3 + 2 * MARGIN)
        gc.collect()
        assert arena.stats()["blocks_in_use"] == 0
    finally:
        fastpin.configure(on_full=policy["on_full"], wait_timeout=policy["wait_timeout"])


# ---- a new iter() --------------------------------------------------------------------

def _new_iter(loader):
    first = iter(loader)
    first_is_right(next(first))
    time.sleep(0.3)  # every worker busy or hung by now
    t0 = time.monotonic()
    second = iter(loader)
    took = time.monotonic() - t0
    first_is_right(next(second))  # the new epoch starts from the beginning
    t0 = time.monotonic()
    del first, second
    return took + (time.monotonic() - t0)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", sorted(SOURCES))
def test_new_iter_returns_as_fast_as_the_dataloader(kind):
    both(kind, _new_iter)


def test_new_iter_never_reads_a_dataset_beside_the_old_thread():
    """0 workers: the previous epoch's thread may still be inside the dataset;
    the new epoch reads it only after that thread left."""
    inside = []
    overlaps = []

    class Watched(Dataset):
        def __len__(self):
            return 20

        def __getitem__(self, i):
            inside.append(i)
            if len(inside) > 1:
                overlaps.append(tuple(inside))
            time.sleep(0.05)
            inside.remove(i)
            return torch.tensor([i])

    loader = fastpin.Loader(DataLoader(Watched(), batch_size=1), device="cpu")
    for _ in range(3):
        it = iter(loader)
        next(it)
    assert [int(b) for b in iter(loader)] == list(range(20))
    del it
    assert not overlaps


# ---- an exception raised in the loop (a SIGALRM watchdog) ----------------------------

def _watchdog(loader):
    raised = []

    def fire(signum, frame):
        raised.append(time.monotonic())
        raise TimeoutError("the step took too long")

    old = signal.signal(signal.SIGALRM, fire)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with pytest.raises(TimeoutError):
            for batch in loader:
                first_is_right(batch)
                time.sleep(10)
        return time.monotonic() - raised[0]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", sorted(SOURCES))
def test_exception_in_the_loop_returns_as_fast_as_the_dataloader(kind):
    both(kind, _watchdog)


# ---- the DataLoader's own timeout ----------------------------------------------------

@pytest.mark.timeout(60)
def test_dataloader_timeout_raises_as_it_would():
    def scenario(loader):
        it = iter(loader)
        first_is_right(next(it))
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="timed out") as info:
            next(it)
        took = time.monotonic() - t0
        del it, info  # its traceback holds the DataLoader iterator
        return took

    plain = scenario(DataLoader(Hang(), batch_size=1, num_workers=1, timeout=0.5))
    ours = scenario(fastpin.Loader(DataLoader(Hang(), batch_size=1, num_workers=1, timeout=0.5),
                                   device="cpu"))
    assert ours <= plain + MARGIN


# ---- interpreter exit with the Loader alive ------------------------------------------

EXIT_SCRIPT = """
import os, sys, time
import torch
from torch.utils.data import DataLoader, Dataset
import fastpin
mode, kind = sys.argv[1], sys.argv[2]
class Slow(Dataset):
    def __len__(self): return 100
    def __getitem__(self, i):
        time.sleep(%(slow)r)
        return torch.full((16,), i)
class Hang(Dataset):
    def __len__(self): return 100
    def __getitem__(self, i):
        if i > 0:
            time.sleep(10 ** 6)
        return torch.full((16,), i)
dataset, workers = (Hang(), 2) if kind == "hang" else (Slow(), 0 if kind == "slow0" else 2)
dl = DataLoader(dataset, batch_size=1, num_workers=workers)
loader = dl if mode == "plain" else fastpin.Loader(dl, device=None)
it = iter(loader)
batch = next(it)
time.sleep(0.3)  # every worker busy or hung by now
source = it if mode == "plain" else it.producer.source
pids = [w.pid for w in source._workers] if workers else []
print("PIDS", *pids, flush=True)
print("T0", time.time(), flush=True)
"""


def run_to_exit(mode, kind):
    """Seconds from the script's last line to the end of its process, and the
    pids of its DataLoader workers."""
    env = dict(os.environ, PYTHONPATH=FASTPIN_HOME + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-c", EXIT_SCRIPT % {"slow": SLOW}, mode, kind],
                            cwd=tempfile.gettempdir(), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    pids, t0 = [], None
    try:
        for line in proc.stdout:
            if line.startswith("PIDS"):
                pids = [int(p) for p in line.split()[1:]]
            elif line.startswith("T0"):
                t0 = float(line.split()[1])
                break
        proc.wait(timeout=30)
        end = time.time()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for pid in pids:  # never leave a hung worker behind, whatever happened
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        err = proc.stderr.read()
        proc.stdout.close()
        proc.stderr.close()
    assert proc.returncode == 0, err
    assert t0 is not None
    return end - t0, pids


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", sorted(SOURCES))
def test_interpreter_exit_takes_as_long_as_the_dataloaders(kind):
    plain, plain_pids = run_to_exit("plain", kind)
    ours, pids = run_to_exit("fastpin", kind)
    assert ours <= plain + MARGIN, f"fastpin exited in {ours:.2f} s, the plain DataLoader {plain:.2f} s"
    # The workers died with the process (they may take a moment to be reaped).
    deadline = time.monotonic() + 5
    while any(alive(p) for p in pids + plain_pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in pids if alive(p)], "a worker outlived its process"


# Issue 26 item 0: a script that ends while its Loaders' threads still prepare
# batches (depth far ahead) aborted in 1 run of 5 to 50 ("terminate called
# without an active exception", rc 134): the exit hook only set `stop`, and a
# thread still inside torch (pinning, freeing what it had queued) was ended by
# Python's finalization there, inside a C++ destructor. Each run is a child
# forked from one interpreter that imported torch once, so the 50 runs are
# affordable; each child ends as a script does, by falling off its end.
MID_EPOCH_SCRIPT = """
import os, sys
import numpy.random  # a worker's seeding imports it: forked while a thread imports it, it hangs
import torch
from torch.utils.data import DataLoader
import fastpin
SAMPLES, DEPTH = 2000, 500  # every producer still busy when the script ends

def mid_epoch():
    global its  # alive until the interpreter exits
    data = [{"x": torch.arange(4096, dtype=torch.float32) + 4096 * i} for i in range(SAMPLES)]
    def dl():
        return DataLoader(data, batch_size=2, num_workers=2)
    its = [iter(fastpin.Loader(data, device=None, depth=DEPTH)),
           iter(fastpin.Loader(dl(), device=None, depth=DEPTH)),
           iter(fastpin.Loader(dl(), device="cpu", depth=DEPTH)),
           iter(fastpin.Loader(dl(), device=None, depth=DEPTH, zero_copy=True))]
    for k, it in enumerate(its):
        x = next(it)["x"].reshape(-1)  # the first sample, or the first two
        assert torch.equal(x, torch.arange(x.numel(), dtype=torch.float32)), k

"""


@pytest.mark.timeout(600)
def test_exit_while_loaders_are_mid_epoch_never_aborts():
    codes, stderr = exits_of_forked_runs(MID_EPOCH_SCRIPT, "mid_epoch", 50)
    assert codes == ["0"] * 50, f"exit codes {' '.join(codes)}\n{stderr}"


# ---- several consumer threads on one epoch --------------------------------------------

@pytest.mark.timeout(30)
@pytest.mark.parametrize("threads", [2, 4])
@pytest.mark.parametrize("source", ["list", "dataloader"])
def test_every_consumer_thread_sees_the_end(threads, source):
    n = 40
    if source == "list":
        batches = [patterned((8,), torch.int64, seed=k) for k in range(n)]
        loader = fastpin.Loader(batches, device="cpu")
    else:
        class Items(Dataset):
            def __len__(self):
                return n

            def __getitem__(self, k):
                return patterned((8,), torch.int64, seed=k)
        loader = fastpin.Loader(DataLoader(Items(), batch_size=None, num_workers=2), device=None)
    epoch = iter(loader)
    got, errors = [], []

    def drain():
        try:
            for batch in epoch:
                got.append(batch.clone())
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    workers = [threading.Thread(target=drain) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=10)
    assert not [w for w in workers if w.is_alive()], "a consumer thread never saw the end"
    assert not errors
    want = sorted(patterned((8,), torch.int64, seed=k).tolist() for k in range(n))
    assert sorted(b.tolist() for b in got) == want
    del epoch


@pytest.mark.timeout(30)
def test_consumer_threads_see_the_end_after_an_error():
    def source():
        for k in range(5):
            yield torch.tensor([k])
        raise KeyError("broken source")

    class Once:
        def __iter__(self):
            return source()

    epoch = iter(fastpin.Loader(Once(), device="cpu"))
    results = []

    def drain():
        try:
            for _ in epoch:
                pass
            results.append("end")
        except KeyError:
            results.append("error")

    workers = [threading.Thread(target=drain) for _ in range(3)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=10)
    assert not [w for w in workers if w.is_alive()]
    assert sorted(results) == ["end", "end", "error"]


# ---- device="cpu" and a source that refills one buffer per batch ------------------------

class Refilling:
    """A custom loader that refills one buffer for every batch (as many do)."""

    def __init__(self, n=40):
        self.n = n
        self.buffer = torch.empty(4096, dtype=torch.int32)

    def __iter__(self):
        for k in range(self.n):
            self.buffer.copy_(patterned((4096,), torch.int32, seed=k))
            yield {"x": self.buffer, "k": k}


@pytest.mark.timeout(30)
def test_depth_0_hands_over_a_reused_buffer_before_it_is_refilled():
    source = Refilling()
    seen = 0
    for batch in fastpin.Loader(source, device="cpu", depth=0):
        assert torch.equal(batch["x"], patterned((4096,), torch.int32, seed=batch["k"]))
        seen += 1
    assert seen == source.n
    assert not loader_threads()  # depth=0 runs no thread


@pytest.mark.timeout(30)
def test_pinned_host_mode_copies_a_reused_buffer_before_it_is_refilled():
    arena = _C.Arena(1 << 20, cuda=False)
    source = Refilling()
    batches = list(fastpin.Loader(source, device=None, arena=arena))
    for k, batch in enumerate(batches):
        assert torch.equal(batch["x"], patterned((4096,), torch.int32, seed=k))
    del batches, batch
    gc.collect()
    assert arena.stats()["blocks_in_use"] == 0


@pytest.mark.timeout(30)
def test_depth_0_pinned_host_mode_and_break():
    arena = _C.Arena(1 << 20, cuda=False)
    loader = fastpin.Loader(Refilling(), device=None, depth=0, arena=arena)
    for k, batch in enumerate(loader):
        assert torch.equal(batch["x"], patterned((4096,), torch.int32, seed=k))
        if k == 5:
            break
    del batch
    gc.collect()
    assert arena.stats()["blocks_in_use"] == 0
    assert [b["k"] for b in loader] == list(range(40))


# ---- other DataLoader set-ups ------------------------------------------------------------

class Few(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        time.sleep(0.05)
        return patterned((16,), torch.int32, seed=i)


@pytest.mark.timeout(60)
def test_persistent_workers_break_then_a_whole_epoch():
    """Persistent workers outlive an epoch (as with the plain DataLoader): a
    break leaves them running, and the next epoch reuses them from the start."""
    dl = DataLoader(Few(), batch_size=2, num_workers=2, persistent_workers=True)
    loader = fastpin.Loader(dl, device="cpu")
    for batch in loader:
        break
    del batch
    for _ in range(2):
        got = [b for b in loader]
        assert len(got) == 4
        for k, b in enumerate(got):
            for j in range(2):
                assert torch.equal(b[j], patterned((16,), torch.int32, seed=2 * k + j))
    del got, b, loader
    assert not wait_gone()
    del dl  # its persistent workers go with it
    gc.collect()


@pytest.mark.timeout(60)
def test_break_with_hung_workers_and_the_pin_thread(accelerator):
    """pin_memory=True: the DataLoader's data queue is the pin thread's; the
    producer waiting on it is woken as well once the workers are shut down."""
    fastpin.install()
    try:
        def scenario(wrap):
            dl = DataLoader(Hang(), batch_size=1, num_workers=2, pin_memory=True)
            return _break(fastpin.Loader(dl, device="cpu") if wrap else dl)

        plain = scenario(False)
        ours = scenario(True)
        assert ours <= plain + MARGIN
        assert not wait_gone()
    finally:
        fastpin.uninstall()


# ---- on the GPU machine ------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.timeout(60)
@pytest.mark.parametrize("depth", [0, 2])
def test_cuda_batches_from_a_refilling_source_are_right(depth):
    """depth=0 reads the source in the consumer's thread, copying under the
    Loader's stream there; depth=2 relies on the copy having read the source's
    pageable buffer before the source is asked for the next batch."""
    loader = fastpin.Loader(Refilling(), device="cuda", depth=depth)
    for k, batch in enumerate(loader):
        assert batch["x"].is_cuda
        assert torch.equal(batch["x"].cpu(), patterned((4096,), torch.int32, seed=k))
    assert k == 39


@pytest.mark.gpu
@pytest.mark.timeout(60)
def test_cuda_break_with_hung_workers():
    both("hang", _break, device="cuda")
