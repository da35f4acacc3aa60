"""``agl serve``: serve a policy over the OpenAI API, following a store's resources for new weights."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import Any


def add_serve_command(sub: Any, store_help: str) -> None:
    """Register ``agl serve`` on the top-level subparsers (nothing heavy is imported here)."""
    serve = sub.add_parser(
        "serve",
        help="serve a policy (SmolLM2, a tiny test model or any HF causal LM) as an OpenAI-compatible API",
        description="Serve a policy over /v1/chat/completions, /v1/responses and /v1/completions with exact token "
        "ids (docs/serving.md).",
    )
    serve.add_argument(
        "--model", default="smollm2", help="smollm2 (bundled), tiny (random, for tests) or an HF path/name"
    )
    serve.add_argument("--model-name", default="policy", help="the name /v1/models reports (default: policy)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000, help="0 picks a free port (the URL is printed)")
    serve.add_argument("--max-batch-size", type=int, default=16)
    serve.add_argument("--max-tokens", type=int, default=512, help="answer length limit for requests that set none")
    serve.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    serve.add_argument("--dtype", default=None, help="float32, bfloat16... (default: float32 on CPU, bfloat16 on CUDA)")
    serve.add_argument(
        "--store",
        default=None,
        help=f"follow this store's resources and load the checkpoints they name; {store_help}",
    )
    serve.add_argument("--resource", default="main_llm", help="the LLM resource naming the checkpoint")
    serve.add_argument("--poll-interval", type=float, default=1.0, help="seconds between store checks")
    serve.set_defaults(func=cmd_serve)


def _refuse_training_folders(model: str) -> None:
    """An `agl train --out` folder, a checkpoint (or its ``latest`` pointer, its LoRA ``adapter/``) is not a
    model folder (transformers failed on them with a traceback about tokenizer converters, or "not a valid
    JSON file" for ``latest``): say which export makes one."""
    from pathlib import Path

    path = Path(model)
    source = what = None
    if path.is_file() and path.name == "latest" and any(path.parent.glob("step-*")):
        source, what = path.parent, "the pointer to a training run's newest checkpoint"
    elif not path.is_dir() or (path / "config.json").exists():
        return
    elif (path / "adapter_config.json").exists() and (path.parent / "state.json").exists():
        source, what = path.parent, "the LoRA adapter of a training checkpoint (weights without their base model)"
    elif any((path / name).exists() for name in ("state.json", "latest", "checkpoints", "metrics.csv")):
        source, what = path, "an agl training run or checkpoint"
    if source is None:
        return
    target = _export_target(source)
    raise SystemExit(
        f"agl serve: {path} is {what}, not a model folder: export the trained model first (agl export-model "
        f"{source} --out {target}), then agl serve --model {target}"
    )


def _export_target(source: Any) -> Any:
    """Where the export suggested for ``source`` goes: next to the run's checkpoints, never inside a
    ``step-NNNNNN`` folder (a later checkpoint deletes it)."""
    if (source / "state.json").exists():  # one step-NNNNNN folder
        run = source.parent.parent if source.parent.name == "checkpoints" else source.parent
        return run / f"model-{source.name}"
    if source.name == "checkpoints" and (source / "latest").exists():
        return source.parent / "model"
    return source / "model"


def cmd_serve(args: argparse.Namespace) -> int:
    _refuse_training_folders(args.model)  # before the imports: the message needs no torch
    from agl.serving.models import load_policy
    from agl.serving.server import PolicyServer
    from agl.serving.store_watch import StoreWatcher

    print(f"agl serve: loading {args.model} ...", file=sys.stderr, flush=True)
    model, tokenizer = load_policy(args.model, dtype=args.dtype, device=args.device)
    server = PolicyServer(
        model,
        tokenizer,
        model_name=args.model_name,
        host=args.host,
        port=args.port,
        max_batch_size=args.max_batch_size,
        default_max_tokens=args.max_tokens,
    )
    watcher = None
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    url = server.start()
    try:
        if args.store:
            from agl.store import open_store

            watcher = StoreWatcher(open_store(args.store), server, args.resource, args.poll_interval).start()
        print(f"agl serve: {args.model} as {args.model_name!r} (version {server.version}) at {url}", flush=True)
        while not stop.wait(1.0):
            pass
    finally:
        if watcher is not None:
            watcher.stop()
        server.stop()
    return 0
