"""``python -m kvscope.cli``: the ``kvscope`` command (the supervisor starts engine and gateway this way)."""

from kvscope.cli.main import main

raise SystemExit(main())
