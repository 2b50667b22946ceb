"""The daemon: engine loop, HTTP/SSE API, Unix socket, systemd integration, CLI."""
