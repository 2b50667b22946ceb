"""Speculative decoding without a model: the ngram proposer, proposer plugins, and drafts
in the scheduler (1 + k tokens, lookahead slots, fewer drafts when short, caps, rollback)."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import make_request, make_scheduler
from plugins import PluginError, UnknownPluginError, load_proposer, proposer_names
from runner.spec_decode import DraftRequest, NgramProposer, Proposer, SpeculativeConfig
from scheduling import RunnerOutput

# -- the ngram proposer ------------------------------------------------------------------


def ngram(lo: int = 2, hi: int = 4) -> NgramProposer:
    return NgramProposer(SpeculativeConfig("ngram", 3, lo, hi))


def test_ngram_proposes_what_followed_the_tail_last_time():
    p = ngram()
    assert p.propose_one(np.array([1, 2, 3, 4, 5, 9, 1, 2, 3]), 3) == [4, 5, 9]
    assert p.propose_one(np.array([1, 2, 3, 4, 5, 9, 1, 2, 3]), 1) == [4]  # k caps
    # Continuation shorter than k: only what exists.
    assert p.propose_one(np.array([8, 1, 2, 6, 1, 2]), 3) == [6, 1, 2]
    assert p.propose_one(np.array([1, 2, 3, 4, 5, 6]), 3) == []  # no repeat
    assert p.propose_one(np.array([5, 3, 9, 3]), 3) == []  # a 1-gram is below min 2


def test_ngram_prefers_the_longest_match_then_the_most_recent():
    p = ngram()
    # "2 3" occurs twice; "1 2 3" only once (the older one): longest wins.
    assert p.propose_one(np.array([1, 2, 3, 4, 7, 2, 3, 5, 1, 2, 3]), 2) == [4, 7]
    # Equal lengths: the most recent occurrence.
    assert p.propose_one(np.array([1, 2, 3, 1, 2, 3, 4, 8, 2, 3]), 3) == [4, 8, 2]
    # prompt_lookup_max bounds the compared length, so both are "equal" again.
    short = ngram(1, 2)
    assert short.propose_one(np.array([1, 2, 3, 4, 7, 2, 3, 5, 1, 2, 3]), 2) == [5, 1]


def test_ngram_batch_interface_and_plugin_registration():
    assert "ngram" in proposer_names()
    proposer = load_proposer("ngram", SpeculativeConfig("ngram"))
    assert isinstance(proposer, Proposer) and proposer.name == "ngram"
    reqs = [DraftRequest("a", [1, 2, 3, 1, 2], 3, 2), DraftRequest("b", [4, 5, 6], 3, 3)]
    assert proposer.propose(reqs) == [[3, 1], []]


def test_unknown_proposer_names_the_installed_ones():
    with pytest.raises(UnknownPluginError, match=r"'eagle'.*installed: .*ngram"):
        load_proposer("eagle", SpeculativeConfig("eagle"))


def fake_proposer_install(root, dist: str, line: str) -> None:
    info = root / f"{dist}-0.1.0.dist-info"
    info.mkdir(parents=True)
    info.joinpath("METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1.0\n")
    info.joinpath("entry_points.txt").write_text(f"[headrace.proposers]\n{line}\n")


def test_proposer_plugins_are_checked(tmp_path, monkeypatch):
    (tmp_path / "my_proposers.py").write_text(
        "class Old:\n    name = 'old'\n    api_version = 99\n"
        "class Half:\n    name = 'half'\n    api_version = 1\n"
        "    def __init__(self, config): pass\n"
        "class Echo:\n    name = 'echo'\n    api_version = 1\n"
        "    def __init__(self, config): self.k = config.num_speculative_tokens\n"
        "    def propose(self, requests): return [[r.token_ids[-1]] for r in requests]\n"
    )
    fake_proposer_install(
        tmp_path,
        "my_proposers",
        "old = my_proposers:Old\nhalf = my_proposers:Half\necho = my_proposers:Echo",
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(PluginError, match=r"version 99.*supports version 1"):
        load_proposer("old", SpeculativeConfig("old"))
    with pytest.raises(PluginError, match="propose"):
        load_proposer("half", SpeculativeConfig("half"))
    echo = load_proposer("echo", SpeculativeConfig("echo"))
    assert echo.propose([DraftRequest("a", [4, 5], 1, 1)]) == [[5]]


def test_config_validates_its_bounds():
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig("ngram", 0)
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        SpeculativeConfig("ngram", 3, 4, 2)


# -- drafts in the scheduler -------------------------------------------------------------


def decode_once(sched, req, drafts: list[int]):
    """Run `req` to its first decode step and hand the scheduler `drafts` for the next."""
    out = sched.schedule()
    sched.update(out, RunnerOutput({req.request_id: [7]}, draft_token_ids={req.request_id: drafts}))
    return out


def test_a_request_with_drafts_asks_for_one_plus_k_and_rolls_back_rejections():
    sched = make_scheduler(num_blocks=64, block_size=4)
    req = make_request(8, max_tokens=20)
    sched.add_request(req)
    decode_once(sched, req, [11, 12, 13])
    assert req.spec_token_ids == [11, 12, 13]
    out = sched.schedule()
    assert out.num_scheduled_tokens[req.request_id] == 4
    assert out.scheduled_spec_decode_tokens[req.request_id] == [11, 12, 13]
    assert out.shape.num_decode_tokens == 4
    # Blocks cover the drafts (lookahead), but only real tokens are cached.
    assert len(sched.kv.get_block_ids(req.request_id)) * 4 >= 9 + 3
    assert req.num_computed_tokens == 9 + 3
    # The target accepted one draft and corrected the second: 2 tokens, 1 draft rejected
    # beyond the correction, and the counter steps back over it.
    sched.update(out, RunnerOutput({req.request_id: [11, 40]}))
    assert req.output_token_ids == [7, 11, 40]
    assert req.num_computed_tokens == 10  # everything but the newest token
    assert req.spec_stats.num_verified == 3 and req.spec_stats.num_accepted == 1
    assert sched.spec_stats.acceptance_rate == pytest.approx(1 / 3)
    assert sched.spec_stats.mean_accepted_length == 2
    sched.check_integrity()


def test_drafts_are_cut_to_max_tokens_and_max_model_len():
    sched = make_scheduler(num_blocks=64, block_size=4)
    req = make_request(8, max_tokens=3)
    sched.add_request(req)
    decode_once(sched, req, [11, 12, 13])
    assert req.spec_token_ids == [11]  # 1 output + 1 draft + 1 bonus = max_tokens
    sched = make_scheduler(num_blocks=64, block_size=4, max_model_len=11)
    req = make_request(8, max_tokens=20)
    sched.add_request(req)
    decode_once(sched, req, [11, 12, 13])
    assert req.spec_token_ids == [11]  # 9 tokens + 1 draft + 1 bonus = max_model_len


def test_short_budget_schedules_fewer_drafts_not_none():
    sched = make_scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=10)
    req = make_request(8, max_tokens=20)
    sched.add_request(req)
    decode_once(sched, req, [11, 12, 13])
    other = make_request(8, max_tokens=20, arrival=-1.0)  # ranked first: takes 8 of 10
    sched.add_request(other)
    out = sched.schedule()
    assert out.num_scheduled_tokens[other.request_id] == 8
    assert out.num_scheduled_tokens[req.request_id] == 2
    assert out.scheduled_spec_decode_tokens[req.request_id] == [11]


def test_short_blocks_schedule_fewer_drafts_before_preempting():
    # 5 blocks of 4: B (ranked first, 8-token prompt) and A (6-token prompt) hold 2 each.
    # B's next token takes the last free block; A has room for its next token + 1 draft.
    sched = make_scheduler(num_blocks=5, block_size=4)
    b = make_request(8, max_tokens=20, arrival=-1.0)
    a = make_request(6, max_tokens=20)
    sched.add_request(b)
    sched.add_request(a)
    out = sched.schedule()
    sched.update(
        out,
        RunnerOutput(
            {a.request_id: [7], b.request_id: [7]}, draft_token_ids={a.request_id: [11, 12, 13]}
        ),
    )
    assert a.spec_token_ids == [11, 12, 13]
    out = sched.schedule()
    assert sched.num_preemptions == 0
    assert out.num_scheduled_tokens == {b.request_id: 1, a.request_id: 2}
    assert out.scheduled_spec_decode_tokens[a.request_id] == [11]
    sched.update(out, RunnerOutput({a.request_id: [11, 50], b.request_id: [8]}))
    assert a.output_token_ids == [7, 11, 50]
    sched.check_integrity()


def test_no_block_leaks_after_rejections_aborts_and_preemptions():
    sched = make_scheduler(num_blocks=12, block_size=4)
    reqs = [make_request(10, max_tokens=30) for _ in range(4)]
    for r in reqs:
        sched.add_request(r)
    for i in range(200):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        sampled, drafts = {}, {}
        for rid in out.sampling_req_ids:
            if rid not in sched.requests:
                continue
            d = out.scheduled_spec_decode_tokens.get(rid, [])
            n_acc = i % (len(d) + 1)  # accept a varying prefix: rejections of every length
            sampled[rid] = [*d[:n_acc], 90 + i % 5]
            drafts[rid] = [60 + i % 7, 61, 62, 63]
        sched.update(out, RunnerOutput(sampled, draft_token_ids=drafts))
        sched.check_integrity()
        if i == 6:
            sched.finish_requests([reqs[0].request_id], reqs[0].status.FINISHED_ABORTED)
    assert not sched.has_unfinished_requests()
    assert sched.num_preemptions > 0
    assert sched.spec_stats.num_accepted > 0
    assert sched.spec_stats.num_verified > sched.spec_stats.num_accepted
    assert all(len(r.output_token_ids) <= 30 for r in reqs)
    sched.check_integrity()
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_adaptive_draft_length_backs_off_and_probes():
    from runner.spec_decode.draft_length import AdaptiveDraftLength

    adaptive = AdaptiveDraftLength(4, initial_rate=0.5, weight=0.5, probe_every=3)
    assert adaptive.cap("a") == 2
    adaptive.observe("a", 2, 2)  # all accepted: rate 0.75
    assert adaptive.cap("a") == 3
    for _ in range(4):
        adaptive.observe("a", 3, 0)  # rejected again and again
    # At 0 it skips, then probes with one draft every third step.
    assert [adaptive.cap("a") for _ in range(6)] == [0, 0, 1, 0, 0, 1]
    for _ in range(4):
        adaptive.observe("a", 1, 1)  # the probes succeed: back up
    assert adaptive.cap("a") == 4
    assert adaptive.cap("b") == 2  # per request
    adaptive.drop("a")
    assert "a" not in adaptive.tracks
