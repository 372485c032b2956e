"""Generate the Grafana dashboards and docs/metrics.md from the metric catalog.

    python -m kvscope.dashboards.generate           # write dashboards/json/*.json and docs/metrics.md python
    -m kvscope.dashboards.generate --check   # exit 1 if a committed file differs from what would be written

Exit status 2 when the catalog is incomplete (a metrics module is missing), since the output would differ.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

from kvscope.common import generated_files
from kvscope.dashboards import engine_detail, engine_variants, metrics_doc, overview
from kvscope.dashboards.catalog import Catalog, discover
from kvscope.dashboards.coverage import REPO, not_shown
from kvscope.dashboards.engine_names import VARIANT_KINDS, variant_uid
from kvscope.dashboards.grafana import Json
from kvscope.dashboards.promql import PromQL

JSON_DIR = REPO / "dashboards" / "json"
METRICS_DOC = REPO / "docs" / "metrics.md"
BUILDERS: dict[str, Callable[[PromQL], Json]] = {
    "kvscope-overview.json": overview.build,
    "kvscope-engine.json": engine_detail.build,
}
"""Output file name → dashboard builder (over our own series)."""


def build_dashboards(catalog: Catalog) -> dict[str, Json]:
    """File name → dashboard JSON, the engine dashboard's vLLM and SGLang variants included
    (``kvscope-engine-vllm.json``, engine_variants.py); raises KeyError/ValueError if a panel names an
    undefined metric/label."""
    q = PromQL(catalog)
    built = {name: build(q) for name, build in BUILDERS.items()}
    for kind in VARIANT_KINDS:
        built[f"{variant_uid(kind)}.json"] = engine_variants.build(catalog, kind)
    return built


def to_text(dashboard: Json) -> str:
    return json.dumps(dashboard, indent=2, ensure_ascii=False) + "\n"


def expected_files(catalog: Catalog) -> dict[Path, str]:
    """Every generated path → its content."""
    dashboards = build_dashboards(catalog)
    files = {JSON_DIR / name: to_text(d) for name, d in dashboards.items()}
    files[METRICS_DOC] = metrics_doc.render(catalog, list(dashboards.values()))
    return files


def stale_files(files: dict[Path, str]) -> list[Path]:
    """Paths whose content on disk differs from ``files`` (missing files included)."""
    return generated_files.stale_files(files)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="fail if the generated files are stale")
    args = parser.parse_args(argv)
    catalog = discover()
    files = expected_files(catalog)
    unshown = not_shown(build_dashboards(catalog).values(), catalog)
    if unshown:
        print("defined but on no dashboard: " + ", ".join(unshown), file=sys.stderr)
    return generated_files.write_or_check(
        files, stale_files(files), args.check, "python -m kvscope.dashboards.generate", REPO
    )


if __name__ == "__main__":
    sys.exit(main())
