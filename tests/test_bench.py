"""`headrace bench`: metric math on synthetic streams, the result schema, server counters,
and one short real run against the daemon (result file and PNG). Workloads: their own file."""

from __future__ import annotations

import argparse
import math

import numpy as np
import orjson
import pytest
from daemon_fixtures import Daemon

from daemon.bench.client import check_loopback, parse_prometheus, server_deltas
from daemon.bench.profile import summarize_steps
from daemon.bench.results import RequestRecord, SLOSpec, output_rate_series, summarize
from daemon.bench.serve import RunOutcome, RunSpec, build_result, format_report
from daemon.bench.workloads import RequestClass


def rec(start: float, chunks: list[float], end: float, tokens: int, **kw: object) -> RequestRecord:
    return RequestRecord(start, 10, list(chunks), end, tokens, **kw)  # type: ignore[arg-type]


# -- metric math ---------------------------------------------------------------------------


def test_ttft_tpot_itl_of_one_stream():
    # Start at 1.0; first token at 1.5; then tokens every 0.1 s; last chunk is the end.
    r = rec(1.0, [1.5, 1.6, 1.7, 1.9], 1.9, 4)
    assert r.ttft_s == pytest.approx(0.5)
    assert r.e2el_s == pytest.approx(0.9)
    # TPOT excludes the first token: (0.9 - 0.5) / 3.
    assert r.tpot_s == pytest.approx(0.4 / 3)
    assert r.itls_s == pytest.approx([0.1, 0.1, 0.2])


def test_tpot_undefined_for_a_single_token_and_failed_requests_excluded():
    one = rec(0.0, [0.2], 0.2, 1)
    assert math.isnan(one.tpot_s)
    failed = rec(0.0, [], 0.1, 0, error="HTTP 500: boom")
    s = summarize([one, failed], duration_s=2.0)
    assert s["completed"] == 1 and s["failed"] == 1
    assert s["errors"] == {"HTTP 500: boom": 1}
    assert s["mean_tpot_ms"] == 0.0  # no request with two tokens
    assert s["mean_ttft_ms"] == pytest.approx(200.0)


def test_percentiles_and_throughputs_on_known_values():
    # TTFTs of 10, 20, ..., 100 ms; 5 output tokens each, 10 ms apart.
    records = []
    for i in range(10):
        ttft = (i + 1) / 100
        chunks = [ttft + 0.01 * k for k in range(5)]
        records.append(rec(0.0, chunks, chunks[-1], 5))
    s = summarize(records, duration_s=4.0)
    ttfts = np.arange(10, 101, 10)
    assert s["median_ttft_ms"] == pytest.approx(np.percentile(ttfts, 50))
    assert s["p90_ttft_ms"] == pytest.approx(np.percentile(ttfts, 90))
    assert s["p99_ttft_ms"] == pytest.approx(np.percentile(ttfts, 99))
    assert s["mean_tpot_ms"] == pytest.approx(10.0)
    assert s["median_itl_ms"] == pytest.approx(10.0)
    assert s["request_throughput"] == pytest.approx(10 / 4)
    assert s["output_throughput"] == pytest.approx(50 / 4)
    assert s["total_token_throughput"] == pytest.approx((50 + 100) / 4)


def test_goodput_counts_requests_meeting_both_bounds():
    fast = rec(0.0, [0.1, 0.15, 0.2], 0.2, 3)  # TTFT 100 ms, TPOT 50 ms
    slow_first = rec(0.0, [0.9, 0.95, 1.0], 1.0, 3)  # TTFT 900 ms
    slow_tokens = rec(0.0, [0.1, 0.5, 0.9], 0.9, 3)  # TPOT 400 ms
    failed = rec(0.0, [], None, 0, error="timeout")  # type: ignore[arg-type]
    slo = SLOSpec.parse("ttft_ms=500,tpot_ms=100")
    s = summarize([fast, slow_first, slow_tokens, failed], duration_s=2.0, slo=slo)
    assert s["request_goodput"] == pytest.approx(1 / 2)
    assert s["output_goodput"] == pytest.approx(3 / 2)
    assert s["goodput_fraction"] == pytest.approx(1 / 4)
    only_ttft = summarize([fast, slow_first, slow_tokens], 2.0, SLOSpec(ttft_ms=500))
    assert only_ttft["request_goodput"] == pytest.approx(2 / 2)


@pytest.mark.parametrize("bad", ["ttft=5", "ttft_ms=x", "tpot_ms=-1", "ttft_ms"])
def test_bad_slo_is_named(bad):
    with pytest.raises(ValueError, match="--slo"):
        SLOSpec.parse(bad)


def test_output_rate_series_spreads_tokens_over_time():
    records = [rec(0.0, [0.5, 1.5, 2.5], 2.5, 6), rec(0.0, [0.2], 0.2, 1)]
    centres, rates = output_rate_series(records, t0=0.0, bin_s=1.0)
    assert centres == [0.5, 1.5, 2.5]
    assert rates == pytest.approx([3.0, 2.0, 2.0])  # 2 tokens per chunk, plus the single one
    assert sum(rates) == pytest.approx(7.0)


# -- result schema, server counters, loopback ----------------------------------------------


def _outcome() -> RunOutcome:
    records = [
        rec(0.0, [0.1, 0.2, 0.3], 0.3, 3, request_class="chat"),
        rec(0.0, [0.5, 0.9], 0.9, 2, request_class="batch"),
        rec(0.0, [], 0.2, 0, error="HTTP 429: busy", request_class="batch"),
    ]
    before = {"preemptions": 1.0, "prefix_queries": 100.0, "prefix_hits": 10.0}
    after = {"preemptions": 4.0, "prefix_queries": 300.0, "prefix_hits": 110.0, "kv_usage": 0.2}
    return RunOutcome(records, 0.0, 1.0, before, after, 0.6, 0, [(0.0, 1), (0.3, 0)])


def test_result_schema_uses_vllm_key_names_and_round_trips(tmp_path):
    from daemon.bench.client import Endpoint
    from daemon.bench.serve import write_result

    classes = [RequestClass.parse("chat:1:0:200:150"), RequestClass.parse("batch:1:1")]
    result = build_result(
        _outcome(),
        RunSpec(request_rate=4.0, max_concurrency=8),
        Endpoint("http://127.0.0.1:1"),
        SLOSpec(ttft_ms=1000),
        classes,
        {"workload": "random"},
    )
    for key in (
        "completed", "failed", "duration", "request_throughput", "output_throughput",
        "total_token_throughput", "total_input_tokens", "total_output_tokens", "request_goodput",
        "mean_ttft_ms", "median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "mean_tpot_ms",
        "median_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "p99_itl_ms", "mean_e2el_ms",
        "p99_e2el_ms", "input_lens", "output_lens", "ttfts", "itls", "errors", "max_concurrency",
        "request_rate", "burstiness",
    ):  # fmt: skip
        assert key in result, key
    assert result["completed"] == 2 and result["failed"] == 1
    assert result["errors"] == {"HTTP 429: busy": 1}
    assert result["server"] == {
        "preemptions": 3.0,
        "prefix_cache_hit_rate": pytest.approx(0.5),
        "kv_cache_usage_peak": 0.6,
    }
    # Per class: chat's own SLO (TPOT 150 ms: met), batch falls back to the run's SLO.
    assert result["classes"]["chat"]["request_goodput"] == pytest.approx(1.0)
    assert result["classes"]["batch"]["completed"] == 1
    assert result["classes"]["batch"]["slo"] == {"ttft_ms": 1000}
    path = tmp_path / "r.json"
    write_result(result, path)
    back = orjson.loads(path.read_bytes())
    assert back["median_ttft_ms"] == pytest.approx(result["median_ttft_ms"])
    report = format_report(result)
    assert "Request goodput" in report and "class chat" in report and "429" in report


def test_prometheus_counters_from_headrace_and_vllm_pages():
    headrace = (
        "# HELP headrace_preemptions x\nheadrace_preemptions 2.0\n"
        "headrace_kv_cache_usage 0.25\nheadrace_prefix_cache_hit_rate 0.5\n"
        "headrace_prefix_cache_queries_tokens 40.0\n"
    )
    m = parse_prometheus(headrace)
    assert m == {
        "preemptions": 2.0,
        "kv_usage": 0.25,
        "prefix_hit_rate": 0.5,
        "prefix_queries": 40.0,
        "prefix_hits": 20.0,
    }
    vllm = (
        'vllm:num_preemptions_total{model_name="m"} 7\n'
        'vllm:kv_cache_usage_perc{model_name="m"} 0.1\n'
        'vllm:prefix_cache_queries_total{model_name="m"} 10\n'
        'vllm:prefix_cache_hits_total{model_name="m"} 4\n'
    )
    m2 = parse_prometheus(vllm)
    assert (m2["preemptions"], m2["kv_usage"], m2["prefix_hits"]) == (7.0, 0.1, 4.0)
    assert server_deltas(None, m2, None)["preemptions"] is None


async def test_each_request_gets_its_own_connection():
    # A pooled keep-alive connection that the server closed after its last stream fails the
    # next request with "Server disconnected" before the server sees it: llama-server lost
    # about one request in eight that way at c=1. One connection a request cannot be stale.
    from aiohttp import web

    from daemon.bench.client import Endpoint, send
    from daemon.bench.workloads import BenchRequest

    peers: list[object] = []

    async def completions(request: web.Request) -> web.StreamResponse:
        peers.append(request.transport.get_extra_info("peername"))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices": [{"text": "hi"}]}\n\ndata: [DONE]\n\n')
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        ep = Endpoint(f"http://127.0.0.1:{port}")
        async with ep.session(limit=1) as session:
            for _ in range(3):
                got = await send(session, ep, BenchRequest("x", None, 1, 1), len)
                assert got.error is None and got.chunk_times
    finally:
        await runner.cleanup()
    assert len(peers) == 3 and len(set(peers)) == 3  # three client ports: no reuse


def test_remote_hosts_need_allow_remote():
    check_loopback("http://127.0.0.1:8000", allow_remote=False)
    check_loopback("http://localhost:8000", allow_remote=False)
    with pytest.raises(ValueError, match="allow-remote"):
        check_loopback("http://192.0.2.1:8000", allow_remote=False)
    check_loopback("http://192.0.2.1:8000", allow_remote=True)


def test_profile_summary_splits_steps_by_kind():
    def step(prefill: int, decode: int, fwd: float) -> dict[str, float]:
        return {
            "prefill_tokens": prefill, "decode_tokens": decode, "seqs": 1, "schedule_ms": 1.0,
            "prepare_ms": 1.0, "forward_ms": fwd, "sample_ms": 1.0, "process_ms": 1.0,
            "step_ms": fwd + 4.0,
        }  # fmt: skip

    s = summarize_steps([step(100, 0, 96.0), step(0, 1, 16.0), step(0, 1, 16.0)])
    assert s["prefill"]["steps"] == 1 and s["decode"]["steps"] == 2
    assert s["decode"]["overhead_share"] == pytest.approx(3 / 20)
    assert s["all"]["share_forward"] == pytest.approx(128 / 140)


# -- a real run against the daemon on the embedded model ----------------------------------


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    d = Daemon(tmp, "--profile-steps", str(tmp / "steps.jsonl"))
    yield d
    d.stop()  # a kill: graceful shutdown is test_daemon_lifecycle's subject


def test_bench_serve_against_the_daemon_writes_result_and_png(daemon, tmp_path, capsys):
    from daemon.service.cli import main

    result_file, png = tmp_path / "result.json", tmp_path / "run.png"
    rc = main(
        [
            "bench", "serve", "--base-url", daemon.url, "--num-prompts", "4",
            "--input-len", "24", "--output-len", "4", "--ignore-eos", "--request-rate", "20",
            "--max-concurrency", "2", "--slo", "ttft_ms=60000,tpot_ms=60000",
            "--result-file", str(result_file), "--plot", str(png),
        ]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0, out
    result = orjson.loads(result_file.read_bytes())
    assert result["completed"] == 4 and result["failed"] == 0
    assert result["output_lens"] == [4, 4, 4, 4]  # ignore_eos, counted by the server's usage
    assert all(24 <= n <= 26 for n in result["input_lens"])  # in the target's tokens
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    assert result["max_concurrent_requests"] <= 2
    # Pigeonhole: the busiest one-second bucket holds at least the mean bucket.
    buckets = result["output_rate_series"][1]
    assert sum(buckets) == pytest.approx(sum(result["output_lens"]))
    assert result["max_output_tokens_per_s"] >= sum(buckets) / len(buckets) - 1e-9
    assert result["server"]["kv_cache_usage_peak"] is not None
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    assert "RESULT output_throughput=" in out
    # The same run through the daemon's step log.
    assert main(["bench", "profile", str(daemon.log.parent / "steps.jsonl")]) == 0
    assert "RESULT overhead_share=" in capsys.readouterr().out
    # Each request's first token, laid out over the steps since it arrived: the engine's
    # share of a TTFT is inside what the client measured.
    from daemon.bench.first_token import first_token_paths
    from daemon.bench.profile import load_steps

    # (The log is flushed every 64 steps: the run's last lines may still be buffered.)
    paths = first_token_paths(load_steps(daemon.log.parent / "steps.jsonl"))
    assert paths and all(p["steps"] and p["engine_ttft_ms"] > 0 for p in paths)
    assert all(p["steps"][-1]["prefill_tokens"] + p["steps"][-1]["decode_tokens"] for p in paths)
    assert min(p["engine_ttft_ms"] for p in paths) <= 1e3 * min(result["ttfts"])


def test_bench_sweep_draws_targets_side_by_side(daemon, tmp_path, capsys):
    from daemon.service.cli import main

    png = tmp_path / "sweep.png"
    rc = main(
        [
            "bench", "sweep", "--target", f"a={daemon.url}", "--target", f"b={daemon.url}",
            "--concurrency", "2", "--num-prompts", "2", "--input-len", "16",
            "--output-len", "3", "--ignore-eos", "--plot", str(png),
            "--result-dir", str(tmp_path / "points"), "--markdown", str(tmp_path / "t.md"),
        ]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0, out
    assert out.strip().splitlines()[-1].startswith("RESULT tput_ratio_b_c2=")
    assert "| b | 2 |" in (tmp_path / "t.md").read_text()
    assert len(list((tmp_path / "points").glob("*.json"))) == 3  # 2 points + sweep.json
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert "Workload: random, input 16 tokens, output 3 tokens (ignore_eos)" in out


def test_bench_sweep_rounds_take_turns_in_a_rotated_order(daemon, tmp_path, capsys):
    from daemon.service.cli import main

    rc = main(
        [
            "bench", "sweep", "--target", f"a={daemon.url}", "--target", f"b={daemon.url}",
            "--concurrency", "2", "--num-prompts", "2", "--input-len", "16", "--rounds", "2",
            "--output-len", "3", "--ignore-eos", "--result-dir", str(tmp_path / "points"),
            "--markdown", str(tmp_path / "t.md"),
        ]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0, out
    runs = [line.split(":")[0] for line in out.splitlines() if " round " in line]
    assert runs == [
        "[a] concurrency=2 round 1/2",
        "[b] concurrency=2 round 1/2",
        "[b] concurrency=2 round 2/2",
        "[a] concurrency=2 round 2/2",
    ]
    assert len(list((tmp_path / "points").glob("*_round*.json"))) == 4
    assert "| b | 2 |" in (tmp_path / "t.md").read_text()
    assert "| 2: " in out  # the ratio row names its rounds and their spread
    assert out.strip().splitlines()[-1].startswith("RESULT tput_ratio_b_c2=")


def test_a_rounds_ratio_is_the_median_of_paired_ratios_not_a_ratio_of_medians():
    from daemon.bench.sweep import combine_rounds, round_orders, tables

    assert round_orders(["a", "b", "c"], 4) == [
        ["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]
    ]  # fmt: skip

    def point(tput: float, failed: int = 0) -> dict:
        return {
            "level": 8.0, "output_throughput": tput, "failed": failed, "median_ttft_ms": tput,
            "p99_ttft_ms": 1.0, "median_tpot_ms": 1.0, "p99_tpot_ms": 1.0, "median_itl_ms": 1.0,
        }  # fmt: skip

    # The machine slowed in round 2 for both: paired, b ran at 2x, 0.5x, 1x of ref.
    b = combine_rounds([point(10.0), point(20.0, failed=1), point(30.0)])
    ref = combine_rounds([point(5.0), point(40.0), point(30.0, failed=2)])
    assert b["output_throughput"] == 20.0 and b["round_tputs"] == [10.0, 20.0, 30.0]
    assert b["failed"] == 1 and ref["failed"] == 2
    _, ratio_table, pairs = tables({"ref": [ref], "b": [b]}, "ref", "concurrency")
    # The median of the paired ratios is 1.00x; the ratio of the medians would be 0.67x.
    assert "| b | 8 | 1.00x |" in ratio_table and "| 3: 0.50-2.00x |" in ratio_table
    assert pairs == ["tput_ratio_b_c8=1.000"]


def test_the_sweep_caption_of_a_jsonl_workload_names_the_file_not_input_len():
    from daemon.bench.sweep import workload_description

    args = argparse.Namespace(
        workload="jsonl", dataset_path="chat.jsonl", input_len=128, output_len=64, ignore_eos=False
    )
    got = workload_description(args)
    assert "chat.jsonl" in got and "input" not in got and "else 64 tokens" in got


def test_bench_serve_chat_over_the_unix_socket(daemon, tmp_path, capsys):
    from daemon.service.cli import main

    result_file = tmp_path / "chat.json"
    argv = ["bench", "serve", "--uds", daemon.uds, "--api", "chat", "--workload", "prefix"]
    argv += ["--prefix-len", "32", "--input-len", "8", "--output-len", "2", "--ignore-eos"]
    argv += ["--num-prompts", "2", "--result-file", str(result_file)]
    assert main(argv) == 0, capsys.readouterr().out
    result = orjson.loads(result_file.read_bytes())
    assert result["completed"] == 2 and result["backend"] == "openai-chat"
    # The second request reuses the shared system prompt's blocks.
    assert result["server"]["prefix_cache_hit_rate"] > 0
