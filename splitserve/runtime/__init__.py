"""The torch-free runtime every tier shares: the HTTP edge, drain and access checks of its
server, per-client quotas, pooled clients to the other tiers, ports and process lifetime.
The pure wire shapes they carry are `protocol/`."""
