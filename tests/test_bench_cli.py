"""fastpin.bench says what it ran: the device it was asked for, the column
labels and units of its tables, how many batches each path timed, and the
README lists every option, path and compare() argument it takes.

No timing thresholds: only what the output says."""
from __future__ import annotations

import importlib.util
import inspect
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import fastpin
from fastpin import bench
from conftest import patterned
from editable_venv import installed_venv

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "docs" / "benchmark.md"   # the benchmark guide: every option, path, compare()
no_gpu = pytest.mark.skipif(fastpin.cuda_available(), reason="checks the machine without a GPU")


class Eight(Dataset):
    def __len__(self):
        return 32

    def __getitem__(self, i):
        return patterned((64,), torch.float32, i)


def eight_batches(pin_memory: bool) -> DataLoader:
    return DataLoader(Eight(), batch_size=4, pin_memory=pin_memory)


# ---- --device ---------------------------------------------------------------------

@no_gpu
def test_device_cuda_without_a_gpu_is_an_error_not_a_host_run(capsys):
    # Bug: --device cuda with no GPU ran on the host and exited 0.
    with pytest.raises(SystemExit) as exc:
        bench.main(["--device", "cuda", "--quick", "--case", "tokens", "--no-progress"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--device cuda: no GPU to deliver to here" in err
    assert fastpin.cuda_status().reason in err and "--device host" in err


def test_device_bogus_is_a_usage_error(capsys):
    # Bug: --device bogus ended in a raw torch traceback.
    with pytest.raises(SystemExit) as exc:
        bench.main(["--device", "bogus", "--quick"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --device: 'bogus' is not a device" in err and "Traceback" not in err


# ---- numbers and files: a usage error, never a traceback or a silent run ----------

# (option, a value it must refuse). Bugs: --sizes 0 ended in a ZeroDivisionError
# traceback, --from-json of a missing file in a FileNotFoundError one, and --batches -5,
# --max-seconds -1 (and the others below) were taken as given. --list follows each, so
# a value taken as given ends the call at once, with status 0.
REFUSED = [
    ("--sizes", "0"), ("--sizes", "1e-9"), ("--seconds", "-1"), ("--batches", "-5"),
    ("--batches", "0"), ("--warmup", "-1"), ("--max-seconds", "-1"),
    ("--max-seconds", "nan"), ("--compute-ms", "-2"), ("--compute-ms", "inf"),
    ("--hang-report", "-3"), ("--workers", "-1"), ("--from-json", "no-such-run.json"),
    ("--rounds", "0"), ("--rounds", "1.5"),
]


@pytest.mark.parametrize("option,value", REFUSED, ids=[f"{o}={v}" for o, v in REFUSED])
def test_bad_numbers_and_missing_files_are_usage_errors(option, value, capsys, tmp_path,
                                                        monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        bench.main([option, value, "--list"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"error: argument {option}: " in err and "Traceback" not in err
    assert repr(value) in err


@pytest.mark.parametrize("option,value", [("--steps", "0"), ("--warmup", "-1"),
                                          ("--workers", "-2")])
def test_bench_train_bad_numbers_are_usage_errors(option, value, capsys):
    # Bug: python -m fastpin.bench.train took --steps 0 (its figure divides by the time
    # of no steps), --warmup -1 and --workers -2 as given.
    from fastpin.bench import train

    with pytest.raises(SystemExit) as exc:
        train.main([option, value])
    assert exc.value.code == 2
    assert f"error: argument {option}: {value!r}" in capsys.readouterr().err


def test_from_json_that_is_not_json_is_a_usage_error(capsys, tmp_path):
    path = tmp_path / "run.json"
    path.write_text("not json {")
    with pytest.raises(SystemExit) as exc:
        bench.main(["--from-json", str(path)])
    assert exc.value.code == 2
    assert f"error: argument --from-json: {str(path)!r}" in capsys.readouterr().err


def test_the_bounds_themselves_are_taken():
    args = bench._parser().parse_args(
        ["--sizes", "0.0625", "--seconds", "0", "--batches", "1", "--warmup", "0",
         "--max-seconds", "0", "--compute-ms", "0", "--hang-report", "0", "--workers", "0", "2",
         "--rounds", "1"])
    assert (args.sizes, args.seconds, args.batches, args.warmup, args.rounds) == \
        ([0.0625], 0.0, 1, 0, 1)
    assert (args.max_seconds, args.compute_ms, args.hang_report, args.workers) == \
        (0.0, 0.0, 0.0, [0, 2])


# ---- --list -----------------------------------------------------------------------

def test_list_describes_every_case(capsys):
    # Bug: the three micro cases were listed by name alone.
    assert bench.main(["--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    for name in bench.CASE_NAMES:
        [line] = [ln for ln in lines if ln.split()[:1] == [name]]
        assert len(line.split()) > 4, line


# ---- labels and units ---------------------------------------------------------------

def loader_result(gpu: bool) -> dict:
    row = {"dtype": "uint8", "workers": 1, "batch_mb": 256 * 3 * 224 * 224 / bench.MB,
           "stock_gbps": 1.0, "stock_cpu_ms": 1.0, "copy_gbps": 2.0, "copy_cpu_ms": 1.0,
           "zero_copy_gbps": 3.0, "zero_copy_cpu_ms": 0.5, "zero_copy_fallbacks": 0,
           "batches_timed": [5, 5, 5]}
    return {"gpu": gpu, "batches": 10, "batch_size": 256, "rows": [row], "max_seconds": 3.0}


def test_loader_table_without_a_gpu_says_pin_memory_was_false():
    # Bug: with no GPU the column said pin_memory=True and the caption "pinned host
    # batches", though DataLoader ran with pin_memory=False and nothing was pinned.
    text = bench.format_loader_table(loader_result(gpu=False))
    assert "pin_memory=True" not in text and "pinned host batches" not in text
    assert "| pin_memory=False |" in text and "zero-copy / pin_memory=False" in text
    assert "nothing is page-locked" in text
    text = bench.format_loader_table(loader_result(gpu=True))
    assert "| pin_memory=True |" in text and "to the GPU" in text


def test_sizes_are_mib_and_labelled_so():
    # Bug: sizes were MiB (1 << 20) labelled MB.
    text = bench.format_loader_table(loader_result(gpu=False))
    assert "| 36.8 MiB |" in text and not re.search(r"\bMB\b", text)
    pins = {"gpu": False, "torch_threads": 2, "fastpin_threads": 2,
            "rows": [{"size_mb": 1, "memcpy_1": 1.0, "memcpy_n": 2.0, "memcpy_pool": 2.0,
                      "fastpin": 2.0}]}
    text = bench.format_pin_table(pins)
    assert "| 1 MiB |" in text and not re.search(r"\bMB\b", text)
    res = bench.compare(eight_batches, paths=["pageable", "loader_host"], batches=2, warmup=0,
                        device=None, progress=False)
    text = res.markdown()
    assert "MiB batches" in text and "pinned MiB (peak)" in text and not re.search(r"\bMB\b", text)


def test_pin_table_says_too_short_instead_of_zero_gbps():
    # Bug: torch's 2-thread memcpy of 64 KiB on a loaded 2-core machine showed 0.0 GB/s:
    # each call (8 ms against 2 us on one thread) timed a thread waiting for a core.
    pins = {"gpu": False, "torch_threads": 2, "fastpin_threads": 2,
            "rows": [{"size_mb": 0.0625, "memcpy_1": 31.6, "memcpy_n": 0.0082,
                      "memcpy_pool": 12.5, "fastpin": 9.75},
                     {"size_mb": 16, "memcpy_1": 7.25, "memcpy_n": 11.5, "memcpy_pool": 13.0,
                      "fastpin": 12.0}]}
    text = bench.format_pin_table(pins)
    assert "| 0.0 |" not in text
    assert "| 0.0625 MiB | 31.6 | too short* | 12.5 | 9.8 | 0.78x | n/a |" in text
    assert "| 16 MiB | 7.2 | 11.5 | 13.0 |" in text
    [note] = [ln for ln in text.splitlines() if ln.startswith("* too short")]
    assert "0.0082 GB/s" not in text and "--json keeps the figure" in text


def test_pin_table_is_narrow():
    """Bug: the report's first table had 12 columns and lines of 391 characters."""
    for gpu in (False, True):
        row = {"size_mb": 256, "memcpy_1": 5.2, "memcpy_n": 40.1, "memcpy_pool": 41.0,
               "fastpin": 46.9, "torch_pin_1": 4.8, "torch_pin_n": 30.2,
               "cpu_s_per_gb": {"fastpin": 0.31, "torch_pin_1": 0.2, "torch_pin_n": 1.5}}
        text = bench.format_pin_table({"gpu": gpu, "torch_threads": 16, "fastpin_threads": 16,
                                       "rows": [row]})
        assert max(map(len, text.splitlines())) <= 110, text
        tables = [ln for ln in text.splitlines() if ln.startswith("| batch |")]
        assert all(ln.count("|") - 1 <= 9 for ln in tables), tables
        assert ("torch pin 16" in text) == gpu   # torch cannot pin without a GPU


def test_pin_table_has_each_pinning_paths_cpu_seconds_per_gb():
    """Issue 25: the pin table gives each pinning path's CPU-seconds per GB, every
    thread of the process counted, at sizes from 64 KiB through 2, 4 and 8 MiB."""
    pins = bench.pin_table([0.0625, 2], min_seconds=0, min_iters=3)
    for row in pins["rows"]:
        cpu = row["cpu_s_per_gb"]
        assert set(cpu) == {k for k in row if k not in ("size_mb", "cpu_s_per_gb")}
        assert all(v > 0 for v in cpu.values()), cpu
    text = bench.format_pin_table(pins)
    assert "CPU s/GB" in text and "every thread of this process" in text
    rows = [ln for ln in text.splitlines() if ln.startswith("| 2 MiB |")]
    cells = [c.strip() for c in rows[-1].strip("|").split("|")]
    assert cells[-1] == f"{pins['rows'][1]['cpu_s_per_gb']['fastpin']:.3f}"
    if pins["gpu"]:
        assert cells[1:3] == [f"{pins['rows'][1]['cpu_s_per_gb'][k]:.3f}"
                              for k in ("torch_pin_1", "torch_pin_n")]


# ---- a short loader -----------------------------------------------------------------

def test_a_short_loader_says_how_many_batches_each_path_timed():
    # Bug: a loader of 8 batches with batches=100 timed 4 per path; the table did not
    # say so and print(results) claimed 100.
    res = bench.compare(eight_batches, paths=["pageable", "fastpin_pin"], batches=100,
                        device=None, progress=False)
    for row in res.ran:
        assert row.batches == 4 and "ran out after 4 of 100" in row.reason
    text = str(res)
    assert "100 timed" not in text and "then 4 timed (at least 100 and 1 s)" in text
    assert "| pageable .to() | 4* |" in res.table()
    assert text.count("warning: ") == 2 and "timed only 4 batches" in text
    assert bench.Results.from_dict(res.to_dict()).markdown() == res.markdown()


def test_enough_batches_carry_no_warning():
    res = bench.compare(eight_batches, paths=["pageable"], batches=3, warmup=0, min_seconds=0,
                        device=None, progress=False)
    # The warm-up takes the first batch and the Loader depth's 2 (no workers here).
    assert res["pageable"].batches == 3 and not res["pageable"].reason
    assert "the first batch and 2 more untimed, then 3 timed (at least 3)" in res.header()
    # 3 batches of a few bytes in well under a second: flagged, though none ran out.
    assert "warning: pageable .to() timed only 3 batches" in res.markdown()
    for batches, ms in [(3, 400.0), (20, 10.0), (19, 100.0)]:
        row = bench.Row("pageable", batches=batches, gbps=1.0, step_ms=ms)
        assert bench._too_few(row)
    assert not bench._too_few(bench.Row("pageable", batches=20, gbps=1.0, step_ms=50.0))


def test_table_says_why_a_row_failed():
    # Bug: table() printed a bare "failed" row; why ("ran out during warm-up") showed
    # only in print(results).
    res = bench.compare(eight_batches, paths=["pageable", "loader_host"], batches=1, warmup=20,
                        device=None, progress=False)
    table = res.table()
    for row in res.rows:
        assert row.status == "failed" and "warm-up" in row.reason
        assert f"| {row.label} | failed: the loader ran out during warm-up: it gave 8 " in table


# ---- the README -----------------------------------------------------------------------

@pytest.fixture
def readme() -> str:
    if not README.exists():
        pytest.skip("README.md is not next to tests/ (an unpacked wheel?)")
    return README.read_text()


def test_readme_lists_every_option(readme):
    # Bug: "Other options" left out --sizes and --seconds.
    options = [o for a in bench._parser()._actions for o in a.option_strings
               if o.startswith("--") and o != "--help"]
    missing = [o for o in options if f"`{o}" not in readme]
    assert not missing, missing


def test_readme_case_table_matches_the_list(readme):
    # Bug: the case table left out train_model.
    table = readme[readme.index("| case | batches |"):]
    table = table[:table.index("\n\n")]
    named = [n for ln in table.splitlines()[2:] for n in re.findall(r"`(\w+)`", ln.split("|")[1])]
    assert sorted(named) == sorted(bench.CASE_NAMES)


@pytest.mark.parametrize("cpus,workloads,images,train", [
    (2, [1], [1], [1]), (4, [3], [3], [3]), (16, [15], [8, 15], [15]),
    (64, [63], [8, 63], [15])])
def test_workers_default_is_what_readme_and_help_say(cpus, workloads, images, train,
                                                     monkeypatch, readme):
    # Bug: the README and --help said loader_images runs "8 and" one per core but one
    # workers; on 2 cores it runs 1.
    from fastpin.bench import __main__ as cli

    monkeypatch.setattr(cli._C, "cpu_count", lambda: cpus)
    plan = cli._plan(cli._parser().parse_args([]))
    assert (plan.workers, plan.loader_workers, plan.train_workers) == (workloads, images, train)
    said = ("one per core but one, N (`loader_images`: N, and 8 too where N > 8: `[1]` on 2 "
            "cores, `[8, 15]` on 16; `train_model`: N, at most 15)")
    assert said in " ".join(readme.split()) and "8 and that" not in readme
    [action] = [a for a in cli._parser()._actions if "--workers" in a.option_strings]
    assert "8 and one per core" not in action.help and "N > 8" in action.help


def test_readme_lists_every_path_name(readme):
    # Bug: the names --path and compare(paths=) take were nowhere in the README.
    missing = [p for p in bench.PATHS if f"`{p}`" not in readme]
    assert not missing, missing


def test_readme_gives_compare_its_whole_signature(readme):
    # Bug: the documented signature left out max_seconds, name and title.
    m = re.search(r"`compare\((loader_factory.*?)\)`", readme, re.S)
    assert m, "no `compare(...)` signature in the README"
    documented = " ".join(m.group(1).split()).replace('"', "'")
    for name, p in inspect.signature(bench.compare).parameters.items():
        text = name if p.default is inspect.Parameter.empty else f"{name}={p.default!r}"
        assert text in documented, text


# ---- make bench -------------------------------------------------------------------------

def bench_recipe(bench_args: str, venv: Path) -> str:
    """The command `make bench BENCH_ARGS=...` runs, as `make -n` prints it, with
    `venv` for the Makefile's."""
    r = subprocess.run(["make", "-s", "-n", "bench", f"VENV={venv}", f"BENCH_ARGS={bench_args}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    [line] = [ln for ln in r.stdout.splitlines() if "fastpin.bench" in ln]
    return line


def test_make_bench_paths_are_relative_to_where_make_ran(tmp_path):
    """Bug: the recipe ran `cd $(VENV) && bin/python -m fastpin.bench`, so
    BENCH_ARGS="--json run.json --plot run.png" wrote both into .venv/, and make
    clean deleted them. The recipe `make bench` runs, with a venv that has fastpin
    installed, run in another directory: it reads run.json from there and draws
    run.png there, and imports the venv's fastpin, not a fastpin/ there."""
    if not (ROOT / "Makefile").exists() or shutil.which("make") is None:
        pytest.skip("no Makefile next to tests/, or no make")
    plots = importlib.util.find_spec("matplotlib") is not None
    venv = installed_venv(tmp_path)
    here = tmp_path / "elsewhere"
    here.mkdir()
    line = bench_recipe("--from-json run.json" + (" --plot run.png" if plots else ""), venv)
    assert not line.startswith("cd ") and line.startswith(str(venv / "bin" / "python")), line
    (here / "fastpin").mkdir()
    (here / "fastpin" / "__init__.py").write_text("raise ImportError('the source tree')\n")
    res = bench.compare(eight_batches, paths=["pageable"], batches=2, warmup=0, min_seconds=0,
                        device=None, progress=False)
    saved = {"machine": bench.machine(), "command": "python -m fastpin.bench --case tokens",
             "order": [], "cases": [res.to_dict()],
             "not_run_cases": {"tokens": "skipped: a pattern 7"}}
    (here / "run.json").write_text(json.dumps(saved))
    r = subprocess.run(line, shell=True, cwd=here, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "`python -m fastpin.bench --case tokens`" in r.stdout
    assert "- tokens: skipped: a pattern 7" in r.stdout
    if plots:
        assert "Plot: run.png" in r.stdout and (here / "run.png").stat().st_size > 0
        assert not list(venv.rglob("run.png")) and not (ROOT / "run.png").exists()


def test_make_help_names_every_variable():
    # Bug: make help's variables left out BENCH_ARGS, PYTEST_ARGS and PYTHONS.
    if not (ROOT / "Makefile").exists() or shutil.which("make") is None:
        pytest.skip("no Makefile next to tests/, or no make")
    makefile = (ROOT / "Makefile").read_text()
    given = set(re.findall(r"^(?:export )?([A-Z_]+) \?=", makefile, re.M))
    # Global assignments, and target-specific ones ("target: NAME = value").
    assigned = set(re.findall(r"^(?:[\w.-]+(?: [\w.-]+)*: )?(?:export )?([A-Z_]+) :?\??=",
                              makefile, re.M))
    read = set(re.findall(r"\$\(([A-Z_]+)\)", makefile)) - assigned - {"MAKE"}
    assert {"BENCH_ARGS", "PYTEST_ARGS"} <= read and "PYTHONS" in given
    out = subprocess.run(["make", "-s", "help"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60).stdout
    variables = out[out.index("Variables:"):]
    missing = [v for v in sorted(given | read) if f"{v}=" not in variables]
    assert not missing, missing


# ---- --json and --plot: checked before anything runs ----------------------------------

@pytest.mark.parametrize("option", ["--json", "--plot"])
def test_output_into_a_missing_folder_fails_at_once(option, tmp_path, capsys, monkeypatch):
    """Bug: --json/--plot into a folder that does not exist ended in a traceback
    after the whole run."""
    ran = []
    monkeypatch.setattr(bench.SUITE["tokens"].__class__, "run",
                        lambda self, *a: ran.append(self.name))
    target = tmp_path / "no-such-folder" / "run.out"
    with pytest.raises(SystemExit) as exc:
        bench.main(["--case", "tokens", option, str(target), "--no-progress"])
    assert exc.value.code == 2 and ran == []
    err = capsys.readouterr().err
    assert f"error: {option} {target}: no folder {target.parent}" in err
    assert "Traceback" not in err


# ---- the memory a case may take ---------------------------------------------------------

GiB = 1 << 30
V2_MOUNT = "41 31 0:38 / /sys/fs/cgroup rw,relatime - cgroup2 cgroup2 rw\n"


def fake_machine(tmp_path, available: int, cgroup: str, files: dict) -> str:
    """A root with proc/meminfo (MemAvailable), proc/self/{cgroup,mountinfo} (one
    cgroup2 mount) and the cgroup files named (path below the root -> content)."""
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/meminfo").write_text(f"MemTotal: {4 * available // 1024} kB\n"
                                           f"MemAvailable: {available // 1024} kB\n")
    (tmp_path / "proc/self/cgroup").write_text(cgroup)
    (tmp_path / "proc/self/mountinfo").write_text(V2_MOUNT)
    for path, content in files.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(content + "\n")
    return str(tmp_path)


def test_available_memory_is_the_room_in_the_processs_own_cgroups(tmp_path):
    """Bug: the benchmark read memory.max at the cgroup mount's root only, so a job
    in a nested cgroup (Slurm's, a systemd scope's) with a limit of its own saw the
    machine's free memory and ran cases its limit would kill."""
    job = "sys/fs/cgroup/system.slice/job_7"
    root = fake_machine(tmp_path, 64 * GiB, "0::/system.slice/job_7/step_0\n", {
        "sys/fs/cgroup/memory.max": "max",
        f"{job}/memory.max": str(2 * GiB),
        f"{job}/memory.current": str(GiB),
        f"{job}/memory.stat": f"anon {GiB // 2}\ninactive_file {GiB // 4}",
        f"{job}/step_0/memory.max": "max",
    })
    # What fastpin itself may still take there: the limit less an eighth, less
    # the job's memory the kernel cannot simply drop (its usage but the inactive
    # file pages).
    from fastpin import _runtime

    assert bench.host.meminfo_available(root) == _runtime.memory_room(root) == GiB


def test_available_memory_without_a_limit_is_memavailable(tmp_path):
    root = fake_machine(tmp_path, 5 * GiB, "0::/user.slice\n",
                        {"sys/fs/cgroup/user.slice/memory.max": "max"})
    assert bench.host.meminfo_available(root) == 5 * GiB


# ---- the report where there is no GPU -----------------------------------------------

@no_gpu
def test_without_a_gpu_one_line_says_so_and_the_gpu_paths_are_left_out(capsys):
    """Bug: on a machine without a GPU the report was 160 lines: the driver's message
    printed 27 times, once per skipped row, a first table of 12 columns, lines up
    to 391 characters."""
    rc = bench.main(["--quick", "--case", "tokens", "--case", "pin_sizes", "--sizes", "1",
                     "--workers", "0", "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0, out
    reason = fastpin.cuda_status().reason
    assert out.count(reason) == 1 and f"No GPU: {reason}" in out
    for path, info in bench.PATHS.items():
        if info.needs_gpu or info.needs_cuda_target:
            assert f"| {info.label} |" not in out, path
    assert "skipped" not in out and "warning" not in out
    assert out.index("# Summary") < out.index("# Details")
    long = [ln for ln in out.splitlines() if len(ln) > 110]
    assert not long, long


def test_quick_shortens_the_lists_never_the_method():
    """Bug: --quick timed 2-4 batches after 1 warm-up (and pin_sizes cells for 0.1 s):
    a short run measured something else. It now leaves out cases, paths and sizes."""
    from fastpin.bench import __main__ as cli

    quick = cli._plan(cli._parser().parse_args(["--quick"]))
    full = cli._plan(cli._parser().parse_args([]))
    method = ("batches", "warmup", "seconds", "max_seconds", "compute_ms", "workers")
    assert [getattr(quick, k) for k in method] == [getattr(full, k) for k in method]
    assert set(quick.names) < set(full.names) and set(quick.paths) <= set(full.paths)
    assert set(quick.sizes) < set(full.sizes)
    assert full.batches == 20 and full.warmup == 3


def test_a_default_run_on_a_gpu_takes_the_summarys_paths_and_leaves_the_rest_to_be_named(
        monkeypatch):
    """A default run on the GPU machine took 4 min 37 s, over the four minutes it is to
    fit in: the copying Loader and the train_step micro table now run only when named."""
    from fastpin.bench import __main__ as cli
    from fastpin.bench import train

    monkeypatch.setattr(cli, "gpu_usable", lambda: (True, ""))
    monkeypatch.setattr(cli, "target_of", lambda device: (torch.device("cuda"), ""))
    monkeypatch.setattr(cli, "why_not", lambda path, target, host_reason: None)
    plan = cli._plan(cli._parser().parse_args([]))
    assert plan.paths == ["pin_memory", "prefetcher", "zero_copy", "install", "install_device"]
    assert "train_step" not in plan.names and "loader_images" not in plan.names
    assert {"pin_sizes", "train_model", "tokens", "video"} <= set(plan.names)
    assert train.default_paths() == tuple(plan.paths)
    named = cli._plan(cli._parser().parse_args(["--path", "loader_cuda", "--case", "train_step"]))
    assert (named.paths, named.names) == (["loader_cuda"], ["train_step"])
