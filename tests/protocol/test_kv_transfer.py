"""kv_transfer_params: one typed class, one wire form with vLLM's key names."""

from __future__ import annotations

import pytest

from splitserve.protocol.kv_transfer import KVParamsError, KVTransferParams, RemoteAddress


def test_the_wire_form_round_trips_with_vllms_key_names():
    wire = {
        "do_remote_prefill": True,
        "transfer_mode": "pull",
        "remote_engine_id": "prefill-1",
        "remote_host": "10.0.0.2",
        "remote_port": 5555,
        "remote_request_id": "r1",
        "remote_block_ids": [4, 5, 6],
        "remote_num_tokens": 40,
        "prompt_token_ids": [1, 2, 3],
    }
    params = KVTransferParams.from_wire(wire)
    assert params.to_wire() == wire and params.invalid is None
    assert params.remote_address() == RemoteAddress("prefill-1", "10.0.0.2", 5555)
    assert params.block_ids() == (4, 5, 6) and params.mode("push") == "pull"
    assert KVTransferParams(do_remote_decode=True).to_wire() == {"do_remote_decode": True}
    assert KVTransferParams.from_wire(None) == KVTransferParams()
    assert KVTransferParams().mode("push") == "push"


def test_fields_that_cannot_describe_a_transfer_are_named_not_fatal():
    bogus = {"do_remote_prefill": True, "remote_block_ids": "nope", "remote_host": "h", "remote_port": "x"}
    params = KVTransferParams.from_wire(bogus)
    assert params.do_remote_prefill and params.remote_block_ids is None
    with pytest.raises(KVParamsError, match="remote_port"):
        params.remote_address()
    with pytest.raises(KVParamsError, match="remote_block_ids"):
        params.block_ids()
    assert KVTransferParams.from_wire({"remote_block_ids": [1, True]}).remote_block_ids is None
