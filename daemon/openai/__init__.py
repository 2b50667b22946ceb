"""The OpenAI-compatible HTTP layer: routes, request parsing and validation, response and
SSE shaping, tools, structured-output mapping, errors, auth, metrics. It reaches an engine
only through daemon.engine.client.EngineClient."""
