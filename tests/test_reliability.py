"""Faults and limits: registration refused, fork, Ctrl-C, a Loader collected
while its batches live, bad input. No crash, no hang, nothing lost."""
import gc
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import fastpin
from fastpin import _C, _arena


def run_script(code, timeout=120, **kwargs):
    here = os.path.dirname(os.path.dirname(fastpin.__file__))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=timeout, cwd=here, **kwargs)


def test_refused_registration_names_limit_and_fix(monkeypatch):
    real = _C.Arena

    def refusing(capacity, **kwargs):
        if kwargs.get("cuda", True):
            raise _C.CudaError("cuMemHostRegister of the arena failed: CUDA_ERROR_OUT_OF_MEMORY (2)")
        return real(capacity, **kwargs)

    monkeypatch.setattr(_C, "Arena", refusing)
    with pytest.raises(fastpin.CudaError) as info:
        _arena.make_arena(1 << 20)
    message = str(info.value)
    assert "CUDA_ERROR_OUT_OF_MEMORY" in message and "1048576 bytes" in message
    assert "RLIMIT_MEMLOCK" in message and "allow_unpinned" in message
    fastpin.configure(allow_unpinned=True)
    try:
        with pytest.warns(RuntimeWarning, match="ordinary"):
            arena = _arena.make_arena(1 << 20)
        assert not arena.registered
        out = fastpin.pin_memory(torch.arange(5) + 3, arena=arena)
        assert torch.equal(out, torch.arange(5) + 3)
    finally:
        fastpin.configure(allow_unpinned=False)


def test_reading_stats_makes_no_arena():
    # A page-locked arena as a side effect of reading counters would be
    # memory the OS cannot page out, for nothing.
    r = run_script("""
        import fastpin
        from fastpin import _arena
        s = fastpin.stats()
        assert s["arena"] is None and s["batches"] == 0, s
        assert not _arena._arenas
        fastpin.pin_memory({"x": __import__("numpy").arange(1000) * 3})
        s = fastpin.stats()
        assert s["batches"] == 1 and s["arena"]["high_water"] > 0, s
        print("ok")
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def test_forked_child_uses_fastpin_afresh():
    # The parent pins (pool threads started, arena made), then forks: the
    # child has no copy threads or CUDA context of its own and starts anew.
    r = run_script("""
        import os, numpy as np, fastpin
        from fastpin import _C
        big = np.arange(4 << 20, dtype=np.uint8)
        assert np.array_equal(fastpin.pin_memory(big), big)
        pid = os.fork()
        if pid == 0:
            try:
                arr = (np.arange(3 << 20, dtype=np.int32) * 7 + 1)
                out = fastpin.pin_memory({"a": arr})
                ok = np.array_equal(out["a"], arr) and fastpin.default_arena() is not None
                os._exit(0 if ok else 3)
            except BaseException:
                import traceback; traceback.print_exc()
                os._exit(4)
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
        print("ok")
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def test_ctrl_c_during_iteration_leaves_the_process_clean():
    r = run_script("""
        import os, signal, threading, time, torch, fastpin
        from torch.utils.data import DataLoader, Dataset
        class Slow(Dataset):
            def __len__(self): return 10_000
            def __getitem__(self, i):
                time.sleep(0.01)
                return torch.full((64,), i)
        loader = fastpin.Loader(DataLoader(Slow(), batch_size=4, num_workers=2), device=None)
        # Started in the background (CI), the process inherits SIGINT ignored,
        # and Python then leaves it so: Ctrl-C as at a terminal.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()
        batch = None  # Ctrl-C may come before the first batch
        try:
            for batch in loader:
                pass
        except KeyboardInterrupt:
            print("interrupted")
        del batch
        deadline = time.monotonic() + 10
        while any(t.name == "fastpin-loader" for t in threading.enumerate()):
            assert time.monotonic() < deadline, "the producer thread outlived Ctrl-C"
            time.sleep(0.05)
        print("clean")
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["interrupted", "clean"], r.stderr


class Patterned(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        return torch.arange(i, i + 32, dtype=torch.int64) * 3 + 1


def test_loader_collected_while_batches_live():
    arena = _C.Arena(1 << 20, cuda=False)
    loader = fastpin.Loader(DataLoader(Patterned(), batch_size=8, num_workers=2), device=None,
                            arena=arena)
    batches = list(loader)
    del loader
    gc.collect()
    for k, b in enumerate(batches):
        for j, row in enumerate(b):
            i = 8 * k + j
            assert torch.equal(row, torch.arange(i, i + 32, dtype=torch.int64) * 3 + 1)
    del batches, b, row
    gc.collect()
    arena.collect()
    assert arena.stats()["blocks_in_use"] == 0


class Flaky(Dataset):
    def __len__(self):
        return 40

    def __getitem__(self, i):
        if i % 13 == 5:
            raise ValueError(f"index {i} is corrupt")
        return torch.full((4,), i)


@pytest.mark.parametrize("workers", [0, 2])
def test_dataset_raising_on_some_indices(workers):
    loader = fastpin.Loader(DataLoader(Flaky(), batch_size=2, num_workers=workers), device=None)
    with pytest.raises(ValueError, match="index 5 is corrupt"):
        for _ in loader:
            pass
    # The next epoch runs up to the same fault again: nothing stuck in between.
    got = []
    with pytest.raises(ValueError):
        for b in loader:
            got.extend(b[:, 0].tolist())
    assert got == [0, 1, 2, 3]


def test_bad_input_is_refused_or_passed_through():
    # A GPU-less meta tensor: a clear error naming the device.
    with pytest.raises(ValueError, match="meta"):
        fastpin.pin_memory({"x": torch.empty(3, device="meta")})
    # Objects fastpin cannot pin pass through untouched.
    obj = object()
    arr = np.array([obj, 1], dtype=object)
    out = fastpin.pin_memory({"o": obj, "a": arr, "s": {1, 2}})
    assert out["o"] is obj and out["a"] is arr and out["s"] == {1, 2}
    # Overlapping views (stride 0) come back as real copies with equal values.
    base = torch.arange(5, dtype=torch.float32) + 0.5
    over = base.as_strided((4, 5), (0, 1))
    pinned = fastpin.pin_memory(over)
    assert torch.equal(pinned, over) and pinned.stride() == (5, 1)
    # An enormous shape over a block is refused, not read past its end.
    block = fastpin.default_arena().alloc(64)
    with pytest.raises(ValueError):
        block.dlpack(0, (1 << 40, 1 << 40), (1 << 40, 1), 2, 32)


def test_collate_fn_returning_something_unexpected():
    loader = fastpin.Loader(DataLoader(Patterned(), batch_size=4, collate_fn=lambda s: "batch"),
                            device=None)
    assert list(loader)[:2] == ["batch", "batch"]


def test_copy_threads_are_not_inherited_by_a_fork_child():
    r = run_script("""
        import os, numpy as np, fastpin
        from fastpin import _C
        _C.set_threads(4)
        fastpin.pin_memory(np.arange(8 << 20, dtype=np.uint8))  # starts the pool
        parent_threads = len(os.listdir("/proc/self/task"))
        pid = os.fork()
        if pid == 0:
            # Only the forking thread exists here; a pin starts a pool of its own.
            alone = len(os.listdir("/proc/self/task")) == 1
            a = np.arange(8 << 20, dtype=np.uint8)
            ok = np.array_equal(fastpin.pin_memory(a), a)
            os._exit(0 if alone and ok else 5)
        _, status = os.waitpid(pid, 0)
        print(parent_threads >= 4, os.WEXITSTATUS(status))
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "0"]
