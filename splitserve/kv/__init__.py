"""The KV cache between engines: the connector the engine calls (connector/) and the
transports that move the blocks (transport/)."""
