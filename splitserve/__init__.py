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
