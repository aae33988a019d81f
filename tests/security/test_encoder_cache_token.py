"""The encoder cache server of a deployment (`--ec-serve-port`) answers only the
deployment's internal token, which never crosses the wire: an engine's flags wire it from
the environment on both ends; a client without it, or with another, reads and writes
nothing, and a request captured on the wire is useless (the token is not in it)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
import zmq

from splitserve.engine.api.encode_routes import ECSetup
from splitserve.encoder_cache.tcp import TcpECConnector

IMAGE = "ab" * 32
INTRUDER_IMAGE = "cd" * 32


def _flags(**values: object) -> argparse.Namespace:
    defaults: dict[str, object] = {"ec_remote": None, "ec_shm_dir": None, "ec_serve_port": None}
    return argparse.Namespace(host="127.0.0.1", **(defaults | values))


def test_the_encoder_cache_server_answers_only_the_deployments_token(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("SPLITSERVE_INTERNAL_TOKEN", "the-deployment-token")
    served = ECSetup(_flags(ec_shm_dir=str(tmp_path), ec_serve_port=0), encoder_role=True)
    assert served.server is not None
    port = served.server.port
    remote = ECSetup(_flags(ec_remote=("127.0.0.1", port)), encoder_role=False).connector
    assert isinstance(remote, TcpECConnector)
    intruders = [TcpECConnector("127.0.0.1", port), TcpECConnector("127.0.0.1", port, token="guess")]
    context = zmq.Context()
    sniffer = context.socket(zmq.DEALER)
    try:
        embeddings = torch.arange(12, dtype=torch.float32).view(3, 4)
        remote.save_cache(IMAGE, embeddings)
        assert remote.has_cache(IMAGE)
        loaded = remote.load_cache(IMAGE, torch.device("cpu"))
        assert loaded is not None and torch.equal(loaded, embeddings)

        for intruder in intruders:
            assert not intruder.has_cache(IMAGE)
            assert intruder.load_cache(IMAGE, torch.device("cpu")) is None
            with pytest.raises(OSError, match="did not store"):
                intruder.save_cache(INTRUDER_IMAGE, torch.zeros(2, 2))
        assert not (tmp_path / f"{INTRUDER_IMAGE}.ec").exists()

        # the old wire format, the token in clear in the header: refused too
        sniffer.connect(f"tcp://127.0.0.1:{port}")
        header = {"op": "get", "id": 0, "hash": IMAGE, "token": "the-deployment-token"}
        sniffer.send_multipart([json.dumps(header).encode()])
        assert sniffer.poll(10_000)
        reply = sniffer.recv_multipart()
        assert len(reply) == 1 and json.loads(reply[0])["error"] == "unauthorized"
    finally:
        sniffer.close(linger=0)
        context.term()
        for connector in (remote, *intruders):
            connector.shutdown()
        served.close()
