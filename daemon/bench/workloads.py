"""What each request asks for: random lengths, a shared prefix, a JSON-lines or ShareGPT file.

Lengths are counted in the target model's tokens: the prompts are built and measured with the
tokenizer of the served model (the embedded SmolLM2 by default).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from daemon.bench.results import SLOSpec


@dataclass(slots=True)
class BenchRequest:
    """One request to send: a prompt (text) or chat messages, and its output length."""

    prompt: str | None
    messages: list[dict[str, str]] | None
    prompt_tokens: int
    max_tokens: int
    request_class: str = "default"
    priority: int | None = None
    # Sent as the request's `slo` (headrace's slo policy reads it) when classes are used.
    slo: dict[str, float] | None = None
    # Sent as the OpenAI `user` field (`--tenants`); headrace's `fair` policy shares by it.
    tenant: str | None = None


@dataclass(frozen=True, slots=True)
class RequestClass:
    """A share of the traffic with its own priority and SLO (for `--class`)."""

    name: str
    share: float
    priority: int = 0
    slo: SLOSpec = field(default_factory=SLOSpec)

    @classmethod
    def parse(cls, text: str) -> RequestClass:
        """`NAME:SHARE[:PRIORITY[:TTFT_MS[:TPOT_MS]]]`, e.g. `chat:0.3:0:500:80`."""
        parts = text.split(":")
        if len(parts) < 2 or len(parts) > 5 or not parts[0]:
            raise ValueError(f"--class: {text!r} is not NAME:SHARE[:PRIORITY[:TTFT_MS[:TPOT_MS]]]")
        try:
            share = float(parts[1])
            priority = int(parts[2]) if len(parts) > 2 and parts[2] else 0
            ttft = float(parts[3]) if len(parts) > 3 and parts[3] else None
            tpot = float(parts[4]) if len(parts) > 4 and parts[4] else None
        except ValueError:
            raise ValueError(f"--class: {text!r} has a field that is not a number") from None
        if share <= 0:
            raise ValueError(f"--class: the share of {parts[0]} must be > 0")
        return cls(parts[0], share, priority, SLOSpec(ttft_ms=ttft, tpot_ms=tpot))


def sample_lengths(mean: int, range_ratio: float, n: int, rng: np.random.Generator) -> list[int]:
    """Integers uniform in [mean*(1-r), mean*(1+r)], at least 1 (vLLM's random dataset)."""
    if mean < 1:
        raise ValueError("lengths must be >= 1")
    if not 0 <= range_ratio < 1:
        raise ValueError("--range-ratio must be in [0, 1)")
    low = max(1, int(mean * (1 - range_ratio)))
    high = max(low, int(mean * (1 + range_ratio)))
    return rng.integers(low, high + 1, size=n).tolist()


class PromptMaker:
    """Builds text prompts of an exact length in the target tokenizer's tokens."""

    def __init__(self, tokenizer: Any, seed: int = 0) -> None:
        self.tok = tokenizer
        self.rng = np.random.default_rng(seed)
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        # Plain word pieces decode and re-encode stably, unlike bytes or special tokens.
        vocab = tokenizer.get_vocab()
        self.pool = np.array(
            sorted(
                i
                for t, i in vocab.items()
                if i not in special and t.isascii() and t.strip("Ġ▁").isalpha() and len(t) > 2
            )
        )
        if self.pool.size == 0:
            raise ValueError("the tokenizer has no plain word tokens to build prompts from")

    def count(self, text: str) -> int:
        return len(self.tok.encode(text, add_special_tokens=False))

    def make(self, n_tokens: int) -> str:
        """A random text of exactly `n_tokens` tokens (or as close as re-encoding allows)."""
        ids = self.rng.choice(self.pool, size=n_tokens).tolist()
        text = self.tok.decode(ids)
        for _ in range(4):
            enc = self.tok.encode(text, add_special_tokens=False)
            if len(enc) == n_tokens:
                break
            if len(enc) > n_tokens:
                text = self.tok.decode(enc[:n_tokens])
            else:
                extra = self.rng.choice(self.pool, size=n_tokens - len(enc)).tolist()
                text = self.tok.decode(enc + extra)
        return text


def random_workload(
    maker: PromptMaker, n: int, input_len: int, output_len: int, range_ratio: float, seed: int
) -> list[BenchRequest]:
    rng = np.random.default_rng(seed)
    ins = sample_lengths(input_len, range_ratio, n, rng)
    outs = sample_lengths(output_len, range_ratio, n, rng)
    out = []
    for i, o in zip(ins, outs):
        prompt = maker.make(i)
        out.append(BenchRequest(prompt, None, maker.count(prompt), o))
    return out


def prefix_workload(
    maker: PromptMaker,
    n: int,
    prefix_len: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    seed: int,
) -> list[BenchRequest]:
    """One long shared system prompt, then a different short question per request."""
    rng = np.random.default_rng(seed)
    system = maker.make(prefix_len)
    ins = sample_lengths(input_len, range_ratio, n, rng)
    outs = sample_lengths(output_len, range_ratio, n, rng)
    out = []
    for i, o in zip(ins, outs):
        question = maker.make(i)
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        prompt = system + "\n\n" + question
        out.append(BenchRequest(prompt, messages, maker.count(prompt), o))
    return out


_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}


def _from_record(obj: dict[str, Any], maker: PromptMaker, default_out: int) -> BenchRequest | None:
    """One JSON object: {"prompt"} or {"messages"}, or a ShareGPT {"conversations"}."""
    out_len = obj.get("output_len") or obj.get("max_tokens")
    if "conversations" in obj:
        turns = obj["conversations"]
        if len(turns) < 2:
            return None
        first, reply = turns[0], turns[1]
        if _ROLES.get(first.get("from", first.get("role", ""))) != "user":
            return None
        text = first.get("value", first.get("content", ""))
        answer = reply.get("value", reply.get("content", ""))
        out_len = out_len or max(1, maker.count(answer))
        messages = [{"role": "user", "content": text}]
        return BenchRequest(text, messages, maker.count(text), int(out_len))
    if "messages" in obj:
        messages = [{"role": m["role"], "content": m["content"]} for m in obj["messages"]]
        text = "\n".join(m["content"] for m in messages)
        return BenchRequest(text, messages, maker.count(text), int(out_len or default_out))
    if "prompt" in obj:
        text = obj["prompt"]
        messages = [{"role": "user", "content": text}]
        return BenchRequest(text, messages, maker.count(text), int(out_len or default_out))
    raise ValueError(f"a workload record needs prompt, messages or conversations: {obj!r:.80}")


def file_workload(
    path: str | Path, maker: PromptMaker, n: int, default_out: int, seed: int
) -> list[BenchRequest]:
    """Requests from a JSON-lines file or a ShareGPT JSON list; sampled with replacement when
    the file holds fewer usable records than `n`."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--dataset-path: {path} does not exist")
    text = path.read_text()
    try:
        if text.lstrip().startswith("["):
            objs = json.loads(text)
        else:
            objs = [json.loads(line) for line in text.splitlines() if line.strip()]
    except json.JSONDecodeError as e:
        raise ValueError(f"--dataset-path: {path} is not JSON lines or a JSON list: {e}") from None
    records = [r for r in (_from_record(o, maker, default_out) for o in objs) if r is not None]
    if not records:
        raise ValueError(f"--dataset-path: {path} holds no usable prompts")
    rng = np.random.default_rng(seed)
    if n <= len(records):
        order = rng.permutation(len(records))[:n]
    else:
        order = rng.integers(0, len(records), size=n)
    return [records[i] for i in order]


def assign_classes(
    requests: list[BenchRequest], classes: list[RequestClass], seed: int
) -> list[BenchRequest]:
    """Give each request a class drawn by the classes' traffic shares."""
    if not classes:
        return requests
    shares = np.array([c.share for c in classes], dtype=float)
    picks = np.random.default_rng(seed + 1).choice(
        len(classes), size=len(requests), p=shares / shares.sum()
    )
    for req, k in zip(requests, picks):
        c = classes[k]
        req.request_class, req.priority = c.name, c.priority
        bounds = {"ttft_ms": c.slo.ttft_ms, "tpot_ms": c.slo.tpot_ms}
        req.slo = {key: v for key, v in bounds.items() if v is not None} or None
    return requests
