"""The benchmark's training case, now fastpin.bench.train; this name stays for
`from fastpin import bench_train` and `python -m fastpin.bench_train`."""
from __future__ import annotations

import sys

from fastpin.bench.train import PATHS, format_train_table, main, resnet18_maker, train_table, why_not

_resnet18 = resnet18_maker  # the name tests/test_bench_train.py asks for

__all__ = ["PATHS", "format_train_table", "train_table", "why_not"]

if __name__ == "__main__":
    sys.exit(main())
