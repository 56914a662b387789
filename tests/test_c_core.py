"""The C core's own test programs (allocator, copy pool), built and run by
tests/c/Makefile without an interpreter."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

C_DIR = Path(__file__).resolve().parent / "c"


def test_c_core_programs():
    if not (C_DIR / "Makefile").exists():
        pytest.skip("tests/c/Makefile is not there")
    compiler = os.environ.get("CC") or "gcc"
    if shutil.which("make") is None or shutil.which(compiler) is None:
        pytest.skip(f"needs make and {compiler}")
    r = subprocess.run(["make", "-C", str(C_DIR), "test"], capture_output=True, text=True,
                       timeout=600)
    output = r.stdout + r.stderr
    assert r.returncode == 0, output[-6000:]
    for program in ("test_arena", "test_copier"):
        assert f"== test: {program}" in output, output[-6000:]
    assert "FAILED" not in output, output[-6000:]
