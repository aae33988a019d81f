"""`splitserve serve [MODEL]`: the collocated OpenAI-compatible server.

One process: the OpenAI service (the same as the P/D proxy's) wired to an in-process
frontend (`LocalFrontendClient`) and an `AsyncEngine` (its own thread) behind a
`LocalEngineClient`. Takes the engine's flags (`splitserve engine --help`) plus the
frontend's (chat template, parsers, body limit).
"""

from __future__ import annotations

import argparse
import logging
import sys

from splitserve.engine.api import cli as engine_cli
from splitserve.frontend import cli as render_cli
from splitserve.runtime import access
from splitserve.runtime.drain import serve_draining


def add_arguments(parser: argparse.ArgumentParser) -> None:
    engine_cli.add_arguments(parser)
    parser.set_defaults(port=8000)
    render_cli.add_frontend_arguments(parser)
    access.add_public_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from splitserve.engine.api.encode_routes import ECSetup
    from splitserve.engine.api.kv_store_setup import make_kv_store_client
    from splitserve.engine.api.local_client import LocalEngineClient
    from splitserve.engine.async_engine import AsyncEngine
    from splitserve.engine.step_log import attach_step_log
    from splitserve.frontend.chat_template import TemplateError
    from splitserve.frontend.local_client import LocalFrontendClient
    from splitserve.frontend.render import Renderer
    from splitserve.gguf_file import shared_gguf_readers
    from splitserve.model_files.resolve import resolve_model_or_exit
    from splitserve.service.app import create_openai_app

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.role != "both":
        print("splitserve serve: the collocated server runs --role both", file=sys.stderr)
        return 2
    model = resolve_model_or_exit(args.model)
    model_dir = model.path
    with shared_gguf_readers():  # the engine and the renderer read a GGUF file's metadata once
        try:
            ec = ECSetup(args, encoder_role=False)  # images: an encoder cache shared with others
            config = engine_cli.engine_config(args, model_dir)
            store = make_kv_store_client(args, config, access.load_internal_token(args))  # --kv-store
            engine = AsyncEngine(config, ec_connector=ec.connector, kv_store=store)
        except (OSError, ValueError) as exc:
            print(f"splitserve serve: {exc}", file=sys.stderr)
            return 2
        try:
            attach_step_log(args.step_log, engine, "both")
        except OSError as exc:
            engine.shutdown()
            print(f"splitserve serve: --step-log: {exc}", file=sys.stderr)
            return 2
        max_model_len = engine.model_info.max_model_len  # the engine's bound is the one that holds
        try:
            renderer = Renderer(render_cli.render_config(args, model, max_model_len))
        except (OSError, TemplateError, ValueError) as exc:
            engine.shutdown()
            print(f"splitserve serve: {exc}", file=sys.stderr)
            return 2

    async def start() -> None:
        engine.start()

    async def stop() -> None:
        engine.shutdown()
        ec.close()

    app = create_openai_app(
        LocalFrontendClient(renderer),
        LocalEngineClient(engine, max_model_len=max_model_len, max_pixel_bytes=args.max_pixel_bytes),
        max_body_bytes=args.max_body_bytes,
        on_startup=start,
        on_shutdown=stop,
    )
    serve_draining(
        access.AccessGuard(app, access.public_policy(args)),
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        drain_timeout_s=args.drain_timeout,
        max_in_flight=args.max_in_flight,
    )
    return 0
