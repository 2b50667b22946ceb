"""Speculative decoding's set-up for one engine: the config, its proposer, adaptive k."""

from __future__ import annotations

from daemon.engine.config import EngineConfig
from plugins import load_proposer
from runner.spec_decode import Proposer, SpeculativeConfig
from runner.spec_decode.draft_length import AdaptiveDraftLength


def speculative_config(config: EngineConfig) -> SpeculativeConfig:
    return SpeculativeConfig(
        config.speculative_method,
        config.num_speculative_tokens,
        config.prompt_lookup_min,
        config.prompt_lookup_max,
        config.speculative_adaptive,
    )


def build_proposer(spec: SpeculativeConfig) -> Proposer | None:
    """The proposer plugin named by `spec.method`, or None with speculation off."""
    return load_proposer(spec.method, spec) if spec.enabled else None


def draft_length(spec: SpeculativeConfig) -> AdaptiveDraftLength | None:
    """With --speculative-adaptive: the controller that tunes k per step from acceptance."""
    if spec.enabled and spec.adaptive:
        return AdaptiveDraftLength(spec.num_speculative_tokens)
    return None


def describe(spec: SpeculativeConfig) -> str:
    return f"{spec.method} k={spec.num_speculative_tokens}" if spec.enabled else "off"
