"""The encoder cache: vision embeddings an encoder worker computes, kept by image hash for
the engines that use them (shared memory on one host, tcp across hosts)."""
