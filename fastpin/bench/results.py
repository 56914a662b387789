"""What a comparison measured: one Row per path, a Results per loader (or
workload case), and their Markdown tables and JSON."""
from __future__ import annotations

import dataclasses
import json
import statistics
from typing import Iterator, Optional

from .paths import PATHS


def workers_label(n: int) -> str:
    return f"{n} worker" if n == 1 else f"{n} workers"


@dataclasses.dataclass
class Row:
    """One path's figures. status: 'ok', 'skipped' or 'failed' (reason says why)."""

    path: str
    status: str = "ok"
    reason: str = ""
    batches: int = 0                       # batches timed
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

    @property
    def label(self) -> str:
        info = PATHS.get(self.path)
        return info.label if info else self.path

    @property
    def ok(self) -> bool:
        return self.status == "ok"


METRICS = {
    "gbps": "delivered GB/s",
    "step_ms": "step ms",
    "cpu_ms": "main CPU ms/batch",
    "cpu_s_per_gb": "CPU s/GB (main + workers)",
    "first_batch_s": "first batch s",
    "pinned_mb": "pinned MiB held",
}


def num(x: Optional[float], digits: int = 2) -> str:
    if x is None:
        return "-"
    if abs(x) >= 100:
        return f"{x:.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    return f"{x:.{digits}f}"


FEW_TIMED = 10  # fewer batches than this, in under a second, measure start-up noise


def too_few(row: Row) -> bool:
    """A path timed too few batches, too briefly, for its figures to mean much (two
    runs of 4 batches each of the same loader once gave 0.85x and 4.00x)."""
    return (row.ok and row.batches < FEW_TIMED and row.step_ms is not None
            and row.batches * row.step_ms < 1e3)


def few_warning(row: Row) -> str:
    return (f"warning: {row.label} timed only {row.batches} batches, in "
            f"{row.batches * row.step_ms:.0f} ms: too few for its figures to mean much; ask for "
            f"more batches (and a loader that yields at least 1 + warmup + batches)")


def _table_row(r: Row, base: Optional[Row]) -> str:
    if not r.ok:  # the reason in the row: table() alone says why
        why = r.reason.replace("|", "\\|")
        return f"| {r.label} | | {r.status}: {why} | | | | | | |"
    ratio = f"{r.gbps / base.gbps:.2f}x" if base and r.gbps is not None else "-"
    pinned = "-" if r.pinned_mb is None else f"{r.pinned_mb:.0f}"
    if r.pool_peak_mb is not None:
        pinned += f" ({r.pool_peak_mb:.0f})"
    few = " (too few)" if too_few(r) else ""
    return (f"| {r.label} | {r.batches}{few} | {num(r.gbps)} | {ratio} | {num(r.step_ms)} | "
            f"{num(r.cpu_ms, 3)} | {num(r.cpu_s_per_gb, 3)} | {pinned} | "
            f"{num(r.first_batch_s, 3)} |")


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
        base = self.baseline()
        vs = f"x {base.label}" if base else "x baseline"
        lines = [
            f"| path | batches timed | GB/s | {vs} | step ms | main CPU ms/batch | "
            "CPU s/GB (main + workers) | pinned MiB held (peak used) | first batch s |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        lines += [_table_row(r, base) for r in self.rows]
        return "\n".join(lines)

    def header(self) -> str:
        mb = [r.batch_mb for r in self.rows if r.ok and r.batch_mb]
        size = f"{statistics.mean(mb):.1f} MiB batches, " if mb else ""
        workers = "" if self.workers is None else workers_label(self.workers) + ", "
        # What the paths timed, never more: a loader that runs out times fewer.
        counts = sorted({r.batches for r in self.rows if r.ok})
        span = (f"{counts[0]}" if len(counts) == 1 else f"{counts[0]}-{counts[-1]}") if counts else "0"
        timed = f"{self.batches} timed" if counts in ([], [self.batches]) else \
            f"{span} timed (of {self.batches} asked for)"
        if self.max_seconds:
            timed = f"{span} timed (up to {self.batches}, or {self.max_seconds:g} s a path)"
        return (f"{size}{timed} after {self.warmup} warm-up, {workers}"
                f"compute {self.compute_ms:g} ms/step, delivered to {self.device}.")

    def markdown(self, heading: str = "##") -> str:
        parts = []
        if self.title or self.name:
            parts.append(f"{heading} {self.title or self.name}\n")
        parts.append(self.header() + "\n")
        parts.append(self.table())
        fallbacks = [f"- {r.label}: {r.fallbacks} batches pinned the ordinary way (arena full)"
                     for r in self.rows if r.ok and r.fallbacks]
        short = [f"- {r.label}: {r.reason}" for r in self.rows if r.ok and r.reason]
        few = [f"- {few_warning(r)}" for r in self.rows if too_few(r)]
        if fallbacks or short or few or self.notes:
            parts.append("")
            parts.extend(fallbacks + short + few + [f"- {n}" for n in self.notes])
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
