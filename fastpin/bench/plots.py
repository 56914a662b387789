"""Bar charts of Results: plot(), one row of panels per case, one panel per
metric, one bar per path (needs matplotlib)."""
from __future__ import annotations

from typing import Any, Optional, Sequence

from .paths import PATHS
from .results import METRICS, Results, num, workers_label

# fastpin is on no package index: "pip install 'fastpin[plot]'" would ask one for
# a project of that name, not this one.
MATPLOTLIB = ("pip install matplotlib (or, installing fastpin from its source, "
              "pip install '/path/to/fastpin[plot]')")

_COLORS = ["#8c8c8c", "#1f77b4", "#17becf", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd"]


def _as_results(obj: Any) -> list:
    if isinstance(obj, Results):
        return [obj]
    if isinstance(obj, dict):
        if "cases" in obj:                       # a suite, as main() writes it
            return [Results.from_dict(c) for c in obj["cases"]]
        return [Results.from_dict(obj)]          # one Results.to_dict()
    return [r if isinstance(r, Results) else Results.from_dict(r) for r in obj]


def _panel(ax, res: Results, metric: str, colors: dict, first_row: bool, first_col: bool) -> None:
    rows = [row for row in res.rows if not row.unavailable]  # as the tables leave them out
    ys = list(range(len(rows)))
    values = [getattr(row, metric) if row.ok and getattr(row, metric) is not None else 0.0
              for row in rows]
    ax.barh(ys, values, color=[colors.get(row.path, "#444444") for row in rows])
    ax.set_yticks(ys, [row.label for row in rows] if first_col else [""] * len(rows))
    ax.invert_yaxis()
    ax.tick_params(axis="both", labelsize=8)
    top = max(values) if values and max(values) > 0 else 1.0
    ax.set_xlim(0, top * 1.3)
    for y, row, v in zip(ys, rows, values):
        text = num(getattr(row, metric), 3 if metric == "cpu_ms" else 2) if row.ok \
            else row.status
        ax.text(v + top * 0.02, y, text, va="center", fontsize=7,
                color="black" if row.ok else "#999999")
    if first_row:
        ax.set_title(METRICS[metric], fontsize=10)
    if first_col:
        ax.set_ylabel(res.name if res.workers is None
                      else f"{res.name}\n{workers_label(res.workers)}", fontsize=9)


def plot(results: Any, path: Optional[str] = None, *,
         metrics: Sequence[str] = ("gbps", "step_ms", "cpu_ms", "first_batch_s")):
    """Bar charts of Results (or a list of them, or the dict/JSON that
    Results.to_dict() or `python -m fastpin.bench --json` wrote): one row of panels
    per case, one panel per metric, one bar per path. Saves a PNG (or any format
    matplotlib knows by the suffix) to `path` when given; returns the
    matplotlib Figure. Needs matplotlib (pip install matplotlib)."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError(f"fastpin.bench.plot needs matplotlib: {MATPLOTLIB}") from None
    groups = _as_results(results)
    if not groups:
        raise ValueError("nothing to plot")
    bad = [m for m in metrics if m not in METRICS]
    if bad:
        raise ValueError(f"unknown metrics {bad}; choose from {list(METRICS)}")
    colors = {p: _COLORS[i % len(_COLORS)] for i, p in enumerate(PATHS)}
    most = max(len([r for r in g.rows if not r.unavailable]) for g in groups)
    fig = Figure(figsize=(3.6 * len(metrics) + 1.6, (0.32 * most + 0.9) * len(groups) + 0.6),
                 layout="constrained")
    axes = fig.subplots(len(groups), len(metrics), squeeze=False)
    for r, res in enumerate(groups):
        for c, metric in enumerate(metrics):
            _panel(axes[r][c], res, metric, colors, r == 0, c == 0)
    where = sorted({g.device for g in groups})
    fig.suptitle(f"fastpin.bench, delivered to {', '.join(where)}", fontsize=11)
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig
