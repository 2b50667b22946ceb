"""grammars/: the fair compile queue, per-compile time limits, cancellation, size limits."""

from __future__ import annotations

import random
import string
import time

import pytest

from grammars import GrammarCompiler, GrammarError, GrammarSpec
from grammars.fair_queue import CompileJob, FairQueue
from grammars.limits import GrammarLimits, check_size
from runner.model_source import resolve_model
from runner.tokenizer import load_tokenizer

VOCAB = 49152


def heavy(seed: int, n: int = 120) -> GrammarSpec:
    """A choice list of n x 1 KB: seconds of compiling on any machine we run on."""
    rng = random.Random(seed)
    return GrammarSpec.choice(
        ["".join(rng.choices(string.ascii_letters, k=1000)) for _ in range(n)]
    )


def job(client: str, name: str) -> CompileJob:
    return CompileJob(GrammarSpec("regex", name), client)


def test_fair_queue_serves_clients_in_turn_and_caps_each():
    q = FairQueue(per_client=1)
    jobs = [job("a", f"a{i}") for i in range(3)] + [job("b", "b0"), job("c", "c0")]
    for j in jobs:
        q.put(j)
    first = q.take(0)
    assert first is jobs[0]
    # "a" runs one already: the others go first, then nothing until "a" is done.
    assert [q.take(0).spec.text for _ in range(2)] == ["b0", "c0"]
    assert q.take(0.01) is None
    q.done(first)
    assert q.take(0).spec.text == "a1"
    assert len(q) == 1
    q2 = FairQueue(per_client=2)
    for j in [job("a", f"a{i}") for i in range(3)] + [job("b", "b0")]:
        q2.put(j)
    assert [q2.take(0).spec.text for _ in range(3)] == ["a0", "b0", "a1"]


def test_fair_queue_remove_and_close():
    q = FairQueue()
    a, b = job("a", "a0"), job("a", "a1")
    q.put(a)
    q.put(b)
    assert q.take(0) is a
    assert not q.remove(a)  # running: the worker stops it, not the queue
    assert q.remove(b) and len(q) == 0
    q.put(b)
    assert q.close() == [b]
    assert q.take() is None


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        (GrammarSpec.choice(["x" * 550] * 2), "choice: all choices together are 1100 bytes"),
        (GrammarSpec.choice(["x"] * 5), "choice: 5 choices, more than the limit of 4"),
        (GrammarSpec("regex", "a" * 1001), "regex: the pattern is 1001 bytes"),
        (GrammarSpec("grammar", "root ::= " + '"a"' * 400), "grammar: the grammar is"),
        (GrammarSpec.json_schema({"enum": ["x" * 1000]}), "schema: the schema is"),
    ],
)
def test_size_limits_name_the_kind_and_the_limit(spec, needle):
    with pytest.raises(GrammarError) as e:
        check_size(spec, GrammarLimits(max_bytes=1000, max_choices=4))
    assert needle in str(e.value)
    check_size(spec, GrammarLimits(max_bytes=0, max_choices=0))  # 0: no limit


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model(None))


@pytest.fixture(scope="module")
def compiler(tokenizer):
    c = GrammarCompiler(tokenizer, VOCAB, [2], max_workers=2, time_limit_s=600)
    yield c
    c.shutdown()


def test_a_grammar_with_no_finite_sentence_is_refused(compiler):
    with pytest.raises(GrammarError, match="no finite sentence"):
        compiler.compile(GrammarSpec("grammar", 'root ::= x\nx ::= x "a"'))
    assert compiler.compile(GrammarSpec("grammar", 'root ::= "" | "a"')) is not None


def test_a_heavy_client_leaves_a_worker_for_others_and_leaving_stops_its_compiles(compiler):
    heavies = [compiler.submit(heavy(i), client="heavy") for i in range(3)]
    jobs = [compiler._jobs[id(f)] for f in heavies]
    victim = compiler.submit(GrammarSpec("regex", "[0-9]{3}victim"), client="victim")
    assert victim.result(timeout=300) is not None
    # The victim started before the heavy client's second grammar: it never queued behind.
    assert jobs[0].started is not None
    assert jobs[1].started is None or compiler._jobs.get(id(victim)) is None
    assert not heavies[0].done(), "the heavy compile should still be running"
    starts = [w.starts for w in compiler.pool.workers]
    abandoned = compiler.stats.abandoned
    for f in heavies:  # the client leaves: the running compile is killed, the rest dropped
        compiler.release(f)
    for f in heavies:
        with pytest.raises(Exception):  # noqa: B017 - cancelled
            f.result(timeout=60)
        assert f.cancelled()
    assert compiler.stats.abandoned == abandoned + 3
    assert not compiler._in_flight and not compiler._jobs
    # The killed worker is replaced (its slot restarts it before taking more work).
    deadline = time.monotonic() + 300
    while sum(w.starts for w in compiler.pool.workers) < sum(starts) + 1:
        assert time.monotonic() < deadline, "the killed worker was not replaced"
        time.sleep(0.05)
    assert sum(w.starts for w in compiler.pool.workers) == sum(starts) + 1
    assert compiler.compile(GrammarSpec("regex", "after"), timeout=300) is not None


def test_only_the_compile_past_its_own_limit_fails(tokenizer):
    c = GrammarCompiler(tokenizer, VOCAB, [2], max_workers=1, time_limit_s=0.2)
    try:
        c.compile(GrammarSpec("regex", "warm"), timeout=300)  # the worker is up
        slow = c.submit(heavy(99), client="a")
        queued = c.submit(GrammarSpec("regex", "[a-z]{2}queued"), client="b")
        with pytest.raises(GrammarError, match=r"compiling took longer than 0\.2 s"):
            slow.result(timeout=300)
        # It waited behind the slow one (and the worker's restart) far longer than 0.2 s,
        # but its own compile was short: it is not blamed.
        assert queued.result(timeout=300) is not None
        assert c.stats.timeouts == 1 and c.pool.workers[0].starts == 2
    finally:
        c.shutdown()
