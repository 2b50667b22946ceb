"""The first-token paths of a --profile-steps log (daemon/bench/first_token.py)."""

from __future__ import annotations

import orjson
import pytest

from conftest import make_request, make_scheduler, sample_all
from daemon.bench.first_token import (
    describe_log,
    describe_phases,
    first_token_paths,
    summarize_paths,
)
from daemon.engine.step_profile import first_tokens


def line(at: float, end: float, prefill: int, decode: int, firsts: list) -> dict:
    return {
        "scheduled_at": at,
        "done_at": end,
        "prefill_tokens": prefill,
        "decode_tokens": decode,
        "seqs": decode + (1 if prefill else 0),
        "threads": 2,
        "execute_ms": (end - at) * 1e3 - 1,
        "first_tokens": firsts,
    }


def test_a_path_is_the_step_in_flight_at_arrival_then_its_own() -> None:
    steps = [
        line(0.00, 0.02, 0, 16, []),
        line(0.02, 0.04, 0, 16, []),  # in flight when the urgent one arrives at 0.03
        line(0.04, 0.09, 128, 0, [["u", 0, 0.03]]),
        line(0.09, 0.11, 16, 8, [["b", 1, 0.00]]),
    ]
    (u,) = first_token_paths(steps, priority=0)
    assert u["id"] == "u" and len(u["steps"]) == 2
    assert u["wait_ms"] == pytest.approx(10) and u["own_ms"] == pytest.approx(50)
    assert u["engine_ttft_ms"] == pytest.approx(60)
    assert [s["decode_tokens"] for s in u["steps"]] == [16, 0]
    # Unfiltered, the batch request's path reaches back to its arrival.
    assert len(first_token_paths(steps)[1]["steps"]) == 4
    summary = summarize_paths(first_token_paths(steps, priority=0))
    assert summary["steps_per_path"] == {2: 1} and summary["mean_own_decode_tokens"] == 0


def test_describe_log_reads_a_profile_and_refuses_an_old_one(tmp_path) -> None:
    log = tmp_path / "steps.jsonl"
    log.write_bytes(orjson.dumps(line(0.0, 0.05, 128, 0, [["u", 0, 0.0]])) + b"\n")
    text = describe_log(log, 0)
    assert "u prio 0: ttft 50.0 ms" in text and "SUMMARY requests=1" in text
    old = {k: v for k, v in line(0.0, 0.05, 128, 0, []).items() if k != "first_tokens"}
    log.write_bytes(orjson.dumps(old) + b"\n")
    with pytest.raises(ValueError, match="no first_tokens"):
        describe_log(log)


def test_describe_phases_sums_up_the_requests_that_arrived_in_each(tmp_path) -> None:
    log = tmp_path / "steps.jsonl"
    steps = [
        line(0.00, 0.05, 128, 0, [["a", 0, 0.0]]),
        line(1.00, 1.08, 128, 0, [["b", 0, 1.0]]),
        line(1.08, 1.20, 128, 0, [["c", 0, 1.01]]),
    ]
    log.write_bytes(b"".join(orjson.dumps(s) + b"\n" for s in steps))
    text = describe_phases(log, {"idle": (0.0, 0.5), "loaded": (0.5, 2.0), "none": (3, 4)}, 0)
    idle, loaded, none = text.splitlines()
    assert idle.startswith("PHASE idle requests=1 p50_engine_ttft_ms=50.00")
    assert loaded.startswith("PHASE loaded requests=2")
    assert none == "PHASE none requests=0"


def test_first_tokens_names_each_request_once_at_its_first_sample() -> None:
    sched = make_scheduler(max_num_batched_tokens=8, policy="priority")
    long, short = make_request(12, max_tokens=3, priority=1), make_request(4, max_tokens=3)
    sched.add_request(long)
    sched.add_request(short)
    seen = []
    for _ in range(6):
        out = sched.schedule()
        seen += [(rid, prio) for rid, prio, _ in first_tokens(out, sched.requests)]
        sched.update(out, sample_all(sched, out, 7))
    # `short` samples first in step 1; `long`'s 12-token prompt ends in step 2 (chunked).
    assert seen == [(short.request_id, 0), (long.request_id, 1)]
