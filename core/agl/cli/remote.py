"""The command line for running across machines: ``agl store serve`` and ``agl runner``.

The parsers are built here (agl.cli only hooks them in) and the heavy imports (FastAPI, the agent) happen
only when a command runs, so ``agl --help`` stays fast.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import threading
import time
from typing import TYPE_CHECKING, Any, Dict, Optional, Tuple, Union

from agl.cli.common import shown_store

if TYPE_CHECKING:
    from agl.store.http.server import ServerLimits

logger = logging.getLogger("agl.cli.remote")

_TOKEN_HELP = "bearer token (default: $AGL_STORE_TOKEN)"


def add_serve_parser(store_sub: Any) -> None:
    """``agl store serve --store PATH_OR_DSN --host --port --token ...``."""
    serve = store_sub.add_parser(
        "serve",
        help="serve a store over HTTP so runners on other machines can use it (API docs at /docs)",
        description="Serve a store over HTTP. Runners and trainers elsewhere use it with --store http://HOST:PORT "
        "and the same token. OpenTelemetry exporters can send spans to http://HOST:PORT/v1/traces.",
    )
    serve.add_argument(
        "--store",
        default=None,
        help="the store to serve: a .db file or postgresql://... (default: $AGL_STORE or .agl/store.db)",
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    serve.add_argument("--port", type=int, default=4747)
    serve.add_argument("--token", default=None, help="shared secret every client must send (default: $AGL_STORE_TOKEN)")
    serve.add_argument("--tokens-file", default=None, help="per-runner tokens: one 'NAME TOKEN' per line")
    serve.add_argument(
        "--insecure-no-auth", action="store_true", help="accept requests without a token (trusted networks only)"
    )
    serve.add_argument("--max-body-mb", type=float, default=32.0, help="largest request body accepted (413 above)")
    serve.add_argument(
        "--retry-cache-mb",
        type=float,
        default=64.0,
        help="memory for the first answers that retried requests (Idempotency-Key) get; the oldest go first",
    )
    serve.add_argument(
        "--header-timeout", type=float, default=10.0, help="seconds a request's headers may take (connection closed)"
    )
    serve.add_argument(
        "--body-timeout",
        type=float,
        default=30.0,
        help="seconds a request's body may stall, nothing received, before its connection is closed",
    )
    serve.add_argument(
        "--max-connections", type=int, default=4096, help="open connections and running requests (503 above)"
    )
    serve.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    from agl.store import open_store
    from agl.store.http.server import TokenSet, serve
    from agl.store.http.wire import TOKEN_ENV
    from agl.ui import create_ui

    if args.store and args.store.split("://", 1)[0].lower() in ("http", "https"):
        raise SystemExit("agl: --store names the store to serve (a .db file or postgresql://...), not another server")
    try:
        tokens = TokenSet.load(args.token, args.tokens_file)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"agl: cannot read the tokens: {exc}") from None
    if not tokens and not args.insecure_no_auth:
        raise SystemExit(
            f"agl: the store server needs a token: pass --token, set ${TOKEN_ENV} or give --tokens-file "
            "(or --insecure-no-auth on a trusted network)"
        )
    limits = _serve_limits(args)
    store = open_store(args.store)
    print(
        f"agl: serving {store!r} on http://{args.host}:{args.port} ({len(tokens)} token(s)); API docs at /docs, "
        "web pages at /ui (open /ui/?token=TOKEN once)",
        flush=True,
    )
    pages = {"/ui": create_ui(store, tokens=tokens or None)}  # the web view, behind the same tokens (docs/ui.md)
    serve(
        store, args.host, args.port, tokens=tokens, allow_anonymous=args.insecure_no_auth, limits=limits, mounts=pages
    )
    print(f"agl: store server stopped; {store!r} closed", flush=True)
    return 0


def _serve_limits(args: argparse.Namespace) -> ServerLimits:
    """The server's limits from ``agl store serve``'s options, each checked to be a positive number first."""
    from agl.store.http.server import ServerLimits

    _check_seconds(args, header_timeout=True, body_timeout=True)
    for option in ("max_body_mb", "retry_cache_mb", "max_connections"):
        value = getattr(args, option)
        if not value > 0 or value == float("inf"):
            raise SystemExit(f"agl: --{option.replace('_', '-')} must be a positive number, got {value}")
    mib = 1024 * 1024
    return ServerLimits(
        max_body_bytes=int(args.max_body_mb * mib),
        idempotency_bytes=int(args.retry_cache_mb * mib),
        header_timeout=args.header_timeout,
        body_timeout=args.body_timeout,
        max_connections=args.max_connections,
    )


def add_runner_parser(sub: Any) -> None:
    """``agl runner --store URL --agent MODULE:AGENT [--n-runners N] [--token T]``."""
    runner = sub.add_parser(
        "runner",
        help="run an agent's rollouts from a store (on this machine, for a trainer elsewhere)",
        description="Start runners that take rollouts from the store, run the agent and report spans and "
        "results. SIGTERM or Ctrl-C stops them gracefully: idle runners leave at once, busy ones finish "
        "their rollout (up to --stop-timeout; a rollout still running then ends as failed, and is retried if its "
        "max_attempts allow). Dead runner processes are replaced.",
    )
    runner.add_argument(
        "--store",
        required=True,
        help="the store: http://HOST:PORT of `agl store serve`, "
        "postgresql://USER@HOST/DATABASE (the postgres extra), or a .db file on this machine",
    )
    runner.add_argument(
        "--agent", required=True, help="MODULE:NAME or path/to/file.py:NAME (a LitAgent or a rollout function)"
    )
    runner.add_argument("--n-runners", type=int, default=1)
    runner.add_argument("--runner-mode", choices=["process", "thread"], default="process")
    runner.add_argument(
        "--ray",
        metavar="ADDRESS",
        default=None,
        help="run the runners as Ray actors (the ray extra) on the cluster at ADDRESS: 'auto' (the cluster of "
        "this node), HOST:PORT or ray://HOST:PORT, or 'local' (start one here); instead of --runner-mode",
    )
    runner.add_argument(
        "--ray-resources",
        metavar="JSON",
        default=None,
        help='with --ray, what each actor asks Ray for, e.g. \'{"num_cpus": 2, "resources": {"tools": 1}}\' '
        "(default: one CPU)",
    )
    runner.add_argument("--token", default=None, help=_TOKEN_HELP)
    runner.add_argument("--heartbeat-interval", type=float, default=5.0, help="seconds between heartbeats")
    runner.add_argument("--rollout-timeout", type=float, default=None, help="seconds a rollout may run (default: none)")
    runner.add_argument("--stop-timeout", type=float, default=30.0, help="seconds busy runners get to finish on stop")
    runner.add_argument(
        "--outage-timeout",
        type=float,
        default=600.0,
        help="seconds each call to a store server (or PostgreSQL) keeps trying through an outage "
        "once the runners run (a server restart; at start, --wait-for-store applies) (default 600)",
    )
    runner.add_argument(
        "--wait-for-store",
        type=float,
        default=120.0,
        metavar="SECONDS",
        help="at start, how long to wait for a store server (or PostgreSQL) that does not answer "
        "yet, e.g. one starting beside the runners; a wrong token or URL still fails at once "
        "(default 120)",
    )
    runner.set_defaults(func=cmd_runner)


def open_runner_store(url: str, token: Optional[str]) -> Any:
    """The store a runner uses: the HTTP client (with ``token``) for a URL, else whatever open_store opens. A
    SQLite file that does not exist yet is made (runner and trainer may start in either order), and said so:
    with a mistyped path the runners would otherwise wait for work that never comes, without a word."""
    from agl.errors import StoreNotFoundError
    from agl.store import open_store
    from agl.store.http.client import RemoteLightningStore

    if url.split("://", 1)[0].lower() in ("http", "https"):
        return RemoteLightningStore(url, token=token)
    try:
        return open_store(url, create=False)
    except StoreNotFoundError:
        logger.warning(
            "no store at %s yet: made a new, empty one; the runners wait for a trainer to enqueue rollouts "
            "into this file (check the path if the trainer already runs)",
            url,
        )
        return open_store(url)


def first_contact(url: str, token: Optional[str], wait_s: float) -> Tuple[Any, Any]:
    """The runner's store and its stats, once it answers: a store server or database that cannot be reached
    yet (started beside the runners, by docker compose or a Job) is waited for up to ``wait_s`` seconds,
    saying so every 10 s; any other problem (a wrong token, a URL that is no agl store) raises at once.

    Each try is one quick call (no retries), so the wait ends close to ``wait_s``; a PostgreSQL store
    retries its connection by itself for its own ``reconnect_timeout`` per try."""
    from agl.errors import StoreUnavailableError
    from agl.store.http.client import RemoteLightningStore

    started = time.monotonic()
    said = 0.0
    while True:
        store = None
        try:
            store = open_runner_store(url, token)
            if isinstance(store, RemoteLightningStore):
                retries, store.retries = store.retries, 0
                try:
                    return store, store.stats()
                finally:
                    store.retries = retries
            return store, store.stats()
        except StoreUnavailableError as exc:
            if store is not None:
                store.close()
            waited = time.monotonic() - started
            if waited >= wait_s:
                raise StoreUnavailableError(
                    f"the store at {shown_store(url)} did not answer within {wait_s:g} s (--wait-for-store): {exc}"
                ) from exc
            if waited >= said:
                logger.warning(
                    "the store at %s does not answer yet (%s); waiting for it, up to %g s (--wait-for-store)",
                    shown_store(url),
                    exc,
                    wait_s,
                )
                said = waited + 10.0
            time.sleep(min(1.0, max(0.0, wait_s - waited)))


def _check_seconds(args: argparse.Namespace, **positive: bool) -> None:
    """Each named option, when given, is a finite number of seconds: above 0 where ``positive``, else >= 0."""
    from agl.checks import check_number

    for name, above_zero in positive.items():
        value = getattr(args, name)
        if value is not None:
            try:
                check_number(name, value, positive=above_zero)
            except ValueError:
                raise SystemExit(
                    f"agl: --{name.replace('_', '-')} must be a finite number of seconds "
                    f"{'> 0' if above_zero else '>= 0'}, got {value}"
                ) from None


def _ray_resources(args: argparse.Namespace) -> Optional[Dict[str, Any]]:
    """``--ray-resources`` as a dict, checked before anything starts."""
    from agl.runtime.ray_runners import RESOURCE_KEYS

    if args.ray_resources is None:
        return None
    if args.ray is None:
        raise SystemExit("agl: --ray-resources places Ray actors: add --ray ADDRESS")
    try:
        resources = json.loads(args.ray_resources)
    except json.JSONDecodeError as exc:
        raise SystemExit(f"agl: --ray-resources is not JSON ({exc.msg}): write e.g. '{{\"num_cpus\": 2}}'") from None
    if not isinstance(resources, dict) or set(resources) - set(RESOURCE_KEYS):
        raise SystemExit(f"agl: --ray-resources must be a JSON object of {', '.join(RESOURCE_KEYS)}")
    return resources


def _join_ray(address: str) -> None:
    """Connect to the Ray cluster at ``address`` ('local': start one in this process)."""
    try:
        import ray
    except ImportError:
        raise SystemExit('agl: --ray needs Ray: pip install "agl[ray]"') from None
    ray.init(address=None if address == "local" else address, log_to_driver=True)


def cmd_runner(args: argparse.Namespace) -> int:
    import agl
    from agl.cli.common import load_agent
    from agl.runtime.ray_runners import RayRunnerPool
    from agl.runtime.runner_pool import RunnerPool

    if args.n_runners < 1:
        raise SystemExit("agl: --n-runners must be at least 1")
    resources = _ray_resources(args)
    _check_seconds(
        args,
        heartbeat_interval=True,
        rollout_timeout=True,
        outage_timeout=True,
        stop_timeout=False,
        wait_for_store=False,
    )
    agent = load_agent(args.agent)
    store, stats = first_contact(args.store, args.token, args.wait_for_store)
    store.ride_out_outages(args.outage_timeout)  # from now on, ride out restarts of a store server or database
    queued = stats.rollouts.get("queued", 0)
    agl.instrument()
    stop = threading.Event()
    stopped_by = ["an error"]  # what stopped the runners, for the error of an attempt that had to be killed

    def on_signal(signum: int, frame: Any) -> None:
        logger.warning(
            "signal %s: stopping the runners (busy ones get --stop-timeout %g s to finish their rollout)",
            signum,
            args.stop_timeout,
        )
        stopped_by[0] = signal.Signals(signum).name
        stop.set()

    if args.ray is not None:
        _join_ray(args.ray)  # first: ray.init sets SIGTERM to abort the process, and this command handles it
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    runner_kwargs = {
        "heartbeat_interval": args.heartbeat_interval,
        "rollout_timeout": args.rollout_timeout,
        "outage_timeout": args.outage_timeout,  # a store gone for good ends `agl runner` (non-zero), not hangs it
    }
    pool: Union[RunnerPool, RayRunnerPool]
    if args.ray is None:
        pool = RunnerPool(agent, store, args.n_runners, mode=args.runner_mode, runner_kwargs=runner_kwargs)
    else:
        pool = RayRunnerPool(agent, store, args.n_runners, resources=resources, runner_kwargs=runner_kwargs)
    where = "" if args.ray is None else f" as Ray actors on {args.ray}"
    print(
        f"agl: {args.n_runners} runner(s){where} on {store!r} ({queued} rollouts queued); SIGTERM or Ctrl-C stops them",
        flush=True,
    )
    pool.start()
    try:
        while not stop.wait(1.0):
            pool.check()  # replaces runners that died
    finally:
        reason = f"agl runner was stopped by {stopped_by[0]}; busy runners get --stop-timeout {args.stop_timeout:g} s"
        # Busy runners had up to --stop-timeout; one still busy then was killed (a process) or left behind (a
        # thread: it reports nothing more, and its agent thread does not keep this process alive), and its
        # attempt ended as failed. Only then is the store closed.
        pool.stop(args.stop_timeout, reason=reason)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        store.close()
    print(f"agl: runners stopped ({pool.respawned} replaced during the run)", flush=True)
    return 0
