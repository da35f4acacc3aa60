"""Compact span attributes: token ids and logprobs as packed binary arrays, the rest JSON, compressed when large.

Why: an LLM span's token ids as JSON text are ~7 bytes an id (61% of a span's bytes), and its prompt
messages are text that compresses 2-3x. Packed, an id from a 50k vocabulary takes 2 bytes; logprobs that a
server computed in float32 take 4. Every backend stores this one blob (SQLite and the in-memory store in the
attributes column, PostgreSQL in ``payload``), and the store server sends it on the wire, so a span is encoded
once on its way in and decoded once on its way out. Reads return exactly what was written: ids as ints, a
logprob list as the same floats (float64 when float32 would change one), the attributes in their order.

Layout (little-endian): ``MAGIC``, the number of arrays, then per array its key's index in ``PACKED_KEYS``,
its position among the attributes, its type code and length (for a prompt sharing an earlier span's ids: the
code ``R``, how many it shares, its own type code and that span's id), and its bytes; then a flag (0 plain,
1 zstd) and the other attributes as one JSON object. A JSON text (what agl wrote before) starts with ``{``,
never ``MAGIC``.
"""

from __future__ import annotations

import struct
import sys
import threading
from array import array
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

import zstandard
from pydantic_core import from_json

from agl import semconv
from agl.store import _rules

MAGIC = 0xA9
#: Attributes stored as packed arrays, and whether they hold ints (token ids) or floats (logprobs). The
#: semantic conventions declare these list[int] / list[float]; a bool among ids reads back as 0 or 1.
PACKED_KEYS: Tuple[Tuple[str, bool], ...] = (
    (semconv.PROMPT_TOKEN_IDS, True),
    (semconv.RESPONSE_TOKEN_IDS, True),
    (semconv.RESPONSE_LOGPROBS, False),
)
_KEY_INDEX = {key: (index, is_int) for index, (key, is_int) in enumerate(PACKED_KEYS)}
_INT_CODES = "HIq"  # the first that holds every id: 2 bytes for vocabularies up to 65,536, 4, then 8
_BIG_ENDIAN = sys.byteorder == "big"  # stored little-endian; arrays read in the machine's order
_SIZES = {"H": 2, "I": 4, "q": 8, "f": 4, "d": 8}
_HEAD = struct.Struct("<BB")
_ARRAY_HEAD = struct.Struct("<BHBI")  # key index, position, type code, length
_REF = ord("R")  # the type code of a prompt that begins with an earlier span's ids; then _REF_HEAD and the id
_REF_HEAD = struct.Struct("<IBB")  # ids shared, the rest's type code, the span id's length
#: JSON of at least this many bytes is compressed (below it zstd's frame costs more than it saves).
COMPRESS_FROM = 200
_PLAIN, _ZSTD = 0, 1
_local = threading.local()  # zstandard's (de)compressors must not be shared between threads


def _compressor() -> zstandard.ZstdCompressor:
    found = getattr(_local, "compressor", None)
    if found is None:
        found = _local.compressor = zstandard.ZstdCompressor(level=1)
    return found


def _decompressor() -> zstandard.ZstdDecompressor:
    found = getattr(_local, "decompressor", None)
    if found is None:
        found = _local.decompressor = zstandard.ZstdDecompressor()
    return found


def _packed(values: Any, is_int: bool) -> Union[Tuple[str, bytes], None]:
    """(type code, bytes) of a list of ids or logprobs, or None if it is not one (it then stays JSON)."""
    if type(values) not in (list, tuple) or not values:
        return None
    n = len(values)
    if is_int:
        if type(values[0]) is not int or type(values[-1]) is not int:
            return None
        for code in _INT_CODES:
            try:
                return code, struct.pack(f"<{n}{code}", *values)
            except struct.error:  # a value beyond this width (or not an int): try the next
                continue
        return None
    if type(values[0]) is not float or type(values[-1]) is not float:
        return None
    try:
        data = struct.pack(f"<{n}f", *values)
    except (struct.error, OverflowError):  # beyond float32's range, or not numbers
        data = b""
    if data and list(struct.unpack(f"<{n}f", data)) == list(values):  # float32 keeps every value exactly
        return "f", data
    try:
        return "d", struct.pack(f"<{n}d", *values)
    except struct.error:
        return None


class PrefixRef(NamedTuple):
    """A decoded span whose prompt ids begin with ``shared`` ids of an earlier span of its attempt (that span's
    prompt, then its response): ``attributes`` holds only the rest until :mod:`agl.store.prefixes` resolves it."""

    attributes: Dict[str, Any]
    span_id: str
    shared: int


def encode_attributes(attributes: Mapping[str, Any], prefix: Optional[Tuple[str, int]] = None) -> bytes:
    """The stored form of a span's attributes; ``prefix`` = (span id, n): its prompt ids begin with the first n
    of that earlier span's (see :mod:`agl.store.prefixes`), which are not stored again. Raises what
    ``_rules.json_bytes`` raises for a value JSON cannot hold."""
    arrays: List[bytes] = []
    rest: Dict[str, Any] = {}
    for position, (key, value) in enumerate(attributes.items()):
        found = _KEY_INDEX.get(key)
        if found is not None:
            if prefix is not None and key == semconv.PROMPT_TOKEN_IDS:
                entry = _prefix_entry(found[0], position, value, prefix)
                if entry is not None:
                    arrays.append(entry)
                    continue
            packed = _packed(value, found[1])
            if packed is not None:
                code, data = packed
                arrays.append(_ARRAY_HEAD.pack(found[0], position, ord(code), len(data) // _SIZES[code]) + data)
                continue
        rest[key] = value
    text = _rules.json_bytes(rest) if rest else b""
    flag = _PLAIN
    if len(text) >= COMPRESS_FROM:
        squeezed = _compressor().compress(text)
        if len(squeezed) < len(text):
            text, flag = squeezed, _ZSTD
    return b"".join((_HEAD.pack(MAGIC, len(arrays)), *arrays, bytes((flag,)), text))


def _prefix_entry(index: int, position: int, values: List[int], prefix: Tuple[str, int]) -> Optional[bytes]:
    """The prompt's array as a reference to ``prefix`` and its own rest; None if the rest is not one to pack."""
    span_id, shared = prefix
    rest = values[shared:]
    packed = _packed(rest, True) if rest else ("H", b"")
    if packed is None:
        return None
    code, data = packed
    ref = span_id.encode()
    head = _ARRAY_HEAD.pack(index, position, _REF, len(data) // _SIZES[code])
    return head + _REF_HEAD.pack(shared, ord(code), len(ref)) + ref + data


def decode_attributes(stored: Union[bytes, str], refs: Optional[List[PrefixRef]] = None) -> Dict[str, Any]:
    """Attributes as :func:`encode_attributes` stored them, or the JSON text (or bytes) agl wrote before it. A
    prompt stored as a reference to an earlier span is added to ``refs`` (ValueError where none is expected)."""
    if isinstance(stored, str) or not stored or stored[0] != MAGIC:
        return from_json(stored) if stored else {}
    if stored[1] == 0 and stored[2] == _PLAIN:  # no arrays, JSON as it is: most spans
        return from_json(stored[3:]) if len(stored) > 3 else {}
    data = memoryview(stored)
    offset = _HEAD.size
    placed: List[Tuple[int, str, List[Any]]] = []
    shared: List[Tuple[str, str, int]] = []
    for _ in range(stored[1]):
        index, position, code, count = _ARRAY_HEAD.unpack_from(data, offset)
        offset += _ARRAY_HEAD.size
        key = PACKED_KEYS[index][0]
        if code == _REF:
            n_shared, code, id_size = _REF_HEAD.unpack_from(data, offset)
            offset += _REF_HEAD.size
            if refs is None:
                raise ValueError("a span's prompt refers to another span's ids, which only a store may write")
            shared.append((key, bytes(data[offset : offset + id_size]).decode(), n_shared))
            offset += id_size
        kind = chr(code)
        end = offset + count * _SIZES[kind]
        packed = array(kind)
        packed.frombytes(data[offset:end])
        if _BIG_ENDIAN:
            packed.byteswap()
        placed.append((position, key, packed.tolist()))
        offset = end
    flag = data[offset]
    text = bytes(data[offset + 1 :])
    if flag == _ZSTD:
        text = _decompressor().decompress(text)
    rest: Dict[str, Any] = from_json(text) if text else {}
    if not placed:
        return rest
    items = list(rest.items())
    for position, key, values in placed:  # in position order, as encoded: each lands where it was
        items.insert(position, (key, values))
    attributes = dict(items)
    if refs is not None:
        refs.extend(PrefixRef(attributes, span_id, n_shared) for _, span_id, n_shared in shared)
    return attributes


#: The store server's binary span batches (``POST /v1/spans``, and ``GET .../spans`` when accepted): JSON stays
#: for every other client, but token ids as JSON text are most of a span's bytes.
SPANS_MEDIA_TYPE = "application/vnd.agl.spans"
_U32 = struct.Struct("<I")


def span_frame(row: Sequence[Any]) -> bytes:
    """One span of a binary batch, from its ``span_to_row`` row: the other fields as a JSON list, then the
    compact attributes, each behind its length. A batch is its spans' frames one after another."""
    meta = _rules.json_bytes([*row[:12], row[13]])
    blob = row[12]
    return b"".join((_U32.pack(len(meta)), meta, _U32.pack(len(blob)), blob))


def frame_rows(body: bytes) -> List[Tuple[Any, ...]]:
    """The ``span_to_row`` rows of a binary batch; ValueError if ``body`` is not one."""
    rows: List[Tuple[Any, ...]] = []
    offset, end = 0, len(body)
    try:
        while offset < end:
            (size,) = _U32.unpack_from(body, offset)
            meta = from_json(body[offset + 4 : offset + 4 + size])
            offset += 4 + size
            (size,) = _U32.unpack_from(body, offset)
            blob = body[offset + 4 : offset + 4 + size]
            offset += 4 + size
            if offset > end or not isinstance(meta, list) or len(meta) != 13:
                raise ValueError("a frame is cut short or its fields are not 13")
            rows.append((*meta[:12], blob, meta[12]))
    except (struct.error, ValueError) as exc:
        raise ValueError(f"not a {SPANS_MEDIA_TYPE} body ({exc})") from None
    return rows
