"""splitserve: disaggregated LLM serving (prefill, decode and CPU tiers)."""

__version__ = "0.1.0"
