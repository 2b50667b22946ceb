"""`headrace serve` settings: flags > HEADRACE_* environment > TOML file > defaults."""

from __future__ import annotations

import argparse
import dataclasses
import os
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from daemon.engine.config import EngineConfig, opt

ENV_PREFIX = "HEADRACE_"


@dataclass(slots=True)
class ServerConfig:
    """The daemon around the engine: where it listens and how it stops."""

    host: str = opt("127.0.0.1", "TCP address to listen on ('' to disable TCP)")
    port: int = opt(8000, "TCP port (0: pick a free one and log it)")
    uds: str | None = opt(None, "also serve on this Unix socket path (mode 0660)")
    served_model_name: str | None = opt(None, "model name in the API (default: the file's)")
    drain_timeout: float = opt(
        30.0, "seconds to let in-flight requests finish after SIGTERM before aborting them"
    )
    overlap: bool | None = opt(
        None,
        "schedule step N+1 while step N runs (the batch queue); unset: on with CUDA, off on "
        "CPU, where the forward is itself Python on the GIL and an overlapped step only "
        "competes with it (benchmarks/serve_load.py --spawn measures both)",
    )
    log_level: str = opt("info", "debug, info, warning or error")
    log_prompts: bool = opt(False, "log prompt text (never logged otherwise)")
    api_key: str | None = opt(
        None,
        "require 'Authorization: Bearer KEY' on every route but /health (visible in ps: "
        "prefer HEADRACE_API_KEY or --api-key-file)",
    )
    api_key_file: str | None = opt(
        None,
        "read API keys from this file, one a line: KEY, or NAME KEY to name the tenant its "
        "requests belong to (unless they send `user` or X-Tenant)",
    )
    tenant_rate_limits: str | None = opt(
        None,
        "per-tenant token rates, TENANT=TOKENS_PER_S,... ('*' for every other tenant): a "
        "request's prompt + max_tokens beyond its tenant's bucket answers 429 + Retry-After",
    )
    tenant_metrics_top_k: int = opt(
        8, "tenants with their own label in /metrics (by recent traffic); the rest: other"
    )
    metrics_unix_only: bool = opt(False, "serve /metrics on the Unix socket only")
    max_request_bytes: int = opt(
        8 << 20, "request bodies above this many bytes answer 413 before they are read"
    )
    keepalive_timeout: float = opt(
        5.0,
        "close a connection that has not sent a complete request for this many seconds "
        "(idle keep-alive, nothing sent, or headers sent slowly)",
    )
    body_timeout: float = opt(
        30.0, "a generation request whose body has not all arrived within this answers 408"
    )
    max_connections: int = opt(
        4096,
        "open connections beyond this answer 503 (keep LimitNOFILE above it; 0: no cap)",
    )
    stream_timeout: float = opt(
        60.0, "end a stream whose client has taken no data for this many seconds"
    )
    data_parallel_size: int = opt(
        1,
        "engine replicas, each in its own process on cores // N threads (--threads sets "
        "them), behind this one front door; 1: the engine runs in this process",
    )
    prefill_replicas: int = opt(
        0,
        "prefill/decode disaggregation: this many replicas compute prompts (KV producers) "
        "and --decode-replicas decode them, each request's KV pulled from the producer that "
        "computed it (shared memory on one host); 0: off (--data-parallel-size then)",
    )
    decode_replicas: int = opt(
        0, "P/D: replicas that decode (KV consumers), beside --prefill-replicas producers"
    )
    pd_prefill_timeout: float = opt(
        300.0,
        "P/D: seconds a prompt may take on its producer replica before the consumer computes "
        "it itself (a producer that hangs without dying)",
    )
    router: str | None = opt(
        None,
        "how a request picks its replica: an entry point in headrace.routers (round_robin, "
        "least_load, cache_aware; default cache_aware when --data-parallel-size > 1)",
    )
    distributed_backend: str = opt(
        "local", "where replicas run: local (child processes) or ray (Ray actors on a cluster)"
    )
    ray_address: str | None = opt(
        None, "ray: the cluster to join (auto: the running one; unset: start a local one)"
    )
    profile_steps: str | None = opt(
        None,
        "append one JSON line per engine step to this file (tokens, schedule/forward/sample "
        "time, Python share); summarise with `headrace bench profile FILE`",
    )


@dataclass(slots=True)
class ServeConfig:
    """Everything `headrace serve` needs."""

    server: ServerConfig = field(default_factory=ServerConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)


def options() -> list[tuple[str, dataclasses.Field[Any], str]]:
    """(option name, field, section) for every field of both configs."""
    out = []
    for section, cls in (("server", ServerConfig), ("engine", EngineConfig)):
        for f in dataclasses.fields(cls):
            out.append((f.name, f, section))
    return out


def _converter(f: dataclasses.Field[Any]) -> Any:
    kind = str(f.type).replace(" | None", "")
    return {
        "int": int,
        "float": float,
        "bool": _parse_bool,
        "str": str,
        "tuple[str, ...]": _parse_strings,
    }[kind]


def _parse_strings(value: str | Sequence[str]) -> tuple[str, ...]:
    """A list option: repeated words on the command line, a TOML list, or one
    whitespace-separated string (the environment)."""
    if isinstance(value, str):
        return tuple(value.split())
    if not all(isinstance(v, str) for v in value):
        raise ValueError(f"expected a list of strings, got {value!r}")
    return tuple(value)


def _parse_bool(value: str | bool) -> bool:
    if isinstance(value, bool):
        return value
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {value!r}")


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        metavar="FILE",
        help=f"TOML file of these options (also {ENV_PREFIX}CONFIG); keys as option names "
        "with underscores",
    )
    for name, f, _ in options():
        flag = "--" + name.replace("_", "-")
        env = ENV_PREFIX + name.upper()
        default = f.default
        help_text = f"{f.metadata['help']} [env {env}; default {default}]"
        if str(f.type) in ("bool", "bool | None"):
            parser.add_argument(
                flag,
                action=argparse.BooleanOptionalAction,
                help=help_text,
                default=argparse.SUPPRESS,
            )
        elif str(f.type) == "tuple[str, ...]":
            parser.add_argument(flag, nargs="+", help=help_text, default=argparse.SUPPRESS)
        else:
            parser.add_argument(flag, type=_converter(f), help=help_text, default=argparse.SUPPRESS)


def build_serve_config(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> ServeConfig:
    """Layer the sources: defaults, then the TOML file, then the environment, then flags."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    config_file = getattr(args, "config", None) or environ.get(ENV_PREFIX + "CONFIG")
    if config_file:
        data = tomllib.loads(Path(config_file).read_text())
        flat = {**data.pop("server", {}), **data.pop("engine", {}), **data}
        for key, value in flat.items():
            values[key.replace("-", "_")] = (value, f"{config_file}: {key}")
    for name, _, _ in options():
        env = ENV_PREFIX + name.upper()
        if env in environ:
            values[name] = (environ[env], env)
    for name, _, _ in options():
        if hasattr(args, name):
            values[name] = (getattr(args, name), "--" + name.replace("_", "-"))
    known = {name: (f, section) for name, f, section in options()}
    sections: dict[str, dict[str, Any]] = {"server": {}, "engine": {}}
    for name, (value, source) in values.items():
        if name not in known:
            raise ValueError(f"{source}: unknown option {name!r}")
        f, section = known[name]
        try:
            sections[section][name] = (
                None
                if value in (None, "", "none") and "None" in str(f.type)
                else _converter(f)(value)
            )
        except (TypeError, ValueError) as e:
            raise ValueError(f"{source}: {e}") from None
    return ServeConfig(ServerConfig(**sections["server"]), EngineConfig(**sections["engine"]))


def parse_serve_args(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> ServeConfig:
    parser = argparse.ArgumentParser(prog="headrace serve")
    add_serve_arguments(parser)
    return build_serve_config(parser.parse_args(argv), environ)
