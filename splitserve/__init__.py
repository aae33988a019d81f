"""splitserve: disaggregated LLM serving (prefill, decode and CPU tiers)."""

import os

__version__ = "0.1.0"

# OpenMP threads that wait between parallel regions sleep instead of spinning. A decode
# step runs a few hundred short parallel regions; on a machine whose cores are shared
# (a 2-core host running other work) spinning workers steal the cores the others need
# and a step took 3-5x longer (measured: 64-sequence offline run 41-57 s spinning, 10-13 s
# passive). Read by libgomp when torch loads, so it must be set before torch is
# imported; an explicit OMP_WAIT_POLICY in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# ...but first they spin briefly: 20,000 rounds (0.1-0.2 ms of a core after a region)
# bridge the microseconds between a step's back-to-back regions, where waking each worker
# from sleep cost more than the matmul (batch-1 decode of SmolLM2-135M, two threads: 30.8
# -> 19.2 ms a step), and end long before another process would miss the core. Only
# honoured while libgomp manages no more threads than there are CPUs: one team, the
# engine thread's (engine/async_engine.py).
os.environ.setdefault("GOMP_SPINCOUNT", "20000")
