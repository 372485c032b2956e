"""bench/spec_decode.py's prompt builders and table (the benchmark itself is not a test)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("spec_decode_bench", ROOT / "bench" / "spec_decode.py")
bench = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("spec_decode_bench", bench)  # dataclasses look their module up while it executes
_spec.loader.exec_module(bench)


def test_code_prompt_renames_the_most_frequent_identifier(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text("import os\n\n\ndef f(count):\n    total = count + 1\n    return total * count\n")
    [message] = bench.code_prompt(source, lines=3)
    assert message["content"] == (
        "Rewrite this code with the variable `count` renamed to `count_2`. Change nothing "
        "else and output only the code.\n\n```python\ndef f(count):\n    total = count + 1"
        "\n    return total * count\n```"
    )


def test_list_prompt_and_the_shipped_metric_names() -> None:
    [message] = bench.list_prompt(["a", "b", "c"], 1)
    assert message["content"].endswith(
        "replace item 2 with `banana`. Output only the list.\n\n1. a\n2. b\n3. c"
    )
    names = bench.metric_names(ROOT / bench.LIST_SOURCE)
    assert names[:2] == ["kvscope_engine_requests_running", "kvscope_engine_requests_waiting"]
    assert all((ROOT / f).is_file() for f in bench.CODE_FILES)


def test_table_compares_on_with_off() -> None:
    off = bench.Run("code", 1, False, 100, 10.0, 0, 0, 0, ((1, 2),), 10.5)
    on = bench.Run("code", 1, True, 100, 4.0, 20, 80, 60, ((1, 2),), 28.0)
    assert bench.table({("code", 1, False): off, ("code", 1, True): on}).splitlines()[2] == (
        "| code | 1 | 10.0 | 25.0 | 2.50× | 10.5 → 28.0 | 2.67× | 75% | 4.00 | 20 | yes |"
    )
