"""Testing tools shipped with twophase (like ``pyspark.testing``): the reference job,
the exactly-once verifier, the chaos runner and private local servers.

This is the top layer with the CLI: nothing in the core, the coordinator or the
participants imports it.
"""
