"""Many engine replicas behind one front end: the prefix-aware :class:`Router` (fed by each
replica's KV events, :mod:`pagedkv.kv_events`). Ray is imported only by the modules that need it,
never here, so routing and the simulated cluster run without Ray."""

from pagedkv.cluster.router import POLICIES, NoReplicaError, ReplicaLoad, Router, UnknownReplicaError

__all__ = ["POLICIES", "NoReplicaError", "ReplicaLoad", "Router", "UnknownReplicaError"]
