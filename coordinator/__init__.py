"""The coordinator: durable decision log (store), HTTP service, and the ``twophase`` CLI."""
