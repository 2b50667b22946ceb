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


def test_windows_decode_through_the_rust_tokenizer_as_transformers_would(tok):
    from daemon.engine.detokenizer import window_decoder

    # The embedded tokenizer cleans up no spaces, so its windows skip transformers' wrapper.
    assert window_decoder(tok) == tok.backend_tokenizer.decode
    ids = tok.encode(TEXT + " <|im_end|>")
    for skip in (True, False):
        for end in range(1, len(ids) + 1):
            window = ids[max(0, end - 6) : end]
            assert window_decoder(tok)(window, skip_special_tokens=skip) == tok.decode(
                window, skip_special_tokens=skip
            )

    class Cleaning:  # a tokenizer whose decode does more than its backend's
        backend_tokenizer = tok.backend_tokenizer
        clean_up_tokenization_spaces = True
        decode = tok.decode

    assert window_decoder(Cleaning()) == Cleaning.decode


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
