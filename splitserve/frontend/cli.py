"""`splitserve render [MODEL]`: serve the CPU render/derender tier (no torch imported)."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import TYPE_CHECKING

from splitserve.frontend.media_cli import add_media_arguments, media_config
from splitserve.frontend.stream_state import STATE_KEY_ENV, resolve_state_key
from splitserve.runtime import access
from splitserve.runtime.drain import add_serving_arguments, serve_draining
from splitserve.runtime.http_edge import DEFAULT_MAX_BODY_BYTES

if TYPE_CHECKING:
    from splitserve.model_files.resolve import ResolvedModel

logger = logging.getLogger("splitserve.render")


def add_frontend_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags shared by `render` and `serve` (the model, its template and parsers)."""
    parser.add_argument(
        "--served-model-name", default=None, help="model name clients use (default: directory name)"
    )
    parser.add_argument(
        "--chat-template", default=None, help="a chat template file or string overriding the model's"
    )
    parser.add_argument(
        "--reasoning-parser",
        choices=["auto", "qwen3", "none"],
        default="auto",
        help="split <think>...</think> into `reasoning` (auto: when the vocabulary has the tags)",
    )
    parser.add_argument(
        "--tool-call-parser",
        choices=["auto", "hermes", "none"],
        default="auto",
        help="parse <tool_call> blocks into tool_calls (auto: when the vocabulary has the tag)",
    )
    parser.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="accept a chat_template in requests (sandboxed, but it costs CPU and memory)",
    )
    parser.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES)
    add_media_arguments(parser)  # images: sources, limits, pixel dtype


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model", nargs="?", default=None, help="GGUF file, model directory or HF ID (default: the demo model)"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8200)
    parser.add_argument("--max-model-len", type=int, default=None, help="default: max_position_embeddings")
    parser.add_argument("--block-size", type=int, default=16, help="block size of the block_hashes")
    parser.add_argument(
        "--state-key",
        default=None,
        help=f"HMAC key signing streaming derender states (or ${STATE_KEY_ENV}); every replica "
        "behind one load balancer must use the same key",
    )
    add_frontend_arguments(parser)
    access.add_internal_arguments(parser)
    parser.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )
    add_serving_arguments(parser)


def _parser_switch(choice: str) -> bool | None:
    return None if choice == "auto" else choice != "none"


def render_config(args: argparse.Namespace, model: ResolvedModel, max_model_len: int | None):
    from splitserve.frontend.render import RenderConfig

    return RenderConfig(
        model=model.path,
        served_model_name=args.served_model_name or model.name,
        max_model_len=max_model_len,
        block_size=args.block_size,
        chat_template=args.chat_template,
        reasoning=_parser_switch(args.reasoning_parser),
        tools=_parser_switch(args.tool_call_parser),
        trust_request_chat_template=args.trust_request_chat_template,
        media=media_config(args),
    )


def run(args: argparse.Namespace) -> int:
    from splitserve.frontend.app import create_render_app
    from splitserve.frontend.chat_template import TemplateError
    from splitserve.frontend.render import Renderer
    from splitserve.model_files.resolve import resolve_model_or_exit

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    key, shared = resolve_state_key(args.state_key)
    if not shared:
        logger.warning(
            "no --state-key or $%s: streaming derender states are signed with a random key "
            "only this process knows; replicas behind one load balancer must share a key",
            STATE_KEY_ENV,
        )
    try:
        policy = access.internal_policy(args)
        renderer = Renderer(render_config(args, resolve_model_or_exit(args.model), args.max_model_len))
        app = create_render_app(renderer, key, max_body_bytes=args.max_body_bytes)
    except (OSError, TemplateError, ValueError) as exc:
        print(f"splitserve render: {exc}", file=sys.stderr)
        return 2
    serve_draining(
        access.AccessGuard(app, policy),
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        drain_timeout_s=args.drain_timeout,
        max_in_flight=args.max_in_flight,
    )
    return 0
