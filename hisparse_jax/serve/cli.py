"""`python3 -m hisparse_jax.serve`: check the flags, build the model and engine, serve.

Order of work: every flag checked (`args.parse_args`: exit 2 naming the flag), the
optional packages found (exit 2 saying how to install them), the model loaded, the engine
built (a configuration it refuses: exit 2) and warmed up (unless --no-warmup), the socket
bound, then one line `serving <model> on http://HOST:PORT` on stdout, and the server runs
until SIGTERM / SIGINT drain it (exit 0).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from typing import Any

INSTALL_HINT = 'pip install -e ".[serve]"'
_NEEDED = ("starlette", "uvicorn", "prometheus_client")


def missing_packages() -> list[str]:
    return [name for name in _NEEDED if importlib.util.find_spec(name) is None]


def build_state(args: argparse.Namespace, *, model: Any = None):
    """The `ServerState` of checked flags: the model (`model`, or the one `--model` names),
    the engine (warmed up unless --no-warmup), a checkpoint's tokenizer and chat template,
    the metrics, and the engine loop, started. ValueError for a configuration the engine
    refuses."""
    from hisparse_jax.engine import Engine
    from hisparse_jax.models.tokenizer import load_tokenizer
    from hisparse_jax.serve import args as cli_args
    from hisparse_jax.serve.app import ServerState
    from hisparse_jax.serve.engine_loop import EngineLoop
    from hisparse_jax.serve.metrics import ServerMetrics
    from hisparse_jax.serve.schema import Limits
    from hisparse_jax.serve.text import ChatTemplate

    name = args.served_model_name or args.model
    checkpoint = cli_args.is_checkpoint(args.model)
    tokenizer = load_tokenizer(args.model) if checkpoint else None
    template = ChatTemplate.from_folder(args.model) if checkpoint else None
    model = cli_args.load_model(args) if model is None else model
    engine = Engine(model, cli_args.engine_config(args, model.spec))
    try:
        if not args.no_warmup:
            engine.warmup()
        metrics = ServerMetrics(name)
        loop = EngineLoop(engine, capacity=args.seats + args.max_queue, observer=metrics)
    except BaseException:
        engine.close()
        raise
    limits = Limits(max_model_len=args.max_model_len, vocab_size=model.spec.vocab_size,
                    model_name=name)
    return ServerState(loop.start(), metrics, limits, tokenizer, template)


def main(argv: list[str] | None = None) -> int:
    from hisparse_jax.serve import args as cli_args

    parser = cli_args.build_parser()
    args = cli_args.parse_args(argv, parser)
    missing = missing_packages()
    if missing:
        parser.error(f"the server needs {', '.join(missing)}: {INSTALL_HINT}")
    from host_tier import CapacityError

    print(f"loading {args.model} ...", flush=True)
    try:
        state = build_state(args)
    except (ValueError, CapacityError, ImportError) as e:
        parser.error(f"the engine refused this configuration: {' '.join(str(e).split())}")
    from hisparse_jax.serve.server import HTTPServer

    try:
        server = HTTPServer(state, host=args.host, port=args.port,
                            grace_period=args.grace_period, log_level=args.log_level)
    except OSError as e:
        state.loop.stop()
        parser.error(f"--host {args.host} --port {args.port}: {e.strerror or e}")
    print(f"serving {state.model_name} on {server.url}", flush=True)
    server.run()
    print("server stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
