"""Settings for the Elasticsearch log sink and the ``kvscope logs`` CLI (the only env reads of
kvscope.gateway.logs).

:class:`EsLogSettings` is a msgspec Struct in the gateway's config style, meant to sit in the gateway's
``logs`` config as ``elasticsearch:``; :meth:`EsLogSettings.sink_config` turns it into the sink's config.
:func:`cli_env` reads the conventional ``ELASTICSEARCH_*`` variables for CLI defaults.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import msgspec

from kvscope.gateway.logs.elasticsearch import ElasticsearchSinkConfig
from kvscope.gateway.logs.es_client import EsConnectionConfig
from kvscope.gateway.logs.es_setup import EsIndexConfig
from kvscope.gateway.logs.es_shipper import ShipperConfig
from kvscope.gateway.logs.spool import SpoolConfig, fsync_policy

_STRUCT = {"frozen": True, "forbid_unknown_fields": True, "kw_only": True}


class EsLogSettings(msgspec.Struct, **_STRUCT):
    """``logs.elasticsearch`` in the gateway config (YAML/TOML)."""

    hosts: tuple[str, ...] = ("http://localhost:9200",)
    api_key: str | None = None
    username: str | None = None
    password: str | None = None
    ca_certs: str | None = None
    verify_certs: bool = True
    compat_major: int = 8
    """8: works with Elasticsearch 8.x and 9.x; 9: 9.x only (see kvscope.gateway.logs.es_client)."""
    data_stream: str = "kvscope-requests"
    delete_after: str = "30d"
    setup_on_start: bool = True
    spool_dir: str = "~/.cache/kvscope/log-spool"
    spool_max_bytes: int = 1 << 30
    spool_fsync: str = "interval"
    queue_size: int = 10_000
    batch_size: int = 500
    flush_interval_s: float = 1.0

    def connection(self) -> EsConnectionConfig:
        basic = (self.username, self.password or "") if self.username else None
        return EsConnectionConfig(
            hosts=self.hosts,
            api_key=self.api_key,
            basic_auth=basic,
            ca_certs=self.ca_certs,
            verify_certs=self.verify_certs,
            compat_major=self.compat_major,
        )

    def sink_config(self) -> ElasticsearchSinkConfig:
        """The sink's config; raises ValueError for invalid values."""
        return ElasticsearchSinkConfig(
            spool=SpoolConfig(
                Path(self.spool_dir).expanduser(),
                max_bytes=self.spool_max_bytes,
                fsync=fsync_policy(self.spool_fsync),
            ),
            connection=self.connection(),
            index=EsIndexConfig(data_stream=self.data_stream, delete_after=self.delete_after),
            shipper=ShipperConfig(
                queue_size=self.queue_size, batch_size=self.batch_size, flush_interval_s=self.flush_interval_s
            ),
            setup_on_start=self.setup_on_start,
        )


@dataclass(frozen=True, slots=True)
class CliEnv:
    """Defaults for ``kvscope logs`` taken from the environment (flags win)."""

    source: str | None = None
    """``KVSCOPE_LOGS_SOURCE``, else ``KVSCOPE_GATEWAY_LOG_FILE`` (the gateway's JSONL file)."""
    es_url: str | None = None
    """``ELASTICSEARCH_URL`` (for ``setup-es``)."""
    api_key: str | None = None
    """``ELASTICSEARCH_API_KEY``."""
    username: str | None = None
    """``ELASTICSEARCH_USERNAME``."""
    password: str | None = None
    """``ELASTICSEARCH_PASSWORD``."""
    ca_certs: str | None = None
    """``ELASTICSEARCH_CA_CERTS``."""


def cli_env(env: Mapping[str, str]) -> CliEnv:
    return CliEnv(
        source=env.get("KVSCOPE_LOGS_SOURCE") or env.get("KVSCOPE_GATEWAY_LOG_FILE") or _serve_log(env),
        es_url=env.get("ELASTICSEARCH_URL"),
        api_key=env.get("ELASTICSEARCH_API_KEY"),
        username=env.get("ELASTICSEARCH_USERNAME"),
        password=env.get("ELASTICSEARCH_PASSWORD"),
        ca_certs=env.get("ELASTICSEARCH_CA_CERTS"),
    )


def _serve_log(env: Mapping[str, str]) -> str | None:
    """The request log ``kvscope serve`` writes (``$KVSCOPE_CACHE/logs/requests.jsonl``), if it exists."""
    from pathlib import Path

    root = Path(env.get("KVSCOPE_CACHE") or Path.home() / ".cache" / "kvscope").expanduser()
    path = root / "logs" / "requests.jsonl"
    return str(path) if path.exists() else None
