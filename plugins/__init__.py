"""Plugin discovery: policies, routers, model architectures and speculative proposers."""

from plugins.registry import (
    MODEL_GROUP,
    POLICY_GROUP,
    PROPOSER_GROUP,
    ROUTER_GROUP,
    PluginError,
    UnknownPluginError,
    installed,
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
    "MODEL_GROUP",
    "POLICY_GROUP",
    "PROPOSER_GROUP",
    "ROUTER_GROUP",
    "PluginError",
    "UnknownPluginError",
    "installed",
    "load_model_class",
    "load_plugin",
    "load_policy",
    "load_proposer",
    "load_router",
    "policy_names",
    "proposer_names",
    "router_names",
]
