"""The top-p nucleus of a token distribution, as the engine samples from it (:mod:`agl.serving.engine`): the
smallest set of most likely tokens whose probability reaches ``top_p``, renormalized; and its top-k."""

from __future__ import annotations

from typing import Any

import torch


def nucleus(logprobs: Any, top_p: float) -> Any:
    """Keep the smallest set of most likely tokens whose probability reaches ``top_p``; renormalize.

    On the CPU the nucleus is looked for among the ``k`` most likely tokens first (``topk``), widening ``k``
    only when their mass falls short: sorting a 49K vocabulary costs ~3.7 ms there, for every row at every
    step, while a nucleus rarely holds more than a few hundred tokens (``topk`` of 256: ~0.15 ms). On a GPU
    the sort is cheaper than the tries (each reads their mass back to the host): an H200 took 0.23 ms per
    row to sort and 0.45-1.0 ms to try (``benchmarks/sampling.py``).
    """
    if logprobs.device.type == "cpu":
        for k in _NUCLEUS_CANDIDATES:
            if k >= logprobs.shape[-1]:
                break
            top, order = torch.topk(logprobs, k)  # descending
            shares = top.exp()
            before = shares.cumsum(-1) - shares  # mass of the more likely tokens
            if float(before[-1] + shares[-1]) >= top_p:
                keep = before < top_p
                keep[0] = True  # a top_p below float32's range (1e-300) rounds to 0 and would keep nothing
                kept = torch.full_like(logprobs, float("-inf"))
                kept[order[keep]] = top[keep]
                return torch.log_softmax(kept, dim=-1)
    return sorted_nucleus(logprobs, top_p)


def top_k_only(logprobs: Any, k: int) -> Any:
    """Keep the ``k`` most likely tokens (ties at the k-th as ``topk`` breaks them); renormalize."""
    top, order = torch.topk(logprobs, k)
    kept = torch.full_like(logprobs, float("-inf"))
    kept[order] = top
    return torch.log_softmax(kept, dim=-1)


def sorted_nucleus(logprobs: Any, top_p: float) -> Any:
    """The nucleus by sorting the whole vocabulary: a token is dropped once the mass before it reached top_p."""
    ordered, order = torch.sort(logprobs, descending=True)
    shares = ordered.exp()
    beyond = shares.cumsum(-1) - shares >= top_p
    beyond[0] = False  # the most likely token stays, even for a top_p that rounds to 0 in float32
    drop = torch.zeros_like(shares, dtype=torch.bool).scatter(0, order, beyond)
    return torch.log_softmax(logprobs.masked_fill(drop, float("-inf")), dim=-1)


#: how many of the most likely tokens ``nucleus`` looks at on the CPU before sorting the whole vocabulary
_NUCLEUS_CANDIDATES = (256, 4096)
