"""The embedded SmolLM2-135M-Instruct: token-for-token equal to transformers on the same GGUF."""

from __future__ import annotations

import pytest
import torch
from model_fixtures import engine_for, hf_greedy, load_hf_smollm

from daemon.engine.loaded_model import LoadedModel
from runner.attention import build_metadata
from runner.model_runner import kv_bytes_per_block
from scheduling import SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Hi",
    "Write a haiku about the sea.",
    "Explain, in two sentences, why the sky is blue during the day and red at sunset.",
    "List three prime numbers.",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 12?",
    "Give me a short, friendly tip for learning to play the guitar as an adult beginner.",
]
SYSTEM = (
    "You are a careful assistant for a library. Answer briefly and accurately, cite no "
    "sources, and never invent book titles. If you do not know, say so plainly."
)
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def hf_smollm():
    return load_hf_smollm()


def chat_ids(loaded: LoadedModel, question: str, system: str | None = None) -> list[int]:
    messages = [{"role": "user", "content": question}]
    if system:
        messages.insert(0, {"role": "system", "content": system})
    text = loaded.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    return loaded.tokenizer.encode(text)


def test_gguf_config_is_smollm2(smollm):
    cfg = smollm.config
    assert (cfg.architecture, cfg.num_hidden_layers, cfg.hidden_size) == (
        "LlamaForCausalLM",
        30,
        576,
    )
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (9, 3, 64)
    assert cfg.tie_word_embeddings and cfg.eos_token_ids == [2]


@pytest.mark.parametrize("block_size", [16, 4])
def test_greedy_equals_transformers_chunked_and_preempted(smollm, hf_smollm, block_size):
    prompts = [chat_ids(smollm, q) for q in QUESTIONS]
    per_block = kv_bytes_per_block(smollm.config, block_size, torch.float32)
    # Room for about half of what the eight requests need at once: preemption must happen.
    need = sum(-(-(len(p) + NEW_TOKENS) // block_size) for p in prompts)
    engine = engine_for(
        smollm,
        block_size=block_size,
        max_num_batched_tokens=40,
        long_prefill_token_threshold=7,
        kv_cache_memory=per_block * (need // 2),
    )
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    ours = engine.generate(prompts, params)
    assert engine.scheduler.num_preemptions > 0
    for p, c in zip(prompts, ours):
        assert c.token_ids == hf_greedy(hf_smollm, p, NEW_TOKENS)
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    engine.kv.check_integrity()


def test_greedy_equals_transformers_with_prefix_cache_hits(smollm, hf_smollm):
    prompts = [chat_ids(smollm, q, SYSTEM) for q in QUESTIONS[:4]]
    engine = engine_for(smollm, kv_cache_memory=64 << 20)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    first = engine.generate(prompts[:1], params)
    rest = engine.generate(prompts[1:], params)
    for p, c in zip(prompts[1:], rest):
        common = next(i for i, (x, y) in enumerate(zip(p, prompts[0])) if x != y)
        assert common >= 32
        assert c.cached_tokens == common // 16 * 16  # every full block of the shared prefix
    for p, c in zip(prompts, first + rest):
        assert c.token_ids == hf_greedy(hf_smollm, p, NEW_TOKENS)
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_mixed_batch_logits_match_transformers(smollm, hf_smollm):
    model, cfg = smollm.model, smollm.config
    a, b, c = (chat_ids(smollm, q) for q in QUESTIONS[:3])
    bs = 16
    caches = [torch.zeros(2, 24, bs, cfg.num_key_value_heads, cfg.head_dim) for _ in model.layers]
    tables = [list(range(0, 8)), list(range(8, 16)), list(range(16, 24))]
    cpu = torch.device("cpu")
    with torch.inference_mode():
        meta = build_metadata([0], [len(a) - 1], tables[:1], bs, cpu)
        model(torch.tensor(a[:-1]), torch.arange(len(a) - 1), caches, meta)
        ids = [a[-1], *b[:9], *c]
        pos = [len(a) - 1, *range(9), *range(len(c))]
        meta = build_metadata([len(a) - 1, 0, 0], [1, 9, len(c)], tables, bs, cpu)
        logits = model.compute_logits(model(torch.tensor(ids), torch.tensor(pos), caches, meta))
        ref = torch.cat(
            [
                hf_smollm(torch.tensor([a])).logits[0, -1:],
                hf_smollm(torch.tensor([b[:9]])).logits[0],
                hf_smollm(torch.tensor([c])).logits[0],
            ]
        )
    assert (logits - ref).abs().max().item() < 1e-3


def test_seeded_sampling_is_reproducible_and_seeds_differ(smollm):
    engine = engine_for(smollm, kv_cache_memory=32 << 20)
    prompt = chat_ids(smollm, "Tell me a story about a dragon.")

    def run(seed: int) -> list[int]:
        p = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, seed=seed, ignore_eos=True)
        # Batch-mates differ between runs: a seeded request must not care.
        (out, *_) = engine.generate([prompt, *[prompt[: 5 + seed % 7]] * (seed % 3)], p)
        return out.token_ids

    assert run(1) == run(1)
    assert run(1) != run(2)
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_stop_string_and_eos_end_requests(smollm):
    engine = engine_for(smollm, kv_cache_memory=32 << 20)
    prompt = chat_ids(smollm, "What is the capital of France?")
    (plain,) = engine.generate([prompt], SamplingParams(max_tokens=40, temperature=0))
    assert plain.finish_reason == "stop" and "Paris" in plain.text  # ended by EOS
    (cut,) = engine.generate([prompt], SamplingParams(max_tokens=40, temperature=0, stop=["Paris"]))
    assert cut.finish_reason == "stop" and "Paris" not in cut.text
    assert plain.text.startswith(cut.text)
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_cli_generate_offline(capsys):
    from daemon.service.cli import main

    # Float weights: the fast paths' start-up timings pick kernels whose sums differ in order,
    # and this prompt's first token is a near-tie there (oneDNN fp32, which --quantization auto
    # takes on Zen 1, answers "L'Étoile"; MKL fp32 and the int16 dot kernel answer "The").
    args = ["generate", "What is the capital of France?", "--max-tokens", "12"]
    assert main([*args, "--quantization", "none"]) == 0
    assert "Paris" in capsys.readouterr().out
