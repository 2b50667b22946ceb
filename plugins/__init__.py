"""Plugin discovery: policies, model architectures and speculative proposers."""

from plugins.registry import (
    MODEL_GROUP,
    POLICY_GROUP,
    PROPOSER_GROUP,
    PluginError,
    UnknownPluginError,
    installed,
    load_model_class,
    load_plugin,
    load_policy,
    load_proposer,
    policy_names,
    proposer_names,
)

__all__ = [
    "MODEL_GROUP",
    "POLICY_GROUP",
    "PROPOSER_GROUP",
    "PluginError",
    "UnknownPluginError",
    "installed",
    "load_model_class",
    "load_plugin",
    "load_policy",
    "load_proposer",
    "policy_names",
    "proposer_names",
]
