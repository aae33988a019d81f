"""A multimodal stream migrates: `up --decode 2 --encoder 1` on the tiny Qwen2-VL, an image
chat streaming when the decode worker serving it gets SIGKILL resumes on the other one from
the prompt (its image placeholders included) + the tokens streamed so far. The features
travel without pixels (the encoder cache keeps the embeddings), their placements still
index into the prompt's leading part, and the streamed tokens get the M-RoPE positions decode
gave them; the stream equals the undisturbed greedy run."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time

import httpx

from tests.conftest import free_port, running_server
from tests.router.test_encoder_pool import part_urls
from tests.router.test_pd_proxy import metric, up_log
from tests.service.image_requests import PICTURES, image_chat_body

TOKEN = "multimodal-migration-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


class ChatStream(threading.Thread):
    """One streamed chat completion: its token IDs as they arrive."""

    def __init__(self, base: str, body: dict) -> None:
        super().__init__()
        self.base, self.body = base, body
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.error: str | None = None

    def run(self) -> None:
        try:
            with httpx.stream(
                "POST", f"{self.base}/v1/chat/completions", json=self.body, timeout=180
            ) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        event = json.loads(line[6:])
                        if "choices" not in event:
                            self.error = line
                            return
                        for choice in event["choices"]:
                            self.token_ids += choice.get("token_ids") or []
                            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        except httpx.HTTPError as exc:
            self.error = repr(exc)


# long enough that the stream is still running when the test finds its decode worker
ANSWER_TOKENS = 600


def test_an_image_chat_resumes_on_another_decode_worker_equal_to_its_undisturbed_run(tiny_model_factory):
    model_dir = tiny_model_factory(arch="qwen2_vl")
    port = free_port()
    args = ["up", model_dir, "--port", str(port), "--encoder", "1", "--decode", "2", "--num-blocks", "256"]
    args += ["--max-model-len", "2048", "--min-prefill-tokens", "16", "--pd-decision", "threshold"]
    args += ["--stall-timeout", "1"]
    with running_server(args, port, timeout=240, env={"SPLITSERVE_INTERNAL_TOKEN": TOKEN}) as base:
        while "OpenAI API:" not in up_log(port):
            time.sleep(0.1)
        model = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]
        body = {**image_chat_body(model, PICTURES[1:3]), "max_tokens": ANSWER_TOKENS, "stream": True}
        undisturbed = ChatStream(base, body)
        undisturbed.run()
        assert undisturbed.finish_reason == "length", undisturbed.error

        disturbed = ChatStream(base, body)
        disturbed.start()
        while not disturbed.token_ids and disturbed.is_alive():
            time.sleep(0.01)
        victim = busy_decode(port, disturbed)
        os.kill(part_pid(port, victim), signal.SIGKILL)
        disturbed.join()
        proxy_metrics = httpx.get(f"{base}/metrics").text

    assert disturbed.error is None and disturbed.finish_reason == "length"
    assert len(disturbed.token_ids) == ANSWER_TOKENS
    assert disturbed.token_ids == undisturbed.token_ids
    assert metric(proxy_metrics, "splitserve_proxy_retries_total") >= 1
    # the images went to the encoder once; the resumed request carried hashes only
    assert metric(proxy_metrics, "splitserve_proxy_encoder_images_sent_total") == 2


def busy_decode(port: int, stream: ChatStream) -> str:
    while stream.is_alive():
        for name, url in part_urls(port).items():
            if name.startswith("decode"):
                stats = httpx.get(f"{url}/inference/v1/stats", headers=AUTH, timeout=10).json()
                if stats["num_running"] + stats["num_waiting"] > 0:
                    return name
    raise AssertionError(f"the stream ended before a decode worker was seen running it: {stream.error}")


def part_pid(port: int, name: str) -> int:
    return int(re.findall(rf"^\s+{name}\s+http://\S+\s+\(pid (\d+)\)", up_log(port), re.M)[-1])
