"""What fastpin logs, on logging.getLogger("fastpin"): one WARNING the first
time a fallback slows the user down, DEBUG for the ones after it (README.md,
"Logging"). Needs no torch."""
from __future__ import annotations

import logging

import numpy as np

import fastpin
from fastpin import _pin
from conftest import patterned


def test_the_first_full_arena_fallback_warns_and_later_ones_are_debug(small_arena, caplog,
                                                                       monkeypatch):
    # Bug: every full-arena fallback logged at DEBUG: the user was never told.
    monkeypatch.setitem(_pin._counters, "fallbacks", 0)   # as in a fresh process
    caplog.set_level(logging.DEBUG, logger="fastpin")
    src = patterned((40 << 10,), np.uint8, 3)             # 40 KiB: one fits in 64 KiB
    held = fastpin.pin_memory(src, arena=small_arena)
    first = fastpin.pin_memory(src, arena=small_arena)    # no room: the ordinary way
    second = fastpin.pin_memory(src, arena=small_arena)
    for out in (held, first, second):
        assert np.array_equal(out, src)
    records = [r for r in caplog.records
               if r.name == "fastpin" and "ordinary way" in r.getMessage()]
    assert [r.levelno for r in records] == [logging.WARNING, logging.DEBUG]
    assert "arena" in records[0].getMessage() and "slower" in records[0].getMessage()
    del held, first, second
    small_arena.collect()
