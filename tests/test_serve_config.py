import argparse

import pytest

from daemon.service.cli import build_parser
from daemon.service.serve_config import build_serve_config, parse_serve_args


def test_precedence_flags_over_env_over_toml(tmp_path):
    toml = tmp_path / "headrace.toml"
    toml.write_text(
        'port = 7000\nmax_num_seqs = 9\n[server]\nlog_level = "debug"\n'
        '[engine]\npolicy = "priority"\n'
    )
    env = {"HEADRACE_CONFIG": str(toml), "HEADRACE_MAX_NUM_SEQS": "12", "HEADRACE_PORT": "7100"}
    cfg = parse_serve_args(["--port", "7200", "--no-overlap"], env)
    assert cfg.server.port == 7200  # flag beats env and file
    assert cfg.engine.max_num_seqs == 12  # env beats file
    assert cfg.engine.policy == "priority" and cfg.server.log_level == "debug"  # file
    assert cfg.server.overlap is False
    assert cfg.engine.block_size == 16  # default


def test_errors_name_the_source(tmp_path):
    with pytest.raises(ValueError, match="HEADRACE_MAX_NUM_SEQS"):
        parse_serve_args([], {"HEADRACE_MAX_NUM_SEQS": "many"})
    toml = tmp_path / "bad.toml"
    toml.write_text("colour = 'blue'\n")
    with pytest.raises(ValueError, match="unknown option 'colour'"):
        parse_serve_args(["--config", str(toml)], {})
    assert parse_serve_args([], {"HEADRACE_UDS": ""}).server.uds is None


def test_serve_help_documents_every_option(capsys):
    from dataclasses import fields

    from daemon.engine.config import EngineConfig
    from daemon.service.serve_config import ServerConfig

    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = capsys.readouterr().out
    for f in [*fields(ServerConfig), *fields(EngineConfig)]:
        assert "--" + f.name.replace("_", "-") in text
        assert "HEADRACE_" + f.name.upper() in text
    assert isinstance(build_serve_config(argparse.Namespace(), {}).server.port, int)
