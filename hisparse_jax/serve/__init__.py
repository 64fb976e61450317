"""An OpenAI-compatible HTTP server over the engine: `python3 -m hisparse_jax.serve`.

The package sits on top of the engine and the models; it needs the optional packages of the
`serve` extra (`pip install -e ".[serve]"`: starlette, uvicorn, prometheus_client; jinja2 for
chat templates), imported only by its modules, never by the rest of the library. Its parts:

  * `args.py`: the command line (the decode example's engine flags) and the model and
    `EngineConfig` it builds;
  * `schema.py`: the OpenAI request bodies and their rules, checked before the engine;
  * `text.py`: incremental detokenization, stop strings, chat templates;
  * `engine_loop.py`: `EngineLoop`, the one thread that owns the `Engine`;
  * `responses.py`: OpenAI response bodies and streamed chunks;
  * `metrics.py`: Prometheus collectors under vLLM's names, one registry per server;
  * `app.py`: the Starlette routes; `server.py`: uvicorn with a draining shutdown;
  * `cli.py` / `__main__.py`: the entry point.

`docs/serving.md` documents the endpoints, fields, errors, metrics and shutdown.
"""
