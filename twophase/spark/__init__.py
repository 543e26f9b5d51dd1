"""Spark introspection: what the driver reads from Spark (session, lineage, split,
cluster shape, versions), never a step of the protocol."""
