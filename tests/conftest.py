"""Shared fixtures: torch-free schedulers and requests with a controllable clock."""

from __future__ import annotations

import itertools
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from daemon_fixtures import Daemon

from kvcache import KVCacheManager
from plugins import load_policy
from scheduling import (
    SLO,
    Request,
    RunnerOutput,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)

# Triton reads TRITON_INTERPRET when it decorates a kernel, its own library's included, so
# the mode is fixed when triton is first imported, by whichever module does it (transformers
# may). Without a GPU the interpreter is the only way triton runs at all, so setting it for
# the session changes nothing else; with one, the kernel tests run compiled on the GPU.
# (The same test as the Makefile's for "this machine has CUDA".)
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")


class FakeClock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    policy: str = "fcfs",
    enable_prefix_caching: bool = True,
    hash_algo: str = "sha256",
    **cfg: object,
) -> Scheduler:
    cfg.setdefault("watermark", 0.0)
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching, hash_algo)
    return Scheduler(SchedulerConfig(**cfg), kv, load_policy(policy), FakeClock())


_ids = itertools.count()


def make_request(
    prompt: list[int] | int = 8,
    max_tokens: int = 4,
    priority: int = 0,
    arrival: float | None = None,
    slo: SLO | None = None,
    cache_salt: str | None = None,
    request_id: str | None = None,
    **params: object,
) -> Request:
    n = next(_ids)
    if isinstance(prompt, int):
        prompt = [1000 + n * 997 % 5000 + i for i in range(prompt)]
    params.setdefault("ignore_eos", True)
    return Request(
        request_id=request_id or f"req-{n}",
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=max_tokens, **params),  # type: ignore[arg-type]
        arrival_time=float(n) if arrival is None else arrival,
        eos_token_id=2,
        priority=priority,
        slo=slo,
        cache_salt=cache_salt,
    )


def make_requests(n: int, prompt_len: int = 8, **kw: object) -> list[Request]:
    return [make_request(prompt_len, **kw) for _ in range(n)]  # type: ignore[arg-type]


def sample_all(sched: Scheduler, out: SchedulerOutput, token: int = 7) -> RunnerOutput:
    """What a runner would return: one token for each request that reached its end."""
    return RunnerOutput({rid: [token] for rid in out.sampling_req_ids if rid in sched.requests})


def step(sched: Scheduler, token: int = 7) -> SchedulerOutput:
    out = sched.schedule()
    sched.update(out, sample_all(sched, out, token))
    sched.check_integrity()
    return out


def run_to_completion(sched: Scheduler, max_steps: int = 10_000) -> Iterator[SchedulerOutput]:
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return
        yield step(sched)
    raise AssertionError("requests did not finish")


@pytest.fixture(scope="session")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """One real daemon on the embedded model, shared by every end-to-end test module."""
    d = Daemon(
        tmp_path_factory.mktemp("daemon"),
        "--max-model-len",
        "512",
        "--policy",
        "slo",
        "--max-num-seqs",
        "40",
        env={"WATCHDOG_USEC": "2000000"},
    )
    yield d
    d.stop()


@pytest.fixture
def scheduler_factory() -> Callable[..., Scheduler]:
    return make_scheduler


def pytest_configure(config: pytest.Config) -> None:
    # One intra-op thread: with two, a libgomp team collapses whenever anything else holds a
    # core (measured: up to 20x slower steps), and tests run beside each other.
    import torch

    torch.set_num_threads(1)


# What each narrowing flag takes away, as /proc/cpuinfo names it.
_NARROWED_FEATURE = {"-mno-avx512f": "avx512f", "-mno-avxvnni": "avx_vnni"}


@pytest.fixture(scope="session")
def isa_build(
    tmp_path_factory: pytest.TempPathFactory,
) -> Callable[[str], tuple[dict, Path] | None]:
    """`isa_build(flags) -> (env, cache)`: the environment in which a subprocess loads the
    kernels built with narrowed ISA flags (`-mno-avx512f`...), and the cache directory whose
    `cpu_ops/*/built.ok` that build leaves.

    Narrowed builds all go to one directory shared by both xdist workers (torch's builder
    locks a build directory), so each flag set builds once per run, ~100-180 s apiece on two
    cores. Where the CPU has none of the features the flags take away (an AVX2-only CPU asked
    for `-mno-avx512f`), `-march=native` already builds exactly that and this run's own tests
    run on it: the subprocess would run them a second time (~170 s of a Zen 3 CI run). There
    it checks that the suite's build has no AVX-512 kernel and returns None.
    """
    from runner.cache_dir import cache_dir
    from runner.cpu_ops import EXTRA_CFLAGS_ENV, load_cpu_ops
    from runner.layers.batched_int8 import batched_kernels
    from runner.layers.q4_blocks import q4_gemv_kernels
    from runner.platform import read_cpu_flags

    base = tmp_path_factory.getbasetemp()
    root = base.parent if base.name.startswith("popen-gw") else base
    narrowed = root / "isa-builds"
    narrowed.mkdir(exist_ok=True)
    have = read_cpu_flags()

    def env_for(flags: str) -> tuple[dict, Path] | None:
        if not any(_NARROWED_FEATURE[f] in have for f in flags.split()):
            assert load_cpu_ops() is None, "the CPU kernels did not build"
            isas = {**batched_kernels(), **q4_gemv_kernels()}  # batched includes "q4"
            assert isas and not any("avx512" in i for i in isas.values()), (cache_dir(), isas)
            return None
        env = {**os.environ, EXTRA_CFLAGS_ENV: flags, "HEADRACE_CACHE_DIR": str(narrowed)}
        return env, narrowed

    return env_for


@pytest.fixture(scope="session")
def smollm():
    """The embedded SmolLM2 on the exact fp32 path, loaded once (engines share its weights)."""
    from daemon.engine.config import EngineConfig
    from daemon.engine.loaded_model import LoadedModel

    return LoadedModel.load(EngineConfig(device="cpu", dtype="float32", quantization="none"))


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """A tiny random Llama with SmolLM2's vocabulary, tokenizer and chat template (the API
    tests in tests/reliability/ run on it)."""
    from reliability_fixtures import build_tiny_model_dir, load_tiny

    return load_tiny(build_tiny_model_dir(tmp_path_factory.mktemp("tiny-smol")))
