"""KV connectors, torch-free half: the scheduler side, block stores, the block format.

The runner side (copies between the paged cache and these stores) is in runner/kv_connectors/.
"""

from kvcache.connectors.base import (
    KV_CONNECTOR_API_VERSION,
    KVConnectorMeta,
    KVConnectorScheduler,
    KVLayout,
    LoadSpec,
    SaveSpec,
)
from kvcache.connectors.disk_store import DiskStore
from kvcache.connectors.lookups import PeerLookup, StoreLookup
from kvcache.connectors.peer_store import PeerStore, PeerStores
from kvcache.connectors.peer_wire import PeerServer
from kvcache.connectors.stores import BlockStore, MemoryStore

__all__ = [
    "KV_CONNECTOR_API_VERSION",
    "BlockStore",
    "DiskStore",
    "KVConnectorMeta",
    "KVConnectorScheduler",
    "KVLayout",
    "LoadSpec",
    "MemoryStore",
    "PeerLookup",
    "PeerServer",
    "PeerStore",
    "PeerStores",
    "SaveSpec",
    "StoreLookup",
]
