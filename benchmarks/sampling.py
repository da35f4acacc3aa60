"""Per-row cost of the policy server's sampler against torch's textbook calls, on one device, in one run.

    python benchmarks/sampling.py [--device cpu|cuda] [--vocab 49152] [--rows 200]

The engine samples each row of a batch at every decode step (``agl.serving.engine._sample``), so its cost
is paid rows x tokens times per generation. Two choices made there are measured against their baselines:

- drawing a token: inverse CDF (``_draw``: one uniform variate, float64 cumulative sums, searchsorted)
  against ``torch.multinomial``, which on the CPU draws one exponential variate per vocabulary entry;
- the top-p nucleus: ``_nucleus`` (on the CPU: ``topk`` of 256, then 4,096, then a sort; elsewhere a sort)
  against sorting the whole vocabulary (``_sorted_nucleus``).

Each figure is the median over ``--rows`` rows of random logits at four sharpness levels, the way the server
sees them: one row at a time, including the device-to-host read of the drawn token id. The nucleus column
gives the median nucleus size: past 4,096 tokens ``_nucleus`` pays for its two ``topk`` tries on top of the
sort. SmolLM2-135M's own next-token distributions at temperature 1 (160 steps of 4 prompts, on the CPU)
have median nuclei of 7 (top_p 0.9), 15 (0.95) and 90 tokens (0.99); none past 4,096 at 0.9 and 0.95, 9%
at 0.99. On a GPU both nucleus columns are the same sort: the tries read their mass back to the host, which
cost an H200 0.45-1.0 ms per row against 0.23 ms for the sort.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable, List

import torch

from agl.serving.engine import _draw
from agl.serving.nucleus import nucleus as _nucleus
from agl.serving.nucleus import sorted_nucleus as _sorted_nucleus


def median_us(call: Callable[[torch.Tensor], object], rows: List[torch.Tensor], device: torch.device) -> float:
    for row in rows[:5]:  # warm-up: kernels, allocator
        call(row)
    times = []
    for row in rows:
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        call(row)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--vocab", type=int, default=49_152, help="SmolLM2's vocabulary by default")
    parser.add_argument("--rows", type=int, default=200)
    parser.add_argument("--top-p", type=float, default=0.9)
    args = parser.parse_args()
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"torch {torch.__version__} on {name}; vocabulary {args.vocab}, median of {args.rows} rows (µs per row)")
    generator = torch.Generator(device=device).manual_seed(0)
    print(
        f"{'logits scale':>12}  {'_draw':>8}  {'multinomial':>11}  {'ratio':>6}  "
        f"{'nucleus':>7}  {'_nucleus':>8}  {'full sort':>9}  {'ratio':>6}"
    )
    for scale in (8.0, 4.0, 2.0, 0.5):
        rows = [
            torch.log_softmax(torch.randn(args.vocab, device=device, generator=generator) * scale, dim=-1)
            for _ in range(args.rows)
        ]
        draw = median_us(lambda r: _draw(r, generator), rows, device)
        multinomial = median_us(lambda r: int(torch.multinomial(r.exp(), 1, generator=generator)), rows, device)
        nucleus = median_us(lambda r: _nucleus(r, args.top_p), rows, device)
        full = median_us(lambda r: _sorted_nucleus(r, args.top_p), rows, device)
        size = statistics.median(int(torch.isfinite(_nucleus(r, args.top_p)).sum()) for r in rows)
        print(
            f"{scale:12.1f}  {draw:8.1f}  {multinomial:11.1f}  {multinomial / draw:5.1f}x  "
            f"{size:7.0f}  {nucleus:8.1f}  {full:9.1f}  {full / nucleus:5.1f}x"
        )


if __name__ == "__main__":
    main()
