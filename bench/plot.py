"""Charts for the benchmarks: each script prints its table and, given --plot, draws the same numbers
into a PNG beside it (matplotlib, no display needed).

    line(path, title, xlabel, ylabel, {label: (xs, ys)}, logx=False, logy=False)
    bars(path, title, ylabel, {label: value}, logy=False)

matplotlib is only needed where a chart is asked for: `pip install matplotlib`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence


def _pyplot():  # type: ignore[no-untyped-def]
    try:
        import matplotlib
    except ImportError as e:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _finish(plt, fig, ax, path: Path, title: str, note: str) -> None:  # type: ignore[no-untyped-def]
    ax.set_title(title, fontsize=11)
    ax.grid(True, which="major", alpha=0.3)
    if note:
        fig.text(0.01, 0.01, note, fontsize=7, color="#555555")
    fig.tight_layout(rect=(0, 0.04 if note else 0, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"chart: {path}")


def line(path: Path, title: str, xlabel: str, ylabel: str,
         series: Mapping[str, tuple[Sequence[float], Sequence[float]]], *,
         logx: bool = False, logy: bool = False, note: str = "") -> None:
    """One line with markers per series; note: a small line of text under the chart (the machine,
    the date)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for label, (xs, ys) in series.items():
        ax.plot(list(xs), list(ys), marker="o", markersize=4, label=label)
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if len(series) > 1:
        ax.legend(fontsize=8)
    _finish(plt, fig, ax, path, title, note)


def bars(path: Path, title: str, ylabel: str, values: Mapping[str, float], *,
         logy: bool = False, note: str = "") -> None:
    """One bar per value, its number written above it."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    labels = list(values)
    heights = [values[k] for k in labels]
    rects = ax.bar(labels, heights, color="#4c72b0")
    for r, h in zip(rects, heights):
        ax.annotate(f"{h:,.1f}", (r.get_x() + r.get_width() / 2, h), ha="center", va="bottom",
                    fontsize=8)
    if logy:
        ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    _finish(plt, fig, ax, path, title, note)


def machine_note() -> str:
    """'CPU model, N CPUs, date' for a chart's footnote."""
    import datetime
    import os
    cpu = "unknown CPU"
    try:
        for ln in open("/proc/cpuinfo"):
            if ln.startswith("model name"):
                cpu = ln.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} CPUs, {datetime.date.today().isoformat()}"
