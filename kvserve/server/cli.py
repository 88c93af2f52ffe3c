"""`kvserve serve [MODEL]`: the OpenAI-compatible HTTP server."""
from __future__ import annotations

import argparse
import logging
from typing import Any


def add_serve_parser(sub: Any) -> None:
    from kvserve.cli import add_engine_args
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, /metrics)")
    serve.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                       help="model to serve (same as --model; default: embedded SmolLM2-135M)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--served-model-name", default=None,
                       help="name clients pass as `model` (default: the model path's basename)")
    serve.add_argument("--max-waiting-requests", type=int, default=None,
                       help="opt-in bound: requests allowed to wait beyond --max-num-seqs before "
                            "429 + Retry-After (default: unbounded, as vLLM)")
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    add_engine_args(serve)
    serve.set_defaults(func=cmd_serve)


def cmd_serve(a: argparse.Namespace) -> int:
    import uvicorn

    from kvserve.cli import engine_kwargs
    from kvserve.config import EngineArgs
    from kvserve.server.app import build_app, default_model_name

    if a.model_tag is not None:
        if a.model is not None and a.model != a.model_tag:
            raise ValueError(f"got two models: {a.model_tag!r} and --model {a.model!r}")
        a.model = a.model_tag
    if a.max_waiting_requests is not None and a.max_waiting_requests < 0:
        raise ValueError(f"--max-waiting-requests must be >= 0, got {a.max_waiting_requests}")
    logging.basicConfig(level=a.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    name = a.served_model_name or default_model_name(a.model)
    # The engine core is built in its own process from these args (kvserve/engine/core_process.py).
    app = build_app(EngineArgs(**engine_kwargs(a), usage="server"), name, a.max_waiting_requests)
    uvicorn.run(app, host=a.host, port=a.port, log_level=a.log_level)
    return 0
