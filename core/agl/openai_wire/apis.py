"""What the three OpenAI APIs agl speaks share on the wire: their names and paths, the fields vLLM and agl add
to them, a request that cannot be served (:class:`BadRequest`) and OpenAI's error object."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Collection, Dict, List, Mapping, Optional, Tuple

CHAT = "chat.completions"
RESPONSES = "responses"
COMPLETIONS = "completions"  # the legacy text API: a prompt string or prompt token ids in, text out
API_PATHS = {"chat/completions": CHAT, "responses": RESPONSES, "completions": COMPLETIONS}  # under ``/v1/``

TOKEN_IDS_REQUEST = "return_token_ids"  # vLLM's request flag (the SDK sends it in extra_body)
RESOURCES_VERSION_FIELD = "agl_resources_version"  # agl's policy server: the policy version that answered
LOGPROBS_INCLUDE = "message.output_text.logprobs"  # Responses API: ask for output text logprobs
# Sent with every call the client-side tracer records, so an agl proxy on the way (agl.instrumentation.proxy)
# forwards it without recording it a second time.
CLIENT_TRACED_HEADER = "x-agl-client-traced"

#: OpenAI's error code for a prompt (plus max_tokens) beyond the model's context, which clients match on
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
NOT_AN_OBJECT = "the request body must be a JSON object"
#: How deeply a request body may nest arrays and objects (serde_json's default limit): far beyond any real
#: request, and far short of Python's recursion limit, which a deeper body reaches while it is parsed, rendered
#: or answered (a 500 where the client deserved a 400).
MAX_JSON_DEPTH = 128
TOO_DEEP = (
    f"the request body nests arrays and objects more than {MAX_JSON_DEPTH} levels deep: send a flatter body "
    "(a JSON schema or tool arguments of reasonable depth)"
)


class BadRequest(ValueError):
    """A request that cannot be served as sent (answered with 400); ``param`` names the offending field,
    ``code`` is OpenAI's machine-readable error code where it has one (:data:`CONTEXT_LENGTH_EXCEEDED`)."""

    def __init__(self, message: str, param: Optional[str] = None, code: Optional[str] = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


def require(condition: bool, param: str, message: str) -> None:
    if not condition:
        raise BadRequest(message, param)


def require_object(body: Any) -> None:
    if not isinstance(body, Mapping):
        raise BadRequest(NOT_AN_OBJECT)


def require_shallow(body: Any) -> None:
    """A 400 for a body nested more than :data:`MAX_JSON_DEPTH` levels, naming its top-level field; walked
    without recursion, since a deep value is what it guards against."""
    stack: List[Tuple[Any, int, Optional[str]]] = (
        [(value, 2, key) for key, value in body.items()] if isinstance(body, Mapping) else [(body, 1, None)]
    )
    while stack:
        value, depth, field = stack.pop()
        children = value.values() if isinstance(value, Mapping) else value if isinstance(value, list) else None
        if children is None:
            continue
        if depth > MAX_JSON_DEPTH:
            raise BadRequest(TOO_DEEP, field)
        stack.extend((child, depth + 1, field) for child in children)


def refuse_unknown(
    body: Mapping[str, Any],
    supported: Collection[str],
    ignored: Collection[str],
    server: str = "agl's policy server",
    passed: Collection[str] = (),
) -> None:
    """A 400 naming the parameters of ``body`` that are not ``supported`` (nor ``passed``: checked apart), with
    what ``server`` accepts (``supported`` less the ``ignored`` ones it takes and does nothing with)."""
    unknown = sorted(k for k in set(body) - set(supported) if k not in passed)
    if unknown:
        accepted = ", ".join(sorted(set(supported) - set(ignored)))
        listed = ", ".join(map(repr, unknown))
        raise BadRequest(f"unsupported parameter(s) {listed}: {server} accepts {accepted}", unknown[0])


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def response_header(
    id_prefix: str, model: str, object_type: Optional[str] = None, system_fingerprint: bool = True
) -> Dict[str, Any]:
    """The fields a chat or text completion (or chunk) opens with: a new id, the object type (left out when
    None: a writer that shares one header across types adds it), created, model, ``system_fingerprint``."""
    header: Dict[str, Any] = {"id": id_prefix + uuid.uuid4().hex}
    if object_type is not None:
        header["object"] = object_type
    header["created"] = int(time.time())
    header["model"] = model
    if system_fingerprint:
        header["system_fingerprint"] = None
    return header


def error_body(
    message: str, status: int, param: Optional[str] = None, code: Optional[str] = None, kind: Optional[str] = None
) -> Dict[str, Any]:
    """OpenAI's error object, which the ``openai`` client turns into ``BadRequestError`` etc. (``kind``, its
    ``type``: by default ``invalid_request_error`` for a 4xx, else ``server_error``)."""
    kind = kind or ("invalid_request_error" if 400 <= status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_message(content: bytes) -> str:
    """The message of an error answer: its error object's, else the start of the body as text."""
    try:
        error = json.loads(content).get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
    except (ValueError, AttributeError):
        pass
    return content[:500].decode("utf-8", "replace")
