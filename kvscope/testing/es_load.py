"""Request-log records into an Elasticsearch (the double or a real cluster) the way the gateway ships them:
its resources (kvscope.gateway.logs.es_setup), its bulk ``create`` (kvscope.gateway.logs.es_shipper), then a
refresh so that a search sees every record; and the removal of everything that put there."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from elasticsearch import AsyncElasticsearch, NotFoundError

from kvscope.gateway.logs.es_setup import EsIndexConfig, ensure_setup
from kvscope.gateway.logs.es_shipper import ShipperConfig, ship_batch


async def load_records(
    client: AsyncElasticsearch, index: EsIndexConfig, records: Sequence[dict[str, Any]]
) -> None:
    """Set up ``index`` and ship ``records`` to its data stream (created empty without records), then
    refresh it. Raises AssertionError
    when a record is refused (every test record must fit the mapping) or the cluster cannot be reached."""
    await ensure_setup(client, index)
    if not records:  # a data stream comes with its first write: make an empty one
        await client.indices.create_data_stream(name=index.data_stream)
    result = await ship_batch(client, index.data_stream, records, ShipperConfig(batch_size=500))
    assert result.error is None and not result.rejected and not result.retry, (
        result.error,
        result.rejected[:3],
    )
    await client.indices.refresh(index=index.data_stream)


async def remove_setup(client: AsyncElasticsearch, index: EsIndexConfig) -> None:
    """Delete the data stream, its index template, component templates and ILM policy (those missing are
    skipped)."""
    calls = (
        lambda: client.indices.delete_data_stream(name=index.data_stream),
        lambda: client.indices.delete_index_template(name=index.data_stream),
        lambda: client.cluster.delete_component_template(name=index.settings_template),
        lambda: client.cluster.delete_component_template(name=index.mappings_template),
        lambda: client.ilm.delete_lifecycle(name=index.ilm_policy),
    )
    for call in calls:
        try:
            await call()
        except NotFoundError:
            pass
