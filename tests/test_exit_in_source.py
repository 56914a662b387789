"""A script that ends while a Loader's thread is inside a source that runs in
this process (a DataLoader without workers: its fetch and collate call torch
in that thread) never aborts. Python's finalization ends a thread that takes
the GIL back inside a torch call, and that end, through a C++ frame, aborts
the process ("terminate called without an active exception", rc 134). The
exit hook gave no grace to a thread inside the source, whatever the source:
only a thread waiting on worker processes may be left there at once.

Each run is a child forked from one interpreter that imported torch once
(as in test_shutdown), so 50 runs are affordable; each child ends as a
script does, by falling off its end, its last line the smallest case:
next(iter(fastpin.Loader(DataLoader(ds, batch_size=4), device=None))).
"""
from __future__ import annotations

import pytest

from conftest import exits_of_forked_runs

RUNS = 50

# The dataset does real torch work per sample (matrix products that release
# the GIL), so the producer is inside torch for most of the time it is in the source.
SCRIPT = """
import os, sys
import torch
from torch.utils.data import DataLoader, Dataset
import fastpin

class Work(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        x = torch.arange(128 * 128, dtype=torch.float32).reshape(128, 128).add_(i).div_(16384)
        for _ in range(20):
            x = torch.tanh(x @ x.T / 128)
        return x

def last_line():
    torch.set_num_threads(1)
    next(iter(fastpin.Loader(DataLoader(Work(), batch_size=4), device=None)))
"""


@pytest.mark.timeout(600)
def test_exit_with_the_producer_inside_an_in_process_source_never_aborts():
    codes, stderr = exits_of_forked_runs(SCRIPT, "last_line", RUNS)
    aborted = sum(code != "0" for code in codes)
    assert codes == ["0"] * RUNS, (f"{aborted} of {RUNS} runs ended badly: exit codes "
                                   f"{' '.join(codes)}\n{stderr}")
