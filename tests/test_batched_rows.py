"""The start-up choice of the batched int8 kernel and its row counts (runner/batched_rows.py):
the first unbroken run of wins, the step-budget point, the LM head's own limits, and the
split of a few rows between the small copy and an exact kernel. Timings are faked where the
choice, not the kernels, is under test (tests/test_batched_int8.py tests the kernels).
"""

from __future__ import annotations

import pytest
import torch

from runner.batched_rows import choose, measure_batched_rows
from runner.cpu_ops import load_cpu_ops
from runner.layers.linear import Linear, pack_linears


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    assert load_cpu_ops() is None, "the CPU kernels did not build"


def test_choice_keeps_the_first_unbroken_run_of_wins():
    def t(own, dot, widen, small=None):
        out = {"own": own, "dot": dot, "widen": widen}
        return out | ({"small": small} if small is not None else {})

    ks = ["dot", "widen"]
    # dot wins at 8, 16 and 32, loses at 64: 5..32 rows (small keeps 1..4).
    times = {8: t(10, 8, 9.8), 16: t(10, 5, 8), 32: t(10, 6, 9), 64: t(10, 9.5, 12)}
    assert choose(times, ks, 4, 0.9) == ("dot", 32, 4)
    # Beating the small copy inside small_rows takes those rows from it.
    times = {8: t(10, 4, 9, small=5), 16: t(10, 5, 9, small=6), 32: t(10, 6, 9)}
    assert choose(times, ks, 16, 0.9) == ("dot", 32, 4)
    # A run that ends where the small copy still serves: not taken.
    times = {8: t(10, 4, 9, small=5), 16: t(10, 7, 9, small=6)}
    assert choose(times, ks, 16, 0.9) == (None, 0, 16)
    # One that ends at the copy's last row count takes all of its rows from 8 on.
    times = {8: t(10, 4, 9, small=5), 16: t(10, 5, 9, small=6), 32: t(10, 9.5, 12)}
    assert choose(times, ks, 16, 0.9) == ("dot", 16, 4)
    # widen has the least total time and wins at 8 only; nothing wins at all: dropped.
    assert choose({8: t(10, 9.5, 8), 16: t(10, 9.6, 9.2)}, ks, 4, 0.9) == ("widen", 8, 4)
    assert choose({8: t(10, 9.5, 9.5)}, ks, 4, 0.9) == (None, 0, 4)
    assert choose({}, ks, 4, 0.9) == (None, 0, 4)


def test_measurement_sets_the_layers_or_drops_the_copies():
    model = torch.nn.Sequential(Linear(256, 512), Linear(512, 256))
    pack_linears(model, "float", batched_int8="dot")
    choice = measure_batched_rows(
        model, torch.float32, candidates=(8, 16), reps=1, candidates_kernels=("dot", "widen")
    )
    assert choice.kernel in (None, "dot", "widen") and choice.batched_rows in (0, 8, 16)
    assert all(set(t) == {"own", "dot", "widen"} for t in choice.times.values())
    assert sorted(choice.times) in ([8], [8, 16])
    assert all(m.batched_rows == choice.batched_rows for m in model)
    # A margin nothing can meet: the copies are dropped, not kept unused.
    pack_linears(model := torch.nn.Sequential(Linear(256, 512)), "float", batched_int8="dot")
    choice = measure_batched_rows(model, torch.float32, candidates=(8,), reps=1, margin=0.0)
    assert choice.kernel is None and "dropped" in choice.describe()
    assert model[0].batched_int8 is None and model[0].batched_rows == 0


def test_a_kernel_that_wins_through_the_candidates_is_timed_at_the_step_budget(monkeypatch):
    # Prompt steps run up to the token budget: the kernel serves them where it still wins there.
    import runner.batched_rows

    calls: list[tuple[str, ...]] = []

    def fake_times(at_budget: dict[str, float]):
        def best(runs: dict, reps: int) -> dict[str, float]:
            calls.append(tuple(runs))
            ms = {"own": 10.0, "dot": 5.0, "widen": 9.0} if len(calls) == 1 else at_budget
            return {p: ms[p] / 1e3 for p in runs}

        return best

    model = torch.nn.Sequential(Linear(256, 512))
    for at_budget, want in (({"own": 10.0, "dot": 7.0}, 64), ({"own": 10.0, "dot": 9.5}, 8)):
        calls.clear()
        pack_linears(model, "float", batched_int8="dot")
        monkeypatch.setattr(runner.batched_rows, "best_of_interleaved", fake_times(at_budget))
        choice = measure_batched_rows(
            model, torch.float32, candidates=(8,), reps=1, step_rows=64,
            candidates_kernels=("dot", "widen"),
        )  # fmt: skip
        assert calls == [("own", "dot", "widen"), ("own", "dot")]  # the kept kernel only
        assert choice.kernel == "dot" and choice.batched_rows == want
        assert model[0].batched_rows == want and sorted(choice.times) == [8, 64]
        # Serving through the budget, the copy serves every call: the own weight is freed.
        freed = want == 64
        assert (model[0].format, model[0].weight is None) == (("batched", True) if freed
                                                              else ("float", False))  # fmt: skip
        assert choice.freed == freed and ("own format freed" in choice.describe()) == freed
        model = torch.nn.Sequential(Linear(256, 512))
    # Lost at a candidate already: the budget is not timed.
    calls.clear()
    monkeypatch.setattr(
        runner.batched_rows,
        "best_of_interleaved",
        lambda runs, reps: calls.append(tuple(runs)) or {p: 0.01 for p in runs},
    )
    pack_linears(model, "float", batched_int8="dot")
    measure_batched_rows(model, torch.float32, candidates=(8,), reps=1, step_rows=64)
    assert len(calls) == 1


@pytest.mark.parametrize("loses_from, head_rows", [(32, 16), (8, 4), (1 << 20, 0)])
def test_the_lm_head_is_timed_alone_at_decode_rows(monkeypatch, loses_from, head_rows):
    # It sees one row per sequence, never a prompt's tokens: it is left out at the step budget
    # and timed alone at decode rows, where its shape may lose to its own format sooner.
    import runner.batched_rows

    seen: list[tuple[int, int]] = []

    def fake(layers, dtype, rows, paths, reps):
        seen.append((rows, len(layers)))
        ms = {"own": 10.0, "dot": 5.0, "widen": 9.0, "head_own": 10.0}
        ms["head_batched"] = 11.0 if rows >= loses_from else 9.0
        return {p: ms[p] for p in paths}

    monkeypatch.setattr(runner.batched_rows, "_time_paths", fake)
    model = torch.nn.Module()
    model.body, model.lm_head = Linear(64, 64), Linear(64, 128)
    pack_linears(model, "float", batched_int8="dot")
    choice = measure_batched_rows(
        model, torch.float32, candidates=(8, 16, 32, 64), step_rows=256,
        candidates_kernels=("dot", "widen"),
    )  # fmt: skip
    timed_alone = [(r, 1) for r in (8, 16, 32, 64) if r <= max(loses_from, 8)]
    assert seen == [(8, 2), (16, 2), (32, 2), (64, 2), (256, 1), *timed_alone]
    assert choice.batched_rows == 256 and choice.head_rows == head_rows
    assert model.body.batched_rows == 256
    assert model.lm_head.batched_rows == (head_rows or 256)
    # The body's copy serves through the budget and its own weight goes; the head keeps its
    # own (it takes over past its own limit).
    assert model.body.format == "batched" and model.body.weight is None
    assert model.lm_head.format == "float" and model.lm_head.weight is not None
    assert choice.freed == 1
    assert ("LM head's up to" in choice.describe()) == bool(head_rows)


@pytest.mark.parametrize("isa", ["avx2_madd", "avx512_vnni"])
def test_the_small_copys_rows_split_where_the_total_time_is_least(monkeypatch, isa):
    # On AVX2 without VNNI the dot kernel beat the fp32-widening GEMV down to one row. A
    # kernel that rounds activations to int8 (VNNI) leaves one stream's rows to the copy.
    import runner.batched_rows

    wins = {"own": 10.0, "small": 6.0, "dot": 5.0}
    # (times at 8 rows, at 1 / 2 / 4 rows as (small, dot), the split kept)
    cases = [
        (wins, [(6, 5), (6, 5), (6, 5)], 0),  # the kernel wins everywhere: the copy goes
        (wins, [(3, 7), (6, 5), (6, 5)], 1),  # one row is the copy's
        (wins, [(6, 4), (6, 4), (5, 5.2)], 0),  # a near tie at 4 rows does not decide
        # A near tie at 8 rows left the run to start at 16: 1-8 rows are split as a whole.
        (wins | {"dot": 6.1}, [(6, 5), (6, 5), (6, 5)], 0),
    ]
    for at8, few, want in cases if isa == "avx2_madd" else cases[:1]:
        table = {8: at8, 16: wins, 32: wins, 1: dict(zip(("small", "dot"), few[0]))}
        table |= {2: dict(zip(("small", "dot"), few[1])), 4: dict(zip(("small", "dot"), few[2]))}
        timed: list[int] = []

        def fake(layers, dtype, rows, paths, reps, table=table, timed=timed):
            timed.append(rows)
            return {p: table[rows][p] for p in paths}

        model = torch.nn.Sequential(Linear(256, 512))
        pack_linears(model, "float", small_batch_int8="rows", batched_int8="dot")
        model[0].small_rows = 16
        monkeypatch.setattr(runner.batched_rows, "_time_paths", fake)
        monkeypatch.setattr(runner.batched_rows, "batched_kernels", lambda: {"dot": isa})
        choice = measure_batched_rows(
            model, torch.float32, candidates=(8, 16, 32), reps=1, candidates_kernels=("dot",)
        )
        assert choice.kernel == "dot" and choice.batched_rows == 32, choice
        if isa == "avx512_vnni":  # the copy keeps 1-4 rows, and they are not timed
            want = 4
            assert timed == [8, 16, 32]
        else:
            assert sorted(timed) == [1, 2, 4, 8, 16, 32]
        assert choice.small_rows == want, (at8, few, choice)
        assert model[0].small_rows == want
        # Where the kernel takes every row count, the small copy is dropped, not kept unused.
        assert model[0].has_small_batch_int8 == (want > 0)
        assert f"for {want + 1}-32 rows" in choice.describe()


@pytest.mark.parametrize("head_copy_wins_at_1, head_small", [(False, 0), (True, 1)])
def test_the_lm_heads_few_rows_split_apart_from_the_other_layers(
    monkeypatch, head_copy_wins_at_1, head_small
):
    # The other layers' small copies may hold 4-bit blocks (faster than dot at a few rows);
    # the head's (Q8_0 in SmolLM2) has not, and on Zen 3 dot read it 1.8x faster than the
    # copy's widening GEMV. One split of all layers kept the copy for both.
    import runner.batched_rows

    seen: list[tuple[int, int, tuple[str, ...]]] = []

    def fake(layers, dtype, rows, paths, reps):
        seen.append((rows, len(layers), tuple(sorted(paths))))
        ms = {"own": 10.0, "small": 6.0, "dot": 5.0, "head_own": 10.0, "head_batched": 9.0}
        if rows <= 4:  # the body's copy (blocks) wins; the head's loses but maybe at 1 row
            ms |= {"small": 3.0, "head_small": 2.0 if head_copy_wins_at_1 and rows == 1 else 4.0}
            ms |= {"head_dot": 3.0}
        return {p: ms[p] for p in paths}

    monkeypatch.setattr(runner.batched_rows, "_time_paths", fake)
    monkeypatch.setattr(runner.batched_rows, "batched_kernels", lambda: {"dot": "avx2_madd"})
    model = torch.nn.Module()
    model.body, model.lm_head = Linear(64, 64), Linear(64, 128)
    pack_linears(model, "float", small_batch_int8="rows", batched_int8="dot")
    model.body.small_rows = model.lm_head.small_rows = 4
    choice = measure_batched_rows(
        model, torch.float32, candidates=(8, 16), reps=1, candidates_kernels=("dot",)
    )
    # Each split timed its own layers: the head alone, then the body without it.
    few = [s for s in seen if s[0] <= 4]
    assert [s[1:] for s in few if "head_small" in s[2]] == [(1, ("head_dot", "head_small"))] * 3
    assert [s[1:] for s in few if "small" in s[2]] == [(1, ("dot", "small"))] * 3
    assert choice.small_rows == 4 and model.body.small_rows == 4
    assert model.lm_head.small_rows == head_small and choice.head_small_rows == head_small
    assert model.lm_head.has_small_batch_int8 == bool(head_small)
    assert model.lm_head.kernel_for(1) == ("small" if head_small else "batched")
    assert model.lm_head.kernel_for(2) == "batched" and model.body.kernel_for(4) == "small"
    told = choice.describe()
    assert ("LM head on dot from 1 row" in told) == (not head_small), told
    assert ("LM head's small copy for <= 1 rows" in told) == bool(head_small), told


def test_the_start_up_log_tells_the_small_rows_the_batched_measurement_left(monkeypatch):
    import runner.batched_rows
    import runner.platform as hw

    monkeypatch.setattr(hw, "measure_small_rows", lambda model, dtype: 16)
    # The batched kernel wins from 8 rows: the small copies give up 5-16 (runner/batched_rows).
    won = runner.batched_rows.BatchedChoice("dot", 64, 4)
    measured = lambda model, dtype, step_rows=0: won  # noqa: E731
    monkeypatch.setattr(runner.batched_rows, "measure_batched_rows", measured)
    chosen = hw.Platform(torch.device("cpu"), torch.float32, "float",
                         small_batch_int8="rows", batched_int8="dot")  # fmt: skip
    chosen.prepare(torch.nn.Sequential(Linear(64, 64)))
    assert chosen.small_rows == 4 and chosen.batched_rows == 64
    told = chosen.describe()
    assert "(rows) for <= 4 rows" in told and "for 5-64 rows" in told, told
    assert told.index("<= 4 rows") < told.index("5-64 rows")
