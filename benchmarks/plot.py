"""Grouped bar charts for the benchmarks' PNGs."""

from __future__ import annotations

import math
from pathlib import Path


def grouped_bars(path: Path, rows: list[dict], series: list[str], series_key: str, groups: list, group_of,
                 group_labels: list[str], ylabel: str, title: str, figsize: tuple[float, float]) -> None:
    """One bar per series in each group: the time_ms of the row whose series_key is the series and group_of(row)
    the group (a gap where there is none)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=figsize)
    width = 0.8 / len(series)
    for i, name in enumerate(series):
        ys = [next((r["time_ms"] for r in rows if r[series_key] == name and group_of(r) == g), math.nan)
              for g in groups]
        ax.bar([j + i * width for j in range(len(groups))], ys, width, label=name)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(groups))], group_labels)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
