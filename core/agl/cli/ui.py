"""``agl ui``: the web view (agl.ui) over a store, served on this machine until Ctrl-C or SIGTERM."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import Any, Optional

from agl.cli.common import OPENED_STORES, existing_store

UI_PORT = 4748


def add_ui_parser(sub: Any, store_help: str) -> None:
    """Register ``agl ui`` (nothing heavy is imported here)."""
    ui = sub.add_parser(
        "ui",
        help="web pages over a store: rollouts, one rollout's spans with prompts and samples, training curves",
        description="Serve read-only web pages over a store (docs/ui.md): the rollouts list, one rollout's span tree "
        "with prompt and response text and the calls an agent_match trains, and reward and success per step.",
    )
    ui.add_argument("--store", default=None, help=store_help)
    ui.add_argument("--token", default=None, help="an http:// store server's token (default: $AGL_STORE_TOKEN)")
    ui.add_argument("--host", default="127.0.0.1", help="address to listen on (the pages have no token of their own)")
    ui.add_argument("--port", type=int, default=UI_PORT, help=f"default {UI_PORT}; 0 picks a free one")
    ui.set_defaults(func=cmd_ui)


def cmd_ui(args: argparse.Namespace) -> int:
    from agl._util.http_thread import ThreadedServer, is_loopback
    from agl.ui import create_ui

    store = open_ui_store(args.store, args.token)
    server = ThreadedServer(create_ui(store), name="agl ui", host=args.host, port=args.port)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        server.start()
    except OSError as exc:
        raise SystemExit(f"agl: {exc}") from None
    if not is_loopback(args.host):
        print(
            f"agl: WARNING: the pages on {args.host} have no token: anyone who reaches this port reads the store; "
            "bind 127.0.0.1, or use the /ui pages of `agl store serve`, which need its token",
            file=sys.stderr,
            flush=True,
        )
    print(f"agl ui: {store!r} at http://{args.host}:{server.port}/ (Ctrl-C stops)", flush=True)
    try:
        while not stop.wait(1.0):
            pass
    finally:
        server.stop()
    return 0


def open_ui_store(target: Optional[str], token: Optional[str]) -> Any:
    """The store to show: a store server through its client, asked once at start so that a wrong token or
    address is one line now rather than an error page later; anything else only if it exists."""
    if (target or "").split("://", 1)[0].lower() not in ("http", "https"):
        return existing_store(target)
    from agl.store.http.client import RemoteLightningStore

    store = RemoteLightningStore(target or "", token=token, retries=1)
    OPENED_STORES.append(store)
    store.stats()  # raises StoreAuthError or StoreUnavailableError, which main() prints as one line
    return store
