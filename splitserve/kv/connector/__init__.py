"""The KV connector: the engine's KV seam (base.py), the P/D connector over the transports
(pd_connector.py: a prefill side and a decode side over shared load state) and the
in-process one the tests use."""
