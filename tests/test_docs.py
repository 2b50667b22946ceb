"""The docs agree with the program: every serve flag documented, every README link alive."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from daemon.service.config_docs import markdown
from daemon.service.serve_config import add_serve_arguments

ROOT = Path(__file__).resolve().parents[1]


def _serve_flags() -> list[str]:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    flags = [s for a in parser._actions for s in a.option_strings if s.startswith("--")]
    return [f for f in flags if f not in ("--help",) and not f.startswith("--no-")]


def test_every_serve_flag_is_in_the_configuration_page() -> None:
    page = (ROOT / "docs" / "configuration.md").read_text()
    flags = _serve_flags()
    assert len(flags) > 20  # the parser really was read
    missing = [f for f in flags if f"`{f}`" not in page]
    assert missing == [], (
        f"{missing} not in docs/configuration.md: run "
        "`python -m daemon.service.config_docs > docs/configuration.md`"
    )


def test_the_generated_page_lists_every_flag_too() -> None:
    text = markdown()
    assert all(f"`{f}`" in text for f in _serve_flags() if f != "--config")


def test_readme_links_point_at_files_that_exist() -> None:
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme)
    assert "docs/configuration.md" in links
    assert [link for link in links if not (ROOT / link).exists()] == []


def test_readme_has_the_two_commands() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "make serve" in readme and "make test" in readme
    assert "make test" in (ROOT / ".ci" / "run").read_text()
