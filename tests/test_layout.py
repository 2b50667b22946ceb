"""The rooms of the code base import one way only (ARCHITECTURE.md, "Layout").

```
daemon.service -> daemon.openai -> daemon.engine -> scheduling, runner, grammars, kvcache, plugins
```
The API layer sees an engine only through its seam (daemon/engine/client.py and the plain
outputs), so a replica in another process can stand behind it. Read from the source (ast),
so a lazy import inside a function counts too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OURS = ("daemon", "scheduling", "kvcache", "runner", "grammars", "plugins")
# room -> the rooms (module prefixes) it may import; anything not ours is free.
ALLOWED = {
    "kvcache": {"kvcache"},
    "grammars": {"grammars"},
    "scheduling": {"scheduling", "kvcache"},
    "runner": {"runner", "kvcache", "scheduling", "grammars"},
    "plugins": {"plugins", "scheduling", "runner"},
    "daemon.engine": {"daemon.engine", "scheduling", "runner", "grammars", "kvcache", "plugins"},
    "daemon.openai": {
        "daemon.openai",
        "daemon.engine.client",
        "daemon.engine.outputs",
        "scheduling",
        "grammars",
        "plugins",
    },
    # Replicas: N engines behind one EngineClient (never imported by the API layer).
    "daemon.replicas": {"daemon.replicas", "daemon.engine", "scheduling", "kvcache", "plugins"},
    "daemon.service": {"daemon", "scheduling", "runner", "grammars", "kvcache", "plugins"},
    # The load generator tokenizes its workloads the way the server will.
    "daemon.bench": {"daemon.bench", "runner.model_source", "runner.tokenizer"},
}


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            # `from daemon.openai import validation` imports daemon.openai.validation.
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _room(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "daemon" else parts[0]


def _is_module(name: str) -> bool:
    base = ROOT.joinpath(*name.split("."))
    return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


def _modules() -> list[tuple[str, Path]]:
    out = []
    for top in OURS:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            if "examples" in rel.parts:
                continue  # third-party example packages stand outside the rooms
            out.append((".".join(rel.parts).removesuffix(".__init__"), path))
    return out


def _violations(modules: list[tuple[str, Path]]) -> list[str]:
    bad = []
    for module, path in modules:
        room = _room(module)
        if room == "daemon":
            continue  # daemon/__init__.py itself
        allowed = ALLOWED[room]
        for name in _imports(path):
            if name.split(".")[0] not in OURS or not _is_module(name):
                continue
            if not any(name == a or name.startswith(a + ".") for a in allowed):
                bad.append(f"{module} imports {name}")
    return bad


def test_every_room_imports_only_the_rooms_below_it() -> None:
    assert _violations(_modules()) == []


def test_the_check_sees_a_violation(tmp_path: Path) -> None:
    """The rule is live: an API module that reached into the engine would be caught."""
    probe = tmp_path / "probe.py"
    probe.write_text("from daemon.engine.async_engine import AsyncEngine\nimport orjson\n")
    found = _violations([("daemon.openai.probe", probe)])
    assert found == ["daemon.openai.probe imports daemon.engine.async_engine"]


@pytest.mark.parametrize("room", ["kvcache", "scheduling"])
def test_core_rooms_never_import_torch(room: str) -> None:
    offenders = [
        str(path.relative_to(ROOT))
        for path in (ROOT / room).rglob("*.py")
        if any(name.split(".")[0] == "torch" for name in _imports(path))
    ]
    assert offenders == []
