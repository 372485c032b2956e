"""``python -m engine.server …`` (same flags as ``kvscope engine``)."""

import sys

from engine.server.cli import engine_main

sys.exit(engine_main())
