"""Rich tables for a Plan (``kvscope plan`` without ``--format json``)."""

from __future__ import annotations

from typing import IO, Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from kvscope.common.tables import Column, print_table
from kvscope.plan.devices import load_devices
from kvscope.plan.planner import Plan


def size(n: float | None) -> str:
    """``1.50 GiB`` style, binary units."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.2f} {unit}"
        n /= 1024
    return str(n)


def _kv_table(title: str, rows: list[tuple[str, Any]]) -> Table:
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column("what", style="bold")
    table.add_column("value")
    for key, value in rows:
        table.add_row(key, str(value))
    return table


def _model(p: Plan) -> Table:
    m = p.model
    return _kv_table(
        f"Model {m['name']} ({m['source']})",
        [
            ("layers × hidden", f"{m['num_layers']} × {m['hidden_size']}"),
            (
                "attention",
                f"{m['attention']}: {m['num_heads']} heads, {m['num_kv_heads']} KV heads, "
                f"head_dim {m['head_dim']}",
            ),
            ("vocab / tied embeddings", f"{m['vocab_size']} / {m['tie_word_embeddings']}"),
            ("parameters", f"{m['parameters']:,}"),
        ],
    )


def _weights(p: Plan) -> Table:
    w, disk = p.weights, p.weights["on_disk"]
    named = f"engine format {w['weights_format']}, " if w["weights_format"] else ""
    rows = [(f"weights ({named}{w['dtype']}, quantization {w['quantization']})", size(w["bytes"]))]
    rows += [(f"  as {fmt}", size(b)) for fmt, b in w["by_format"].items()]
    rows += [
        (f"  kvscope engine in format {fmt} (plan --weights-format {fmt})", size(b))
        for fmt, b in w["engine_by_format"].items()
    ]
    if disk["safetensors"]:
        rows.append(("on disk: safetensors", size(disk["safetensors"]["file_bytes"])))
    gguf = disk["gguf"]
    if gguf and "tensor_bytes" in gguf:
        rows.append(
            ("on disk: gguf tensors / file", f"{size(gguf['tensor_bytes'])} / {size(gguf['file_bytes'])}")
        )
    elif gguf:
        rows.append(("on disk: gguf file", size(gguf["file_bytes"])))
    return _kv_table("Weights", rows)


def _kv(p: Plan) -> Table:
    kv, mem = p.kv_cache, p.memory
    return _kv_table(
        "KV cache",
        [
            ("per token", f"{kv['bytes_per_token']:,} B  ({kv['formula']})"),
            (f"per block ({kv['block_size']} tokens)", f"{kv['bytes_per_block']:,} B"),
            (f"per sequence at {kv['max_model_len']} tokens", size(kv["bytes_per_sequence"])),
            ("KV budget", f"{size(mem['kv_budget_bytes'])} = {mem['num_blocks']:,} blocks"),
            (f"max concurrent sequences at {kv['max_model_len']}", mem["max_concurrent_sequences"]),
            (
                f"… at the workload's {mem['workload_tokens']} tokens",
                mem["max_concurrent_sequences_at_workload"],
            ),
        ],
    )


def _decode(p: Plan) -> Table:
    s = p.speed
    table = Table(
        title=f"Decode envelope (context {s['decode_context_tokens']} tokens, {s['compute_format']}, "
        f"{s['bandwidth_bytes_per_s'] / 1e9:,.1f} GB/s, {s['peak_flops'] / 1e12:,.2f} TFLOP/s)",
        title_justify="left",
    )
    for col in ("concurrency", "step ≥ ms", "memory ms", "compute ms", "bound", "output tok/s ≤"):
        table.add_column(col, justify="right")
    for r in s["decode"]:
        table.add_row(
            str(r["concurrency"]),
            f"{r['step_ms']:.2f}",
            f"{r['memory_ms']:.2f}",
            f"{r['compute_ms']:.2f}",
            r["bound"],
            f"{r['output_tokens_per_s']:,.0f}",
        )
    return table


def _ttft(p: Plan) -> Table:
    table = Table(title="TTFT envelope (one prompt, idle device)", title_justify="left")
    for col in ("prompt tokens", "TTFT ≥ ms", "memory ms", "compute ms", "bound"):
        table.add_column(col, justify="right")
    for r in p.speed["ttft"]:
        table.add_row(
            str(r["prompt_tokens"]),
            f"{r['ttft_ms']:.2f}",
            f"{r['memory_ms']:.2f}",
            f"{r['compute_ms']:.2f}",
            r["bound"],
        )
    return table


def _log(p: Plan) -> Table:
    g = p.log or {}
    slo = g["ttft_slo"]
    return _kv_table(
        f"Log replay ({g['source']}: {g['requests']} requests, {g['minutes']} minutes)",
        [
            ("prompt tokens p50 / p99 / max", _triple(g["prompt_tokens"], "p50", "p99", "max")),
            ("output tokens p50 / p99 / max", _triple(g["output_tokens"], "p50", "p99", "max")),
            ("peak concurrency", f"{g['peak_concurrency']} at {g['peak_concurrency_at']}"),
            ("peak KV", f"{size(g['peak_kv_bytes'])} ({g['peak_kv_blocks']} blocks)"),
            (
                "KV of the p50 / p99 / max minute",
                " / ".join(size(g["minute_kv_bytes"][k]) for k in ("p50", "p99", "max")),
            ),
            (
                "would have queued",
                f"{g['would_queue']} ({g['queued_arrivals']} arrivals, "
                f"{g['seconds_over_capacity']:.1f} s over capacity)",
            ),
            (
                f"TTFT SLO {slo['ttft_slo_s']} s",
                f"observed: {_breaks(slo['observed_breaks_at_concurrency'])}; bound (p99 prompt "
                f"{slo['bound_prompt_tokens']}): {_breaks(slo['bound_breaks_at_concurrency'])}",
            ),
        ],
    )


def _breaks(concurrency: int | None) -> str:
    """A concurrency at which the SLO breaks, or the words for "never in the range looked at"."""
    return "never breaks" if concurrency is None else f"breaks at concurrency {concurrency}"


def _triple(d: dict[str, Any], *keys: str) -> str:
    return " / ".join("-" if d[k] is None else f"{d[k]:g}" for k in keys)


def print_plan(p: Plan, console: Console | None = None) -> None:
    """Print every section of ``p`` as tables, then the recommended engine command."""
    console = console or Console()
    for table in (_model(p), _weights(p), _kv(p), _decode(p), _ttft(p)):
        console.print(table)
    slo = p.speed["ttft_slo"]
    if p.fits:
        console.print(
            f"TTFT SLO {slo['ttft_slo_s']} s at {slo['prompt_tokens']}-token prompts: "
            f"{_breaks(slo['breaks_at_concurrency'])} ({slo['note']})"
        )
    else:  # "never breaks (met up to max_num_seqs=1)" read as a promise for a model that cannot load
        console.print(
            f"TTFT SLO {slo['ttft_slo_s']} s: not judged, the model does not fit (the verdict below)"
        )
    if p.log is not None:
        console.print(_log(p))
    for warning in p.warnings:
        console.print(Text.assemble(("warning: ", "yellow"), warning))
    for flag, why in p.assumed.items():
        value = p.flags["engine"].get(flag, p.request.get(flag.removeprefix("--").replace("-", "_")))
        console.print(Text.assemble(("assumed: ", "bold"), f"{flag} {value}: {why}"), soft_wrap=True)
    verdict = p.verdict
    console.print(Text.assemble(("verdict: ", "bold"), verdict["text"]), soft_wrap=True)
    if p.flags["command"]:
        console.print(Text.assemble(("recommended: ", "bold"), p.flags["command"]), soft_wrap=True)
    elif p.flags["note"] and p.fits:
        console.print(Text.assemble(("no recommended command: ", "bold"), p.flags["note"]))
    for alt in verdict.get("alternatives", []):
        line = Text.assemble(("would fit with ", "bold"), f"{alt['change']}: {alt['verdict']}")
        console.print(line, soft_wrap=True)
        if alt["command"]:
            console.print(Text(f"  {alt['command']}"), soft_wrap=True)
        if alt["note"]:
            console.print(Text(f"  ({alt['note']})"))
    if not p.fits and not verdict.get("alternatives"):
        console.print(Text("nothing tried fits: a smaller model, or a shorter --max-model-len/--concurrency"))


DEVICE_COLUMNS = (
    Column("name"),
    Column("memory", 1, "right"),
    Column("GB/s", 2, "right"),
    Column("bf16\nTFLOP/s", 3, "right"),
    Column("fp8\nTFLOP/s", 4, "right"),
    Column("int8\nTOP/s", 4, "right"),
    Column("aliases", 5),
    Column("vendor", 6),
    Column("source", 9),
)
"""``kvscope plan --list-devices``: the name (what ``--device`` takes) always; the source goes first, then the
vendor and the aliases (kvscope.common.tables priorities)."""


def device_rows() -> list[list[str]]:
    """One row of :data:`DEVICE_COLUMNS` per device of the shipped table (memory in GiB as the planner reads
    the vendor's GB, bandwidth in GB/s, dense peaks in 10^12 operations/s, ``-`` where the datasheet has
    none)."""
    rows = []
    for d in load_devices().values():
        peaks = [f"{d.peak_flops[k] / 1e12:g}" if k in d.peak_flops else "-" for k in ("bf16", "fp8", "int8")]
        rows.append(
            [
                d.name,
                f"{d.memory_bytes / (1 << 30):g} GiB",
                f"{d.bandwidth / 1e9:g}",
                *peaks,
                ", ".join(d.aliases),
                d.vendor,
                d.source,
            ]
        )
    return rows


def print_devices(out: IO[str], width: int | None) -> None:
    """The shipped device table fitted to ``width`` terminal cells (None: every column, sources included):
    one line per device."""
    print_table(
        out,
        "kvscope plan devices (dense peaks; cpu is measured)",
        DEVICE_COLUMNS,
        device_rows(),
        width,
        more="--wide or --format json",
    )


def devices_json() -> dict[str, Any]:
    """The device table as JSON-ready dicts (bytes, bytes/s, operations/s)."""
    return {
        d.name: {
            "aliases": list(d.aliases),
            "vendor": d.vendor,
            "memory_bytes": d.memory_bytes,
            "bandwidth_bytes_per_s": d.bandwidth,
            "peak_flops": dict(d.peak_flops),
            "source": d.source,
        }
        for d in load_devices().values()
    }
