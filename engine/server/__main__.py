"""``python -m kvscope.engine.server …`` (same flags as ``kvscope engine``)."""

import sys

from kvscope.engine.server.cli import engine_main

sys.exit(engine_main())
