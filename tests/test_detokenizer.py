import pytest

from daemon.engine.detokenizer import IncrementalDetokenizer
from runner.model_source import resolve_model
from runner.tokenizer import load_tokenizer
from scheduling import SamplingParams


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(resolve_model(None))


TEXT = "Héllo wörld — a naïve café, 北京 🚀 and spaces:   done."


def stream(tok, text, params, prompt="Say:"):
    detok = IncrementalDetokenizer(tok, tok.encode(prompt), params)
    pieces = [detok.add([t]) for t in tok.encode(text)]
    pieces.append(detok.flush())
    return pieces, detok


def test_incremental_text_equals_full_decode(tok):
    pieces, _ = stream(tok, TEXT, SamplingParams())
    assert "".join(pieces) == tok.decode(tok.encode(TEXT))
    assert not any("\ufffd" in p for p in pieces)  # never half a character


def test_stop_string_truncates_and_is_never_streamed(tok):
    pieces, detok = stream(tok, TEXT, SamplingParams(stop=["café"]))
    text = "".join(pieces)
    assert detok.stop_reason == "café"
    assert text == tok.decode(tok.encode(TEXT)).split("café")[0]
    kept, _ = stream(tok, TEXT, SamplingParams(stop=["café"], include_stop_str_in_output=True))
    assert "".join(kept).endswith("café")


def test_stop_string_split_across_tokens(tok):
    params = SamplingParams(stop=["wörld —"])
    pieces, detok = stream(tok, TEXT, params)
    assert detok.stop_reason == "wörld —"
    assert "".join(pieces).rstrip() == "Héllo"
