"""The built-in console: the live picture of the stack in a browser at ``/console``, served by the gateway
itself, with nothing else to install and no network beyond the gateway (docs/console.md).

- routes.py: the pages, static files and JSON API; the console's state and lifespan.
- series.py: the bounded rings of ticks and chart points (the last hour at 2 s), Prometheus'
  ``histogram_quantile``.
- sampler.py: one tick every 2 s from the gateway's Prometheus registry, the replicas' engine samples and
  the request-log records.
- records.py: the newest request-log records (a log sink), the request list's rows and filters, a request's
  waterfall.
- alerts.py: the shipped alert rules (kvscope.rules.yaml = alerts/kvscope.rules.yaml) evaluated in-process.
- access.py: open without API keys; admin keys only with them (login form → HttpOnly session cookie).
- static/: index.html, console.js, console.css and the vendored uPlot (static/vendor/).

It runs in the gateway, so the contract that keeps the offline log analytics off the request path covers it
(pyproject.toml): the request page's explanation comes from gateway/logs/why.py, never gateway/analytics/.
"""
