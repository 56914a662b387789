"""The training case of the benchmark (fastpin.bench_train): skipped with its
reason where it cannot run; its machinery run on the CPU with a tiny model."""
import pytest
import torch

from fastpin import bench, bench_train

from conftest import gpu

pytestmark = pytest.mark.timeout(300)


def tiny():
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.AdaptiveAvgPool2d(1),
                               torch.nn.Flatten(), torch.nn.Linear(4, 1000))


def test_skipped_with_a_reason_where_it_cannot_run():
    why = bench_train.why_not()
    if torch.cuda.is_available() and bench_train._resnet18() is not None:
        assert why is None
    else:
        assert why.startswith("skipped: needs ")


def test_every_host_path_trains_on_the_cpu():
    paths = ("pageable", "loader_host", "zero_copy")
    result = bench_train.train_table(workers=(2,), steps=3, warmup=1, batch_size=8, images=16,
                                     size=32, paths=paths, device="cpu", model=tiny)
    assert [(r["dtype"], r["workers"]) for r in result["rows"]] == [("uint8", 2), ("float32", 2)]
    for row in result["rows"]:
        assert row["bound_ips"] > 0
        for p in paths:
            assert row["paths"][p]["ips"] > 0, row["paths"][p]
    table = bench_train.format_train_table(result)
    assert "| path | uint8 (0 MB), 2 workers | float32 (0 MB), 2 workers |" in table
    for p in paths:
        ips = [f"{row['paths'][p]['ips']:.0f}" for row in result["rows"]]
        assert f"| {bench.PATHS[p].label} | {ips[0]} (" in table


@gpu
def test_training_case_on_the_gpu():
    if bench_train._resnet18() is None:
        pytest.skip("needs torchvision or timm")
    result = bench_train.train_table(workers=(4,), steps=5, warmup=2)
    for row in result["rows"]:
        for p in bench_train.PATHS:
            assert "ips" in row["paths"][p], row["paths"][p]
        assert row["paths"]["zero_copy"]["fallbacks"] == 0
