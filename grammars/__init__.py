"""Structured output: grammar compile cache, per-request matchers, token bitmasks."""
