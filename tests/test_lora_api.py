"""LoRA adapters at the HTTP API, in-process on a tiny model with SmolLM2's tokenizer:
`model` routing, /v1/models with `parent`, 404 for unknown names, and the runtime
load/unload routes (off by default, behind the API key, 400 for a bad file)."""

from __future__ import annotations

import pytest
from lora_fixtures import make_peft_adapter
from reliability_fixtures import api_client, build_tiny_model_dir, load_tiny

from daemon.openai.options import APIOptions
from daemon.service.serve_config import parse_serve_args
from runner.model_source import resolve_model
from runner.tokenizer import load_tokenizer

BODY = {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("lora-api")
    build_tiny_model_dir(d / "base")
    tokenizer = load_tokenizer(resolve_model(None))
    overrides = dict(
        vocab_size=len(tokenizer), tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id
    )
    for name, seed, rank in (("one", 1, 4), ("two", 2, 8), ("big", 3, 32)):
        make_peft_adapter("llama-plain", d / name, seed, r=rank, model_overrides=overrides)
    return d, load_tiny(d / "base")


def _cfg(d, **extra):
    return dict(lora_modules=(f"one={d / 'one'}",), max_loras=2, max_lora_rank=8, **extra)


async def _complete(client, model: str | None) -> tuple[int, dict]:
    r = await client.post("/v1/completions", json={**BODY, "model": model} if model else BODY)
    return r.status, await r.json()


async def test_model_names_the_adapter_and_models_lists_it(tiny) -> None:
    d, loaded = tiny
    async with api_client(loaded, **_cfg(d)) as (client, api):
        models = (await (await client.get("/v1/models")).json())["data"]
        assert [(m["id"], m.get("parent")) for m in models] == [("tiny", None), ("one", "tiny")]
        card = await (await client.get("/v1/models/one")).json()
        assert card["parent"] == "tiny" and card["root"] == str(d / "one")

        status, base = await _complete(client, None)
        assert status == 200 and base["model"] == "tiny"
        status, adapted = await _complete(client, "one")
        assert status == 200 and adapted["model"] == "one"
        assert adapted["choices"][0]["text"] != base["choices"][0]["text"]
        assert api.engine.engine.runner.lora.table.resident() == [
            api.engine.engine.loras.get("one").lora_id
        ]

        status, err = await _complete(client, "three")
        assert status == 404 and err["error"]["param"] == "model"
        assert "'three' does not exist" in err["error"]["message"]
        assert "'one'" in err["error"]["message"]  # names what is served


async def test_runtime_updates_are_off_by_default(tiny) -> None:
    d, loaded = tiny
    async with api_client(loaded, **_cfg(d)) as (client, _):
        r = await client.post("/v1/load_lora_adapter", json={"lora_name": "two", "lora_path": "x"})
        assert r.status == 404
        assert "--enable-lora-runtime-updates" in (await r.json())["error"]["message"]


async def test_load_use_and_unload_at_run_time(tiny) -> None:
    d, loaded = tiny
    cfg = _cfg(d, enable_lora_runtime_updates=True)
    async with api_client(loaded, APIOptions(api_key="k"), **cfg) as (client, _):
        auth = {"Authorization": "Bearer k"}

        async def post(path: str, body: dict, headers=auth):
            r = await client.post(path, json=body, headers=headers)
            return r.status, await r.json()

        status, _ = await post("/v1/load_lora_adapter", {"lora_name": "two"}, headers={})
        assert status == 401  # behind the API key
        status, card = await post(
            "/v1/load_lora_adapter", {"lora_name": "two", "lora_path": str(d / "two")}
        )
        assert status == 200 and card["id"] == "two" and card["parent"] == "tiny"
        status, err = await post(
            "/v1/load_lora_adapter", {"lora_name": "two", "lora_path": str(d / "two")}
        )
        assert status == 400 and "served already" in err["error"]["message"]
        status, err = await post(
            "/v1/load_lora_adapter", {"lora_name": "big", "lora_path": str(d / "big")}
        )
        assert status == 400 and err["error"]["param"] == "lora_path"
        assert f"{d / 'big'}: " in err["error"]["message"] and "rank 32" in err["error"]["message"]
        status, err = await post("/v1/load_lora_adapter", {"lora_name": "x"})
        assert status == 400 and err["error"]["param"] == "lora_path"

        models = await (await client.get("/v1/models", headers=auth)).json()
        assert [m["id"] for m in models["data"]] == ["tiny", "one", "two"]
        r = await client.post("/v1/completions", json={**BODY, "model": "two"}, headers=auth)
        assert r.status == 200 and (await r.json())["model"] == "two"

        status, _ = await post("/v1/unload_lora_adapter", {"lora_name": "two"})
        assert status == 200
        r = await client.post("/v1/completions", json={**BODY, "model": "two"}, headers=auth)
        assert r.status == 404
        status, err = await post("/v1/unload_lora_adapter", {"lora_name": "two"})
        assert status == 404 and err["error"]["param"] == "lora_name"
        r = await client.post("/v1/completions", json={**BODY, "model": "one"}, headers=auth)
        assert r.status == 200  # the start-up adapter was never disturbed


def test_lora_flags_parse() -> None:
    cfg = parse_serve_args(
        ["--lora-modules", "a=/x", "b=/y.gguf", "--max-loras", "8", "--max-lora-rank", "32"],
        environ={},
    ).engine
    assert cfg.lora_modules == ("a=/x", "b=/y.gguf")
    assert (cfg.max_loras, cfg.max_lora_rank, cfg.enable_lora_runtime_updates) == (8, 32, False)
    env = parse_serve_args([], environ={"HEADRACE_LORA_MODULES": "a=/x b=/y"}).engine
    assert env.lora_modules == ("a=/x", "b=/y")


async def test_grammars_and_speculation_through_an_adapter(tiny) -> None:
    d, loaded = tiny
    cfg = _cfg(d, speculative_method="ngram", prompt_lookup_min=1)
    async with api_client(loaded, **cfg) as (client, _):
        for model in ("one", None):
            body = {**BODY, "max_tokens": 8, "guided_choice": ["yes", "no", "maybe"]}
            r = await client.post("/v1/completions", json={**body, "model": model or "tiny"})
            assert r.status == 200
            assert (await r.json())["choices"][0]["text"] in ("yes", "no", "maybe")
