"""agl's web view: server-rendered pages over any store (``agl ui``, and ``/ui`` of ``agl store serve``).

- ``/``: the rollouts, filtered by status and mode, a page at a time (LIMIT/OFFSET through the store's
  ``query_rollouts``);
- ``/rollouts/ID``: one rollout's attempts and span tree, with prompt and response text, tool calls and
  results, token counts, rewards and errors, the LLM calls an ``agent_match`` turns into samples highlighted;
- ``/training``: reward and success per step and the held-out evaluations, reloading every few seconds.

Plain HTML and CSS with an inline SVG chart: nothing to download, no script, nothing to build. The layers
below are only read; the command line mounts these pages, so the store layer never imports them."""

from __future__ import annotations

from agl.ui.routes import create_ui

__all__ = ["create_ui"]
