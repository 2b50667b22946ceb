"""Model definitions, weight loaders, attention backends, sampler and ModelRunner."""
