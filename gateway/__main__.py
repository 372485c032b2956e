"""``python -m kvscope.gateway …`` runs the gateway (same flags as ``kvscope gateway``)."""

import sys

from kvscope.gateway.cli import gateway_main

raise SystemExit(gateway_main(sys.argv[1:]))
