"""Data-parallel replicas: N full engines in their own processes (or Ray actors) behind one
front door. `ReplicaSet` is the EngineClient the API talks to; a router picks a replica per
request. Imports: daemon.service -> daemon.replicas -> daemon.engine, scheduling, kvcache,
plugins."""
