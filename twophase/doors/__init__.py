"""The front doors, thin over the engine: ``foreachbatch`` (``TransactionalSink``) and
``datasource`` (``df.writeStream.format("twophase")``)."""
