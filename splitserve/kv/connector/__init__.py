"""The KV connector: the engine's KV seam (base.py), the P/D connector over the transports
(pd_connector.py: reservations, prefix lending, layer push, handoff reports) and the
in-process one the tests use."""
