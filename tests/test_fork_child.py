"""A process forked mid-epoch (os.fork, a 'fork' multiprocessing.Process) can
iterate the zero-copy Loader it inherited: its epochs take the copy path with
workers of their own (the shared arena is the parent's, registered in the
parent's CUDA context), and its batches are exact; the parent's epoch goes on
exact. It raised "... its arena is not known in this process" in the child."""
from __future__ import annotations

import multiprocessing
import os
import sys
import traceback

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import fastpin

from conftest import assert_same, patterned

pytestmark = pytest.mark.timeout(120)
SAMPLES, BATCH = 24, 4


class Patterned(Dataset):
    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        return {"x": patterned((64, 3), torch.float32, seed=i), "i": i}


def expected(n):
    ids = range(n * BATCH, (n + 1) * BATCH)
    return torch.stack([patterned((64, 3), torch.float32, seed=i) for i in ids])


def check_epoch(loader, start=0, it=None):
    """Every batch of an epoch (from batch `start` of iterator `it`) exact."""
    it = iter(loader) if it is None else it
    n = start
    for batch in it:
        assert_same(batch["x"], expected(n))
        assert batch["i"].tolist() == list(range(n * BATCH, (n + 1) * BATCH))
        n += 1
    assert n == SAMPLES // BATCH


def make_loader():
    loader = fastpin.Loader(DataLoader(Patterned(), batch_size=BATCH, num_workers=2),
                            device=None)
    assert loader.zero_copy
    return loader


def in_child(loader) -> None:
    """The child's part: two full epochs of the inherited Loader, exact."""
    try:
        check_epoch(loader)
        check_epoch(loader)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    os._exit(0)


def test_os_fork_child_iterates_the_inherited_loader_and_the_parent_stays_exact():
    loader = make_loader()
    it = iter(loader)
    first = next(it)
    assert_same(first["x"], expected(0))
    pid = os.fork()
    if pid == 0:
        in_child(loader)
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    assert code == 0, "the forked child could not iterate the Loader (see its traceback above)"
    check_epoch(loader, 1, it)  # the parent's epoch goes on, exact
    check_epoch(loader)         # and the next one
    assert loader.zero_copy


def _process_target(loader, queue):
    try:
        check_epoch(loader)
        queue.put("ok")
    except BaseException:
        queue.put(traceback.format_exc())


def test_fork_process_child_iterates_the_inherited_loader():
    loader = make_loader()
    it = iter(loader)
    next(it)
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_process_target, args=(loader, queue))
    child.start()
    result = queue.get(timeout=100)
    child.join(30)
    assert result == "ok", result
    check_epoch(loader, 1, it)
