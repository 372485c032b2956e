"""``kvscope logs plot``: PNG charts (matplotlib, Agg backend, no display needed).

- ``latency_percentiles.png``: TTFT and end-to-end p50/p95/p99 per time bucket (two panels);
- ``ttft_histogram.png``: TTFT distribution over [min, p99.5] (the last bin holds everything above).
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Any

from kvscope.gateway.analytics.report import PERCENTS

NICE_BUCKETS_S = (1, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 21600, 43200, 86400)


def auto_bucket_s(start: datetime | None, end: datetime | None, target_points: int = 60) -> int:
    """The smallest "nice" bucket (1 s … 1 d) that gives at most ``target_points`` buckets over the range."""
    if start is None or end is None:
        return 60
    span = (end - start).total_seconds()
    return next((b for b in NICE_BUCKETS_S if span / b <= target_points), NICE_BUCKETS_S[-1])


def parse_bucket(text: str) -> int:
    """``30s``/``5m``/``1h`` → seconds. Raises ValueError."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    if len(text) < 2 or text[-1] not in units or not text[:-1].isdigit() or int(text[:-1]) < 1:
        raise ValueError(f"--bucket {text!r}: use e.g. 30s, 5m, 1h")
    return int(text[:-1]) * units[text[-1]]


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_latency(series: list[dict[str, Any]], path: Path, title: str) -> Path:
    """Two panels (TTFT, e2e) with one line per percentile. ``series`` rows: ``t``, ``ttft``, ``e2e``."""
    plt = _pyplot()
    import matplotlib.dates as mdates

    fig, axes = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
    times = [row["t"] for row in series]
    for ax, name, label in ((axes[0], "ttft", "time to first token (s)"), (axes[1], "e2e", "end-to-end (s)")):
        for i, p in enumerate(PERCENTS):
            ax.plot(times, [row[name][i] if row[name] else None for row in series], marker=".", label=f"p{p}")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        ax.legend(loc="upper left")
    axes[0].set_title(title)
    locator = mdates.AutoDateLocator()
    axes[1].xaxis.set_major_locator(locator)
    axes[1].xaxis.set_major_formatter(mdates.ConciseDateFormatter(locator))
    axes[1].set_xlabel("time (UTC)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_histogram(edges: list[float], counts: list[int], path: Path, title: str) -> Path:
    """TTFT histogram from bin ``edges`` (len n+1) and ``counts`` (len n)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(11, 5))
    if counts:
        ax.stairs(counts, edges, fill=True, alpha=0.7)
    ax.set_xlabel("time to first token (s)")
    ax.set_ylabel("requests")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
