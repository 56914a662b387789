"""fastpin._runtime (issue 17): one place for the configuration and for what
belongs to one process, emptied in a forked child by one fork hook."""
from __future__ import annotations

import os

import numpy as np
import pytest

import fastpin
from fastpin import _arena, _runtime
from conftest import patterned

pytestmark = pytest.mark.timeout(60)
# Python 3.12+ warns on fork() in a process with threads (the copy pool's): the
# child here runs only fastpin, which is what is tested.
FORK_WARNING = "ignore:.*use of fork\\(\\) may lead to deadlocks:DeprecationWarning"


def in_child(check) -> int:
    """The exit status of a forked child that runs check() (0: it held)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            check()
            code = 0
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


@pytest.mark.filterwarnings(FORK_WARNING)
def test_a_forked_child_starts_with_no_registries_and_keeps_the_settings():
    kept = fastpin.pin_memory(patterned((1000,), np.int32, 3))  # the default arena exists
    parent_lock = _runtime.process.lock
    assert _runtime.process.arenas
    on_full = _runtime.settings.on_full

    def check():
        assert not _runtime.process.arenas and not _runtime.process.producers
        assert _arena.made_default_arena() is None       # the parent's is not this process's
        assert _runtime.process.lock is not parent_lock  # never one a parent's thread held
        assert _runtime.settings.on_full == on_full
        out = fastpin.pin_memory(patterned((1000,), np.int32, 4))
        assert np.array_equal(out, patterned((1000,), np.int32, 4))
        assert _runtime.process.arenas                   # its own, made here

    assert in_child(check) == 0
    assert np.array_equal(kept, patterned((1000,), np.int32, 3))
    assert _runtime.process.lock is parent_lock


def test_a_setting_given_before_first_use_overrides_the_environment(monkeypatch):
    settings = _runtime.Settings()
    monkeypatch.setenv("FASTPIN_ON_FULL", "raise")
    settings.wait_timeout = 1.5   # loads the environment first, then sets
    assert settings.on_full == "raise" and settings.wait_timeout == 1.5
    with pytest.raises(AttributeError, match="no setting 'capcity'"):
        settings.capcity = 1
