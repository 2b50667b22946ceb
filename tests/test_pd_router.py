"""The ReplicaSet's P/D mode against fake replicas (no processes): the prompt goes to a
producer first, then the request to a consumer naming that producer's KV address; an abort
at the prefill reaches the producer and nothing else; a failed prefill names no producer."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from daemon.engine.client import ModelInfo
from daemon.engine.config import EngineConfig
from daemon.engine.outputs import Delta
from daemon.replicas.messages import Abort, Add, Deltas, Hello
from daemon.replicas.prefill_decode import PDLayout
from daemon.replicas.replica import ReplicaSpec
from daemon.replicas.replica_set import ReplicaSet
from daemon.replicas.routing import make_router
from scheduling import SamplingParams

PARAMS = SamplingParams(max_tokens=3, temperature=0)
PROMPT = list(range(20, 40))


class FakeChannel:
    """A replica that records what it is sent; the test feeds what it answers."""

    def __init__(self, spec: ReplicaSpec) -> None:
        self.spec, self.pid = spec, 1000 + spec.index
        self.sent: list[object] = []
        self.inbox: asyncio.Queue[object] = asyncio.Queue()

    def send(self, message: object) -> None:
        self.sent.append(message)

    async def recv(self) -> object:
        return await self.inbox.get()

    def kill(self) -> None:
        pass

    async def close(self, timeout: float) -> None:
        pass


class FakeBackend:
    name = "fake"

    def __init__(self) -> None:
        self.channels: dict[int, FakeChannel] = {}

    async def connect(self, spec: ReplicaSpec) -> tuple[FakeChannel, Hello]:
        channel = self.channels[spec.index] = FakeChannel(spec)
        return channel, Hello(ModelInfo("tiny", 512, 1000), channel.pid, 1)

    async def shutdown(self) -> None:
        pass


async def open_pd(tmp_path: Path, producers: int, consumers: int, timeout_s: float = 300.0):
    config = EngineConfig(block_size=4)
    layout = PDLayout(producers, consumers, str(tmp_path), timeout_s)
    n = layout.num_replicas
    backend = FakeBackend()
    rs = ReplicaSet(
        config,
        n,
        backend,
        make_router("round_robin", config, n),
        False,
        layout,
        make_router("round_robin", config, n),
    )
    await rs.open(None)
    return rs, backend, layout


def adds(channel: FakeChannel) -> list[Add]:
    return [m for m in channel.sent if isinstance(m, Add)]


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_prompt_on_a_producer_then_the_stream_from_a_consumer_naming_it(tmp_path):
    rs, backend, layout = await open_pd(tmp_path, producers=2, consumers=1)
    try:
        p0, p1, c = (backend.channels[i] for i in range(3))
        assert (p0.spec.engine.kv_role, p0.spec.engine.kv_peer) == (
            "producer",
            layout.kv_address(0),
        )
        assert (c.spec.engine.kv_role, c.spec.engine.kv_peer) == ("consumer", None)
        for turn, producer in enumerate((p0, p1)):  # round robin over the producers
            stream = rs.add_request(PROMPT, PARAMS, cache_salt="s", grammar=None)
            [prefill] = adds(producer)[-1:]
            assert prefill.params.max_tokens == 1 and prefill.options == {"cache_salt": "s"}
            assert len(adds(c)) == turn  # the consumer waits for the prompt's KV
            assert rs.num_in_flight_requests == 1
            producer.inbox.put_nowait(_finished(prefill.request_id, "length"))
            await settle()
            decode = adds(c)[-1]
            assert decode.request_id == stream.request_id and decode.params is PARAMS
            assert decode.options["kv_source"] == layout.kv_address(producer.spec.index)
            c.inbox.put_nowait(_finished(stream.request_id, "length", [7, 8, 9]))
            assert [d.new_token_ids async for d in stream] == [[7, 8, 9]]
        assert rs.pd.prefills == {"ok": 2, "failed": 0, "timeout": 0, "none": 0}
        assert rs.num_in_flight_requests == 0 and rs.replicas[2].reserved == 0
    finally:
        await rs.stop()
    assert not Path(layout.kv_dir).exists()  # the socket folder goes with the front door


async def test_an_abort_at_the_prefill_reaches_the_producer_only(tmp_path):
    rs, backend, _ = await open_pd(tmp_path, producers=1, consumers=1)
    try:
        p, c = backend.channels[0], backend.channels[1]
        stream = rs.add_request(PROMPT, PARAMS)
        [prefill] = adds(p)
        stream.close()  # the client went away
        await settle()
        assert [m for m in p.sent if isinstance(m, Abort)] == [Abort([prefill.request_id])]
        assert adds(c) == [] and rs.num_in_flight_requests == 0
        assert rs.replicas[1].reserved == 0 and rs.replicas[0].streams == {}
    finally:
        await rs.stop()


@pytest.mark.parametrize("how", ["failed", "none", "timeout"])
async def test_a_failed_prefill_sends_the_request_naming_no_producer(tmp_path, how):
    rs, backend, _ = await open_pd(tmp_path, 1, 1, timeout_s=0.2 if how == "timeout" else 300)
    try:
        p, c = backend.channels[0], backend.channels[1]
        if how == "none":  # the producer is down
            rs.replicas[0].healthy = False
        stream = rs.add_request(PROMPT, PARAMS)
        if how == "failed":
            [prefill] = adds(p)
            p.inbox.put_nowait(_finished(prefill.request_id, "error"))
        await settle()
        if how == "timeout":  # the producer hangs: no answer at all
            assert adds(c) == []
            await asyncio.sleep(0.3)
            [prefill] = adds(p)
            assert [m for m in p.sent if isinstance(m, Abort)] == [Abort([prefill.request_id])]
        [decode] = adds(c)
        assert decode.request_id == stream.request_id and "kv_source" not in decode.options
        want = {"ok": 0, "failed": 0, "timeout": 0, "none": 0} | {how: 1}
        assert rs.pd.prefills == want and rs.replicas[0].streams == {}
    finally:
        await rs.stop()


def _finished(rid: str, reason: str, tokens: list[int] | None = None) -> Deltas:
    delta = Delta.ending(rid, reason, "")
    delta.new_token_ids = tokens or []
    return Deltas([delta], [])


def test_pd_flags_are_checked_with_names():
    from daemon.service.replicas import pd_layout
    from daemon.service.serve_config import parse_serve_args

    assert pd_layout(parse_serve_args([])) is None
    for argv, field in (
        (["--prefill-replicas", "1"], "decode_replicas"),
        (["--prefill-replicas", "1", "--decode-replicas", "1", "--data-parallel-size", "2"],
         "data_parallel_size"),
        (["--prefill-replicas", "1", "--decode-replicas", "1", "--distributed-backend", "ray"],
         "prefill_replicas"),
        (["--prefill-replicas", "1", "--decode-replicas", "1", "--kv-connector", "disk"],
         "kv_connector"),
    ):  # fmt: skip
        with pytest.raises(ValueError, match=field):
            pd_layout(parse_serve_args(argv))
    layout = pd_layout(parse_serve_args(["--prefill-replicas", "2", "--decode-replicas", "3"]))
    assert layout is not None and (layout.producers, layout.consumers) == (2, 3)
    assert oct(Path(layout.kv_dir).stat().st_mode & 0o777) == "0o700"
    Path(layout.kv_dir).rmdir()
