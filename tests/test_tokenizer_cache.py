"""The converted GGUF tokenizer's cache: renamed into place whole, never half-written."""

from __future__ import annotations

import shutil

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from runner.model_source import resolve_model
from runner.tokenizer import load_tokenizer


def test_a_racing_conversion_keeps_the_first_and_leaves_no_staging(monkeypatch, tmp_path):
    monkeypatch.setenv("HEADRACE_CACHE_DIR", str(tmp_path))
    save = PreTrainedTokenizerBase.save_pretrained
    targets = []

    def save_then_lose_the_race(self, directory, *args, **kwargs):
        out = save(self, directory, *args, **kwargs)
        # Another replica finishes its own conversion first and renames it into place.
        target = tmp_path / "tokenizers" / str(directory).split("/")[-1].split(".")[0]
        shutil.copytree(directory, target)
        (target / "theirs").touch()
        targets.append(target)
        return out

    monkeypatch.setattr(PreTrainedTokenizerBase, "save_pretrained", save_then_lose_the_race)
    source = resolve_model(None)
    first = load_tokenizer(source)
    assert first is not None and len(targets) == 1
    entries = sorted(p.name for p in (tmp_path / "tokenizers").iterdir())
    assert entries == [targets[0].name]  # the staging directory is gone
    assert (targets[0] / "theirs").exists()  # the winner's directory was not replaced

    # The next start loads the cached directory, not the GGUF.
    loads = []
    from_pretrained = AutoTokenizer.from_pretrained

    def recorded(path, *args, **kwargs):
        loads.append((str(path), kwargs.get("gguf_file")))
        return from_pretrained(path, *args, **kwargs)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", recorded)
    again = load_tokenizer(source)
    assert loads == [(str(targets[0]), None)]
    text = "Hello, world! Ünïcode and code: def f(x): return x"
    assert again.encode(text) == first.encode(text)
