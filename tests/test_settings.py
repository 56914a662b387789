"""Issue 13: every setting is checked where it is given (type, range, finite),
with a message that names the setting and what it may be; environment
variables at import; and the raw _C entry points refuse overflowing shapes and
sizes before anything is allocated or handed out."""
from __future__ import annotations

import ctypes
import os
import re
import subprocess
import sys
import tempfile

import numpy as np
import pytest
import torch

import fastpin
from fastpin import _C, _arena, _runtime

MAX = _C.MAX_CAPACITY
# Every test here has a time limit: a hang fails it instead of stalling the run.
pytestmark = pytest.mark.timeout(60)


def test_max_capacity_is_the_cores():
    assert MAX == 2 ** 43
    assert _arena.MAX_CAPACITY == MAX


# ---- fastpin.configure ------------------------------------------------------------

BAD_CONFIGURE = [
    ({"capacity": 1.5e9}, TypeError, r"capacity must be an integer, a number of bytes from 1 to"),
    ({"capacity": 2e9}, TypeError, r"capacity must be an integer"),
    ({"capacity": "1G"}, TypeError, r"capacity must be an integer"),
    ({"capacity": True}, TypeError, r"capacity must be a number of bytes"),
    ({"capacity": 0}, ValueError, r"capacity must be a number of bytes from 1 to 8796093022208 .*not 0"),
    ({"capacity": -5}, ValueError, r"capacity must be .* not -5"),
    ({"capacity": 2 ** 44}, ValueError, r"capacity must be .*\(2\*\*43\), not 17592186044416"),
    ({"wait_timeout": float("nan")}, ValueError, r"wait_timeout must be a finite number of seconds >= 0, not nan"),
    ({"wait_timeout": float("inf")}, ValueError, r"wait_timeout must be a finite .* not inf"),
    ({"wait_timeout": -1}, ValueError, r"wait_timeout must be a finite .* not -1"),
    ({"wait_timeout": "10"}, TypeError, r"wait_timeout must be a number of seconds"),
    ({"wait_timeout": True}, TypeError, r"wait_timeout must be a number of seconds"),
    ({"threads": -1}, ValueError, r"threads must be a number of copy threads from 0 \(the "
                                  r"default.* to 1024, not -1"),
    ({"threads": 1025}, ValueError, r"threads must be .* not 1025"),
    ({"threads": 2.5}, TypeError, r"threads must be an integer"),
    ({"device": -1}, ValueError, r"device must be a CUDA device \('cuda', 'cuda:N', an ordinal N >= 0 "
                                 r"or a torch.device of type cuda\), not -1"),
    ({"device": "cpu"}, ValueError, r"device must be a CUDA device \(.*\), not 'cpu'"),
    ({"device": "cuda:-1"}, ValueError, r"device must be a CUDA device .* not 'cuda:-1'"),
    ({"device": torch.device("cpu")}, ValueError, r"device must be a CUDA device .* not device\(type='cpu'\)"),
    ({"device": 0.0}, TypeError, r"device must be an integer, a CUDA device .* not float 0.0"),
    ({"device": True}, TypeError, r"device must be a CUDA device .* not True"),
    ({"on_full": "drop"}, ValueError, r"on_full must be one of 'fallback', 'wait', 'raise', not 'drop'"),
    ({"allow_unpinned": "no"}, TypeError, r"allow_unpinned must be True or False, not 'no'"),
    ({"numa": 2}, TypeError, r"numa must be True or False, not 2"),
]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kwargs, error, message", BAD_CONFIGURE,
                         ids=[f"{next(iter(k))}={v!r}" for k, _, _ in BAD_CONFIGURE
                              for v in k.values()])
def test_configure_refuses_bad_settings_and_changes_nothing(kwargs, error, message):
    before = (_arena.get_capacity(), _arena.policy(), _runtime.settings.device)
    with pytest.raises(error, match=message):
        # A good value beside the bad one is not applied either.
        fastpin.configure(**{"on_full": "raise", "capacity": 4096, **kwargs})
    assert (_arena.get_capacity(), _arena.policy(), _runtime.settings.device) == before


@pytest.mark.timeout(30)
def test_configure_accepts_good_settings():
    before = (_arena.get_capacity(), _arena.policy())
    try:
        fastpin.configure(capacity=np.int64(64 << 20), wait_timeout=0, threads=0)
        assert _arena.get_capacity() == 64 << 20 and type(_arena.get_capacity()) is int
        fastpin.configure(wait_timeout=2.5, capacity=MAX)
        assert _arena.policy()["wait_timeout"] == 2.5
    finally:
        fastpin.configure(capacity="auto" if before[0] is None else before[0],
                          wait_timeout=before[1]["wait_timeout"])
        _runtime.settings.device = None


def test_configure_device_refused_cuda_n_and_took_an_absent_gpu(monkeypatch):
    """Issue 26: configure(device="cuda:0") was refused though Loader takes
    "cuda:N", and configure(device=5) was taken with no GPU present. It takes
    what the Loader takes for a CUDA device ("cuda": the current one), and
    refuses one this machine does not have."""
    settings = _runtime.settings
    try:
        # A machine of two GPUs, as configure sees it.
        monkeypatch.setattr(_arena, "cuda_available", lambda: True)
        monkeypatch.setattr(_arena, "cuda_status",
                            lambda: _arena.CudaStatus("ready", "ready", 12080, 2, "event"))
        for given, index in [("cuda:1", 1), (1, 1), (np.int64(1), 1), (torch.device("cuda", 1), 1),
                             ("cuda:0", 0), ("cuda", None), (torch.device("cuda"), None)]:
            settings.device = 7
            fastpin.configure(device=given)
            assert settings.device == index and type(settings.device) in (int, type(None)), given
        settings.device = 7
        for given in ["cuda:2", 2, torch.device("cuda", 2), 2 ** 40]:
            with pytest.raises(ValueError, match=r"device must be a CUDA device from 0 to 1 "
                                                 r"\(this machine has 2\), not "):
                fastpin.configure(device=given, on_full="raise")
            assert settings.device == 7 and settings.on_full != "raise"  # nothing changed
        monkeypatch.undo()
        # This machine as it is.
        settings.device = None
        if fastpin.cuda_available():
            count = fastpin.cuda_status().device_count
            fastpin.configure(device=f"cuda:{count - 1}")
            assert settings.device == count - 1
            with pytest.raises(ValueError, match=rf"this machine has {count}\), not {count}"):
                fastpin.configure(device=count)
        else:
            for given in [0, 5, "cuda:0", "cuda", torch.device("cuda", 0)]:
                with pytest.raises(ValueError, match=r"device must be a CUDA device this machine "
                                                     r"has, not .*: no usable CUDA GPU here \("):
                    fastpin.configure(device=given)
            assert settings.device is None
    finally:
        settings.device = None


# ---- environment variables, checked at import ----------------------------------------

# The fastpin this process imported (the installed one under `make test`, the
# source tree built in place otherwise): the child imports the same one, from a
# directory that holds no other.
FASTPIN_HOME = os.path.dirname(os.path.dirname(os.path.abspath(fastpin.__file__)))


def import_with(**env):
    full = dict(os.environ, PYTHONPATH=FASTPIN_HOME + os.pathsep + os.environ.get("PYTHONPATH", ""),
                **env)
    return subprocess.run([sys.executable, "-c", "import fastpin; print(fastpin._arena.get_capacity())"],
                          cwd=tempfile.gettempdir(), env=full, capture_output=True, text=True,
                          timeout=60)


BAD_ENV = [
    ("FASTPIN_ARENA_BYTES", "-5", r"FASTPIN_ARENA_BYTES='-5': must be a number of bytes from 1 to 8796093022208"),
    ("FASTPIN_ARENA_BYTES", "0", r"FASTPIN_ARENA_BYTES='0': must be a number of bytes"),
    ("FASTPIN_ARENA_BYTES", "1.5e9", r"FASTPIN_ARENA_BYTES='1.5e9': must be a number of bytes"),
    ("FASTPIN_ARENA_BYTES", "lots", r"FASTPIN_ARENA_BYTES='lots': must be"),
    ("FASTPIN_ARENA_BYTES", str(2 ** 44), r"FASTPIN_ARENA_BYTES='17592186044416': must be"),
    ("FASTPIN_THREADS", "-5", r"FASTPIN_THREADS='-5': must be a number of copy threads from 0 "
                              r"\(the default: .*\) to 1024"),
    ("FASTPIN_THREADS", "1025", r"FASTPIN_THREADS='1025': must be a number of copy threads"),
    ("FASTPIN_THREADS", "many", r"FASTPIN_THREADS='many': must be"),
    ("FASTPIN_ON_FULL", "drop", r"FASTPIN_ON_FULL='drop': must be one of fallback, wait, raise"),
    ("FASTPIN_ON_FULL", "0", r"FASTPIN_ON_FULL='0': must be one of"),
    ("FASTPIN_ALLOW_UNPINNED", "maybe", r"FASTPIN_ALLOW_UNPINNED='maybe': must be 1 or 0"),
    ("FASTPIN_NUMA", "maybe", r"FASTPIN_NUMA='maybe': must be 1 or 0"),
    ("FASTPIN_STREAMING", "fast", r"FASTPIN_STREAMING='fast': must be 1 or 0"),
    ("FASTPIN_ZERO_COPY_MAX_BYTES", "-5", r"FASTPIN_ZERO_COPY_MAX_BYTES='-5': must be a number of bytes >= 1"),
    ("FASTPIN_ZERO_COPY_MAX_BYTES", "0", r"FASTPIN_ZERO_COPY_MAX_BYTES='0': must be a number of bytes"),
    ("FASTPIN_ZERO_COPY_MAX_BYTES", "lots", r"FASTPIN_ZERO_COPY_MAX_BYTES='lots': must be"),
    ("FASTPIN_DISABLE_CUDA", "maybe", r"FASTPIN_DISABLE_CUDA='maybe': must be 1 or 0 "
                                      r"\(or true/false, yes/no, on/off\)"),
    ("FASTPIN_ARENA_BYTES", "automatic", r"FASTPIN_ARENA_BYTES='automatic': must be .*, or auto"),
    ("FASTPIN_FENCE", "synch", r"FASTPIN_FENCE='synch': must be one of event, sync"),
    ("FASTPIN_SYSFS_ROOT", "/no/such/sysfs", r"FASTPIN_SYSFS_ROOT='/no/such/sysfs': must be a directory"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name, value, message", BAD_ENV, ids=[f"{n}={v}" for n, v, _ in BAD_ENV])
def test_settings_checked_late(name, value, message):
    """Issue 26: FASTPIN_ARENA_BYTES=-5 (or 0) was accepted at import and failed
    only at the first pin_memory. Every FASTPIN_* variable fastpin reads fails
    `import fastpin` itself, with its name and what it may be."""
    full = dict(os.environ, PYTHONPATH=FASTPIN_HOME + os.pathsep + os.environ.get("PYTHONPATH", ""),
                **{name: value})
    r = subprocess.run([sys.executable, "-c", "import fastpin; print('imported')"],
                       cwd=tempfile.gettempdir(), env=full, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode != 0 and "imported" not in r.stdout, r.stdout
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("ValueError: ")
    assert re.search(message, last), last


IMPORT_ONLY = """
import numpy as np
import fastpin
from fastpin import _C
print("imported", _C.get_threads())
fastpin.pin_memory(np.arange(100) * 3)
print("threads", _C.get_threads())
"""


@pytest.mark.timeout(60)
def test_import_checks_the_environment_and_does_nothing_else():
    """Issue 17: importing fastpin does not size the copy pool; the first use
    of the configuration does (the import only checks the environment)."""
    full = dict(os.environ, PYTHONPATH=FASTPIN_HOME + os.pathsep + os.environ.get("PYTHONPATH", ""))
    threads = _C.cpu_count() + 1  # never the pool's default size
    r = subprocess.run([sys.executable, "-c", IMPORT_ONLY], cwd=tempfile.gettempdir(),
                       env={**full, "FASTPIN_THREADS": str(threads)}, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    out = r.stdout.splitlines()
    assert out[0] != f"imported {threads}" and out[-1] == f"threads {threads}", out


@pytest.mark.timeout(60)
def test_good_environment_is_taken():
    r = import_with(FASTPIN_ARENA_BYTES=" 4096 ", FASTPIN_THREADS="2", FASTPIN_ON_FULL="raise",
                    FASTPIN_ALLOW_UNPINNED="1", FASTPIN_NUMA="0", FASTPIN_STREAMING="0",
                    FASTPIN_ZERO_COPY_MAX_BYTES=" 1048576 ", FASTPIN_DISABLE_CUDA="0",
                    FASTPIN_FENCE="sync", FASTPIN_SYSFS_ROOT=tempfile.gettempdir())
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["4096"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("value, on", [("0", False), ("1", True), ("", True)])
def test_streaming_environment_reaches_the_copy_pool(value, on):
    """FASTPIN_STREAMING=0 turns the pool's streaming stores off (they exist
    on x86-64 only), and a batch past the streaming size is exact either way."""
    code = ("import platform, torch, fastpin; from fastpin import _C\n"
            "x = torch.arange(3 << 20, dtype=torch.int32) * 7 + 3\n"
            "y = fastpin.pin_memory(x)\n"
            "print(_C.streaming(), platform.machine(), bool(torch.equal(x, y)))\n")
    full = dict(os.environ, FASTPIN_STREAMING=value,
                PYTHONPATH=FASTPIN_HOME + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", code], cwd=tempfile.gettempdir(), env=full,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    streaming, machine, exact = r.stdout.split()
    assert streaming == str(on and machine == "x86_64")
    assert exact == "True"


# ---- fastpin.Loader ---------------------------------------------------------------

BAD_LOADER = [
    ({"depth": -1}, ValueError, r"depth must be 0 \(no prefetch\) or more batches, not -1"),
    ({"depth": 1.5}, TypeError, r"depth must be an integer"),
    ({"depth": True}, TypeError, r"depth must be 0"),
    ({"depth": "2"}, TypeError, r"depth must be an integer"),
    ({"capacity": 8 << 20}, ValueError, r"capacity sizes the shared arena of zero_copy=True"),
    ({"capacity": 1.5e9, "zero_copy": True}, TypeError, r"Loader: capacity must be an integer"),
    ({"capacity": 0, "zero_copy": True}, ValueError, r"Loader: capacity must be a number of bytes from 1"),
    ({"capacity": 2 ** 44, "zero_copy": True}, ValueError, r"Loader: capacity must be .* not 17592186044416"),
    ({"zero_copy": 1}, TypeError, r"zero_copy must be True or False, not 1"),
    ({"arena": 1 << 20}, TypeError, r"arena must be a fastpin._C.Arena or None, not int"),
    ({"device": 1.5}, TypeError, r"device must be None, 'cpu', 'cuda', 'cuda:N', an int or a torch.device"),
    ({"device": True}, TypeError, r"device must be None"),
    ({"device": "meta"}, ValueError, r"cuda and cpu devices"),
]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kwargs, error, message", BAD_LOADER,
                         ids=["-".join(f"{k}={v!r}" for k, v in kw.items()) for kw, _, _ in BAD_LOADER])
def test_loader_refuses_bad_arguments(kwargs, error, message):
    kwargs = {"device": "cpu", **kwargs}
    with pytest.raises(error, match=message):
        fastpin.Loader([], **kwargs)


# ---- the raw _C entry points ----------------------------------------------------------

@pytest.fixture
def block():
    return _C.Arena(1 << 20, cuda=False).alloc(4096)


@pytest.mark.parametrize("shape, strides, bits, lanes, message", [
    # The element count overflows int64 (strides 0: the extent alone would pass).
    ([2 ** 40, 2 ** 40], [0, 0], 8, 1, "element count overflows int64"),
    ([2 ** 62, 4], [0, 0], 8, 1, "element count overflows int64"),
    # Extents whose arithmetic would wrap a 128-bit sum.
    ([2 ** 62 + 1], [2 ** 62], 255, 65535, "does not fit a block of 4096 bytes"),
    ([2 ** 63 - 1, 1], [2 ** 63 - 1, 1], 64, 1, "does not fit"),
    ([4097], [1], 8, 1, "does not fit a block of 4096 bytes"),
    ([2], [-1], 8, 1, "negative shape or stride"),
])
def test_block_dlpack_refuses_before_exporting(shape, strides, bits, lanes, message):
    """torch refuses such a capsule only after calling its deleter: refused here,
    no capsule exists to free twice."""
    arena = _C.Arena(1 << 20, cuda=False)
    block = arena.alloc(4096)
    with pytest.raises(ValueError, match=message):
        block.dlpack(0, shape, strides, 0, bits, lanes=lanes)
    with pytest.raises(ValueError, match=message):
        block.numpy(0, shape, strides, np.dtype(np.uint8))  # strides in bytes
    del block
    assert arena.stats()["blocks_in_use"] == 0 and arena.is_valid()


def test_block_dlpack_refuses_bad_offsets_and_lanes(block):
    with pytest.raises(ValueError, match=r"dlpack: offset must be a byte offset >= 0, not -1"):
        block.dlpack(-1, [1], [1], 0, 8)
    with pytest.raises(ValueError, match="does not fit"):
        block.dlpack(2 ** 64 - 1, [1], [1], 0, 8)
    with pytest.raises(ValueError, match=r"lanes must be 1 to 65535, not 0"):
        block.dlpack(0, [1], [1], 0, 8, lanes=0)
    with pytest.raises(ValueError, match=r"numpy: offset must be a byte offset >= 0, not -8"):
        block.numpy(-8, [1], [1], np.dtype(np.uint8))


def test_block_dlpack_still_exports_what_fits(block):
    whole = torch.from_dlpack(block.dlpack(0, [64, 64], [64, 1], 0, 8))
    assert whole.shape == (64, 64)
    assert torch.from_dlpack(block.dlpack(4000, [96], [1], 0, 8)).shape == (96,)
    assert torch.from_dlpack(block.dlpack(0, [2 ** 62, 0], [1, 1], 0, 8)).shape == (2 ** 62, 0)
    del whole


@pytest.mark.parametrize("size", [2 ** 64 - 1, 2 ** 64 - 256, 2 ** 63, MAX + 1])
def test_arena_pin_refuses_sizes_that_overflow(size):
    a = _C.Arena(1 << 20, cuda=False)
    src = bytearray(b"\x5a" * 64)
    addr = ctypes.addressof((ctypes.c_char * 64).from_buffer(src))
    with pytest.raises(_C.ArenaFullError, match=rf"pin: {size} bytes .* more than any arena holds"):
        a.pin([(addr, size)])
    with pytest.raises(_C.ArenaFullError, match="more than any arena holds"):
        a.pin([(addr, 64), (0, MAX - 10), (addr, 64)])  # the sum, not one size
    assert a.stats()["blocks_in_use"] == 0 and a.is_valid()
    block, offsets = a.pin([(addr, 64)])  # and still pins what fits
    assert block.numpy(offsets[0], [64], [1], np.dtype(np.uint8)).tobytes() == bytes(src)
    del block


def test_arena_pin_refuses_negative_and_wrapping_sources():
    a = _C.Arena(1 << 20, cuda=False)
    with pytest.raises(ValueError, match=r"pin: a source's nbytes must be a number of bytes >= 0, not -1"):
        a.pin([(4096, -1)])
    with pytest.raises(ValueError, match=r"pin: a source's address must be an address >= 0, not -4096"):
        a.pin([(-4096, 16)])
    with pytest.raises(ValueError, match="past the end of the address space"):
        a.pin([(2 ** 64 - 16, 32)])
    with pytest.raises(TypeError, match=r"pin: a source's nbytes must be an integer"):
        a.pin([(4096, 1.5)])
    assert a.stats()["blocks_in_use"] == 0


@pytest.mark.parametrize("capacity, error, message", [
    (-5, ValueError, r"Arena: capacity must be a number of bytes from 1 to 8796093022208 \(2\*\*43\), not -5$"),
    (0, ValueError, r"not 0$"),
    (2 ** 44, ValueError, r"not 17592186044416$"),
    (2 ** 64, ValueError, r"not 18446744073709551616$"),
    (1.5e9, TypeError, r"Arena: capacity must be an integer, .* not float 1500000000.0"),
    (True, TypeError, r"not bool True"),
])
def test_arena_capacity_message_shows_the_number_given(capacity, error, message):
    with pytest.raises(error, match=message):
        _C.Arena(capacity, cuda=False)


def test_arena_other_arguments():
    with pytest.raises(ValueError, match=r"Arena: max_blocks must be 0 \(the default\) to 4294967294, not -1"):
        _C.Arena(4096, cuda=False, max_blocks=-1)
    with pytest.raises(ValueError, match=r"Arena: device must be a CUDA ordinal >= 0, not -2"):
        _C.Arena(4096, cuda=False, device=-2)
    a = _C.Arena(4096, cuda=False)
    with pytest.raises(ValueError, match=r"alloc: nbytes must be a number of bytes >= 0, not -1"):
        a.alloc(-1)
    with pytest.raises(_C.ArenaFullError):
        a.alloc(2 ** 64 - 1)
    assert a.stats()["blocks_in_use"] == 0 and a.is_valid()


def test_raw_copies_refuse_negative_and_wrapping_spans():
    with pytest.raises(ValueError, match=r"copy: nbytes must be a number of bytes >= 0, not -1"):
        _C.copy(4096, 8192, -1)
    with pytest.raises(ValueError, match=r"copy: src must be an address >= 0, not -8"):
        _C.copy(4096, -8, 8)
    with pytest.raises(ValueError, match="copy: 16 bytes .* run past the end of the address space"):
        _C.copy(4096, 2 ** 64 - 8, 16)
    a = _C.Arena(1 << 20, cuda=False)
    with pytest.raises(ValueError, match=r"h2d: nbytes must be a number of bytes >= 0, not -3"):
        _C.h2d(a, 0, [(4096, 8192, -3, False)])
    with pytest.raises(ValueError, match="h2d: .* run past the end of the address space"):
        _C.h2d(a, 0, [(2 ** 64 - 4, 8192, 16, True)])
    src, dst = bytearray(b"\x11\x22" * 32), bytearray(64)
    s = ctypes.addressof((ctypes.c_char * 64).from_buffer(src))
    d = ctypes.addressof((ctypes.c_char * 64).from_buffer(dst))
    _C.copy(d, s, 64)  # and still copies what is valid
    assert dst == src


# ---- configure() and the environment agree ---------------------------------------------

# (configure()'s argument, its variable, the value as configure() takes it, the same value
# as the environment gives it, whether both take it). Bugs: FASTPIN_THREADS=0 and
# FASTPIN_ARENA_BYTES=auto were refused where configure(threads=0) and
# configure(capacity="auto") were taken.
AGREE = [
    ("capacity", "FASTPIN_ARENA_BYTES", 4096, " 4096 ", True),
    ("capacity", "FASTPIN_ARENA_BYTES", "auto", "auto", True),
    ("capacity", "FASTPIN_ARENA_BYTES", MAX, str(MAX), True),
    ("capacity", "FASTPIN_ARENA_BYTES", 0, "0", False),
    ("capacity", "FASTPIN_ARENA_BYTES", -5, "-5", False),
    ("capacity", "FASTPIN_ARENA_BYTES", MAX + 1, str(MAX + 1), False),
    ("capacity", "FASTPIN_ARENA_BYTES", "lots", "lots", False),
    ("capacity", "FASTPIN_ARENA_BYTES", 1.5e9, "1.5e9", False),
    ("threads", "FASTPIN_THREADS", 0, "0", True),
    ("threads", "FASTPIN_THREADS", 3, "3", True),
    ("threads", "FASTPIN_THREADS", 1024, "1024", True),
    ("threads", "FASTPIN_THREADS", 1025, "1025", False),
    ("threads", "FASTPIN_THREADS", -1, "-1", False),
    ("threads", "FASTPIN_THREADS", "many", "many", False),
    ("on_full", "FASTPIN_ON_FULL", "fallback", "fallback", True),
    ("on_full", "FASTPIN_ON_FULL", "wait", "wait", True),
    ("on_full", "FASTPIN_ON_FULL", "raise", " raise", True),
    ("on_full", "FASTPIN_ON_FULL", "drop", "drop", False),
    ("on_full", "FASTPIN_ON_FULL", "0", "0", False),
] + [(name, var, value, word, True)
     for name, var in [("allow_unpinned", "FASTPIN_ALLOW_UNPINNED"), ("numa", "FASTPIN_NUMA")]
     for value, words in [(True, ["1", "true", "yes", "on", "YES"]),
                          (False, ["0", "false", "no", "off", "Off"])]
     for word in words] + [
    ("allow_unpinned", "FASTPIN_ALLOW_UNPINNED", "maybe", "maybe", False),
    ("numa", "FASTPIN_NUMA", 2, "2", False),
]


def configured(name, value):
    """What configure(name=value) sets, or 'refused'; the settings put back after."""
    settings = _runtime.settings
    settings.load()
    saved = {k: settings.__dict__[k] for k in _runtime.Settings.FIELDS}
    try:
        fastpin.configure(**{name: value})
        return getattr(settings, name)
    except (TypeError, ValueError):
        return "refused"
    finally:
        settings.__dict__.update(saved)
        _C.set_threads(saved["threads"] or 0)
        fastpin._numa.set_enabled(saved["numa"])


def from_environment(monkeypatch, name, var, text):
    monkeypatch.setenv(var, text)
    try:
        return _runtime.read_environment()[name]
    except ValueError as exc:
        assert str(exc).startswith(f"{var}={text!r}: must be "), exc
        return "refused"


@pytest.mark.parametrize("name, var, value, text, taken", AGREE,
                         ids=[f"{v}={t!r}" for _, v, _, t, _ in AGREE])
def test_configure_and_the_environment_take_the_same_values(name, var, value, text, taken,
                                                             monkeypatch):
    by_configure = configured(name, value)
    by_environment = from_environment(monkeypatch, name, var, text)
    assert by_configure == by_environment, (by_configure, by_environment)
    assert (by_configure != "refused") == taken


FLAG_VARIABLES = ["FASTPIN_ALLOW_UNPINNED", "FASTPIN_NUMA", "FASTPIN_STREAMING",
                  "FASTPIN_ZERO_COPY", "FASTPIN_DISABLE_CUDA"]


@pytest.mark.parametrize("word", ["1", "0", "true", "false", "yes", "no", "on", "off", " ON ",
                                  "maybe", "2", "disabled"])
def test_every_flag_takes_the_same_words(word, monkeypatch):
    """Bug: FASTPIN_DISABLE_CUDA=yes was refused where the other flags take yes/no/on/off."""
    taken = {}
    for var in FLAG_VARIABLES:
        monkeypatch.setenv(var, word)
        try:
            _runtime.check_environment()
            taken[var] = True
        except ValueError as exc:
            assert f"{var}={word!r}: must be 1 or 0 (or true/false, yes/no, on/off)" in str(exc)
            taken[var] = False
        monkeypatch.delenv(var)
    assert len(set(taken.values())) == 1, taken


@pytest.mark.parametrize("word, disabled", [("yes", True), ("On", True), ("1", True),
                                            ("no", False), (" off ", False), ("0", False)])
def test_disable_cuda_means_what_the_flag_says(word, disabled):
    """The C core reads FASTPIN_DISABLE_CUDA itself: it must read the words as the
    Python layer does (it once took every word but "0" as "disable")."""
    full = dict(os.environ, FASTPIN_DISABLE_CUDA=word,
                PYTHONPATH=FASTPIN_HOME + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c",
                        "import fastpin; print(fastpin.cuda_status().reason)"],
                       cwd=tempfile.gettempdir(), env=full, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert ("disabled by FASTPIN_DISABLE_CUDA" in r.stdout) == disabled, r.stdout


@pytest.mark.timeout(30)
def test_none_keeps_the_setting_as_the_docstring_says():
    """configure(on_full=None) was taken and meant nothing documented: None (as an
    argument left out) keeps the setting as it is, for every argument."""
    doc = " ".join(fastpin.configure.__doc__.split())
    assert "An argument left out, or None, keeps its current setting" in doc
    settings = _runtime.settings
    before = settings.on_full
    try:
        fastpin.configure(on_full="raise")
        fastpin.configure(on_full=None, capacity=None, threads=None, wait_timeout=None,
                          allow_unpinned=None, numa=None, device=None)
        assert settings.on_full == "raise"
    finally:
        settings.on_full = before
