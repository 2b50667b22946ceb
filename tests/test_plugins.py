import sys
import textwrap
from pathlib import Path

import pytest

from plugins import POLICY_GROUP, PluginError, UnknownPluginError, load_policy, policy_names
from scheduling import Policy, SamplingParams
from scheduling.request import Request

EXAMPLE = Path(__file__).resolve().parents[1] / "plugins" / "examples" / "shortest_first"


def fake_install(root: Path, dist: str, entry_points: dict[str, str]) -> None:
    """What pip would leave behind: a dist-info folder with entry_points.txt, on sys.path."""
    info = root / f"{dist}-0.1.0.dist-info"
    info.mkdir(parents=True)
    info.joinpath("METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1.0\n")
    lines = "\n".join(f"{k} = {v}" for k, v in entry_points.items())
    info.joinpath("entry_points.txt").write_text(f"[{POLICY_GROUP}]\n{lines}\n")


def test_builtin_policies_come_from_entry_points():
    assert {"fcfs", "priority", "slo"} <= set(policy_names())
    for name in ("fcfs", "priority", "slo"):
        policy = load_policy(name)
        assert isinstance(policy, Policy) and policy.name == name


def test_unknown_policy_error_names_the_installed_ones():
    with pytest.raises(UnknownPluginError) as e:
        load_policy("lottery")
    message = str(e.value)
    assert "'lottery'" in message
    for name in ("fcfs", "priority", "slo"):
        assert name in message


def test_example_third_party_policy_is_discovered_once_installed(tmp_path, monkeypatch):
    assert "shortest-first" not in policy_names()
    monkeypatch.syspath_prepend(str(EXAMPLE))
    fake_install(
        tmp_path,
        "headrace_shortest_first",
        {"shortest-first": "headrace_shortest_first:ShortestFirstPolicy"},
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "shortest-first" in policy_names()
    policy = load_policy("shortest-first")
    assert isinstance(policy, Policy)
    short = Request("a", [1] * 4, SamplingParams(max_tokens=2), 1.0)
    long = Request("b", [1] * 400, SamplingParams(max_tokens=2), 0.0)
    assert policy.rank(short, 0.0) < policy.rank(long, 0.0)
    monkeypatch.delitem(sys.modules, "headrace_shortest_first", raising=False)


def test_plugin_with_another_api_version_is_refused(tmp_path, monkeypatch):
    pkg = tmp_path / "old_policy.py"
    pkg.write_text(
        textwrap.dedent(
            """
            class OldPolicy:
                name = "old"
                api_version = 99
                def rank(self, req, now): return 0
            """
        )
    )
    fake_install(tmp_path, "old_policy", {"old": "old_policy:OldPolicy"})
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(PluginError, match=r"version 99.*supports version 1"):
        load_policy("old")


def test_plugin_missing_methods_is_refused(tmp_path, monkeypatch):
    (tmp_path / "half_policy.py").write_text(
        "class HalfPolicy:\n    name = 'half'\n    api_version = 1\n"
    )
    fake_install(tmp_path, "half_policy", {"half": "half_policy:HalfPolicy"})
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(PluginError, match="rank/admit/observe"):
        load_policy("half")
