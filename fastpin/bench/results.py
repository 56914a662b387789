"""What a comparison measured: one Row per path, a Results per loader (or
workload case), and their Markdown tables and JSON."""
from __future__ import annotations

import dataclasses
import json
import textwrap
from typing import Iterator, Optional

from .paths import PATHS

# What a figure needs to mean something: every path of the suite is timed this
# long at least (compare() times fewer only where asked to, and says so).
MIN_TIMED = 20       # batches
MIN_SECONDS = 1.0    # seconds
WIDTH = 110          # the report's lines, tables aside, are wrapped at this


def wrap(text: str, indent: str = "") -> str:
    """A paragraph of the report, wrapped (a list item's later lines indented)."""
    return textwrap.fill(text, WIDTH, subsequent_indent=indent, break_on_hyphens=False,
                         break_long_words=False)


def workers_label(n: int) -> str:
    return f"{n} worker" if n == 1 else f"{n} workers"


@dataclasses.dataclass
class Row:
    """One path's figures. status: 'ok', 'skipped' or 'failed' (reason says why);
    unavailable: skipped for what this machine or target lacks (a GPU, a GPU
    target), so the tables leave it out and say so once."""

    path: str
    status: str = "ok"
    reason: str = ""
    batches: int = 0                       # batches timed
    warmup: int = 0                        # untimed batches after the first
    batch_mb: Optional[float] = None       # mean MiB of tensor data per timed batch
    gbps: Optional[float] = None           # delivered GB/s (1e9 bytes)
    step_ms: Optional[float] = None        # wall time per step, compute included
    cpu_ms: Optional[float] = None         # main-process CPU time per batch
    cpu_s_per_gb: Optional[float] = None   # CPU-seconds per GB delivered, the main
                                           # process and its worker processes together
    pinned_mb: Optional[float] = None      # page-locked memory held by the path, MiB
    pool_peak_mb: Optional[float] = None   # peak of it in use (fastpin's arenas only)
    first_batch_s: Optional[float] = None  # loader made -> first batch ready
    fallbacks: Optional[int] = None        # batches pinned the ordinary way (fastpin)
    unavailable: bool = False              # skipped: no GPU here, or a host target
    rounds_gbps: Optional[list] = None     # GB/s of each round, in the order run, where
                                           # compare() ran several: the row is the median's

    @property
    def label(self) -> str:
        info = PATHS.get(self.path)
        return info.label if info else self.path

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def timed_s(self) -> Optional[float]:
        return None if self.step_ms is None else self.batches * self.step_ms / 1e3


METRICS = {
    "gbps": "delivered GB/s",
    "step_ms": "step ms",
    "cpu_ms": "main CPU ms/batch",
    "cpu_s_per_gb": "CPU s/GB (main + workers)",
    "first_batch_s": "first batch s",
    "pinned_mb": "pinned MiB held",
}

LEGEND = ("timed: batches timed, after the warm-up; x: GB/s over the stock path's; step ms: "
          "wall time per batch, compute included; main CPU ms: CPU time per batch of every "
          "thread of this process; CPU s/GB: CPU-seconds of this process and its DataLoader "
          "workers per GB delivered; pinned MiB: page-locked memory the path held at its end "
          "(peak in use); first s: from making the loader to the first batch.")


def num(x: Optional[float], digits: int = 2) -> str:
    if x is None:
        return "-"
    if abs(x) >= 100:
        return f"{x:.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    return f"{x:.{digits}f}"


def ratio(x: float) -> str:
    """A ratio to the stock path: 2 significant digits (0.93x, 4.2x, 17x)."""
    return f"{x:.0f}x" if x >= 9.95 else f"{x:.1f}x" if x >= 1 else f"{x:.2f}x"


def too_few(row: Row) -> bool:
    """A path timed too few batches, or too briefly, for its figures to mean much
    (two runs of 4 batches each of the same loader once gave 0.85x and 4.00x; a
    few batches after a short warm-up time what the workers had made ahead)."""
    return (row.ok and row.timed_s is not None
            and (row.batches < MIN_TIMED or row.timed_s < MIN_SECONDS))


def few_warning(row: Row) -> str:
    return (f"warning: {row.label} timed only {row.batches} batches, in "
            f"{row.timed_s * 1e3:.0f} ms: too few for its figures to mean much (at least "
            f"{MIN_TIMED} batches and {MIN_SECONDS:g} s do); ask for more batches or seconds, "
            "and a loader that gives enough")


def _table_row(r: Row, base: Optional[Row]) -> str:
    if not r.ok:  # the reason in the row: table() alone says why
        why = r.reason.replace("|", "\\|")
        return f"| {r.label} | {r.status}: {why} |"
    x = ratio(r.gbps / base.gbps) if base and r.gbps is not None else "-"
    pinned = "-" if r.pinned_mb is None else f"{r.pinned_mb:.0f}"
    if r.pool_peak_mb is not None:
        pinned += f" ({r.pool_peak_mb:.0f})"
    few = "*" if too_few(r) else ""
    gbps = num(r.gbps)
    if r.rounds_gbps and len(r.rounds_gbps) > 1:
        gbps += f" ({num(min(r.rounds_gbps))}-{num(max(r.rounds_gbps))})"
    return (f"| {r.label} | {r.batches}{few} | {gbps} | {x} | {num(r.step_ms)} | "
            f"{num(r.cpu_ms, 3)} | {num(r.cpu_s_per_gb, 3)} | {pinned} | "
            f"{num(r.first_batch_s, 3)} |")


def span(values: list) -> str:
    values = sorted(set(values))
    return "-" if not values else (f"{values[0]}" if len(values) == 1
                                   else f"{values[0]}-{values[-1]}")


@dataclasses.dataclass
class Results:
    """What compare() measured: one Row per path, in the order asked for.

    table() / markdown() give a Markdown table (Jupyter shows it as one);
    to_dict() / to_json() the same as data; Results.from_dict() reads it back;
    fastpin.bench.plot() draws it."""

    rows: list
    name: str = "compare"
    title: str = ""
    device: str = "host"
    workers: Optional[int] = None
    batches: int = 0
    warmup: int = 0
    compute_ms: float = 0.0
    max_seconds: Optional[float] = None
    min_seconds: float = 0.0
    rounds: int = 1                        # each path run this many times, in turn
    notes: list = dataclasses.field(default_factory=list)
    machine: dict = dataclasses.field(default_factory=dict)

    def __iter__(self) -> Iterator[Row]:
        return iter(self.rows)

    def __getitem__(self, path: str) -> Row:
        for row in self.rows:
            if row.path == path:
                return row
        raise KeyError(path)

    @property
    def ran(self) -> list:
        return [r for r in self.rows if r.ok]

    @property
    def not_run(self) -> list:
        return [r for r in self.rows if not r.ok]

    def baseline(self) -> Optional[Row]:
        """The row the others are compared with: pin_memory=True, else pageable."""
        for path in ("pin_memory", "pageable"):
            for row in self.rows:
                if row.path == path and row.ok and row.gbps:
                    return row
        return None

    def table(self) -> str:
        """The paths that could run here (those this machine cannot run are left
        out: left_out() names them), one row each."""
        base = self.baseline()
        vs = f"x {base.label}" if base else "x stock"
        lines = [f"| path | timed | GB/s | {vs} | step ms | main CPU ms | CPU s/GB | "
                 "pinned MiB (peak) | first s |",
                 "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        lines += [_table_row(r, base) for r in self.rows if not r.unavailable]
        return "\n".join(lines)

    def left_out(self) -> list:
        """'Left out: labels: why', one line for each reason paths could not run here."""
        groups: dict = {}
        for r in self.rows:
            if r.unavailable:
                groups.setdefault(r.reason, []).append(r.label)
        return [f"Left out: {', '.join(labels)}: {why}" for why, labels in groups.items()]

    def header(self) -> str:
        mb = [r.batch_mb for r in self.rows if r.ok and r.batch_mb]
        size = f"{sum(mb) / len(mb):.1f} MiB batches, " if mb else ""
        workers = "" if self.workers is None else workers_label(self.workers) + ", "
        ran = self.ran
        # What the paths did, never more than that: a loader that runs out times fewer.
        warm = span([r.warmup for r in ran]) if ran else str(self.warmup)
        asked = f"at least {self.batches}"
        if self.min_seconds:
            asked += f" and {self.min_seconds:g} s"
        if self.max_seconds:
            asked += f", up to {self.max_seconds:g} s"
        rounds = ""
        if self.rounds > 1:
            rounds = (f" Each path ran {self.rounds} times, the paths taking turns; its row "
                      "is the run of the median GB/s, the lowest and highest in brackets.")
        return (f"{size}{workers}each path: the first batch and {warm} more untimed, then "
                f"{span([r.batches for r in ran])} timed ({asked}); compute "
                f"{self.compute_ms:g} ms/step; delivered to {self.device}.{rounds}")

    def notes_lines(self) -> list:
        """What the table's rows need said: fallbacks, short loaders, too few batches."""
        fallbacks = [f"{r.label}: {r.fallbacks} batches pinned the ordinary way (arena full)"
                     for r in self.rows if r.ok and r.fallbacks]
        short = [f"{r.label}: {r.reason}" for r in self.rows if r.ok and r.reason]
        few = [few_warning(r) for r in self.rows if too_few(r)]
        if few:
            few.append("* too few batches or seconds timed (see the warnings)")
        return fallbacks + short + few + list(self.notes)

    def markdown(self, heading: str = "##", legend: bool = True,
                 left_out: bool = True) -> str:
        """The heading, what was timed, the table and its notes. The suite's report
        gives the legend and what was left out once for every case (False here)."""
        parts = []
        if self.title or self.name:
            parts.append(f"{heading} {self.title or self.name}\n")
        whys = {r.reason for r in self.rows}
        if self.rows and not self.ran and len(whys) == 1 and self.rows[0].status == "skipped":
            parts.append(wrap(f"Every path skipped: {whys.pop()}"))   # the case, not a path
            return "\n".join(parts)
        parts.append(wrap(self.header()) + "\n")
        parts.append(self.table())
        notes = self.notes_lines() + (self.left_out() if left_out else [])
        if notes:
            parts.append("")
            parts.extend(wrap(f"- {n}", "  ") for n in notes)
        if legend:
            parts.extend(["", wrap(LEGEND)])
        return "\n".join(parts)

    def _repr_markdown_(self) -> str:
        return self.markdown()

    def __str__(self) -> str:
        return self.markdown()

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        for row, r in zip(d["rows"], self.rows):
            row["label"] = r.label
        return d

    def to_json(self, indent: Optional[int] = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, d: dict) -> "Results":
        names = {f.name for f in dataclasses.fields(Row)}
        rows = [Row(**{k: v for k, v in r.items() if k in names}) for r in d["rows"]]
        fields = {f.name for f in dataclasses.fields(cls)} - {"rows"}
        return cls(rows=rows, **{k: v for k, v in d.items() if k in fields})
