"""Speculative decoding: proposers that guess the next tokens, verified in one forward.

Proposers register in the `headrace.proposers` entry-point group (the built-in `ngram`
too) and are loaded with `plugins.load_proposer`.
"""

from runner.spec_decode.config import SpeculativeConfig
from runner.spec_decode.ngram import NgramProposer
from runner.spec_decode.proposer import PROPOSER_API_VERSION, DraftRequest, Proposer

__all__ = [
    "PROPOSER_API_VERSION",
    "DraftRequest",
    "NgramProposer",
    "Proposer",
    "SpeculativeConfig",
]
