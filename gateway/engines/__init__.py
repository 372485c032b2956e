"""What each kind of upstream engine tells the gateway about itself and about each request: the kind
(kinds.py), per-request reports (reports.py), sampled state from its Prometheus endpoint (samples.py,
scraper.py) and the request log's engine section built from them (section.py)."""
