"""Agents for the Ray runner tests, in a module of their own: a Ray actor unpickles the agent by its module
name, which it finds on the ``sys.path`` the pool hands over."""

from __future__ import annotations

import os
import time
from typing import Any, Dict

import agl
from agl.types import Rollout


@agl.rollout
def counting_agent(task: Dict[str, Any], rollout: Rollout) -> float:
    """One message span naming the process, a pause, and the task's number as the reward."""
    agl.emit_message(f"task {task['n']} in process {os.getpid()}")
    time.sleep(task.get("sleep", 0.0))
    return float(task["n"])
