"""What fastpin logs, on logging.getLogger("fastpin"): one WARNING the first
time a fallback slows the user down, DEBUG for the ones after it (README.md,
"Logging"). Needs no torch."""
from __future__ import annotations

import logging

import numpy as np

import fastpin
from fastpin import _runtime
from conftest import patterned


def test_the_first_full_arena_fallback_warns_and_later_ones_are_debug(small_arena, caplog,
                                                                       monkeypatch):
    # Bug: every full-arena fallback logged at DEBUG: the user was never told.
    monkeypatch.setitem(_runtime.counts, "fallbacks", 0)   # as in a fresh process
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


def test_fallback_log_record_keeps_the_batch_alive(small_arena, caplog, monkeypatch):
    # Bug: the WARNING's record held the ArenaFullError itself, whose traceback
    # holds the frames of pin_memory (the batch, and up the stack a Loader with
    # its shared arena): as long as a log handler kept the record (pytest's
    # capture, a MemoryHandler), none of them could be freed.
    import gc
    import weakref

    monkeypatch.setitem(_runtime.counts, "fallbacks", 0)
    caplog.set_level(logging.DEBUG, logger="fastpin")
    held = fastpin.pin_memory(patterned((40 << 10,), np.uint8, 5), arena=small_arena)
    src = patterned((30 << 10,), np.uint8, 6)
    gone = weakref.ref(src)
    out = fastpin.pin_memory(src, arena=small_arena)     # no room: the ordinary way
    assert np.array_equal(out, src)
    assert any("ordinary way" in r.getMessage() for r in caplog.records)
    del src, out
    gc.collect()
    assert gone() is None, "the log record keeps the batch alive"
    del held
    small_arena.collect()
