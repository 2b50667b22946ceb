"""GGUF loading on files written here: llama.cpp's Q/K layout, quant types, clear errors."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from model_fixtures import make_tiny_hf_model

from runner.attention import build_metadata
from runner.loader import load_model
from runner.loaders.gguf_loader import GGUFModel, unpermute_qk
from runner.model_source import ModelSource

NAMES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}  # fmt: skip


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to Q/K rows (written from its documented layout)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def write_gguf(path, hf, arch="llama", qtype=gguf.GGMLQuantizationType.F32):
    cfg = hf.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(cfg.vocab_size)
    w.add_eos_token_id(2)
    for name, t in hf.state_dict().items():
        a = t.float().numpy()
        name = name.removeprefix("model.")
        if name == "embed_tokens.weight":
            out = "token_embd.weight"
        elif name == "norm.weight":
            out = "output_norm.weight"
        elif name == "lm_head.weight":
            out = "output.weight"
        else:
            _, i, *rest = name.split(".")
            out = f"blk.{i}.{NAMES['.'.join(rest[:-1])]}.{rest[-1]}"
            if "q_proj" in name:
                a = llama_cpp_permute(a, cfg.num_attention_heads)
            if "k_proj" in name:
                a = llama_cpp_permute(a, cfg.num_key_value_heads)
        if a.ndim == 2 and qtype == gguf.GGMLQuantizationType.IQ4_NL:
            # gguf cannot quantize to IQ4_NL; zero bytes of the right size still load.
            raw = np.zeros(gguf.quants.quant_shape_to_byte_shape(a.shape, qtype), np.uint8)
            w.add_tensor(out, raw, raw_dtype=qtype)
        elif a.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            w.add_tensor(out, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(out, np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf"), make_tiny_hf_model("llama-plain")


def our_logits(model, ids):
    cfg = model.config
    caches = [torch.zeros(2, 8, 16, cfg.num_key_value_heads, cfg.head_dim) for _ in model.layers]
    meta = build_metadata([0], [len(ids)], [list(range(8))], 16, torch.device("cpu"))
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), caches, meta))


def test_unpermute_inverts_llama_cpp():
    w = np.random.default_rng(0).standard_normal((4 * 8, 5)).astype(np.float32)
    back = unpermute_qk(torch.from_numpy(llama_cpp_permute(w, 4)), 4)
    assert torch.equal(back, torch.from_numpy(w))


@pytest.mark.parametrize(
    "qtype,tol",
    [
        (gguf.GGMLQuantizationType.F32, 1e-4),
        (gguf.GGMLQuantizationType.F16, 0.05),
        (gguf.GGMLQuantizationType.Q8_0, 0.2),
    ],
)
def test_gguf_logits_match_the_hf_model(tiny, qtype, tol):
    d, hf = tiny
    path = d / f"tiny-{qtype.name}.gguf"
    write_gguf(path, hf, qtype=qtype)
    model, cfg = load_model(ModelSource(d, path), torch.device("cpu"))
    assert cfg.architecture == "LlamaForCausalLM" and cfg.vocab_size == 320
    ids = [5, 17, 200, 3, 99, 42, 7]
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0]
    assert (our_logits(model, ids) - ref).abs().max().item() < tol


def test_unsupported_architecture_is_named(tiny, tmp_path):
    _, hf = tiny
    path = tmp_path / "odd.gguf"
    write_gguf(path, hf, arch="gpt2")
    with pytest.raises(ValueError, match=r"unsupported GGUF architecture 'gpt2'.*llama"):
        GGUFModel(path)


def test_unsupported_quant_type_is_named(tiny, tmp_path):
    _, hf = tiny
    path = tmp_path / "q.gguf"
    write_gguf(path, hf, qtype=gguf.GGMLQuantizationType.IQ4_NL)
    with pytest.raises(ValueError, match="unsupported quant type IQ4_NL"):
        GGUFModel(path)
