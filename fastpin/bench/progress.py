"""Progress reporting: one reporter per run, passed to whatever measures.

A Progress draws the bar on stderr (tqdm where installed), notes what was
skipped or failed, writes report lines to stdout around the bar, and watches
for a path that runs too long (hang_report_s: every thread's stack to stderr).
python -m fastpin.bench makes one for the whole suite; compare() makes its own
unless it is given one."""
from __future__ import annotations

import faulthandler
import importlib
import io
import sys
import threading
import time
import traceback
from typing import Any, Optional


class HangWatch:
    """After `seconds` on one path, every thread's stack, named, to stderr.
    That report needs the GIL; should a call hold it while stuck, faulthandler's
    own thread dumps the stacks at twice the time without it."""

    def __init__(self, label: str, seconds: float):
        self.timer = threading.Timer(seconds, self.report, (label, seconds))
        self.timer.daemon = True
        self.timer.start()
        self.dumping = False
        try:
            faulthandler.dump_traceback_later(2 * seconds, file=sys.stderr)
            self.dumping = True
        except (AttributeError, ValueError, OSError, io.UnsupportedOperation):
            pass  # stderr with no file descriptor (captured): the timer alone

    @staticmethod
    def report(label: str, seconds: float) -> None:
        names = {t.ident: t.name for t in threading.enumerate()}
        lines = [f"fastpin.bench: {label} has run for {seconds:g} s; "
                 "the stack of every thread follows\n"]
        for ident, frame in sys._current_frames().items():
            lines.append(f"-- thread {names.get(ident, ident)}\n")
            lines.extend(traceback.format_stack(frame))
        sys.stderr.write("".join(lines))
        sys.stderr.flush()

    def cancel(self) -> None:
        self.timer.cancel()
        if self.dumping:
            faulthandler.cancel_dump_traceback_later()


class Progress:
    """A progress bar on stderr: tqdm where it is installed, else a plain counter
    (redrawn in place on a terminal, one line per stage elsewhere).
    hang_report_s: a path still running after this long prints every thread's
    stack (None: never)."""

    def __init__(self, total: int, enabled: bool = True, desc: str = "fastpin.bench",
                 hang_report_s: Optional[float] = None):
        self.total, self.n, self.enabled, self.desc = total, 0, enabled, desc
        self.hang_report_s = hang_report_s
        self.label = ""
        self.start = time.monotonic()
        self.bar: Any = None
        self._last = 0.0
        self._tty = enabled and hasattr(sys.stderr, "isatty") and sys.stderr.isatty()
        # A redrawn bar in a log (CI, a remote run's captured output) is noise:
        # tqdm only on a terminal or in Jupyter, one line per stage elsewhere.
        if enabled and (self._tty or "ipykernel" in sys.modules):
            try:
                from tqdm import tqdm
            except ImportError:
                pass
            else:
                self.bar = tqdm(total=total, desc=desc, unit="step", file=sys.stderr,
                                dynamic_ncols=True, leave=False)

    def stage(self, label: str) -> None:
        """A new stage begins (a case, a path)."""
        self.label = label
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix_str(label, refresh=True)
        elif self._tty:
            self._draw(force=True)
        else:
            self._write(f"[{self.n}/{self.total}, {time.monotonic() - self.start:.0f} s] {label}")

    def update(self, n: int = 1) -> None:
        self.n += n
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(n)
        elif self._tty:
            self._draw()

    def skip(self, n: int) -> None:
        """Steps counted in the total that will not run."""
        self.total -= n
        if self.bar is not None:
            self.bar.total = self.total
            self.bar.refresh()

    def note(self, msg: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(msg, file=sys.stderr)
        else:
            if self._tty:
                sys.stderr.write("\r\x1b[K")
            self._write(msg)
            if self._tty:
                self._draw(force=True)

    def step_done(self, msg: str) -> None:
        """A stage of the micro tables done: a note and a step of the bar."""
        self.note(msg)
        self.update(1)

    def write(self, text: str = "") -> None:
        """A line of the report on stdout, the bar cleared around it."""
        if self.bar is not None:
            self.bar.clear()
        elif self._tty:
            sys.stderr.write("\r\x1b[K")
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
        if self.bar is not None:
            self.bar.refresh()

    def hang_watch(self, label: str) -> Optional[HangWatch]:
        """A watch on one path (cancel() it when the path ends), or None."""
        return HangWatch(label, self.hang_report_s) if self.hang_report_s else None

    def _draw(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._last > 0.1:
            self._last = now
            sys.stderr.write(f"\r\x1b[K{self.desc} {self.n}/{self.total} {self.label}")
            sys.stderr.flush()

    def _write(self, line: str) -> None:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        elif self.enabled and self._tty:
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()


def reporter_for(progress: Any, total: int, desc: str) -> tuple:
    """(the reporter to report to, whether the caller made it and must close it).
    progress: a Progress (the caller's, for one bar over several runs), or a bool:
    a bar of its own, on or off, whose hang report is fastpin.bench._hang_report_s
    (None: none; tests set it there)."""
    if isinstance(progress, Progress):
        return progress, False
    hang = importlib.import_module(__package__)._hang_report_s
    return Progress(total, enabled=bool(progress), desc=desc, hang_report_s=hang), True
