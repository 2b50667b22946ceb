"""Models for runner tests: the embedded SmolLM2 (ours and transformers') and tiny random ones."""

from __future__ import annotations

from pathlib import Path

import torch

from daemon.engine.config import EngineConfig
from daemon.engine.engine import Engine
from daemon.engine.loaded_model import LoadedModel
from runner.model_source import resolve_model


def hf_greedy(hf_model: torch.nn.Module, prompt_ids: list[int], n: int) -> list[int]:
    """transformers' own greedy decoding of exactly n tokens, EOS included as a token.

    NOTE: not min_new_tokens, which would forbid EOS instead of ignoring it. Memoised on the
    model object: several tests ask transformers the same question.
    """
    memo = hf_model.__dict__.setdefault("_headrace_greedy", {})
    key = (tuple(prompt_ids), n)
    if key not in memo:
        memo[key] = _hf_generate(hf_model, prompt_ids, n)
    return list(memo[key])


def _hf_generate(hf_model: torch.nn.Module, prompt_ids: list[int], n: int) -> list[int]:
    hf_model.generation_config.eos_token_id = None
    out = hf_model.generate(
        torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False, pad_token_id=0
    )
    assert out.shape[1] == len(prompt_ids) + n
    return out[0, len(prompt_ids) :].tolist()


def load_hf_smollm() -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    src = resolve_model(None)
    return AutoModelForCausalLM.from_pretrained(
        src.path, gguf_file=src.gguf_file.name, dtype=torch.float32
    ).eval()


def sixteen_chat_prompts(tokenizer) -> list[str]:  # type: ignore[no-untyped-def]
    """16 chat prompts: 4 questions in 4 phrasings, so no two share a whole prefix."""
    questions = ["the capital of France", "the boiling point of water", "a prime number",
                 "the largest planet"]  # fmt: skip
    asks = ["What is {}?", "Tell me {}.", "Please name {}.", "Do you know {}?"]
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": a.format(q)}], add_generation_prompt=True, tokenize=False
        )
        for q in questions
        for a in asks
    ]


def engine_for(loaded: LoadedModel, **cfg: object) -> Engine:
    cfg.setdefault("threads", 1)
    return Engine(EngineConfig(**cfg), loaded)  # type: ignore[arg-type]


def make_tiny_hf_model(
    kind: str, directory: Path | None = None, **overrides: object
) -> torch.nn.Module:
    """A random tiny model of the given family, saved as config.json + safetensors.

    Kinds: llama (with llama3 RoPE scaling), llama-plain, qwen2, qwen3. `overrides` replace
    config fields (a real tokenizer's vocabulary, tied embeddings, its EOS id).
    """
    import transformers as tf

    torch.manual_seed(0)
    common = dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        # A wide init gives peaked logits, so greedy choices are not near-ties.
        initializer_range=0.2,
        tie_word_embeddings=False,
    )
    common.update(overrides)
    if kind == "llama":
        cfg = tf.LlamaConfig(
            **common,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 4.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        )
        model = tf.LlamaForCausalLM(cfg)
    elif kind == "llama-plain":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**common))
    elif kind == "qwen2":
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**common))
    elif kind == "qwen3":
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**common, head_dim=24))
    else:
        raise ValueError(kind)
    model = model.float().eval()
    if directory is not None:
        model.save_pretrained(directory)
    return model
