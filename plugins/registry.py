"""Entry-point discovery for policies, routers, model architectures, speculative proposers
and KV connectors.

Each kind is checked against the plugin API version it declares."""

from __future__ import annotations

from importlib.metadata import EntryPoint, entry_points
from typing import Any

from scheduling.policy import POLICY_API_VERSION, Policy
from scheduling.routing.router import ROUTER_API_VERSION, Router, RouterContext

POLICY_GROUP = "headrace.policies"
MODEL_GROUP = "headrace.models"
PROPOSER_GROUP = "headrace.proposers"
ROUTER_GROUP = "headrace.routers"
KV_CONNECTOR_GROUP = "headrace.kv_connectors"


class PluginError(RuntimeError):
    """A plugin was found but cannot be used (wrong API version, wrong shape)."""


class UnknownPluginError(PluginError, LookupError):
    """No installed plugin has the requested name; the message lists the installed ones."""


def installed(group: str) -> dict[str, EntryPoint]:
    """Entry points of `group`, by name. Read fresh each call: installs take effect at once."""
    return {ep.name: ep for ep in entry_points(group=group)}


def load_plugin(group: str, name: str, api_version: int, kind: str) -> Any:
    """Load the object behind entry point `name` of `group` and check its API version.

    The object must declare `api_version`; a plugin built for another version of the
    interface fails here, with both versions named, instead of deep inside a step.
    """
    found = installed(group)
    if name not in found:
        names = ", ".join(sorted(found)) or "(none)"
        raise UnknownPluginError(f"unknown {kind} {name!r}; installed: {names}")
    obj = found[name].load()
    declared = getattr(obj, "api_version", None)
    if declared != api_version:
        raise PluginError(
            f"{kind} {name!r} ({found[name].value}) declares plugin API version {declared!r}; "
            f"this headrace supports version {api_version}"
        )
    return obj


def load_model_class(architecture: str) -> type:
    """A third-party model class registered under its HF architecture name."""
    from runner.models.registry import BUILTIN_ARCHITECTURES, MODEL_API_VERSION

    if architecture not in installed(MODEL_GROUP):
        known = sorted({*BUILTIN_ARCHITECTURES, *installed(MODEL_GROUP)})
        raise UnknownPluginError(
            f"unsupported model architecture {architecture!r}; supported: {', '.join(known)}"
        )
    return load_plugin(MODEL_GROUP, architecture, MODEL_API_VERSION, "model architecture")


def policy_names() -> list[str]:
    return sorted(installed(POLICY_GROUP))


def load_policy(name: str, **options: Any) -> Policy:
    """Instantiate the policy registered as `name`, passing `options` to its constructor."""
    cls = load_plugin(POLICY_GROUP, name, POLICY_API_VERSION, "policy")
    policy = cls(**options)
    if not isinstance(policy, Policy):
        raise PluginError(f"policy {name!r} does not implement rank/admit/observe")
    return policy


def router_names() -> list[str]:
    return sorted(installed(ROUTER_GROUP))


def load_router(name: str, context: RouterContext | None = None) -> Router:
    """Instantiate the data-parallel router registered as `name`: `cls(context)`, the one
    way every router is built (the default context: one replica, the default KV layout)."""
    cls = load_plugin(ROUTER_GROUP, name, ROUTER_API_VERSION, "router")
    router = cls(context or RouterContext())
    if not isinstance(router, Router):
        raise PluginError(f"router {name!r} does not implement pick/on_kv_events/on_replica_reset")
    return router


def proposer_names() -> list[str]:
    return sorted(installed(PROPOSER_GROUP))


def load_proposer(name: str, config: Any) -> Any:
    """Instantiate the speculative proposer registered as `name` with the engine's config."""
    from runner.spec_decode.proposer import PROPOSER_API_VERSION, Proposer

    cls = load_plugin(PROPOSER_GROUP, name, PROPOSER_API_VERSION, "speculative proposer")
    proposer = cls(config)
    if not isinstance(proposer, Proposer):
        raise PluginError(f"speculative proposer {name!r} does not implement propose(requests)")
    return proposer


def kv_connector_names() -> list[str]:
    return sorted(installed(KV_CONNECTOR_GROUP))


def load_kv_connector(name: str, ctx: Any) -> Any:
    """Build the KV connector registered as `name` for an engine (`ctx`: KVConnectorContext)."""
    from runner.kv_connectors import (
        KV_CONNECTOR_API_VERSION,
        KVConnectorScheduler,
        KVConnectorWorker,
    )

    cls = load_plugin(KV_CONNECTOR_GROUP, name, KV_CONNECTOR_API_VERSION, "KV connector")
    connector = cls(ctx)
    if not isinstance(getattr(connector, "scheduler", None), KVConnectorScheduler) or not (
        isinstance(getattr(connector, "worker", None), KVConnectorWorker)
        and callable(getattr(connector, "close", None))
    ):
        raise PluginError(f"KV connector {name!r} lacks a scheduler side, a runner side or close()")
    return connector
