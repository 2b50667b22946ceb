"""Tensor parallelism: sharding rules, the process group, the step ring, the workers."""
