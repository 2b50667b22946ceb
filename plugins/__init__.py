"""Plugin discovery: policies (`headrace.policies`) and model architectures (`headrace.models`)."""

from plugins.registry import (
    MODEL_GROUP,
    POLICY_GROUP,
    PluginError,
    UnknownPluginError,
    installed,
    load_model_class,
    load_plugin,
    load_policy,
    policy_names,
)

__all__ = [
    "MODEL_GROUP",
    "POLICY_GROUP",
    "PluginError",
    "UnknownPluginError",
    "installed",
    "load_model_class",
    "load_plugin",
    "load_policy",
    "policy_names",
]
