"""`headrace bench`: a serving benchmark for OpenAI-compatible endpoints (headrace or a peer)."""
