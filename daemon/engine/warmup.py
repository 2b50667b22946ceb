"""One tiny request through the whole path, so the first client pays no first-call costs."""

from __future__ import annotations

from daemon.engine.client import EngineClient
from scheduling import SamplingParams


async def warm_up(engine: EngineClient) -> None:
    """Run a two-token greedy request to its end (the server and each replica do this)."""
    stream = engine.add_request(
        [engine.info.warmup_token_id, 1, 2],
        SamplingParams(max_tokens=2, temperature=0, ignore_eos=True),
    )
    try:
        async for delta in stream:
            if delta.finish_reason == "error":
                raise RuntimeError(f"warm-up request failed: {delta.stop_reason}")
    finally:
        stream.close()
