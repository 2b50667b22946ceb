"""Layers whose kernels depend on the platform (weight formats)."""
