"""LoRA adapters from peft and llama.cpp's GGUF, over HF, GGUF and embedded bases: the
logits equal peft's merged model, and bad files fail at load naming the problem."""

from __future__ import annotations

import gguf
import numpy as np
import orjson
import pytest
import torch
from lora_fixtures import adapted_logits, make_peft_adapter, write_gguf_lora
from model_fixtures import make_tiny_hf_model
from test_gguf_loader import llama_cpp_permute, write_gguf

from runner.loader import load_model
from runner.lora import LoRABase, LoRAError, LoRAManager, load_adapter
from runner.model_source import ModelSource, resolve_model

CPU = torch.device("cpu")
IDS = [5, 17, 200, 3, 99, 42, 7, 11]


def _serve(directory, gguf_file=None, max_rank=8):
    model, cfg = load_model(ModelSource(directory, gguf_file), CPU)
    base = LoRABase.of(model, cfg)
    return model, base, LoRAManager(model, base, 2, max_rank, CPU, torch.float32)


def _hf_logits(hf, ids=IDS) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def hf_base(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(f"base-{request.param}")
    make_tiny_hf_model(request.param, directory)
    return request.param, directory


@pytest.mark.parametrize(
    "extra",
    [
        {},
        # q/v only at rank 6, with rsLoRA's alpha / sqrt(r) and per-module overrides.
        {
            "r": 6,
            "targets": ["q_proj", "v_proj", "down_proj"],
            "use_rslora": True,
            "rank_pattern": {"down_proj": 2},
            "alpha_pattern": {"v_proj": 3.0},
        },
    ],
)
def test_peft_adapter_matches_peft_merged_model(hf_base, tmp_path, extra) -> None:
    kind, directory = hf_base
    merged = make_peft_adapter(kind, tmp_path / "adapter", seed=1, **extra)
    model, base, manager = _serve(directory)
    adapter = load_adapter("tuned", tmp_path / "adapter", base, 8)
    ours = adapted_logits(model, manager, adapter, IDS)
    ref = _hf_logits(merged)
    assert (ours - ref).abs().max().item() < 1e-4
    # The adapter matters, and the base path is untouched by the installed wrappers.
    plain = adapted_logits(model, manager, None, IDS)
    assert (plain - ref).abs().max().item() > 0.1
    assert (plain - _hf_logits(make_tiny_hf_model(kind))).abs().max().item() < 1e-4


@pytest.fixture(scope="module")
def llama_adapter(tmp_path_factory):
    """A tiny plain Llama as an HF directory and as a GGUF file, and a peft adapter for it
    in both formats."""
    d = tmp_path_factory.mktemp("gguf-base")
    hf = make_tiny_hf_model("llama-plain", d)
    write_gguf(d / "base.gguf", hf)
    merged = make_peft_adapter("llama-plain", d / "peft", seed=2, alpha=12.0)
    write_gguf_lora(d / "adapter.gguf", d / "peft", hf.config, alpha=12.0)
    return d, _hf_logits(merged)


def test_peft_adapter_over_a_gguf_base(llama_adapter) -> None:
    d, ref = llama_adapter
    model, base, manager = _serve(d, d / "base.gguf")  # Q/K rows unpermuted at load
    adapter = load_adapter("tuned", d / "peft", base, 8)
    assert (adapted_logits(model, manager, adapter, IDS) - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("gguf_base", [False, True])
def test_gguf_lora_matches_peft_merged_model(llama_adapter, gguf_base) -> None:
    d, ref = llama_adapter
    model, base, manager = _serve(d, d / "base.gguf" if gguf_base else None)
    adapter = load_adapter("tuned", d / "adapter.gguf", base, 8)
    assert (adapted_logits(model, manager, adapter, IDS) - ref).abs().max().item() < 1e-4


def test_gguf_lora_over_the_embedded_model(tmp_path) -> None:
    """llama.cpp's layout over the embedded SmolLM2 (a permuted llama GGUF): the adapter's
    logits equal the same model with B @ A merged into its HF-layout weights."""
    source = resolve_model(None)
    model, cfg = load_model(source, CPU)
    torch.manual_seed(3)
    path = tmp_path / "smol-lora.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_type(gguf.GGUFType.ADAPTER)
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, 8.0)
    pairs = {}
    for layer in (0, 7):
        for name, gname, rows in (
            ("q_proj", "attn_q", cfg.q_size),
            ("k_proj", "attn_k", cfg.kv_size),
        ):
            heads = cfg.num_attention_heads if name == "q_proj" else cfg.num_key_value_heads
            a, b = torch.randn(4, cfg.hidden_size) * 0.1, torch.randn(rows, 4) * 0.1
            pairs[layer, name] = (a, b)
            w.add_tensor(f"blk.{layer}.{gname}.weight.lora_a", a.numpy())
            w.add_tensor(f"blk.{layer}.{gname}.weight.lora_b",
                         np.ascontiguousarray(llama_cpp_permute(b.numpy(), heads)))  # fmt: skip
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    base = LoRABase.of(model, cfg)
    manager = LoRAManager(model, base, 1, 8, CPU, torch.float32)
    adapter = load_adapter("smol", path, base, 8)
    ids = [1, 504, 3458, 314, 260, 2095, 30]
    ours = adapted_logits(model, manager, adapter, ids)
    plain = adapted_logits(model, manager, None, ids)
    assert (ours - plain).abs().max().item() > 0.01
    with torch.no_grad():  # merge by hand: scale alpha / r = 2
        for (layer, name), (a, b) in pairs.items():
            qkv = model.layers[layer].self_attn.qkv_proj.base.weight
            rows = base.targets[name].rows
            qkv[rows] += 2.0 * b @ a
    merged = adapted_logits(model, None, None, ids)
    assert (ours - merged).abs().max().item() < 1e-3


# -- bad adapters: clear errors at load -------------------------------------------------


@pytest.fixture(scope="module")
def llama_base(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama")
    make_tiny_hf_model("llama-plain", d)
    model, cfg = load_model(ModelSource(d, None), CPU)
    return d, LoRABase.of(model, cfg)


def test_rank_above_max_lora_rank_is_refused(llama_base, tmp_path) -> None:
    _, base = llama_base
    make_peft_adapter("llama-plain", tmp_path / "big", seed=0, r=16)
    with pytest.raises(
        LoRAError, match=r"big: layers\.0\.\w+ has rank 16, above --max-lora-rank 8"
    ):
        load_adapter("big", tmp_path / "big", base, 8)


def test_adapter_of_another_base_is_refused(llama_base, tmp_path) -> None:
    _, base = llama_base
    from peft import LoraConfig, get_peft_model

    wider = make_tiny_hf_model("llama-plain", hidden_size=96)
    get_peft_model(wider, LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(
        tmp_path / "wide"
    )
    with pytest.raises(
        LoRAError, match=r"q_proj maps 96 -> 96 features, the base.s q_proj maps 64 -> 64"
    ):
        load_adapter("wide", tmp_path / "wide", base, 8)


def test_missing_files_are_named(llama_base, tmp_path) -> None:
    d, base = llama_base
    with pytest.raises(LoRAError, match="no such adapter"):
        load_adapter("x", tmp_path / "nowhere.gguf", base, 8)
    with pytest.raises(LoRAError, match=r"no adapter_config\.json"):
        load_adapter("x", d, base, 8)  # the base model's own directory
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "adapter_config.json").write_bytes(orjson.dumps({"r": 2}))
    with pytest.raises(LoRAError, match=r"no adapter_model\.safetensors"):
        load_adapter("x", tmp_path / "half", base, 8)


def test_a_model_gguf_is_not_an_adapter(llama_base, tmp_path) -> None:
    _, base = llama_base
    write_gguf(tmp_path / "model.gguf", make_tiny_hf_model("llama-plain"))
    with pytest.raises(LoRAError, match="not a LoRA adapter"):
        load_adapter("x", tmp_path / "model.gguf", base, 8)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"use_dora": True}, "DoRA adapters are not served"),
        ({"target_modules": ["embed_tokens", "q_proj"]}, "embeddings, LM head or biases"),
    ],
)
def test_unsupported_variants_are_refused(llama_base, tmp_path, config, message) -> None:
    _, base = llama_base
    from peft import LoraConfig, get_peft_model

    target = config.pop("target_modules", ["q_proj"])
    peft_model = get_peft_model(
        make_tiny_hf_model("llama-plain"), LoraConfig(r=2, target_modules=target, **config)
    )
    peft_model.save_pretrained(tmp_path / "odd")
    with pytest.raises(LoRAError, match=message):
        load_adapter("x", tmp_path / "odd", base, 8)
