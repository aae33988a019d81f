"""The KV transports: how KV blocks cross between engines (shm, tcp, auto), their per-peer
send lanes, control channel, message MACs and the receiver's arrival tracking."""
