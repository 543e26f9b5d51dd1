"""The coordinator: the durable decision log and the HTTP service around it.

Modules, in the order a request meets them: ``guard`` (token, body size) -> ``app``
(routes) with ``models`` (request bodies) -> ``store`` (protocol + compare-and-set) ->
``groupcommit`` (one transaction per group of requests) -> ``sql`` (statements, rows) ->
``db`` (engines); ``schema`` holds the tables. Beside them: ``hub`` (long-poll wakeups),
``maintenance`` and ``background`` (deadlines, alerts, retention), ``metrics``, ``logs``,
``listing`` (operators' listings) and ``embedded`` (the service inside a Spark driver).
"""
