"""The process around the API: `headrace` CLI, serve configuration, listening sockets,
systemd integration (notify, watchdog, socket activation, unit files), drain on stop."""
