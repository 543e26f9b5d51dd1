"""The batch engine: the protocol's steps in order, shared by both doors.

``plan`` (what travels driver -> tasks), ``prepare`` (the batch's Spark job) with the
executor's branch runner beside it (``task``, ``feed``, ``finish``; ``native``: Spark's
own writer prepares), ``decide``, ``commit``, ``report``; ``recover`` (a restart's
in-doubt attempt) and ``resolve`` (an operator's settle). Importing it never imports
pyspark."""
