"""Print the markdown results table of docs/benchmarks.md from a bench/peers.sh results folder.

Reads ``serve-c*.json`` (``kvscope bench --compare`` results: per-endpoint medians over rounds) and
``transformers.json`` (bench/transformers_row.py). One row per system and concurrency: output tok/s,
TTFT p50/p99, TPOT p50/p99 (ms), and the requests that failed or had another output length than requested.
Then the paired ratios: per concurrency, each system against the first (the kvscope engine), the median over
rounds of its round's figure ÷ the engine's in the same round, with the lowest and highest round in brackets
(the spread a reader needs to judge a ratio near a target, e.g. the gateway's "within 5 %").
Last, from ``idle-ttft.json`` where the run measured it (``kvscope bench --offline --step-bench
--save-result``), the offline engine's idle TTFT of one prompt.

    python bench/peers_table.py /work/peers-build/results/<timestamp>
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

HEADER = (
    "| system | concurrency | output tok/s | TTFT p50 (ms) | TTFT p99 (ms) | TPOT p50 (ms) | TPOT p99 (ms) "
    "| failed / length mismatches |"
)


def serve_rows(data: dict) -> list[tuple[str, int, list[str]]]:
    """Rows of one parsed ``serve-c<C>.json``: (label, concurrency, cells)."""
    concurrency = data["runs"][0][0]["load"]["max_concurrency"]
    figures = data["figures"]
    rows = []
    for e, label in enumerate(data["labels"]):
        runs = [row[e] for row in data["runs"]]
        failed = sum(run["failed"] for run in runs)
        mismatched = sum(run["output_len_mismatches"] for run in runs)
        cells = [
            f"{figures['output_throughput'][e]:.1f}",
            f"{figures['median_ttft_ms'][e]:.0f}",
            f"{figures['p99_ttft_ms'][e]:.0f}",
            f"{figures['median_tpot_ms'][e]:.1f}",
            f"{figures['p99_tpot_ms'][e]:.1f}",
            f"{failed} / {mismatched}",
        ]
        rows.append((label, concurrency, cells))
    return rows


RATIO_HEADER = "| concurrency | system ÷ {base} | output tok/s | TTFT p99 | TPOT p50 | rounds |"
RATIO_FIGURES = ("output_throughput", "p99_ttft_ms", "median_tpot_ms")


def ratio_rows(data: dict) -> tuple[str, list[str]]:
    """(the first endpoint's label, one table row per other endpoint) of one parsed ``serve-c<C>.json``: per
    figure of :data:`RATIO_FIGURES`, ``median [min–max]`` over rounds of X_r / A_r (a round where A_r is 0 has
    no ratio and is left out; ``n/a`` when no round has one)."""
    concurrency = data["runs"][0][0]["load"]["max_concurrency"]
    rows = []
    for e, label in enumerate(data["labels"][1:], start=1):
        cells = []
        for name in RATIO_FIGURES:
            ratios = [row[e][name] / row[0][name] for row in data["runs"] if row[0][name]]
            cells.append(
                f"{statistics.median(ratios):.3f} [{min(ratios):.2f}–{max(ratios):.2f}]" if ratios else "n/a"
            )
        rows.append(f"| {concurrency} | {label} | " + " | ".join(cells) + f" | {len(data['runs'])} |")
    return data["labels"][0], rows


def transformers_rows(path: Path) -> list[tuple[str, int, list[str]]]:
    """Rows of ``transformers.json``; a static batch has one TTFT and one TPOT, so p50 = p99."""
    rows = []
    for row in json.loads(path.read_text()):
        cells = [
            f"{row['output_throughput']:.1f}",
            f"{row['ttft_ms']:.0f}",
            f"{row['ttft_ms']:.0f}",
            f"{row['tpot_ms']:.1f}",
            f"{row['tpot_ms']:.1f}",
            "n/a",
        ]
        rows.append((row["system"], row["concurrency"], cells))
    return rows


def idle_ttft_line(path: Path) -> str:
    """One line from a saved ``kvscope bench --offline --step-bench`` result (``[steps, ttft]``): the idle
    TTFT's median and min in ms, the prompt's length, the runs, the threads and the weights format."""
    _, ttft = json.loads(path.read_text())
    idle = ttft["idle_ttft"]
    return (
        f"Idle TTFT (offline engine, one {idle['input_len']}-token prompt, {idle['runs']} runs, "
        f"{ttft['num_threads']} threads, {ttft['dtype']}/{ttft['quantization']}): median "
        f"{idle['median_ms']:.1f} ms, min {idle['min_ms']:.1f} ms"
    )


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    folder = Path(argv[0])
    serve_files = sorted(folder.glob("serve-c*.json"), key=lambda p: int(p.stem.removeprefix("serve-c")))
    serves = [json.loads(path.read_text()) for path in serve_files]
    rows = [r for data in serves for r in serve_rows(data)]
    if (folder / "transformers.json").is_file():
        rows += transformers_rows(folder / "transformers.json")
    order = list(dict.fromkeys(label for label, _, _ in rows))
    rows.sort(key=lambda r: (order.index(r[0]), r[1]))
    print(HEADER)
    print("|" + "---|" * 2 + "---:|" * 6)
    for label, concurrency, cells in rows:
        print(f"| {label} | {concurrency} | " + " | ".join(cells) + " |")
    ratio_tables = [ratio_rows(data) for data in serves]
    if ratio_tables:
        base = ratio_tables[0][0]
        print(f"\nPaired ratios: median [lowest–highest] over rounds of each round's figure ÷ {base}'s")
        print(RATIO_HEADER.format(base=base))
        print("|---|---|---:|---:|---:|---:|")
        for _, lines in ratio_tables:
            print("\n".join(lines))
    if (folder / "idle-ttft.json").is_file():
        print("\n" + idle_ttft_line(folder / "idle-ttft.json"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
