"""An engine's load and cache figures as plain data (`EngineStats`), read on its loop thread."""

from __future__ import annotations

from typing import TYPE_CHECKING

from daemon.engine import kv_connector as kv_connectors
from daemon.engine.client import EngineStats

if TYPE_CHECKING:
    from daemon.engine.engine import Engine


def engine_stats(engine: Engine) -> EngineStats:
    """Gauges as they are now; once-only figures (compile times, queue times) drained."""
    sched, kv, grammars = engine.scheduler, engine.kv, engine.grammars
    compiles = grammars.stats
    queue_times = list(engine.queue_times)
    engine.queue_times.clear()
    return EngineStats(
        failure=engine.fatal,
        running=len(sched.running),
        waiting=len(sched.waiting),
        kv_usage=kv.usage(),
        prefix_hit_rate=kv.prefix_stats.hit_rate,
        prefix_query_tokens=kv.prefix_stats.queries,
        prefix_hit_tokens=kv.prefix_stats.hits,
        preemptions=sched.num_preemptions,
        interrupted_steps=sched.num_undone_steps,
        constrained_requests=grammars.num_requests,
        grammar_cache_hits=compiles.hits if compiles else 0,
        grammar_cache_misses=compiles.misses if compiles else 0,
        grammar_compile_seconds=list(compiles.drain_compile_seconds()) if compiles else [],
        spec=sched.spec_stats,
        tenant_queue_seconds=queue_times,
        kv_connector=kv_connectors.connector_stats(engine.kv_connector, sched, kv.block_size),
    )
