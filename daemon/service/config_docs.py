"""docs/configuration.md from the options themselves: `python -m daemon.service.config_docs`.

The flags, their environment variables and defaults come from the same dataclass fields
that `headrace serve --help` prints, so the page cannot drift from the program
(tests/test_docs.py checks that every flag is on it).
"""

from __future__ import annotations

from daemon.service.serve_config import ENV_PREFIX, options

HEADER = """# Configuration: every `headrace serve` option

Every option is a flag, an environment variable `HEADRACE_<NAME>` and a key of an optional
TOML file (`--config` FILE, or `HEADRACE_CONFIG`), in that order of precedence; keys are the
option names with underscores. `headrace serve --help` prints the same list. Regenerate
this page with `python -m daemon.service.config_docs > docs/configuration.md`.
"""


def markdown() -> str:
    rows = []
    section = None
    for name, f, where in options():
        if where != section:
            section = where
            title = "Server (the process around the engine)" if where == "server" else "Engine"
            rows += ["", f"## {title}", "", "| flag | environment | default | meaning |"]
            rows.append("|---|---|---|---|")
        flag = "--" + name.replace("_", "-")
        help_text = str(f.metadata["help"]).replace("|", "\\|")
        default = f"`{f.default!r}`" if f.default is not None else "unset"
        rows.append(f"| `{flag}` | `{ENV_PREFIX}{name.upper()}` | {default} | {help_text} |")
    return HEADER + "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
