"""fastpin.bench: compare() on a DataLoader of our own, the Results it returns,
the workload cases, plot(), and the command line (python -m fastpin.bench).

No timing thresholds: the tests check that every path delivers every batch, in
order, with the right bytes, and that the figures are there and consistent."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import fastpin
from fastpin import bench
from conftest import gpu, patterned, tensor_bytes

HOST_PATHS = ["pageable", "fastpin_pin", "loader_host", "zero_copy", "install"]
GPU_PATHS = ["pin_memory", "prefetcher", "loader_cuda"]
N, BATCH = 48, 4
BATCH_BYTES = BATCH * (3 * 16 * 16 * 4 + 8 * 8 + 8)   # image, tokens, index


class Samples(Dataset):
    """Item i: a float32 image and int64 tokens whose patterns depend on i, and i."""

    def __len__(self):
        return N

    def __getitem__(self, i):
        return {"image": patterned((3, 16, 16), torch.float32, i),
                "tokens": patterned((8,), torch.int64, 1000 + i), "index": i}


def factory(workers=0):
    def make(pin_memory: bool) -> DataLoader:
        return DataLoader(Samples(), batch_size=BATCH, num_workers=workers,
                          pin_memory=pin_memory)
    return make


def digest(batch) -> tuple:
    """What a path delivered, independent of where it lies."""
    return (zlib.crc32(tensor_bytes(batch["image"].cpu())),
            zlib.crc32(tensor_bytes(batch["tokens"].cpu())), tuple(batch["index"].tolist()))


def expected_digests(n):
    return [digest(b) for b, _ in zip(factory()(False), range(n))]


class Recorder:
    """A step that records the digest of every batch, per path."""

    def __init__(self):
        self.seen: list = []

    def __call__(self, batch):
        self.seen.append(digest(batch))


def by_path(results):
    return {row.path: row for row in results.rows}


# ---- compare() --------------------------------------------------------------------

@pytest.mark.parametrize("workers", [0, 2])
def test_every_host_path_delivers_every_batch_in_order(workers):
    batches, warmup = 4, 2
    for path in HOST_PATHS:
        step = Recorder()
        res = bench.compare(factory(workers), paths=[path], batches=batches, warmup=warmup,
                            min_seconds=0, device=None, step=step, progress=False)
        row = res[path]
        assert row.status == "ok", (path, row.reason)
        # The warm-up: what was asked for, or what the workers and the depth (2) hold.
        assert row.warmup == max(warmup, 2 * workers + 2)
        assert step.seen == expected_digests(1 + row.warmup + batches), path
        assert row.batches == batches
        assert row.batch_mb * bench.MB == pytest.approx(BATCH_BYTES)
        assert row.gbps > 0 and row.step_ms > 0 and row.first_batch_s > 0 and row.cpu_ms >= 0
        # Byte rate and step time describe the same timed batches.
        assert row.gbps * 1e9 * row.step_ms / 1e3 == pytest.approx(BATCH_BYTES, rel=1e-6)
        if bench.PATHS[path].fastpin and not (path == "install" and workers == 0):
            # The batches went through a fastpin arena of their own (install()
            # without workers: DataLoader pins, which it does not without a GPU).
            assert row.pool_peak_mb * bench.MB >= BATCH_BYTES
            assert row.fallbacks == 0
        if not fastpin.cuda_available():
            assert row.pinned_mb == 0     # nothing is page-locked without a GPU
        assert not fastpin.installed()    # the install path puts it back as it was


@pytest.mark.parametrize("path", ["install", "zero_copy"])
def test_worker_fallbacks_are_counted_for_the_install_path_too(path, monkeypatch):
    """The H200 bench of 2026-12-02 printed fallbacks 0 for install() while its
    workers fell back on every batch: the row counted the main process's own
    fallbacks and a Loader's, never the pool install() gives the DataLoader."""
    monkeypatch.setenv("FASTPIN_ZERO_COPY_MAX_BYTES", "4096")   # no batch fits: all fall back
    res = bench.compare(factory(2), paths=[path], batches=4, warmup=1, device=None,
                        progress=False)
    row = res[path]
    assert row.status == "ok", row.reason
    assert row.fallbacks >= row.batches

def test_rounds_take_turns_and_report_each_paths_median_run():
    """rounds=3: every path runs three times, the paths in turn, each run
    delivering every batch; a path's row is its run of the median GB/s, with
    every run's GB/s beside it, in the table and through JSON."""
    paths = ["pageable", "fastpin_pin", "loader_host"]
    step = Recorder()
    res = bench.compare(factory(0), paths=paths, batches=3, warmup=1, min_seconds=0,
                        device=None, step=step, progress=False, rounds=3)
    assert res.rounds == 3 and [r.path for r in res.rows] == paths
    # Each run: the first batch, the warm-up, the timed ones; the paths in turn.
    one_round = [d for row in res.rows for d in expected_digests(1 + row.warmup + row.batches)]
    assert step.seen == one_round * 3
    for row in res.rows:
        assert row.ok, row.reason
        assert len(row.rounds_gbps) == 3 and all(g > 0 for g in row.rounds_gbps)
        assert row.gbps == sorted(row.rounds_gbps)[1]
    table = res.table()
    for row in res.rows:
        low, high = min(row.rounds_gbps), max(row.rounds_gbps)
        assert f"({bench.results.num(low)}-{bench.results.num(high)})" in table
    assert "ran 3 times" in res.markdown()
    again = bench.Results.from_dict(json.loads(res.to_json()))
    assert again.rounds == 3 and again["pageable"].rounds_gbps == res["pageable"].rounds_gbps


def test_rounds_must_be_a_whole_number_of_at_least_one():
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="rounds"):
            bench.compare(factory(0), paths=["pageable"], batches=1, warmup=0, device=None,
                          progress=False, rounds=bad)


def test_gpu_paths_say_why_they_did_not_run():
    res = bench.compare(factory(), paths=None, batches=2, warmup=0, device=None, progress=False)
    rows = by_path(res)
    assert list(rows) == list(bench.PATHS)
    for path in ("prefetcher", "loader_cuda"):
        assert rows[path].status == "skipped"
        assert "delivers to a GPU" in rows[path].reason or "needs a GPU" in rows[path].reason
    if not fastpin.cuda_available():
        reason = fastpin.cuda_status().reason
        for path in GPU_PATHS:
            assert rows[path].status == "skipped" and reason in rows[path].reason
    for path in HOST_PATHS:
        assert rows[path].ok, rows[path].reason
    # The table has the paths that ran; those this machine cannot run are named once.
    table, md = res.table(), res.markdown()
    for row in res.rows:
        assert (f"| {row.label} |" in table) == (not row.unavailable)
    unavailable = [r.label for r in res.rows if r.unavailable]
    assert unavailable and all(label in md for label in unavailable)
    assert md.count("Left out: ") == len({r.reason for r in res.rows if r.unavailable})


@pytest.mark.skipif(fastpin.cuda_available(), reason="checks the machine without a GPU")
def test_auto_device_without_gpu_runs_the_host_paths():
    res = bench.compare(factory(), paths=["pageable", "loader_cuda"], batches=2, warmup=0,
                        progress=False)
    assert res.device == "host"
    assert res["pageable"].ok
    assert res["loader_cuda"].status == "skipped"
    assert fastpin.cuda_status().reason in res["loader_cuda"].reason


@gpu
def test_every_path_delivers_to_the_gpu():
    batches, warmup = 4, 1
    for path in bench.PATHS:
        step = Recorder()
        res = bench.compare(factory(2), paths=[path], batches=batches, warmup=warmup,
                            min_seconds=0, device="cuda", step=step, progress=False)
        row = res[path]
        assert row.status == "ok", (path, row.reason)
        assert row.warmup == 2 * 2 + 2   # the workers' prefetch and the depth
        assert step.seen == expected_digests(1 + row.warmup + batches), path
        assert row.pinned_mb is not None


@gpu
def test_pinned_memory_held_is_each_paths_own():
    # A fastpin path after pin_memory=True counts its own arena, not what
    # torch's pinned cache still holds.
    res = bench.compare(factory(2), paths=["pin_memory", "loader_cuda"], batches=4, warmup=1,
                        device="cuda", capacity=64 << 20, progress=False)
    assert res["pin_memory"].pinned_mb * bench.MB >= BATCH_BYTES
    assert res["pin_memory"].pool_peak_mb is None   # torch gives no true peak
    assert res["loader_cuda"].pinned_mb == 64
    assert 0 < res["loader_cuda"].pool_peak_mb <= 64


@gpu
def test_torch_paths_measure_torch_even_after_install():
    from conftest import in_arena

    pinned_by = []

    def step(batch):
        pinned_by.append("fastpin" if in_arena(batch["image"], fastpin.default_arena())
                         else "torch" if batch["image"].is_pinned() else "nobody")

    fastpin.install()
    try:
        res = bench.compare(factory(2), paths=["pin_memory"], batches=2, warmup=0,
                            min_seconds=0, device=None, step=step, progress=False)
        assert fastpin.installed()
    finally:
        fastpin.uninstall()
    row = res["pin_memory"]
    assert row.ok and pinned_by == ["torch"] * (1 + row.warmup + row.batches)


@gpu
def test_simulated_compute_on_the_gpu():
    res = bench.compare(factory(), paths=["loader_cuda"], batches=3, warmup=1, device="cuda",
                        compute_ms=2.0, progress=False)
    assert res["loader_cuda"].ok and res.compute_ms == 2.0


def test_results_round_trip_through_json():
    res = bench.compare(factory(), paths=["pageable", "loader_host", "prefetcher"], batches=2,
                        warmup=1, device=None, progress=False, name="mine", title="My loader")
    back = bench.Results.from_dict(json.loads(res.to_json()))
    assert back.rows == res.rows
    assert back.name == "mine" and back.title == "My loader" and back.batches == 2
    assert back.table() == res.table()
    assert res.to_dict()["rows"][0]["label"] == "pageable .to()"
    assert res._repr_markdown_().startswith("## My loader")


def test_baseline_is_pin_memory_else_pageable():
    res = bench.compare(factory(), paths=["pageable", "fastpin_pin"], batches=2, warmup=0,
                        device=None, progress=False)
    assert res.baseline() is res["pageable"]
    assert "| pageable .to() |" in res.table() and "x pageable .to()" in res.table()
    assert "1.0x" in res.table()


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown paths"):
        bench.compare(factory(), paths=["pageable", "warp_drive"])
    with pytest.raises(ValueError, match="batches"):
        bench.compare(factory(), batches=0)
    with pytest.raises(ValueError, match="device"):
        bench.compare(factory(), device="mps")


def test_a_short_loader_is_reported():
    def short(pin_memory):
        return [{"x": patterned((64,), torch.float32, i)} for i in range(4)]

    # The first batch and 2 untimed (the Loader's depth), then 1 of the 10 asked for.
    res = bench.compare(short, paths=["pageable", "loader_host", "zero_copy"], batches=10,
                        warmup=1, device=None, progress=False)
    assert res["pageable"].ok and res["pageable"].batches == 1
    assert "ran out after 1 of 10" in res["pageable"].reason
    # A list is not a DataLoader: zero-copy says so instead of failing.
    assert res["zero_copy"].status == "skipped" and "DataLoader" in res["zero_copy"].reason
    res = bench.compare(short, paths=["pageable"], batches=1, warmup=5, device=None,
                        progress=False)
    assert res["pageable"].status == "failed" and "warm-up" in res["pageable"].reason


class SlowSamples(Samples):
    """Samples that take `delay` seconds each to load."""

    def __init__(self, delay):
        self.delay = delay

    def __getitem__(self, i):
        time.sleep(self.delay)
        return super().__getitem__(i)


def slow_factory(delay):
    def make(pin_memory):
        return DataLoader(SlowSamples(delay), batch_size=BATCH, pin_memory=pin_memory)
    return make


def test_time_budget_stops_a_path_early_and_says_so():
    source = Burst(num_workers=1, prefetch_factor=1, interval=0.003, n=1000)
    res = bench.compare(lambda pin_memory: source, paths=["pageable", "loader_host"],
                        batches=300, warmup=1, min_seconds=0, device=None, progress=False,
                        max_seconds=0.1)
    for row in res.ran:
        # Never fewer than the 20 batches a figure needs, short of the 300 asked for,
        # and no "ran out" reason.
        assert 20 <= row.batches < 300 and not row.reason
        assert row.batches * row.step_ms >= 100
    assert "up to 0.1 s" in res.header()
    assert bench.Results.from_dict(res.to_dict()).max_seconds == 0.1


def test_a_path_running_too_long_prints_every_stack(monkeypatch, capsys):
    monkeypatch.setattr(bench, "_hang_report_s", 0.1)
    res = bench.compare(slow_factory(0.02), paths=["pageable"], batches=5, warmup=1,
                        min_seconds=0, device=None, progress=False)
    assert res["pageable"].ok and res["pageable"].batches == 5
    err = capsys.readouterr().err
    assert "pageable .to() has run for 0.1 s" in err
    assert "-- thread MainThread" in err and "__getitem__" in err


def test_a_path_stuck_holding_the_gil_still_gets_its_stacks_dumped(monkeypatch, capfd):
    # The named report needs the GIL; faulthandler's dump, at twice the time, does not.
    monkeypatch.setattr(bench, "_hang_report_s", 0.05)
    res = bench.compare(slow_factory(0.03), paths=["pageable"], batches=5, warmup=1,
                        min_seconds=0, device=None, progress=False)
    assert res["pageable"].ok
    err = capfd.readouterr().err
    assert "pageable .to() has run for 0.05 s" in err
    assert re.search(r"Timeout \(0:00:00\.1\d*\)!", err) and "in __getitem__" in err


def test_a_failing_path_does_not_end_the_comparison(monkeypatch):
    def broken(batch, **kwargs):
        raise RuntimeError("pinning broke")

    monkeypatch.setattr(bench.fastpin, "pin_memory", broken)
    res = bench.compare(factory(), paths=["pageable", "fastpin_pin", "loader_host"], batches=2,
                        warmup=0, device=None, progress=False)
    assert res["fastpin_pin"].status == "failed"
    assert "RuntimeError: pinning broke" in res["fastpin_pin"].reason
    assert res["pageable"].ok


def test_compare_leaves_global_settings_alone():
    capacity = fastpin._arena.get_capacity()
    arena = fastpin.default_arena()
    bench.compare(factory(), paths=["fastpin_pin", "loader_host"], batches=2, warmup=0,
                  device=None, capacity=8 << 20, progress=False)
    assert fastpin._arena.get_capacity() == capacity
    assert fastpin.default_arena() is arena


def test_factory_asked_for_pin_memory_false_gets_it():
    asked = []

    def make(pin_memory):
        asked.append(pin_memory)
        return DataLoader(Samples(), batch_size=BATCH, pin_memory=True)  # ignores it

    res = bench.compare(make, paths=["fastpin_pin"], batches=2, warmup=0, device=None,
                        progress=False)
    assert asked == [False] and res["fastpin_pin"].ok


# ---- progress ---------------------------------------------------------------------

def test_plain_counter_without_tqdm(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm", None)
    bench.compare(factory(), paths=["pageable", "loader_host"], batches=2, warmup=0,
                  device=None, progress=True, name="counted")
    err = capsys.readouterr().err
    # One line a stage, with the steps done and the seconds since the start.
    assert re.search(r"^\[0/6, \d+ s\] counted: pageable \.to\(\)$", err, re.M)
    assert re.search(r"^\[3/6, \d+ s\] counted: Loader\(device=None\)$", err, re.M)


def test_no_progress_writes_nothing(capsys):
    bench.compare(factory(), paths=["pageable"], batches=2, warmup=0, device=None,
                  progress=False)
    assert capsys.readouterr().err == ""


# ---- the workload cases -------------------------------------------------------------

@pytest.mark.parametrize("name", list(bench.CASES))
def test_workload_case_batches_are_what_they_say(name):
    w = bench.CASES[name]
    res = bench.run_case(w, workers=0, batches=2, warmup=0, device=None, compute_ms=0,
                         paths=["pageable"], progress=False)
    row = res["pageable"]
    assert row.ok, row.reason
    assert 0.3 * w.batch_bytes < row.batch_mb * bench.MB <= w.batch_bytes
    assert res.name == name and res.workers == 0


def test_token_batches_are_padded_per_batch():
    w = bench.CASES["tokens"]
    ds = w.make()
    batch = next(iter(w.factory(ds, 0, 2)(False)))
    ids, mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
    assert ids.dtype == torch.int64 and ids.shape[0] == 8
    assert 2048 <= ids.shape[1] <= 8192
    lengths = mask.sum(1)
    assert lengths.max() == ids.shape[1] and lengths.min() >= 2048
    assert torch.equal(labels[mask == 0], torch.full_like(labels[mask == 0], -100))
    assert torch.equal(labels[mask == 1], ids[mask == 1]) and (ids[mask == 1] > 0).all()


def test_recsys_batch_is_a_dict_of_50_tensors():
    w = bench.CASES["recsys"]
    ds = w.make()
    batch = next(iter(w.factory(ds, 0, 2)(False)))
    assert len(batch) == 50 and all(t.shape[0] == 4096 for t in batch.values())
    assert batch["cat_0"].dtype == torch.int64 and batch["dense_0"].shape == (4096, 16)
    assert not torch.equal(batch["cat_0"], batch["cat_1"])


def test_too_little_memory_skips_the_case_with_the_reason(monkeypatch):
    monkeypatch.setattr(bench, "_available_memory", lambda: 100 << 20)
    res = bench.run_case(bench.CASES["video"], workers=1, batches=2, warmup=0, device=None,
                         compute_ms=0, paths=["pageable", "loader_host"], progress=False)
    assert [r.status for r in res.rows] == ["skipped", "skipped"]
    assert "too little memory" in res.rows[0].reason and "0.1 GB available" in res.rows[0].reason


# ---- plot ---------------------------------------------------------------------------

def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    res = bench.compare(factory(), paths=["pageable", "loader_host", "prefetcher"], batches=2,
                        warmup=0, device=None, progress=False)
    out = tmp_path / "cmp.png"
    fig = bench.plot(res, str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000
    assert len(fig.axes) == 4
    # Several cases, as dicts (what --json writes): one row of panels each.
    fig = bench.plot([res.to_dict(), res.to_dict()], metrics=("gbps", "cpu_ms"))
    assert len(fig.axes) == 4
    with pytest.raises(ValueError, match="unknown metrics"):
        bench.plot(res, metrics=("speed",))


def test_plot_without_matplotlib_says_what_to_install(monkeypatch):
    res = bench.Results(rows=[bench.Row("pageable", batches=1, gbps=1.0)])
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r"fastpin\[plot\]"):
        bench.plot(res, "x.png")


# ---- the command line -----------------------------------------------------------------

def test_cli_json_plot_and_from_json(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    js, png = tmp_path / "run.json", tmp_path / "run.png"
    rc = bench.main(["--quick", "--case", "tokens", "--case", "pin_sizes", "--sizes", "1",
                     "--path", "pageable", "--path", "loader_host", "--workers", "1",
                     "--batches", "3", "--json", str(js), "--plot", str(png), "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0, out
    suite = json.loads(js.read_text())
    assert suite["settings"]["cases"] == ["pin_sizes", "tokens"]
    [case] = suite["cases"]
    assert case["name"] == "tokens" and case["workers"] == 1
    assert [r["path"] for r in case["rows"]] == ["pageable", "loader_host"]
    assert all(r["status"] == "ok" and r["batches"] >= 3 for r in case["rows"])
    assert [r["size_mb"] for r in suite["pin_memory"]["rows"]] == [1]
    assert "## pin_memory of one batch" in out and "| Loader(device=None) |" in out
    if not fastpin.cuda_available():
        assert "## Training step" not in out   # not asked for
    assert png.read_bytes()[:4] == b"\x89PNG"
    # The same report again from the JSON, measuring nothing.
    assert bench.main(["--from-json", str(js)]) == 0
    again = capsys.readouterr().out
    assert bench.Results.from_dict(case).table() in again
    assert "## pin_memory of one batch" in again


def test_cli_reports_skips_and_failures(monkeypatch, capsys):
    monkeypatch.setattr(bench, "_available_memory", lambda: 100 << 20)
    rc = bench.main(["--quick", "--case", "video", "--case", "train_step", "--workers", "1",
                     "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "Every path skipped: too little memory" in out
    if not fastpin.cuda_available():
        assert "# Not run" in out and "train_step: skipped: needs a GPU (" in out
    monkeypatch.undo()

    def broken(batch, **kwargs):
        raise RuntimeError("pinning broke")

    monkeypatch.setattr(bench.fastpin, "pin_memory", broken)
    rc = bench.main(["--quick", "--case", "tokens", "--path", "fastpin_pin", "--workers", "0",
                     "--batches", "1", "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "failed: RuntimeError: pinning broke" in out


def test_cli_list(capsys):
    assert bench.main(["--list"]) == 0
    out = capsys.readouterr().out
    for name in list(bench.CASES) + list(bench.PATHS) + ["pin_sizes", "loader_images"]:
        assert name in out


def test_module_entry_point_with_plain_progress(tmp_path):
    """python -m fastpin.bench as the README runs it, from outside the source tree,
    with stderr not a terminal: one progress line per stage."""
    env = dict(os.environ, PYTHONPATH=str(Path(fastpin.__file__).parent.parent))
    proc = subprocess.run(
        [sys.executable, "-m", "fastpin.bench", "--quick", "--case", "recsys", "--path",
         "pageable", "--path", "fastpin_pin", "--workers", "1", "--batches", "2"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert "## recommendation batch" in proc.stdout and "| fastpin.pin_memory |" in proc.stdout
    assert "recsys: pageable .to()" in proc.stderr and "/" in proc.stderr


# ---- the method: warm-up drains the prefetch, timing covers the steady state ----------

class Burst:
    """A source shaped like a DataLoader with workers (num_workers, prefetch_factor):
    the first batch and the num_workers x prefetch_factor the workers made meanwhile
    come at once, then one every `interval` seconds, the workers' steady rate.
    Batch i is patterned by i and carries i."""

    def __init__(self, num_workers=3, prefetch_factor=2, interval=0.003, n=400):
        self.num_workers, self.prefetch_factor = num_workers, prefetch_factor
        self.interval, self.n = interval, n

    @property
    def burst(self) -> int:
        return 1 + self.num_workers * self.prefetch_factor

    def __iter__(self):
        for i in range(self.n):
            if i >= self.burst:
                time.sleep(self.interval)
            yield {"x": patterned((256,), torch.float32, i), "i": torch.tensor([i])}


class Indices:
    """A step that records which batch it was given, in order."""

    def __init__(self):
        self.seen: list = []

    def __call__(self, batch):
        self.seen.append(int(batch["i"][0]))


@pytest.mark.parametrize("path", ["pageable", "loader_host"])
def test_prefetched_batches_are_never_timed(path):
    """Bug: the quick run on the H200 timed 2-4 batches after 1 warm-up while 15
    workers had 30 in flight: stock pin_memory=True read 36.2 GB/s (its steady
    state: 2-3). The warm-up takes every batch the workers had prefetched before
    timing starts, whatever warm-up was asked for."""
    source = Burst()
    step = Indices()
    res = bench.compare(lambda pin_memory: source, paths=[path], batches=10, warmup=0,
                        device=None, step=step, progress=False)
    row = res[path]
    assert row.ok, row.reason
    timed = step.seen[-row.batches:]
    assert step.seen == list(range(len(step.seen)))    # every batch, in order
    assert row.batches >= 10 and timed == step.seen[len(step.seen) - row.batches:]
    # Not one of the burst: only batches that came at the steady rate were timed.
    assert min(timed) >= source.burst, (source.burst, timed[:5])


def test_timing_covers_the_batches_and_the_seconds_asked_for():
    """A path times at least `batches` batches and at least `min_seconds`: 5 batches
    of a source giving one every 3 ms last 15 ms, so it goes on to 0.1 s."""
    source = Burst(num_workers=1, prefetch_factor=1)
    res = bench.compare(lambda pin_memory: source, paths=["pageable"], batches=5, warmup=0,
                        min_seconds=0.1, device=None, progress=False)
    row = res["pageable"]
    assert row.ok and not row.reason, row.reason
    assert row.batches > 5 and row.batches * row.step_ms >= 100
    assert row.warmup == source.num_workers * source.prefetch_factor + 2  # and the depth
    assert res.min_seconds == 0.1
    # The suite's own rule: at least 20 batches and a second.
    assert (bench.runner.MIN_TIMED, bench.runner.MIN_SECONDS) == (20, 1.0)


def test_running_out_says_how_many_batches_it_needed_and_had():
    """Bug: compare() on the README's 256-sample dataset (one batch of 256) failed
    every path with "ran out during warm-up", not saying how many it needed."""
    def one_batch(pin_memory):
        return DataLoader(Samples(), batch_size=N, num_workers=0, pin_memory=pin_memory)

    res = bench.compare(one_batch, paths=["pageable"], batches=100, warmup=3, device=None,
                        progress=False)
    row = res["pageable"]
    assert row.status == "failed"
    assert row.reason == ("the loader ran out during warm-up: it gave 1 batch; the path needs "
                          "1 + 3 untimed and at least 100 timed (104 in all)")
