"""The coordinator's client: the HTTP calls (``api``), the wire codec both sides share
(``wire``) and a ``coordinator=`` setting turned into a connection (``connection``).
Imports no pyspark: the daemon and the command install without it."""
