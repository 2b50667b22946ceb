"""KV connectors, runner half: copies between the paged cache and a connector's store.

Connectors are plugins (entry point group `headrace.kv_connectors`, plugin API version
`kvcache.connectors.KV_CONNECTOR_API_VERSION`); the built-in `disk` and `peer` register
the same way (runner/kv_connectors/builtin.py).
"""

from kvcache.connectors import KV_CONNECTOR_API_VERSION, KVConnectorScheduler
from runner.kv_connectors.base import KVConnector, KVConnectorContext, KVConnectorWorker
from runner.kv_connectors.layout import model_layout, weights_fingerprint
from runner.kv_connectors.worker import StoreWorker

__all__ = [
    "KV_CONNECTOR_API_VERSION",
    "KVConnector",
    "KVConnectorContext",
    "KVConnectorScheduler",
    "KVConnectorWorker",
    "StoreWorker",
    "model_layout",
    "weights_fingerprint",
]
