"""The thread governor: one thread while a core is taken, every core when they are free."""

from __future__ import annotations

import itertools

from runner.thread_governor import ThreadGovernor, read_idle_seconds


class FakeMachine:
    """Wall, process CPU and machine idle clocks that a test advances step by step."""

    def __init__(self) -> None:
        self.wall = self.cpu = self.idle = 0.0

    def run_step(self, gov: ThreadGovernor, seconds: float, cpu_share: float, idle_cores: float):
        """One step of `seconds`: our threads got `cpu_share` of what they asked for, and
        `idle_cores` cores sat idle meanwhile."""
        threads = gov.threads()
        self.wall += seconds
        self.cpu += seconds * threads * cpu_share
        self.idle += seconds * idle_cores
        gov.step_done()
        return threads


def governor(machine: FakeMachine, cores: int = 2) -> ThreadGovernor:
    return ThreadGovernor(
        cores,
        window_s=0.3,
        wall=lambda: machine.wall,
        cpu=lambda: machine.cpu,
        idle=lambda: machine.idle,
    )


def test_quiet_machine_keeps_every_core():
    m = FakeMachine()
    gov = governor(m)
    used = [m.run_step(gov, 0.05, cpu_share=0.98, idle_cores=0.0) for _ in range(100)]
    assert set(used) == {2} and gov.switches == 0


def test_a_busy_neighbour_sends_steps_to_one_thread_and_they_stay_there():
    m = FakeMachine()
    gov = governor(m)
    # A worker descheduled half of the time: the team got 55% of two cores.
    used = [m.run_step(gov, 0.05, cpu_share=0.55, idle_cores=0.0) for _ in range(40)]
    assert used[0] == 2 and used[-1] == 1
    first_single = used.index(1)
    assert first_single <= 7  # one 0.3 s window of 50 ms steps, then the switch
    assert set(used[first_single:]) == {1}  # no idle core: it does not flap back
    assert gov.switches == 1 and gov.reason == "our threads got 55% of their cores"


def test_the_team_comes_back_when_the_neighbour_leaves():
    m = FakeMachine()
    gov = governor(m)
    for _ in range(10):
        m.run_step(gov, 0.05, cpu_share=0.5, idle_cores=0.0)
    assert gov.current == 1
    # The other core now sits idle while our single thread runs.
    used = [m.run_step(gov, 0.05, cpu_share=1.0, idle_cores=0.9) for _ in range(10)]
    assert used[-1] == 2 and gov.switches == 2 and gov.reason == "0.90 cores sat idle"


def test_a_partly_idle_other_core_is_not_enough_to_come_back():
    m = FakeMachine()
    gov = governor(m)
    for _ in range(10):
        m.run_step(gov, 0.05, cpu_share=0.5, idle_cores=0.0)
    used = [m.run_step(gov, 0.05, cpu_share=1.0, idle_cores=0.3) for _ in range(20)]
    assert set(used) == {1}


def test_one_core_means_no_governing():
    m = FakeMachine()
    assert not governor(m, cores=1).enabled
    assert governor(m).enabled


def test_without_proc_stat_the_team_is_probed_with_a_growing_wait():
    """systemd's ProcSubset=pid hides /proc/stat: the governor still works, by probing."""
    m = FakeMachine()
    gov = ThreadGovernor(
        2, window_s=0.3, probe_s=1.0, max_probe_s=4.0,
        wall=lambda: m.wall, cpu=lambda: m.cpu, idle=lambda: None,
    )  # fmt: skip
    assert gov.enabled
    busy = [m.run_step(gov, 0.05, cpu_share=0.5, idle_cores=0.0) for _ in range(400)]
    assert busy[-1] == 1 or busy[-2] == 1
    # Probes (runs of 2) after 1, 2 then 4 s of single-thread steps (80 steps) at most.
    teams = sum(1 for a, b in itertools.pairwise(busy) if a == 1 and b == 2)
    assert 3 <= teams <= 6, teams
    assert busy.count(2) <= 7 * (teams + 1)  # each probe is one 0.3 s window of 50 ms steps
    # The neighbour leaves: the next probe finds the cores free and keeps them.
    quiet = [m.run_step(gov, 0.05, cpu_share=1.0, idle_cores=1.0) for _ in range(200)]
    assert quiet[-50:] == [2] * 50


def test_reads_this_machines_idle_time():
    first = read_idle_seconds()
    assert first is not None and first >= 0  # Linux, where the daemon runs
    second = read_idle_seconds()
    assert second is not None and second >= first


def test_engine_steps_on_the_governors_thread_count(tiny):
    import torch
    from model_fixtures import engine_for

    from scheduling import SamplingParams

    try:
        engine = engine_for(tiny, threads=2, kv_cache_memory=8 << 20)
        assert engine.governor is not None
        calls: list[int] = []
        real_execute = engine.runner.execute

        def spy(so):
            calls.append(torch.get_num_threads())
            return real_execute(so)

        engine.runner.execute = spy  # type: ignore[method-assign]
        engine.governor.current = 1  # as if a neighbour had taken a core
        params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
        (out,) = engine.generate([[5, 6, 7]], params)
        assert len(out.token_ids) == 3
        assert calls and set(calls) == {1}
        assert not engine_for(tiny, threads=2, thread_governor=False).governor
    finally:
        torch.set_num_threads(1)  # the suite's setting (tests/conftest.py)
