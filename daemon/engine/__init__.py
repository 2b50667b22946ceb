"""The engine room: the step loop (Engine), its asyncio driver with the batch queue
(AsyncEngine), engine configuration, model loading, detokenization, grammar waiting,
and the EngineClient seam the API layer talks to (client.py)."""
