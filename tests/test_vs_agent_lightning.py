"""The side-by-side benchmark's statistics and pairing (benchmarks/vs_agent_lightning/run.py): pure functions,
so no peer venv is needed."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Dict, Iterator, List, Tuple

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "vs_agent_lightning"


@pytest.fixture(scope="module")
def bench() -> Iterator[Tuple[ModuleType, ModuleType]]:
    """(run, common), imported as run.py imports them (its folder on sys.path)."""
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module("run"), importlib.import_module("common")
    finally:
        sys.path.remove(str(BENCH))
        for name in ("run", "common"):
            sys.modules.pop(name, None)


def side_run(side: str, figures: Dict[str, Dict[str, List[float]]]) -> Dict[str, Any]:
    return {"side": side, "workload": "w", "figures": figures, "notes": []}


def test_summary_gives_median_and_quartiles(bench: Tuple[ModuleType, ModuleType]) -> None:
    _, common = bench
    assert common.summary([5.0, 1.0, 3.0, 2.0, 4.0]) == {"median": 3.0, "low": 2.0, "high": 4.0, "n": 5}


def test_summary_under_four_samples_spans_min_to_max(bench: Tuple[ModuleType, ModuleType]) -> None:
    _, common = bench
    assert common.summary([9.0, 1.0, 4.0]) == {"median": 4.0, "low": 1.0, "high": 9.0, "n": 3}


def test_summary_refuses_no_samples(bench: Tuple[ModuleType, ModuleType]) -> None:
    _, common = bench
    with pytest.raises(ValueError, match="at least one sample"):
        common.summary([])


def test_ratio_is_agl_median_over_peer_median(bench: Tuple[ModuleType, ModuleType]) -> None:
    _, common = bench
    assert common.ratio({"median": 3.0}, {"median": 12.0}) == 0.25
    assert common.ratio(None, {"median": 12.0}) is None
    assert common.ratio({"median": 3.0}, {"median": 0.0}) is None


def test_merge_pools_the_rounds_of_each_side(bench: Tuple[ModuleType, ModuleType]) -> None:
    run, _ = bench
    merged = run.merge(
        [
            side_run("agl", {"m": {"HTTP": [1.0, 2.0]}}),
            side_run("peer", {"m": {"HTTP": [5.0]}}),
            side_run("peer", {"m": {"HTTP": [7.0]}}),
            side_run("agl", {"m": {"HTTP": [3.0]}}),
        ]
    )
    assert merged == {"m": {"agl": {"HTTP": [1.0, 2.0, 3.0]}, "peer": {"HTTP": [5.0, 7.0]}}}


def test_pairing_by_name_leaves_unmatched_alone(bench: Tuple[ModuleType, ModuleType]) -> None:
    run, _ = bench
    pairs = run.pair_variants(["in-process", "HTTP", "outside"], ["HTTP", "in-process", "other"])
    assert pairs == [("in-process", "in-process"), ("HTTP", "HTTP"), ("outside", None), (None, "other")]


def test_a_single_variant_faces_each_of_the_other_side(bench: Tuple[ModuleType, ModuleType]) -> None:
    run, _ = bench
    assert run.pair_variants(["in-memory", "SQLite file"], ["in-memory"]) == [
        ("in-memory", "in-memory"),
        ("SQLite file", "in-memory"),
    ]
    assert run.pair_variants(["SQLite file", "PostgreSQL"], ["in-memory"]) == [
        ("SQLite file", "in-memory"),
        ("PostgreSQL", "in-memory"),
    ]
    assert run.pair_variants(["agl"], ["default", "tuned"]) == [("agl", "default"), ("agl", "tuned")]
    assert run.pair_variants(["bulk"], []) == [("bulk", None)]


def test_rows_carry_summaries_and_ratio(bench: Tuple[ModuleType, ModuleType]) -> None:
    run, _ = bench
    merged = {"m": {"agl": {"a": [1.0, 2.0, 3.0]}, "peer": {"p": [4.0, 6.0, 8.0]}}, "bulk": {"agl": {"a": [2.0]}}}
    rows = run.rows(merged)
    assert [(r["measure"], r["variant"], r["ratio"]) for r in rows] == [("m", "a vs p", 2.0 / 6.0), ("bulk", "a", None)]
    assert rows[0]["peer"] == {"median": 6.0, "low": 4.0, "high": 8.0, "n": 3}
    assert rows[1]["peer"] is None
    assert "-" in run.table(rows).splitlines()[2].split()[-1]


def test_figures_print_without_exponents(bench: Tuple[ModuleType, ModuleType]) -> None:
    run, _ = bench
    assert run.figure({"median": 2460.4, "low": 135.2, "high": 4780.0, "n": 9}) == "2,460 [135 to 4,780]"
    assert run.figure({"median": 0.05334, "low": -7.0, "high": 12.25, "n": 9}) == "0.0533 [-7 to 12.2]"
    assert run.figure(None) == "-"
