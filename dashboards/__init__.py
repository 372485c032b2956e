"""Grafana dashboards of kvscope, generated from the metric catalog (``python -m
kvscope.dashboards.generate``).

``catalog`` discovers the metrics the code defines, ``promql``/``grafana`` build queries and panels,
``overview``/``engine_detail`` list the panels, ``generate`` writes ``dashboards/json/*.json`` and
docs/metrics.md (``--check`` fails when they are stale), ``query``/``render`` evaluate the panels against a
Prometheus and draw them with matplotlib.
"""
