"""``kvscope logs``: offline analytics over the request log (an import-linter contract keeps the request path
from importing it).

- cli.py: the ``setup-es|report|search|plot`` commands (argparse, exit codes).
- commands.py: a :class:`~kvscope.gateway.analytics.commands.LogSource` (JSONL file/dir or Elasticsearch URL)
and the
  report/search/plot commands over it.
- report.py: the report's rows and definitions (percentiles, error rates), shared by both back ends.
- duckdb_logs.py: JSONL files through DuckDB; es_logs.py: the same through Elasticsearch aggregations.
- render.py: table/JSON/CSV output; plot.py: PNG charts (matplotlib).

It reads what the sinks write (gateway/logs/): the record fields (gateway/logs/es_setup.py's mapping), the
JSONL reader's contract (gateway/logs/jsonl.py) and the Elasticsearch connection (gateway/logs/es_client.py).
"""
