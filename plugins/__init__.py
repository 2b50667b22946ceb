"""Plugin discovery: policies, routers, model architectures, speculative proposers, KV
connectors."""

from plugins.registry import (
    KV_CONNECTOR_GROUP,
    MODEL_GROUP,
    POLICY_GROUP,
    PROPOSER_GROUP,
    ROUTER_GROUP,
    PluginError,
    UnknownPluginError,
    installed,
    kv_connector_names,
    load_kv_connector,
    load_model_class,
    load_plugin,
    load_policy,
    load_proposer,
    load_router,
    policy_names,
    proposer_names,
    router_names,
)

__all__ = [
    "KV_CONNECTOR_GROUP",
    "MODEL_GROUP",
    "POLICY_GROUP",
    "PROPOSER_GROUP",
    "ROUTER_GROUP",
    "PluginError",
    "UnknownPluginError",
    "installed",
    "kv_connector_names",
    "load_kv_connector",
    "load_model_class",
    "load_plugin",
    "load_policy",
    "load_proposer",
    "load_router",
    "policy_names",
    "proposer_names",
    "router_names",
]
