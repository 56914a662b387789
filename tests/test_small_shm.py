"""A batch a worker cannot place in fastpin's shared pool (full: the loop keeps
its batches, or the pool is at its cap) is collated the ordinary way, through
/dev/shm. Where /dev/shm is small (a container's 64 MB), exactly those batches
fail, and torch's error ("unable to allocate shared memory(shm) ... No space
left on device") said nothing of fastpin's pool. The error now names both
limits and the fix, with torch's error chained, and stays a RuntimeError.

The real case runs in a mount namespace of its own with a small tmpfs on
/dev/shm (unshare, mount: skipped where they are not permitted)."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import types

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, default_collate

import fastpin
from fastpin import _C, _segments, _zerocopy

from conftest import assert_same, patterned

pytestmark = [pytest.mark.timeout(180), pytest.mark.filterwarnings(
    "ignore:.pin_memory. argument is set as true but no accelerator:UserWarning")]
BATCH, SAMPLES = 4, 48
SHAPE = (64, 1024)   # 256 KiB a sample, 1 MiB a batch
BATCH_BYTES = BATCH * 64 * 1024 * 4
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Patterned(Dataset):
    def __init__(self, shape=SHAPE, samples=SAMPLES):
        self.shape, self.samples = shape, samples

    def __len__(self):
        return self.samples

    def __getitem__(self, i):
        return patterned(self.shape, torch.float32, seed=i)


def expected(n, shape=SHAPE):
    return torch.stack([patterned(shape, torch.float32, seed=i)
                        for i in range(n * BATCH, (n + 1) * BATCH)])


def _no_room(self, size, *, device=None):
    """torch's own error when /dev/shm has no room for a worker's batch."""
    raise RuntimeError(f"unable to allocate shared memory(shm) for file "
                       f"</torch_{os.getpid()}_1_0>: No space left on device (28)")


@pytest.fixture
def shm_full(monkeypatch):
    # Workers are forked: they inherit it. Only a batch collated the ordinary
    # way in a worker asks torch for shared memory there.
    monkeypatch.setattr(torch.storage.TypedStorage, "_new_shared", _no_room)


@pytest.fixture
def installed_capped(monkeypatch):
    monkeypatch.setenv("FASTPIN_ZERO_COPY_MAX_BYTES", str(6 * BATCH_BYTES))
    fastpin.install()
    yield
    fastpin.uninstall()


def keep_until_error(loader) -> tuple:
    """Iterate keeping every batch: (the batches, the error that ended it)."""
    kept = []
    with pytest.raises(RuntimeError) as caught:
        for batch in loader:
            kept.append(batch)
    for n, batch in enumerate(kept):
        assert_same(batch, expected(n))
    return kept, str(caught.value)


def shm_size() -> int:
    s = os.statvfs("/dev/shm")
    return s.f_blocks * s.f_frsize


def test_install_fallback_without_shm_room_names_pool_and_shm(installed_capped, shm_full):
    dl = DataLoader(Patterned(), batch_size=BATCH, num_workers=1, prefetch_factor=1,
                    pin_memory=True)
    kept, message = keep_until_error(dl)
    assert kept, "the pool held no batch"
    assert "Caught RuntimeError in DataLoader worker process" in message, message
    # fastpin's pool: full, its size, what holds it, the knob of its cap
    assert "shared pool" in message and "full" in message, message
    assert str(6 * BATCH_BYTES) in message, message
    assert "keeps" in message and "cap" in message, message
    assert "FASTPIN_ZERO_COPY_MAX_BYTES" in message, message
    assert "max_capacity" not in message, message      # not a Loader
    # /dev/shm: its size and free bytes, the batch's size, the fix
    assert f"/dev/shm is {shm_size()} bytes" in message, message
    assert re.search(r"\d+ bytes free", message), message
    assert str(BATCH_BYTES) in message, message
    assert "--shm-size=" in message, message
    # torch's own error, chained
    assert "No space left on device" in message, message
    assert "direct cause" in message, message


def test_loader_fallback_without_shm_room_names_max_capacity(shm_full):
    dl = DataLoader(Patterned(), batch_size=BATCH, num_workers=1, prefetch_factor=1)
    loader = fastpin.Loader(dl, device=None, zero_copy=True, max_capacity=3 * BATCH_BYTES)
    kept, message = keep_until_error(loader)
    assert kept, "the pool held no batch"
    assert "shared pool" in message and str(3 * BATCH_BYTES) in message, message
    assert "max_capacity" in message, message
    assert f"/dev/shm is {shm_size()} bytes" in message, message
    assert "No space left on device" in message, message


def corrupt_at_7(samples):
    """Batch 7 (the pool holds batches 0 to 5, batch 6 falls back) fails."""
    first = patterned(SHAPE, torch.float32, seed=7 * BATCH)
    if torch.equal(samples[0].view(torch.int32), first.view(torch.int32)):
        raise RuntimeError("sample 28 is corrupt")
    return torch.stack(samples)


@pytest.mark.parametrize("collate", [corrupt_at_7, default_collate, lambda s: default_collate(s)],
                         ids=["raises", "default", "calls-default"])
def test_user_collate_errors_pass_unchanged(installed_capped, shm_full, collate):
    """The user's collate_fn runs before the pool is tried: what it raises,
    torch's shared-memory error of its own default_collate among them, is
    its own, unchanged. (default_collate itself is fastpin's path.)"""
    dl = DataLoader(Patterned(), batch_size=BATCH, num_workers=1, prefetch_factor=1,
                    pin_memory=True, collate_fn=collate)
    kept, message = keep_until_error(dl)
    if collate is default_collate:
        assert "shared pool" in message, message
        return
    last = message.rstrip().splitlines()[-1]
    if collate is corrupt_at_7:
        assert last == "RuntimeError: sample 28 is corrupt", message
    else:
        assert last.startswith("RuntimeError: unable to allocate shared memory(shm)"), message
    assert "shared pool" not in message and "direct cause" not in message, message


@pytest.mark.parametrize("limit, fixed, cap, loader, words", [
    (_segments._LIMIT_NONE, True, 0, True, ("its capacity is fixed", "capacity=4194304")),
    (_segments._LIMIT_NONE, False, 4 << 20, True,
     ("at its cap of 4194304", "max_capacity", "FASTPIN_ZERO_COPY_MAX_BYTES")),
    (_segments._LIMIT_NONE, False, 4 << 20, False,
     ("at its cap of 4194304", "raise FASTPIN_ZERO_COPY_MAX_BYTES to 4194304")),
    (_segments._LIMIT_NONE, False, 1 << 30, False, ("sized for the batches in flight",)),
    (_segments._LIMIT_REFUSED, False, 1 << 30, False, ("driver refused", "ulimit -l")),
    (_segments._LIMIT_TIGHT, False, 1 << 30, False, ("cgroup's memory limit", "more memory")),
], ids=["fixed", "cap-loader", "cap-install", "sized", "refused", "tight"])
def test_why_full_names_what_limits_the_pool(limit, fixed, cap, loader, words):
    """What a worker reads of the pool for the message: from the segments'
    shared stats and the directory's word for why it could not grow."""
    arena = _C.Arena(4 << 20, shared=True, cuda=False)
    held = [arena.alloc(1 << 20) for _ in range(2)]
    directory = None if fixed else types.SimpleNamespace(map=bytearray(_segments._DIR_BYTES))
    if directory is not None:
        _segments._set_word(directory.map, _segments._DIR_LIMIT, limit)
    facts, fixes, alive = _zerocopy.why_full([arena], directory, (3, cap), 1 << 20, loader)
    text = f"{facts}: {'; '.join(fixes)}"
    assert facts.startswith("4194304 bytes in 1 segment, 2 batches in it (2097152 bytes)"), text
    assert "up to 3" in facts and "keeps" not in facts, text
    assert alive == 4
    for word in words:
        assert word in text, text
    del held


# ---- in a mount namespace with a tmpfs of its own on /dev/shm -----------------

CHILD = r"""
import json, os, sys
import torch
from torch.utils.data import DataLoader, Dataset
sys.path[:0] = [sys.argv[1], os.path.join(sys.argv[1], "tests")]
import fastpin
from fastpin._runtime import process
from conftest import patterned

mode, stock = sys.argv[2], sys.argv[3] == "stock"
SHAPE, BATCH = (768, 1024), 4          # 3 MiB a sample, 12 MiB a batch

class Patterned(Dataset):
    def __len__(self):
        return 4 * BATCH
    def __getitem__(self, i):
        return patterned(SHAPE, torch.float32, seed=i)

def stack(samples):
    return torch.stack(samples)

def same(a, b):  # bytes, NaN payloads included
    return torch.equal(a.view(torch.int32), b.view(torch.int32))

def batches():
    dl = DataLoader(Patterned(), batch_size=BATCH, num_workers=2, pin_memory=True,
                    collate_fn=stack if mode == "user" else None, timeout=60)
    return dl, list(dl)            # every batch kept: the pool fills

s = os.statvfs("/dev/shm")
out = {"shm_size": s.f_blocks * s.f_frsize}
try:
    if stock:
        want = batches()[1]
    fastpin.install()
    dl, got = batches()
    out["fallbacks"] = process.installed_pools[dl][1].stats()["fallbacks"]
    if stock:
        out["same_as_stock"] = len(got) == len(want) and all(
            same(a, b) for a, b in zip(got, want))
    out["exact"] = all(
        same(b, torch.stack([patterned(SHAPE, torch.float32, seed=i)
                             for i in range(n * BATCH, (n + 1) * BATCH)]))
        for n, b in enumerate(got))
except RuntimeError as e:
    out["error"] = str(e)
print("RESULT " + json.dumps(out))
"""


def _namespace_refused() -> str:
    """Why a mount namespace with its own /dev/shm cannot be made here, or ""."""
    if not sys.platform.startswith("linux") or shutil.which("unshare") is None:
        return "no unshare(1) here"
    probe = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c",
         "mount -t tmpfs -o size=1m tmpfs /dev/shm"],
        capture_output=True, text=True, timeout=30)
    if probe.returncode:
        return ("a mount namespace with a tmpfs on /dev/shm is not permitted here "
                f"(needs CAP_SYS_ADMIN): {probe.stderr.strip()}")
    return ""


def in_small_shm(size: str, mode: str, stock: bool = False) -> dict:
    refused = _namespace_refused()
    if refused:
        pytest.skip(refused)
    env = dict(os.environ, FASTPIN_ZERO_COPY_MAX_BYTES=str(24 << 20))  # two batches
    script = (f"mount -t tmpfs -o size={size} tmpfs /dev/shm && exec \"$0\" -c \"$1\" "
              f"\"$2\" \"$3\" \"$4\"")
    run = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", script,
         sys.executable, CHILD, ROOT, mode, "stock" if stock else "-"],
        capture_output=True, text=True, timeout=150, env=env)
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stdout + run.stderr
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.parametrize("mode", ["default", "user"])
def test_small_dev_shm_error_names_pool_and_shm(mode):
    """Batches of 12 MiB, /dev/shm of 8 MiB, a pool of two batches and a loop
    that keeps every batch: the third falls back and has no room in /dev/shm.
    With a collate_fn of the user's that gives private tensors, stock torch
    moves them to /dev/shm as it pickles them, on the queue's thread, where
    the error is printed and the batch lost (the main process waits until its
    timeout): the fallback moves them in the worker, so the error arrives."""
    out = in_small_shm("8m", mode)
    message = out.get("error")
    assert message is not None, out
    assert out["shm_size"] == 8 << 20
    assert "shared pool" in message and "full" in message, message
    assert str(24 << 20) in message, message                 # the pool, at its cap
    assert "FASTPIN_ZERO_COPY_MAX_BYTES" in message, message
    assert f"/dev/shm is {8 << 20} bytes" in message, message
    assert re.search(r"\d+ bytes free", message), message
    assert str(12 << 20) in message, message                  # the batch
    assert "--shm-size=" in message, message
    assert "No space left on device" in message and "direct cause" in message, message


@pytest.mark.parametrize("mode", ["default", "user"])
def test_big_enough_dev_shm_changes_nothing(mode):
    out = in_small_shm("256m", mode, stock=True)
    assert "error" not in out, out["error"]
    assert out["fallbacks"] > 0, "the test needs batches that fall back"
    assert out["exact"] and out["same_as_stock"], out
