"""`splitserve up --ray` on a local two-node Ray cluster (`ray.cluster_utils.Cluster`),
the tiny Qwen2-VL: prefill on the head node, the encoder on the other, one decode slot on
each (custom resources), checked against the collocated `splitserve serve`; images
through the encoder tier, KV over shm within a node and tcp across, live scaling, a
killed decode replica, a killed ingress replica (its streams end, the tiers stay, the
new one answers), `down --ray`; config errors stop before anything is deployed."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from splitserve.model.tiny import write_tiny_model
from splitserve.model.tiny_text import TinyModelSpec
from tests.conftest import free_port, running_server
from tests.ray.ray_helpers import (
    API_KEY,
    APP,
    AUTH,
    PLANNER_INTERVAL_S,
    app_replicas,
    check_the_planner_follows_a_stepped_rate,
    planner_profile,
    wait_for,
    workers,
)
from tests.ray.ray_store_checks import check_a_killed_store_costs_only_hits, check_the_kv_store
from tests.router.test_pd_proxy import chat_token_ids, chats, metric
from tests.service.image_requests import PICTURES, counter, image_chat_body

ray = pytest.importorskip("ray", reason="ray is not installed: pip install 'splitserve[ray]'")


async def deployed_token_ids(base: str, messages: list[list[dict]], max_tokens: int = 8) -> list[list[int]]:
    """`chat_token_ids` against the Ray deployment, with its API key."""
    async with httpx.AsyncClient(timeout=120, headers=AUTH) as client:

        async def one(m: list[dict]) -> list[int]:
            body = {"messages": m, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True}
            response = await client.post(f"{base}/v1/chat/completions", json=body)
            assert response.status_code == 200, response.text
            return response.json()["choices"][0]["token_ids"]

        return list(await asyncio.gather(*(one(m) for m in messages)))


def splitserve(*args: str, env: dict[str, str] | None = None, timeout: float = 240):
    return subprocess.run(
        [sys.executable, "-m", "splitserve.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


@pytest.fixture(scope="module")
def tiny_model() -> Iterator[str]:
    """The tiny Qwen2-VL (text and images), in a directory of this module's own: the Ray
    workers read it for the whole module, past any other pytest session's clean-up of its
    base temp."""
    directory = tempfile.mkdtemp(prefix="splitserve-ray-model-")
    try:
        yield str(write_tiny_model(Path(directory), TinyModelSpec(arch="qwen2_vl")))
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def up_args(address: str, model: str, port: int) -> list[str]:
    """Prefill on the head node, the encoder on the other, one decode slot on each: decode
    autoscales 1 -> 2 on its load signal (KV blocks in use, reported every second), at a
    target any request exceeds, and then runs one replica on each node; a KV store replica
    wherever it fits."""
    return [
        "up", model, "--ray", address, "--ray-app-name", APP, "--port", str(port),
        "--num-blocks", "512", "--max-model-len", "1024",
        "--min-prefill-tokens", "16", "--pd-decision", "threshold",
        "--open-health-metrics", "--encoder", "1", "--kv-store", "--kv-store-ram-gb", "0.25",
        "--ray-tier", "kvstore:num_cpus=0.25",
        "--ray-tier", "render:num_cpus=0.5", "--ray-tier", "prefill:num_cpus=0.5,prefill_node=1",
        "--ray-tier", "encoder:num_cpus=0.5,encoder_node=1",
        "--ray-tier",
        "decode:num_cpus=0.5,decode_node=1,max_replicas=2,target=0.0001,upscale_delay_s=0,metrics_interval_s=1",
    ]  # fmt: skip


@contextlib.contextmanager
def steady_load(base: str, messages: list[dict]) -> Iterator[None]:
    """Requests one after another (so decode holds KV blocks, its load signal) until the
    block ends."""
    stop = threading.Event()

    def run() -> None:
        with httpx.Client(timeout=120, headers=AUTH) as client:
            while not stop.is_set():
                body = {"messages": messages, "max_tokens": 32, "temperature": 0}
                assert client.post(f"{base}/v1/chat/completions", json=body).status_code == 200

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def test_resources_no_node_has_stop_the_deploy_with_a_clear_message(cluster, tiny_model):
    """(The errors told without a cluster: tests/ray/test_ray_config.py.)"""
    args = [
        "--ray-tier",
        "decode:decode_node=1,num_gpus=1",
        "--ray-app-name",
        APP,
        "--port",
        str(free_port()),
    ]
    done = splitserve("up", tiny_model, "--ray", cluster, *args)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "decode: no node in the cluster has CPU=1, GPU=1, decode_node=1 for one replica" in done.stderr
    assert "nothing deployed" in done.stderr
    assert not app_replicas()


def test_a_tier_that_cannot_start_fails_the_deploy_with_its_reason(cluster, tiny_model, tmp_path):
    config = tmp_path / "ray.yaml"
    config.write_text(
        f"model: {tiny_model}\napp_name: {APP}\nhttp_port: {free_port()}\n"
        "engine_args: [--no-such-flag]\nrender_args: [--no-such-flag]\n"
        "tiers: {render: {num_cpus: 0.5}, decode: {num_cpus: 0.5}}\n"
    )
    done = splitserve("up", "--ray", cluster, "--ray-config", str(config))
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    # both tiers are broken: Serve reports whichever failed first (decode, on a loaded machine)
    assert re.search(r"(render|decode) server exited \(2\)", done.stderr), done.stderr
    for why in ("unrecognized arguments: --no-such-flag", "removing the app"):
        assert why in done.stderr, done.stderr
    assert not app_replicas()


def test_tiers_on_two_nodes_scale_survive_a_killed_replica_and_go_down(cluster, tiny_model, secrets_env):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "splitserve.cli", *up_args(cluster, tiny_model, port)]
    up = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **secrets_env}
    )
    serve_port = free_port()  # the reference starts while the deployment does
    with running_server(
        ["serve", tiny_model, "--port", str(serve_port), "--num-blocks", "1024", "--max-model-len", "1024"],
        serve_port,
    ) as ref:
        stdout, stderr = up.communicate(timeout=240)
        assert up.returncode == 0, stdout + stderr
        check_the_deployment(base, ref, stdout, secrets_env)

    # down: the application and its servers are gone
    urls = [m["url"] for m in workers()]
    done = splitserve("down", "--ray", cluster, "--ray-app-name", APP)
    assert done.returncode == 0, done.stderr
    assert not app_replicas()
    for url in urls:
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{url}/health", timeout=2)


def check_the_deployment(base: str, collocated: str, stdout: str, secrets_env: dict[str, str]) -> None:
    assert (
        f"OpenAI API: {base}/v1" in stdout and "KV over auto (shm within a node, tcp across nodes)" in stdout
    )

    # placement: prefill on the head node, the encoder on the other; the secrets never on a command line
    members = workers()
    nodes = {m["role"]: m["node_id"] for m in members}
    assert set(nodes) == {"render", "prefill", "decode", "encoder", "kvstore"}
    assert nodes["prefill"] != nodes["encoder"]
    token = secrets_env["SPLITSERVE_INTERNAL_TOKEN"]
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            with contextlib.suppress(OSError):
                assert token.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()

    # the same greedy tokens as `serve`, through the openai client too; KV crossed by tcp
    messages = chats()
    expected = asyncio.run(chat_token_ids(collocated, messages))
    assert asyncio.run(deployed_token_ids(base, messages)) == expected
    assert httpx.post(f"{base}/v1/chat/completions", json={"messages": messages[0]}).status_code == 401
    assert httpx.get(f"{base}/health").status_code == 200  # --open-health-metrics: probes need no key
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY)
    reference = openai.OpenAI(base_url=f"{collocated}/v1", api_key="unused")
    stream = client.chat.completions.create(
        model=None, messages=messages[1], max_tokens=8, temperature=0, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    want = reference.chat.completions.create(model=None, messages=messages[1], max_tokens=8, temperature=0)
    assert text == want.choices[0].message.content
    auth = {"Authorization": f"Bearer {token}"}
    url = {m["role"]: m["url"] for m in members}
    assert httpx.get(f"{url['decode']}/health").status_code == 401  # the token guards the engines
    check_images(base, collocated, members, auth)
    check_the_kv_store(base, collocated, members, auth)

    # decode scales 1 -> 2 live on its load (the other tiers keep running): the router uses both
    with steady_load(base, messages[0]):
        wait_for(lambda: sum(m["role"] == "decode" and m["healthy"] for m in workers()) == 2, what="scale-up")
    assert {m["url"] for m in workers() if m["role"] != "decode"} == {
        m["url"] for m in members if m["role"] != "decode"
    }
    asyncio.run(deployed_token_ids(base, chats() * 2))
    decodes = [m for m in workers() if m["role"] == "decode"]
    assert len(decodes) == 2 and all(m["served"] > 0 for m in decodes), decodes
    # one decode on each node: the one beside prefill got its KV through shared memory,
    # the other over tcp (`auto`, chosen per pair)
    assert {m["node_id"] for m in decodes} == {nodes["prefill"], nodes["encoder"]}
    for decode in decodes:
        kv_info = httpx.get(f"{decode['url']}/inference/v1/kv/info", headers=auth).json()
        path, other = ("shm", "tcp") if decode["node_id"] == nodes["prefill"] else ("tcp", "shm")
        assert kv_info["transport"] == "auto", kv_info
        assert kv_info["received_bytes"][path] > 0 and kv_info["received_bytes"][other] == 0, (path, kv_info)
        decode_metrics = httpx.get(f"{decode['url']}/metrics", headers=auth).text
        assert metric(decode_metrics, "splitserve_kv_transfer_bytes_total", '{direction="received"}') > 0

    # kill one decode replica while requests run: none is lost, Serve replaces it, the
    # router drops the dead worker and takes in the new one
    victim = decodes[0]

    async def victim_busy() -> bool:
        from ray import serve

        now = await serve.get_deployment_handle("ProxyIngress", app_name=APP).workers.remote()
        return any(m["url"] == victim["url"] and m["in_flight"] > 0 for m in now)

    async def load_and_kill() -> list[list[int]]:
        batch = asyncio.ensure_future(deployed_token_ids(base, messages * 2, max_tokens=128))
        while not await victim_busy():  # kill it with requests on it
            assert not batch.done(), "the batch finished before the victim took a request"
            await asyncio.sleep(0.05)
        # long answers (128 tokens): the kill lands while they stream, so the proxy must retry
        ray.kill(ray.get_actor(victim["replica"], namespace="serve"), no_restart=True)
        return await batch

    def retries() -> float:
        return metric(httpx.get(f"{base}/metrics", headers=AUTH).text, "splitserve_proxy_retries_total")

    retries_before = retries()

    long_expected = asyncio.run(chat_token_ids(collocated, messages, max_tokens=128))
    assert asyncio.run(load_and_kill()) == long_expected * 2
    assert retries() > retries_before

    def replaced() -> bool:
        now = [m for m in workers() if m["role"] == "decode"]
        urls = {m["url"] for m in now}
        return len(now) == 2 and victim["url"] not in urls and all(m["healthy"] for m in now)

    wait_for(replaced, what="the killed decode replica to be replaced")
    with pytest.raises(httpx.TransportError):  # its server died with it (PR_SET_PDEATHSIG)
        httpx.get(f"{victim['url']}/health", timeout=2)
    assert asyncio.run(deployed_token_ids(base, messages)) == expected
    # the dropped worker left the router's KV-event index too (it held blocks before)
    index = httpx.get(f"{base}/workers", headers=AUTH).json()["kv_index_blocks"]
    assert victim["url"] not in index and any(index.get(m["url"]) for m in workers()), index
    check_a_killed_store_costs_only_hits(base, collocated, auth)


def check_images(base: str, collocated: str, members: list[dict], auth: dict[str, str]) -> None:
    """Image requests through the ingress get `serve`'s greedy tokens; each distinct image
    was encoded once, by the encoder tier on the other node, and the engines loaded the
    embeddings from the encoder cache (kept on the ingress's node: one of the encoder and
    prefill reaches it through shm, the other, on another node, over tcp)."""
    requests = [PICTURES[:1], PICTURES[1:3], PICTURES[:1]]  # the first image twice
    expected = [answer_token_ids(collocated, p, {}) for p in requests]
    assert [answer_token_ids(base, p, AUTH) for p in requests] == expected
    ec = {m["role"]: m["encoder_cache"] for m in members}
    assert ec["render"] is None and ec["prefill"] in ("shm", "tcp")
    assert {ec["encoder"], ec["prefill"]} == {"shm", "tcp"}
    url = {m["role"]: m["url"] for m in members}
    metrics = {role: httpx.get(f"{url[role]}/metrics", headers=auth).text for role in url if role != "render"}
    assert counter(metrics["encoder"], "splitserve_images_encoded") == 3
    for role in ("prefill", "decode"):  # never their own vision tower
        assert counter(metrics[role], "splitserve_images_encoded") == 0
    assert counter(metrics["prefill"], "splitserve_images_loaded") == 3


def answer_token_ids(base: str, pictures: list[bytes], headers: dict[str, str]) -> list[int]:
    """The greedy tokens of a chat request with `pictures` (no model named: the one served)."""
    body = {k: v for k, v in image_chat_body("", pictures).items() if k != "model"}
    response = httpx.post(f"{base}/v1/chat/completions", json=body, headers=headers, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


def stream_tokens(base: str, body: dict, outcome: list) -> None:
    """One streamed completion through the ingress; appends (token IDs, finish reason,
    error or None) to `outcome`."""
    tokens: list[int] = []
    finish_reason, error = None, None
    try:
        with httpx.stream("POST", f"{base}/v1/completions", json=body, headers=AUTH, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    event = json.loads(line[6:])
                    for choice in event.get("choices") or []:
                        tokens += choice.get("token_ids") or []
                        finish_reason = choice.get("finish_reason") or finish_reason
                    error = error or event.get("error")
    except httpx.HTTPError as exc:
        error = repr(exc)
    outcome.append((tokens, finish_reason, error))


def test_a_replaced_ingress_keeps_the_tiers_and_answers_again(cluster, tiny_model, secrets_env, tmp_path):
    """With `--ray-planner`, first: the decode tier follows a stepped rate
    (`check_the_planner_follows_a_stepped_rate`). Then the ingress replica killed outright
    (`ray.kill`) with streams running through it. The
    proxy's streams live in that process: they end (cut, never hung, never a finished stream
    with other tokens) and the decode engine aborts them, so no KV block stays in use. What
    must survive does: the tier replicas keep running (same URLs, none restarted), Serve
    starts a new ingress, which learns them from their heartbeats, and a client that keeps
    sending gets answers or a clear 503 while it starts, then `serve`'s greedy answers."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    args = ["up", tiny_model, "--ray", cluster, "--ray-app-name", APP, "--port", str(port), "--prefill", "0"]
    args += ["--num-blocks", "256", "--max-model-len", "1024", "--open-health-metrics"]
    args += ["--ray-tier", "render:num_cpus=0.5"]
    args += [
        "--ray-tier",
        "decode:num_cpus=0.5,min_replicas=1,max_replicas=2,upscale_delay_s=0,downscale_delay_s=0,"
        "metrics_interval_s=1",
    ]
    args += ["--ray-planner", "--ray-planner-interval", str(PLANNER_INTERVAL_S)]
    args += ["--profile", planner_profile(tmp_path / "profile.json"), "--slo-ttft", "10", "--slo-gap", "4"]
    from ray import serve

    # Nothing of Serve runs now (an earlier test's `down` stopped it, from another driver):
    # this finds the controller this process knew dead and forgets it, so that `workers()`
    # reaches the one `up` starts instead of a handle on the stopped one.
    serve.shutdown()
    try:
        done = splitserve(*args, env=secrets_env)
        assert done.returncode == 0, done.stdout + done.stderr
        check_the_planner_follows_a_stepped_rate(base)
        before = {(m["role"], m["url"], m["replica"]) for m in workers()}
        body = {"prompt": "the ingress", "max_tokens": 8, "temperature": 0, "return_token_ids": True}
        answer = httpx.post(f"{base}/v1/completions", json=body, headers=AUTH, timeout=120)
        assert answer.status_code == 200, answer.text
        expected = answer.json()["choices"][0]["token_ids"]

        streamed: list = []
        long = {**body, "max_tokens": 900, "ignore_eos": True, "stream": True}
        threads = [threading.Thread(target=stream_tokens, args=(base, long, streamed)) for _ in range(2)]
        for thread in threads:
            thread.start()
        decode_url = next(url for role, url, _ in before if role == "decode")
        token_auth = {"Authorization": f"Bearer {secrets_env['SPLITSERVE_INTERNAL_TOKEN']}"}

        def decode_stats() -> dict:
            return httpx.get(f"{decode_url}/inference/v1/stats", headers=token_auth, timeout=10).json()

        wait_for(lambda: decode_stats()["num_running"] == 2, what="both streams on decode")
        (ingress,) = [name for name in app_replicas() if "ProxyIngress" in name]
        ray.kill(ray.get_actor(ingress, namespace="serve"), no_restart=True)
        for thread in threads:
            thread.join(90)
        assert not any(thread.is_alive() for thread in threads), "a stream hung on the dead ingress"
        for tokens, finish_reason, error in streamed:
            assert finish_reason is None and (error or len(tokens) < 900), (finish_reason, error, len(tokens))
        # the engine aborted them: nothing running, every block free again
        wait_for(lambda: decode_stats()["num_running"] == 0, what="decode to abort the cut streams")
        stats = decode_stats()
        assert stats["num_blocks_free"] == stats["num_blocks_total"], stats

        statuses: list[int] = []
        deadline = time.monotonic() + 120
        while statuses[-3:] != [200, 200, 200]:  # answers again, steadily
            assert time.monotonic() < deadline, statuses
            answer = httpx.post(f"{base}/v1/completions", json=body, headers=AUTH, timeout=120)
            statuses.append(answer.status_code)
            if answer.status_code == 200:
                assert answer.json()["choices"][0]["token_ids"] == expected
            else:  # the new ingress starting: an OpenAI error, never a crash
                assert answer.status_code == 503, answer.text
                assert answer.json()["error"]["message"], answer.text
                time.sleep(0.2)
        assert [name for name in app_replicas() if "ProxyIngress" in name] != [ingress]
        # The tiers were kept: every replica of before still serves at its URL, none restarted.
        # The planner still runs, and the two long streams may have made it add a decode
        # replica meanwhile, so the set may have grown; it may not have lost or replaced any.
        assert before <= {(m["role"], m["url"], m["replica"]) for m in workers()}
    finally:
        splitserve("down", "--ray", cluster, "--ray-app-name", APP)
