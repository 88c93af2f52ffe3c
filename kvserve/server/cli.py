"""`kvserve serve [MODEL]`: the OpenAI-compatible HTTP server."""
from __future__ import annotations

import argparse
import logging
import os
from typing import Any


def add_serve_parser(sub: Any) -> None:
    from kvserve.cli import add_engine_args
    from kvserve.server.tools import TOOL_CALL_PARSERS
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, /metrics)")
    serve.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                       help="model to serve (same as --model; default: embedded SmolLM2-135M)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--served-model-name", nargs="+", default=None,
                       help="name(s) clients pass as `model`; responses carry the first (default: the "
                            "model path's basename and the path as given, which is vLLM's default)")
    serve.add_argument("--max-waiting-requests", type=int, default=None,
                       help="opt-in bound: requests allowed to wait beyond --max-num-seqs before "
                            "429 + Retry-After (default: unbounded, as vLLM)")
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    serve.add_argument("--disable-uvicorn-access-log", action="store_true",
                       help="no log line per HTTP request (vLLM's flag; under load they are one a request)")
    serve.add_argument("--api-key", default=None,
                       help="require `Authorization: Bearer KEY` on /v1 routes (401 otherwise)")
    serve.add_argument("--allowed-origins", nargs="*", default=["*"], help="CORS origins (none: no CORS)")
    serve.add_argument("--generation-config", default="auto",
                       help="auto: sampling defaults from the model's generation_config.json; vllm: none; "
                            "or a folder holding one")
    serve.add_argument("--enable-vllm-metrics", action="store_true",
                       help="also export /metrics under vLLM's names (vllm:*, model_name label)")
    serve.add_argument("--tool-call-parser", default="hermes", choices=sorted(TOOL_CALL_PARSERS),
                       help="the form tool_choice='auto' reads calls in: hermes (<tool_call> JSON: Hermes, "
                            "Qwen) or llama3_json (Llama 3.1/3.2 JSON calls)")
    serve.add_argument("--enable-auto-tool-choice", action="store_true",
                       help="vLLM's switch for tool_choice='auto', taken so its command lines run: "
                            "here auto is always on, read with --tool-call-parser")
    add_engine_args(serve)
    serve.set_defaults(func=cmd_serve)


def cmd_serve(a: argparse.Namespace) -> int:
    import uvicorn

    from kvserve.cli import engine_kwargs
    from kvserve.config import EngineArgs
    from kvserve.engine.gc_heap import freeze_startup_heap
    from kvserve.server.app import build_app, default_model_names

    if a.model_tag is not None:
        if a.model is not None and a.model != a.model_tag:
            raise ValueError(f"got two models: {a.model_tag!r} and --model {a.model!r}")
        a.model = a.model_tag
    if a.max_waiting_requests is not None and a.max_waiting_requests < 0:
        raise ValueError(f"--max-waiting-requests must be >= 0, got {a.max_waiting_requests}")
    _check_served_names(a)
    logging.basicConfig(level=a.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    names = a.served_model_name or default_model_names(a.model)
    # The engine core is built in its own process from these args (kvserve/engine/core_process.py).
    app = build_app(EngineArgs(**engine_kwargs(a), usage="server"), names, a.max_waiting_requests,
                    _server_options(a))
    freeze_startup_heap()  # the API server's own start-up heap (tokenizer, app)
    uvicorn.run(app, host=a.host, port=a.port, log_level=a.log_level,
                access_log=not a.disable_uvicorn_access_log)
    return 0


def _check_served_names(a: argparse.Namespace) -> None:
    """`--served-model-name` takes several names, so `--served-model-name m
    /models/x` swallows the model path as a second name (as in vLLM): refuse
    that instead of serving the embedded model under the path's name."""
    if a.model is None and any(os.path.isdir(name) for name in (a.served_model_name or [])[1:]):
        raise ValueError(f"--served-model-name {' '.join(a.served_model_name)}: a name is a directory and no "
                         f"model was given; put the model path before --served-model-name or use --model")


def _server_options(a: argparse.Namespace):
    from kvserve.server.app import ServerOptions
    from kvserve.server.generation_config import generation_defaults
    defaults = generation_defaults(a.model, a.generation_config)
    return ServerOptions(api_key=a.api_key or None, allowed_origins=tuple(a.allowed_origins or ()),
                         generation_defaults=tuple(defaults.items()),
                         enable_vllm_metrics=a.enable_vllm_metrics, tool_call_parser=a.tool_call_parser)
