"""Server-sent events as the OpenAI APIs stream them: ``data:`` lines (chat and Completions, ending with
``data: [DONE]``), named events (Responses), and reading them back line by line."""

from __future__ import annotations

import json
from typing import Any, Mapping, Optional

DONE = "data: [DONE]\n\n"  # the end of a chat or Completions stream (Responses streams end without it)


def data_event(data: Mapping[str, Any]) -> str:
    return f"data: {json.dumps(data)}\n\n"


def named_event(event: Mapping[str, Any]) -> str:
    """A Responses stream event, named by its ``type``."""
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"


def is_done(line: str) -> bool:
    return line.strip() == DONE.strip()


class EventReader:
    """Reads a stream line by line: :meth:`data` gives the text of each ``data:`` line; ``event`` is the name
    the last ``event:`` line gave (a Responses event whose data does not say its type)."""

    def __init__(self) -> None:
        self.event: Optional[str] = None

    def data(self, line: str) -> Optional[str]:
        if line.startswith("event:"):
            self.event = line[6:].strip()
            return None
        if not line.startswith("data:"):
            return None
        return line[5:].strip()
