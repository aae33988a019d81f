"""`splitserve bench`: load generator, streaming client, metrics, reports and plots (no torch)."""
