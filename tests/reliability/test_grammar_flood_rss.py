"""The daemon's RSS under a grammar flood (issue 25's target: <= model + KV + grammar cache
budget + 20%), the one-hour flood shortened to what CI allows: distinct guided_choice lists
and JSON schemas, each a new compile, against a small --grammar-cache-mb. The daemon and its
compile workers (its children) are measured together from /proc."""

from __future__ import annotations

import random
import string
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from daemon_fixtures import Daemon
from reliability_fixtures import build_tiny_model_dir

CACHE_MB = 16
KV_MB = 8
# Distinct grammars in the flood, and how many are in flight at once.
FLOOD = 15
IN_FLIGHT = 4
# Each choice list: CHOICES strings of CHOICE_LEN letters, ~10 MiB compiled on SmolLM2's 49k
# tokens (xgrammar's figure; ~0.6 s to compile): the flood's 10 lists hold ~100 MiB together.
CHOICES, CHOICE_LEN = 100, 400
CHOICE_MB = 10
# Growth allowed past the cache budget: allocator slack, the requests' own buffers.
SLACK_MB = 32


def tree_rss_mb(pid: int) -> float:
    """VmRSS of `pid` and all its descendants, in MiB."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue  # it ended meanwhile
        kb = next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS"))
        total += int(kb)
    return total / 1024


def choice_body(i: int) -> dict:
    rng = random.Random(i)
    choices = ["".join(rng.choices(string.ascii_letters, k=CHOICE_LEN)) for _ in range(CHOICES)]
    return {"prompt": "Pick:", "max_tokens": 1, "guided_choice": choices}


def schema_body(i: int) -> dict:
    props = {f"f{i}_{j}": {"type": ["string", "integer", "boolean"][j % 3]} for j in range(6)}
    schema = {"type": "object", "properties": props, "required": [*props]}
    return {"prompt": "JSON:", "max_tokens": 1, "guided_json": schema}


@pytest.fixture(scope="module")
def flooded(tmp_path_factory) -> Daemon:
    model = build_tiny_model_dir(tmp_path_factory.mktemp("flood-model"))
    d = Daemon(
        tmp_path_factory.mktemp("flood"),
        "--model",
        str(model),
        "--max-model-len",
        "256",
        "--kv-cache-memory",
        str(KV_MB << 20),
        "--grammar-cache-mb",
        str(CACHE_MB),
        "--grammar-workers",
        "2",
    )
    yield d
    d.stop()


def post(url: str, body: dict) -> int:
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120).status_code


def test_rss_stays_within_model_kv_cache_budget_and_20_percent(flooded):
    url = flooded.url
    # Warm: both compile workers started and each past a large compile (a worker's RSS
    # steps up once, at its first), one grammar of each kind served.
    warmup = [choice_body(-1), choice_body(-2), schema_body(-1)]
    with ThreadPoolExecutor(IN_FLIGHT) as pool:
        assert list(pool.map(post, [url] * 3, warmup)) == [200] * 3
    warm = tree_rss_mb(flooded.proc.pid)  # model + KV + runtime + workers, cache ~empty
    bodies = [choice_body(i) if i % 3 else schema_body(i) for i in range(FLOOD)]
    with ThreadPoolExecutor(IN_FLIGHT) as pool:
        statuses = list(pool.map(post, [url] * FLOOD, bodies))
    assert statuses == [200] * FLOOD
    after = tree_rss_mb(flooded.proc.pid)
    bound = 1.2 * (warm + CACHE_MB)
    print(f"RSS warm {warm:.0f} MiB -> after {FLOOD} grammars {after:.0f} MiB (bound {bound:.0f})")
    assert after <= bound, (warm, after)
    # Sharper than the target (whose 20% of a warm daemon is more than the flood holds):
    # growth stays near the cache budget, far below what the flood's grammars hold
    # together, which a cache bounded by count would have kept.
    held_mb = CHOICE_MB * sum(1 for i in range(FLOOD) if i % 3)
    assert held_mb >= 2 * (CACHE_MB + SLACK_MB)
    assert after - warm <= CACHE_MB + SLACK_MB, (warm, after)
