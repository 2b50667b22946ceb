import sys
from pathlib import Path

import pytest

from daemon.service.cli import main
from plugins import load_policy
from scheduling import StepShape
from scheduling.cost_model import OnlineCostModel, StepCostModel
from scheduling.simulator import percentile, simulate
from scheduling.trace import TraceClass, load_trace, make_trace

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))
import simulate_policies  # noqa: E402


def test_slo_beats_fcfs_goodput_on_the_shipped_trace():
    slo = simulate_policies.run("slo_mixed", "slo")
    fcfs = simulate_policies.run("slo_mixed", "fcfs")
    assert slo.summary["goodput"] > fcfs.summary["goodput"]
    assert all(r.finish_reason in ("length", "rejected") for r in slo.records)


def test_priority_keeps_urgent_ttft_near_idle_and_fcfs_does_not():
    *_, priority_ratio = simulate_policies.urgent_ttft_ratio("priority")
    *_, fcfs_ratio = simulate_policies.urgent_ttft_ratio("fcfs")
    assert priority_ratio <= 1.2
    assert fcfs_ratio > 1.2


def test_trace_generator_and_loader_round_trip(tmp_path):
    specs = ["a:20:100:10:0:500:50", "b:10:50:5:1"]
    trace = make_trace([TraceClass.parse(c) for c in specs], duration_s=5.0, seed=3)
    assert 60 < len(trace) < 240  # ~150 expected from the two Poisson rates
    assert [t.arrival for t in trace] == sorted(t.arrival for t in trace)
    assert {t.cls for t in trace} == {"a", "b"}
    assert all(50 <= t.prompt_len <= 150 for t in trace if t.cls == "a")
    assert all(t.slo is None and t.priority == 1 for t in trace if t.cls == "b")
    out = tmp_path / "t.jsonl"
    argv = ["simulate", "--make-trace", str(out), "--duration", "5", "--seed", "3"]
    assert main([*argv, "--class", specs[0], "--class", specs[1]]) == 0
    loaded = load_trace(out)
    assert [(t.prompt_len, t.output_len, t.priority, t.slo, t.cls) for t in loaded] == [
        (t.prompt_len, t.output_len, t.priority, t.slo, t.cls) for t in trace
    ]
    assert [t.arrival for t in loaded] == pytest.approx([t.arrival for t in trace], abs=1e-6)


def test_cli_prints_summary_and_result_line(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        '{"arrival": 0.0, "prompt_len": 64, "output_len": 8, "slo": {"ttft_ms": 1000}}\n'
        '{"arrival": 0.01, "prompt_len": 32, "output_len": 4, "priority": 1}\n'
    )
    assert main(["simulate", "--policy", "priority", "--trace", str(trace)]) == 0
    out = capsys.readouterr().out
    last = out.strip().splitlines()[-1]
    assert last.startswith("RESULT goodput=1.0000 tok_s=")
    assert "ttft_p99_ms=" in last and "tpot_p99_ms=" in last
    assert "TTFT p50" in out


def test_cli_errors_name_the_problem(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"arrival": 0, "output_len": 3}\n')
    assert main(["simulate", "--trace", str(bad)]) == 2
    assert "bad.jsonl:1: missing field 'prompt_len'" in capsys.readouterr().err
    assert main(["simulate", "--policy", "nope", "--trace", str(bad)]) == 2
    assert "installed" in capsys.readouterr().err


def test_every_simulated_request_ends_and_no_block_leaks():
    trace = make_trace([TraceClass("x", 50, 300, 40, 0, 200, 20)], duration_s=3, seed=1)
    result = simulate(trace, load_policy("slo"), num_blocks=64, block_size=16)
    assert len(result.records) == len(trace)
    assert all(r.finish_reason in ("length", "rejected") for r in result.records)
    assert result.num_preemptions > 0  # a 64-block pool is far too small for this load


def test_online_cost_model_recovers_true_coefficients():
    truth = StepCostModel(0.004, 30e-6, 100e-6, 0.05e-6)
    model = OnlineCostModel(prior=StepCostModel(0.02, 1e-6, 1e-6, 1e-6))
    for i in range(400):
        shape = StepShape(
            num_prefill_tokens=(i * 37) % 900,
            num_decode_tokens=(i * 13) % 60,
            num_context_tokens=(i * 997) % 40_000,
        )
        model.observe(shape, truth.predict(shape))
    probe = StepShape(num_prefill_tokens=512, num_decode_tokens=32, num_context_tokens=20_000)
    assert model.predict(probe) == pytest.approx(truth.predict(probe), rel=0.02)
    assert model.model.per_decode_token_s == pytest.approx(100e-6, rel=0.05)


def test_percentile_nearest_rank():
    values = [float(i) for i in range(1, 101)]
    assert percentile(values, 50) == 50.0
    assert percentile(values, 99) == 99.0
    assert percentile([], 99) == 0.0
