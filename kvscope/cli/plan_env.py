"""Environment defaults of ``kvscope plan``; the only module of kvscope.plan that reads the environment."""

from __future__ import annotations

import os

from kvscope.gateway.logs.es_settings import CliEnv, cli_env


def es_env() -> CliEnv:
    """Elasticsearch credentials for ``--from-log URL`` from ``ELASTICSEARCH_*`` (as ``kvscope logs``), at
    call time."""
    return cli_env(os.environ)
