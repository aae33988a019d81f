"""Render with images: chat `image_url` parts become expanded image tokens, image hashes in
the block hashes and `features` with the processed pixels, all as transformers' tokenizer
and image processor make them; every bad image is a 400 or 413 naming the problem."""

from __future__ import annotations

import base64
import io
import time

import numpy as np
import pytest
from PIL import Image

from splitserve.frontend.image_processor import ImageLimits
from splitserve.frontend.images import MediaConfig
from splitserve.frontend.render import RenderConfig, Renderer
from splitserve.protocol.errors import InvalidRequestError
from splitserve.protocol.multimodal import features_from_wire
from splitserve.protocol.openai_api import ChatCompletionRequest
from tests.frontend.test_image_processor import png_header_only


def png(width: int, height: int, seed: int, image_format: str = "PNG") -> bytes:
    rng = np.random.default_rng(seed)
    buffer = io.BytesIO()
    Image.fromarray((rng.random((height, width, 3)) * 255).astype(np.uint8)).save(buffer, format=image_format)
    return buffer.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def image_chat(*urls: str, text: str = "Compare these.") -> ChatCompletionRequest:
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}], "max_tokens": 8}
    )


@pytest.fixture(scope="module")
def vl_model(tiny_model_factory) -> str:
    return tiny_model_factory(arch="qwen2_vl")


@pytest.fixture(scope="module")
def renderer(vl_model) -> Renderer:
    return Renderer(RenderConfig(model=vl_model, max_model_len=4096))


def test_render_equals_transformers_processing(renderer, vl_model):
    from transformers import AutoImageProcessor, AutoTokenizer

    images = [png(120, 90, 1), png(60, 200, 2, "JPEG")]
    body = renderer.render_chat(image_chat(data_url(images[0]), data_url(images[1], "image/jpeg"))).to_wire()

    tokenizer, processor = (
        AutoTokenizer.from_pretrained(vl_model),
        AutoImageProcessor.from_pretrained(vl_model),
    )
    pictures = [Image.open(io.BytesIO(data)).convert("RGB") for data in images]
    expected = processor(images=pictures, return_tensors="np")
    messages = [
        {
            "role": "user",
            "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Compare these."}],
        }
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    counts = [int(np.prod(grid)) // 4 for grid in expected["image_grid_thw"]]
    pieces = text.split("<|image_pad|>")
    text = pieces[0] + "".join(
        "<|image_pad|>" * n + piece for n, piece in zip(counts, pieces[1:], strict=True)
    )
    assert body["token_ids"] == tokenizer.encode(text, add_special_tokens=False)

    features = body["features"]
    placeholders = features["mm_placeholders"]["image"]
    assert [p["length"] for p in placeholders] == counts
    image_token = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    for placeholder in placeholders:
        span = body["token_ids"][placeholder["offset"] : placeholder["offset"] + placeholder["length"]]
        assert span == [image_token] * placeholder["length"]
    decoded = features_from_wire(features, max_pixel_bytes=2**30)
    assert np.array_equal(np.concatenate([d.pixel_values for d in decoded]), expected["pixel_values"])
    assert [list(d.grid_thw) for d in decoded] == expected["image_grid_thw"].tolist()
    assert len(set(features["mm_hashes"]["image"])) == 2


def test_image_hashes_enter_the_block_hashes(renderer):
    """Same size (same token IDs), different pixels: equal block hashes before the image,
    different from the first block that covers it on."""
    first = renderer.render_chat(image_chat(data_url(png(100, 100, 3)), text="x" * 80)).to_wire()
    second = renderer.render_chat(image_chat(data_url(png(100, 100, 4)), text="x" * 80)).to_wire()
    assert first["token_ids"] == second["token_ids"]
    offset = first["features"]["mm_placeholders"]["image"][0]["offset"]
    shared = offset // 16
    assert first["block_hashes"][:shared] == second["block_hashes"][:shared]
    assert all(
        a != b for a, b in zip(first["block_hashes"][shared:], second["block_hashes"][shared:], strict=True)
    )
    again = renderer.render_chat(image_chat(data_url(png(100, 100, 3)), text="x" * 80)).to_wire()
    assert again["block_hashes"] == first["block_hashes"]


def test_local_files_only_under_the_allowed_path(vl_model, tmp_path):
    allowed = tmp_path / "media"
    allowed.mkdir()
    (allowed / "cat.png").write_bytes(png(80, 80, 5))
    (tmp_path / "secret.png").write_bytes(png(80, 80, 6))
    closed = Renderer(RenderConfig(model=vl_model))
    with pytest.raises(InvalidRequestError, match="disabled"):
        closed.render_chat(image_chat(f"file://{allowed}/cat.png")).to_wire()
    opened = Renderer(RenderConfig(model=vl_model, media=MediaConfig(allowed_media_path=str(allowed))))
    body = opened.render_chat(image_chat(f"file://{allowed}/cat.png")).to_wire()
    assert (
        body["features"]["mm_hashes"]["image"]
        == closed.render_chat(image_chat(data_url(png(80, 80, 5)))).to_wire()["features"]["mm_hashes"][
            "image"
        ]
    )
    for url in (
        f"file://{allowed}/../secret.png",
        f"file://{tmp_path}/secret.png",
        f"file://{allowed}/none.png",
    ):
        with pytest.raises(InvalidRequestError, match="not a file under the allowed media path"):
            opened.render_chat(image_chat(url)).to_wire()


@pytest.mark.parametrize(
    ("urls", "status", "message"),
    [
        ([data_url(b"\x89PNG\r\n\x1a\n" + b"junk" * 10)], 400, "cannot decode"),
        ([data_url(png(80, 80, 7), "image/jpeg")], 400, "not image/jpeg"),
        ([data_url(png(1, 1, 8))], 400, "at least 14"),
        (["https://example.com/cat.png"], 400, "remote image URLs are not enabled"),
        (["ftp://example.com/cat.png"], 400, "unsupported image URL scheme"),
        ([data_url(png(20, 20, 9))] * 9, 400, "max_images_per_request"),
    ],
)
def test_bad_images_are_client_errors(renderer, urls, status, message):
    with pytest.raises(InvalidRequestError, match=message) as error:
        renderer.render_chat(image_chat(*urls)).to_wire()
    assert error.value.status == status and error.value.param == "messages"


def test_size_limits_are_413(vl_model):
    tight = Renderer(RenderConfig(model=vl_model, media=MediaConfig(max_pixel_bytes_per_request=100_000)))
    with pytest.raises(InvalidRequestError, match="max_pixel_bytes_per_request") as error:
        tight.render_chat(image_chat(data_url(png(300, 300, 10)))).to_wire()
    assert error.value.status == 413
    renderer = Renderer(RenderConfig(model=vl_model))
    with pytest.raises(InvalidRequestError, match="max_source_pixels") as error:  # a decompression bomb
        renderer.render_chat(image_chat(data_url(png_header_only(20_000, 20_000)))).to_wire()
    assert error.value.status == 413


def test_text_model_refuses_images(tiny_model):
    renderer = Renderer(RenderConfig(model=tiny_model))
    with pytest.raises(InvalidRequestError, match="takes no images") as error:
        renderer.render_chat(image_chat(data_url(png(40, 40, 11)))).to_wire()
    assert error.value.status == 400


class _ImageServer:
    """A local HTTP server: /cat.png, /big (over the limit), /moved (a redirect), /slow."""

    def __init__(self, body: bytes) -> None:
        import http.server
        import threading

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path == "/moved":
                    self.send_response(302)
                    self.send_header("Location", "http://169.254.169.254/")
                    self.end_headers()
                    return
                if self.path == "/slow":
                    self.send_response(200)
                    self.end_headers()
                    for _ in range(30):
                        self.wfile.write(b"x")
                        self.wfile.flush()
                        time.sleep(0.05)
                    return
                payload = {"/cat.png": body, "/big": b"\0" * 30_000}.get(self.path)
                self.send_response(200 if payload is not None else 404)
                self.end_headers()
                self.wfile.write(payload or b"")

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_remote_images_only_from_allowed_public_hosts(vl_model):
    cat = png(64, 64, 12)
    server = _ImageServer(cat)
    base = f"http://localhost:{server.port}"
    try:
        closed = Renderer(
            RenderConfig(model=vl_model, media=MediaConfig(allowed_media_domains=("localhost",)))
        )
        with pytest.raises(InvalidRequestError, match="private address"):  # localhost is not public
            closed.render_chat(image_chat(f"{base}/cat.png")).to_wire()
        media = MediaConfig(
            allowed_media_domains=("localhost",),
            allow_private_media_addresses=True,
            fetch_timeout_s=1.0,
            limits=ImageLimits(max_encoded_bytes=20_000),
        )
        opened = Renderer(RenderConfig(model=vl_model, media=media))
        body = opened.render_chat(image_chat(f"{base}/cat.png")).to_wire()
        assert (
            body["features"]["mm_hashes"]
            == opened.render_chat(image_chat(data_url(cat))).to_wire()["features"]["mm_hashes"]
        )
        cases = [
            (f"http://127.0.0.1:{server.port}/cat.png", 400, "not an allowed media domain"),
            (f"{base}/big", 413, "max_encoded_bytes"),
            (f"{base}/moved", 400, "HTTP 302"),
            (f"{base}/missing", 400, "HTTP 404"),
            (f"{base}/slow", 400, "took over"),
        ]
        for url, status, message in cases:
            with pytest.raises(InvalidRequestError, match=message) as error:
                opened.render_chat(image_chat(url)).to_wire()
            assert error.value.status == status, url
    finally:
        server.close()
