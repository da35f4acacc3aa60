"""Write a batch's samples to JSONL (always available) or Parquet (with ``pip install "agl[parquet]"``),
so any trainer can read them.

One record per sample, these fields in this order (docs/lightningrl.md, "Export format"):

=====================  ==================  ==========================================================
field                  type                meaning
=====================  ==================  ==========================================================
``rollout_id``         str                 the rollout the sample came from
``task_id``            str                 its task (the GRPO group)
``policy``             str                 the policy to train on it (``agent_match``)
``prompt_ids``         list[int]           prompt token ids, exactly as the server tokenized them
``response_ids``       list[int]           response token ids
``response_mask``      list[int]           1 where the model generated the token, 0 elsewhere
``response_logprobs``  list[float] | null  one per response token (0.0 where masked), when known
``reward``             float               the credit the sample got
``advantage``          float               its advantage (GRPO / RLOO)
``loss_weight``        float               1 / samples of its rollout (per policy)
``span_ids``           list[str]           the llm spans it was built from
``mode``               str                 its rollout's mode, ``"train"``, ``"val"`` or ``"dev"`` (GRPO
                                           groups are per ``(mode, task_id)``)
=====================  ==================  ==========================================================

``agl export`` reads training rollouts only unless told otherwise: ``--mode val`` (validation), ``--mode dev``
(``agl dev``'s runs, which are no training data unless one says so) or ``--mode all``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Union

from agl.lightningrl.adapter import Batch
from agl.lightningrl.types import Sample

FIELDS = [
    "rollout_id",
    "task_id",
    "policy",
    "prompt_ids",
    "response_ids",
    "response_mask",
    "response_logprobs",
    "reward",
    "advantage",
    "loss_weight",
    "span_ids",
    "mode",
]
FORMATS = ("jsonl", "parquet")

SamplesLike = Union[Batch, Iterable[Sample]]


def record(sample: Sample) -> Dict[str, Any]:
    """The export record of one sample (a dict with ``FIELDS`` in order)."""
    return {name: getattr(sample, name) for name in FIELDS}


def columns(samples: Iterable[Sample]) -> Dict[str, List[Any]]:
    """The samples as columns (``{field: [value per sample]}``), the table Parquet is written from."""
    out: Dict[str, List[Any]] = {name: [] for name in FIELDS}
    for sample in samples:
        for name in FIELDS:
            out[name].append(getattr(sample, name))
    return out


def _samples(data: SamplesLike) -> Iterable[Sample]:
    return data.samples if isinstance(data, Batch) else data


def write_jsonl(data: SamplesLike, path: Union[str, Path]) -> int:
    """Write one JSON object per sample per line; returns the number of samples written."""
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for sample in _samples(data):
            f.write(json.dumps(record(sample), separators=(",", ":")))
            f.write("\n")
            n += 1
    return n


def read_jsonl(path: Union[str, Path]) -> List[Sample]:
    """Read samples written by :func:`write_jsonl`."""
    names = {f.name for f in dataclasses.fields(Sample)}
    with open(path, encoding="utf-8") as f:
        return [Sample(**{k: v for k, v in json.loads(line).items() if k in names}) for line in f if line.strip()]


def _pyarrow() -> Any:
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        raise ImportError(
            'writing Parquet needs pyarrow, which is not installed: pip install "agl[parquet]" (or pyarrow), '
            "or export to JSONL (.jsonl), which needs nothing"
        ) from None
    return pyarrow


def parquet_schema() -> Any:
    pa = _pyarrow()
    return pa.schema(
        [
            ("rollout_id", pa.string()),
            ("task_id", pa.string()),
            ("policy", pa.string()),
            ("prompt_ids", pa.list_(pa.int64())),
            ("response_ids", pa.list_(pa.int64())),
            ("response_mask", pa.list_(pa.int8())),
            ("response_logprobs", pa.list_(pa.float64())),
            ("reward", pa.float64()),
            ("advantage", pa.float64()),
            ("loss_weight", pa.float64()),
            ("span_ids", pa.list_(pa.string())),
            ("mode", pa.string()),
        ]
    )


def write_parquet(data: SamplesLike, path: Union[str, Path]) -> int:
    """Write the samples as one Parquet table (schema: :func:`parquet_schema`); returns the count."""
    pa = _pyarrow()
    table = pa.table(columns(_samples(data)), schema=parquet_schema())
    pa.parquet.write_table(table, str(path))
    return table.num_rows


def check_target(path: Union[str, Path], format: Optional[str] = None) -> str:
    """The format ``path`` is to be written in (``format``, else from the file's suffix), checked before any
    work: a known format, pyarrow for Parquet, and a folder that exists. Raises ValueError, ImportError or
    FileNotFoundError saying what to change."""
    fmt = format or Path(path).suffix.lstrip(".").lower()
    if fmt not in FORMATS:
        raise ValueError(
            f"unknown export format {fmt!r} for {path}: use one of {list(FORMATS)} (or a .jsonl/.parquet file)"
        )
    if fmt == "parquet":
        _pyarrow()
    folder = Path(path).parent
    if not folder.is_dir():
        raise FileNotFoundError(f"the folder {folder} does not exist: create it first (mkdir -p {folder})")
    return fmt


def export(data: SamplesLike, path: Union[str, Path], format: Optional[str] = None) -> int:
    """Write to ``path`` as ``format`` (``"jsonl"`` or ``"parquet"``; default: from the file's suffix).

    The samples go to a temporary file beside ``path`` that then replaces it, so an export that fails
    halfway (Ctrl-C, a full disk) leaves the previous file at ``path`` whole, never a truncated one."""
    writer: Callable[[SamplesLike, Path], int] = write_jsonl if check_target(path, format) == "jsonl" else write_parquet
    path = Path(path)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        n = writer(data, partial)
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return n
