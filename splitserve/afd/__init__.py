"""Attention-FFN disaggregation: the FFN daemon that computes a MoE model's experts
(ffn_server.py) and the attention engine's client to it (ffn_client.py). docs/afd.md."""
