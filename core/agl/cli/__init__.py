"""The ``agl`` command line: one module per command group (``dev``, ``store``, ``export``, ``train``, ``remote``,
``serve``, ``ui``); this one builds the parser and runs the command."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sqlite3
import sys
from typing import List, Optional

from agl import __version__
from agl.cli.common import STORE_HELP, close_opened_stores
from agl.cli.dev import add_dev_parser
from agl.cli.export import add_export_parser
from agl.cli.store import add_inspect_parser, add_store_parser


def build_parser() -> argparse.ArgumentParser:
    """Every command's parser; the heavy imports (FastAPI, torch, the agent) wait until a command runs."""
    parser = argparse.ArgumentParser(prog="agl", description="Train any AI agent with reinforcement learning.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    parser.add_argument("--version", action="version", version=f"agl {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    add_dev_parser(sub)  # agl dev
    add_inspect_parser(sub)  # agl inspect
    store_sub = add_store_parser(sub)  # agl store rollouts|stats|prune
    from agl.cli.remote import add_runner_parser, add_serve_parser

    add_serve_parser(store_sub)  # agl store serve
    add_runner_parser(sub)  # agl runner
    from agl.cli.serve import add_serve_command

    add_serve_command(sub, STORE_HELP)  # agl serve (the policy server)
    from agl.cli.export_model import add_export_model_parser
    from agl.cli.train import add_train_parser

    add_train_parser(sub, STORE_HELP)  # agl train
    add_export_model_parser(sub)  # agl export-model
    add_export_parser(sub)  # agl export
    from agl.cli.ui import add_ui_parser

    add_ui_parser(sub, STORE_HELP)  # agl ui
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from agl.errors import AglError

    try:
        return int(args.func(args) or 0)
    except AglError as exc:
        print(f"agl: {exc}", file=sys.stderr)
        return 2
    except sqlite3.OperationalError as exc:
        if "locked" not in str(exc) and "busy" not in str(exc):
            raise
        print(
            f"agl: the SQLite store is locked ({exc}): another process (a trainer or runner in a long transaction, "
            "a sqlite3 shell with an open transaction) has held its write lock for longer than agl waits (30 s); "
            "run the command again once that process is done, or stop it",
            file=sys.stderr,
        )
        return 2
    except BrokenPipeError:  # `agl store rollouts | head`: the reader left; say nothing more, as Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the interpreter's final flush too
        return 128 + signal.SIGPIPE
    finally:
        close_opened_stores()
