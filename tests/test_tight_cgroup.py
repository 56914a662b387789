"""In a memory-tight cgroup no fastpin path is killed where the DataLoader
alone raises. A 1,000 MiB cgroup and a DataLoader whose workers' batches
outgrow it: the DataLoader loses a worker and raises ("DataLoader worker ...
is killed"). The Loader's process held the batches it prepared ahead and
their copies, so the kernel chose it instead: killed without a word (rc 137).

Runs in a cgroup made below this process's own (as root; skipped where
cgroups cannot be made).
"""
from __future__ import annotations

import os
import signal

import pytest

import fastpin

from cgroups import PYTHON, memory_cgroup

FASTPIN_HOME = os.path.dirname(os.path.dirname(os.path.abspath(fastpin.__file__)))
LIMIT = 1000 << 20

# 16 samples of 6 MiB a batch, 4 workers x prefetch 2 in flight: more than the
# limit holds, in the DataLoader alone.
SCRIPT = """
import sys
import torch
from torch.utils.data import DataLoader, Dataset
import fastpin

class Big(Dataset):
    def __len__(self):
        return 400

    def __getitem__(self, i):
        return torch.arange(6 << 18, dtype=torch.float32).add_(i)

mode = sys.argv[1]
dl = DataLoader(Big(), batch_size=16, num_workers=4)
source = dl if mode == "stock" else fastpin.Loader(dl, device=None, zero_copy=mode == "zero_copy")
try:
    for n, batch in enumerate(source):
        assert batch[0, 1].item() == 16 * n + 1
except RuntimeError as e:
    print("RAISED", e, flush=True)
    sys.exit(3)
print("DONE", flush=True)
"""


def run(cgroup, mode):
    env = dict(os.environ, PYTHONPATH=FASTPIN_HOME)
    return cgroup.run([PYTHON, "-c", SCRIPT, mode], env=env, capture_output=True, text=True,
                      timeout=250)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["copy", "zero_copy"])
def test_the_loader_raises_where_the_dataloader_does_never_killed(mode):
    for _ in range(2):
        cgroup = memory_cgroup()
        try:
            cgroup.limit(LIMIT)
            out = run(cgroup, mode)
        finally:
            cgroup.close()
        killed = out.returncode in (-signal.SIGKILL, 128 + signal.SIGKILL)
        assert not killed, f"the Loader's process was killed ({mode}):\n{out.stderr[-3000:]}"
        # Done, or the DataLoader's own error about its lost worker.
        assert out.returncode in (0, 3), out.stderr[-3000:]
        if out.returncode == 3:
            assert "DataLoader worker" in out.stdout, out.stdout
