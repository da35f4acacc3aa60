"""Token generation for the policy server: one worker thread, continuous batching, exact token ids.

Concurrent requests share forward passes. Requests wait in a queue; one worker thread owns the model and
runs a decode loop over the *running batch*: at every step it samples one token for each running
request, drops the finished ones, and admits waiting requests (prefilled together, then merged into the
batch's KV cache) up to ``max_batch_size``. A request that arrives while others are generating therefore
joins at the next step instead of waiting for the whole batch to finish. Prompts are left-padded; the
attention mask hides padding and position ids count only real tokens, so a request gets the same logits
(up to float rounding) alone or in a batch.

Joining a running batch rewrites the KV cache tensors, which works for transformers' ``DynamicCache``
with plain (non sliding-window) layers, as Llama, Qwen2 and most causal LMs use. For other caches the
engine admits new requests only when the batch is empty (static batching); it still batches every
request waiting at that moment.

Sampling is per request: temperature, top-p, stop strings, seed (each request has its own
``torch.Generator``), the number of top logprobs, and a grammar the answer must follow (structured output,
:mod:`agl.serving.structured`). **Logprobs** are those of the distribution each token was actually drawn
from: ``log_softmax(logits / temperature)`` over the tokens the grammar allows, restricted to the top-p
nucleus and renormalized. With ``temperature == 0`` (greedy) that distribution is a point mass, so the
engine reports the model's own distribution, ``log_softmax(logits)``, like OpenAI and vLLM do; a temperature
below ``GREEDY_BELOW`` is greedy too (dividing by it would overflow). A request whose sampling fails anyway
(NaN logits) fails alone: its batch neighbours go on.

The engine never changes weights. Whoever does (an in-process trainer, :meth:`PolicyServer.load_weights`)
brackets the change with :meth:`GenerationEngine.paused`: waiting requests stay queued, the running batch
drains, and every request is generated entirely under one ``version``, which it reports.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import math
import random
import threading
import time
from collections import deque
from typing import Any, Deque, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from agl.openai_wire.stops import stop_position
from agl.serving.generation import (
    FINISH_CANCELLED,
    FINISH_LENGTH,
    FINISH_STOP,
    EngineStats,
    Event,
    Failed,
    Finished,
    Generation,
    Listener,
    RequestHandle,
    SamplingParams,
    ServerStopped,
    Started,
    Step,
    Token,
)
from agl.serving.models import attention_kernels
from agl.serving.nucleus import nucleus, top_k_only
from agl.serving.structured import GrammarError, Grammars, TokenMask

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _Request:
    prompt_ids: List[int]
    params: SamplingParams
    listener: Listener
    handle: RequestHandle
    eos_ids: frozenset


class _Row:
    """A request in the running batch: what it sampled so far and its random generator."""

    def __init__(self, request: _Request, version: int, generator: Any, grammar: Optional[TokenMask]) -> None:
        self.request = request
        self.version = version
        self.generator = generator
        self.grammar = grammar
        self.tokens: List[Token] = []
        self.text = ""
        self.finish_reason: Optional[str] = None

    @property
    def ids(self) -> List[int]:
        return [t.token_id for t in self.tokens]


class GenerationEngine:
    """Generates for concurrent requests with one model on one worker thread (see the module docs).

    ``max_batch_size``: most requests in one forward pass. ``batch_wait_s``: how long an idle engine
    waits after the first request arrives for others to join its first forward pass.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        max_batch_size: int = 16,
        batch_wait_s: float = 0.005,
        version: int = 0,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be at least 1, got {max_batch_size}")
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.batch_wait_s = batch_wait_s
        self.stats = EngineStats()
        self.max_context = int(getattr(model.config, "max_position_embeddings", 0) or 0) or None
        self._device = next(model.parameters()).device
        self._pad_id = _pad_id(tokenizer)
        self._eos_ids = _eos_ids(model, tokenizer)
        self.grammars = Grammars(tokenizer, self._eos_ids)
        forward = inspect.signature(_base_model(model).forward).parameters
        self._keeps_logits = "logits_to_keep" in forward
        # transformers renamed forward's ``past_key_values`` to ``cache`` (5.2x; the old name goes in 5.40)
        self._cache_arg = "cache" if "cache" in forward else "past_key_values"
        self._version = version
        self._cond = threading.Condition()
        self._waiting: Deque[_Request] = deque()
        self._pauses = 0
        self._busy = False  # the worker holds rows (a batch is running)
        self._can_join = True  # cleared when the model's KV cache cannot be merged (see the module docs)
        self._was_training = False  # the model's mode before the running batch began (restored after)
        self._closed = False
        self._dropped_running = 0  # requests in the batch as it closed (said with the queued ones)
        self._thread = threading.Thread(target=self._run, name="agl-generation", daemon=True)
        self._thread.start()

    # --- public API ----------------------------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self._version

    def set_version(self, version: int) -> None:
        """Requests admitted from now on report ``version`` (the weights were changed in place)."""
        with self._cond:
            self._version = version

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams, listener: Listener) -> RequestHandle:
        """Queue a request; ``listener`` gets its events on the worker thread (see ``Event``)."""
        if not prompt_ids:
            raise ValueError("the prompt is empty: give at least one token id")
        if self.max_context is not None and len(prompt_ids) + params.max_tokens > self.max_context:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) plus max_tokens ({params.max_tokens}) exceeds the model's "
                f"context of {self.max_context} tokens: shorten the conversation or lower max_tokens"
            )
        handle = RequestHandle()
        request = _Request(list(prompt_ids), params, listener, handle, self._eos_ids)
        with self._cond:
            if self._closed:
                raise RuntimeError("the generation engine is closed")
            self._waiting.append(request)
            self.stats.requests += 1
            self._cond.notify_all()
        return handle

    def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams, timeout: Optional[float] = None
    ) -> Generation:
        """Blocking convenience: submit and wait for the finished generation."""
        done = threading.Event()
        box: Dict[str, Any] = {}

        def listen(event: Event) -> None:
            if isinstance(event, (Finished, Failed)):
                box["event"] = event
                done.set()

        handle = self.submit(prompt_ids, params, listen)
        if not done.wait(timeout):
            handle.cancel()
            raise TimeoutError(f"generation did not finish within {timeout} s")
        event = box["event"]
        if isinstance(event, Failed):
            raise event.error
        return event.generation

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No request starts inside the block; on entry, the running batch is drained first."""
        with self._cond:
            self._pauses += 1
            self._cond.notify_all()
            while self._busy and not self._closed:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._pauses -= 1
                self._cond.notify_all()

    @property
    def waiting(self) -> int:
        """Requests queued and not yet running."""
        with self._cond:
            return len(self._waiting)

    def close(self) -> None:
        """Stop the worker; requests still running or queued fail with a clear error. Idempotent."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=30)
        with self._cond:
            leftover = list(self._waiting)
            self._waiting.clear()
        for request in leftover:
            _notify(request, Failed(ServerStopped("the policy server stopped before this request ran")))
        dropped = len(leftover) + self._dropped_running
        if dropped:
            logger.warning(
                "the policy server stopped with %d requests of running agents unanswered (each answered 500)",
                dropped,
            )

    # --- worker ----------------------------------------------------------------------------------------------

    def _run(self) -> None:
        batch = _Batch(self)
        while True:
            admitted = self._next_admissions(batch.size)
            if admitted is None:
                self._dropped_running = len(batch.rows)
                batch.fail_all(ServerStopped("the policy server stopped while this request was generating"))
                self._leave_eval()
                return
            if admitted and not batch.size:
                self._enter_eval()
            with torch.inference_mode(), attention_kernels(self._device):
                if admitted:
                    try:
                        batch.admit(admitted)
                    except Exception as exc:  # fail these requests, keep serving the others
                        logger.exception("prefill failed; failing the %d new request(s)", len(admitted))
                        for request in admitted:
                            _notify(request, Failed(exc))
                if batch.size:
                    try:
                        batch.step()
                    except Exception as exc:
                        logger.exception("decoding failed; failing the %d running request(s)", batch.size)
                        batch.fail_all(exc)
            if not batch.size:
                self._leave_eval()
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _enter_eval(self) -> None:
        """Generate in eval mode (no dropout; gradient checkpointing would switch the KV cache off).

        A trainer sharing the model only touches it while paused, after the batch drained and
        :meth:`_leave_eval` gave it back its own mode.
        """
        self._was_training = bool(self.model.training)
        if self._was_training:
            self.model.eval()

    def _leave_eval(self) -> None:
        if self._was_training:
            self.model.train()
            self._was_training = False

    def _next_admissions(self, running: int) -> Optional[List[_Request]]:
        """Requests to admit before the next step ([] to just step); None when closed. Blocks while idle.

        An idle engine that gets a request waits up to ``batch_wait_s`` for more to arrive, re-checking
        everything (a pause may have begun) after each wake-up.
        """
        deadline: Optional[float] = None
        with self._cond:
            while True:
                if self._closed:
                    return None
                room = self.max_batch_size - running
                admissible = self._waiting and not self._pauses and room > 0 and (running == 0 or self._can_join)
                if admissible:
                    if running == 0 and len(self._waiting) < room:
                        deadline = deadline if deadline is not None else time.monotonic() + self.batch_wait_s
                        left = deadline - time.monotonic()
                        if left > 0:
                            self._cond.wait(left)
                            continue
                    self._busy = True
                    return [self._waiting.popleft() for _ in range(min(room, len(self._waiting)))]
                if running:
                    return []
                self._busy = False
                self._cond.notify_all()
                self._cond.wait()


class _Batch:
    """The running batch: rows, their KV cache, attention mask, next positions and next-token logits."""

    def __init__(self, engine: GenerationEngine) -> None:
        self.engine = engine
        self.rows: List[_Row] = []
        self.cache: Any = None
        self.mask: Any = None  # [B, T] 1 for real tokens
        self.positions: Any = None  # [B] position id of each row's next token
        self.logits: Any = None  # [B, V] logits for each row's next token

    @property
    def size(self) -> int:
        return len(self.rows)

    # --- admission ---------------------------------------------------------------------------------------

    def admit(self, requests: List[_Request]) -> None:
        engine = self.engine
        device = engine._device
        width = max(len(r.prompt_ids) for r in requests)
        ids = torch.full((len(requests), width), engine._pad_id, dtype=torch.long, device=device)
        mask = torch.zeros((len(requests), width), dtype=torch.long, device=device)
        for i, request in enumerate(requests):
            n = len(request.prompt_ids)
            ids[i, width - n :] = torch.tensor(request.prompt_ids, dtype=torch.long, device=device)
            mask[i, width - n :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        kwargs = {"logits_to_keep": 1} if engine._keeps_logits else {}
        kwargs[engine._cache_arg] = cache
        out = engine.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **kwargs)
        logits = out.logits[:, -1, :].float()
        engine.stats.prefills += 1
        engine.stats.max_batch = max(engine.stats.max_batch, len(requests) + self.size)
        grammars = [engine.grammars.mask(r.params.grammar) if r.params.grammar else None for r in requests]
        rows = [_Row(r, engine._version, _generator(r.params.seed, device), g) for r, g in zip(requests, grammars)]
        next_positions = positions[:, -1] + 1
        if self.rows:
            self._merge(cache, mask, next_positions, logits)
        else:
            self.cache, self.mask, self.positions, self.logits = cache, mask, next_positions, logits
            engine._can_join = engine._can_join and _cache_can_join(cache)
        self.rows.extend(rows)
        for row in rows:
            _notify(row.request, Started(row.version))

    def _merge(self, cache: Any, mask: Any, positions: Any, logits: Any) -> None:
        """Append new rows: left-pad the shorter side's cache and mask to a common width, stack on batch."""
        width = max(self.mask.shape[1], mask.shape[1])
        for old, new in zip(self.cache.layers, cache.layers):
            old.keys = torch.cat([_pad_left(old.keys, width, 2), _pad_left(new.keys, width, 2)], dim=0)
            old.values = torch.cat([_pad_left(old.values, width, 2), _pad_left(new.values, width, 2)], dim=0)
        self.mask = torch.cat([_pad_left(self.mask, width, 1), _pad_left(mask, width, 1)], dim=0)
        self.positions = torch.cat([self.positions, positions])
        self.logits = torch.cat([self.logits, logits])

    # --- decoding ----------------------------------------------------------------------------------------

    def step(self) -> None:
        """Sample one token per row, retire finished rows, run the model on the rest."""
        engine = self.engine
        keep: List[int] = []
        for i, row in enumerate(self.rows):
            try:
                token = _sample(self.logits[i], row)
            except GrammarError as exc:  # this request's answer cannot go on; the others can
                logger.warning("failing a structured-output request: %s", exc)
                _notify(row.request, Failed(exc))
                continue
            except Exception as exc:  # one request's sampling failing must not fail its neighbours
                logger.exception("sampling failed; failing that one request")
                _notify(row.request, Failed(exc))
                continue
            row.tokens.append(token)
            engine.stats.generated_tokens += 1
            self._update_text(row)
            _notify(row.request, Step(token, row.text))
            if row.finish_reason is None and row.request.handle.cancelled:
                row.finish_reason = FINISH_CANCELLED
            if row.finish_reason is None:
                keep.append(i)
            else:
                _notify(row.request, Finished(self._generation(row)))
        if len(keep) < len(self.rows):
            self._select(keep)
        if not self.rows:
            self.cache = self.mask = self.positions = self.logits = None
            return
        next_ids = torch.tensor([[row.tokens[-1].token_id] for row in self.rows], device=engine._device)
        ones = torch.ones((len(self.rows), 1), dtype=self.mask.dtype, device=self.mask.device)
        self.mask = torch.cat([self.mask, ones], dim=1)
        out = engine.model(
            input_ids=next_ids,
            attention_mask=self.mask,
            position_ids=self.positions[:, None],
            **{engine._cache_arg: self.cache},
            use_cache=True,
        )
        self.logits = out.logits[:, -1, :].float()
        self.positions = self.positions + 1
        engine.stats.decode_steps += 1
        engine.stats.row_steps += len(self.rows)
        engine.stats.max_batch = max(engine.stats.max_batch, len(self.rows))

    def _update_text(self, row: _Row) -> None:
        """Decide whether the row is done: end-of-sequence token, a stop string, or max_tokens."""
        request = row.request
        ids = row.ids
        ended = ids[-1] in request.eos_ids
        row.text = self.engine.tokenizer.decode(ids[:-1] if ended else ids)
        cut = stop_position(row.text, request.params.stop, request.params.stop_free_blocks)
        if cut is not None:
            row.text = row.text[:cut]
        if ended or cut is not None:
            row.finish_reason = FINISH_STOP
        elif len(ids) >= request.params.max_tokens:
            row.finish_reason = FINISH_LENGTH

    def _generation(self, row: _Row) -> Generation:
        return Generation(
            prompt_ids=row.request.prompt_ids,
            response_ids=row.ids,
            tokens=row.tokens,
            text=row.text,
            finish_reason=row.finish_reason or FINISH_STOP,
            version=row.version,
        )

    def _select(self, keep: List[int]) -> None:
        """Keep only the rows ``keep``, and drop cache columns that are padding for every remaining row."""
        self.rows = [self.rows[i] for i in keep]
        if not keep:
            return
        index = torch.tensor(keep, device=self.mask.device)
        self.mask = self.mask.index_select(0, index)
        self.positions = self.positions.index_select(0, index)
        self.logits = self.logits.index_select(0, index)
        self.cache.batch_select_indices(index)
        first = int(self.mask.any(dim=0).nonzero()[0])
        if first and self.engine._can_join:
            self.mask = self.mask[:, first:]
            for layer in self.cache.layers:
                layer.keys = layer.keys[:, :, first:, :]
                layer.values = layer.values[:, :, first:, :]

    def fail_all(self, error: BaseException) -> None:
        for row in self.rows:
            _notify(row.request, Failed(error))
        self.rows = []
        self.cache = self.mask = self.positions = self.logits = None


# --- sampling ----------------------------------------------------------------------------------------------


def _sample(logits: Any, row: _Row) -> Token:
    """Draw the row's next token; its logprob is under the distribution it was drawn from (module docs)."""
    params = row.request.params
    allowed = row.grammar.apply(logits) if row.grammar is not None else logits
    if params.temperature < GREEDY_BELOW:
        logprobs = torch.log_softmax(logits, dim=-1)
        token_id = int(torch.argmax(allowed))
    else:
        logprobs = torch.log_softmax(allowed / params.temperature, dim=-1)
        if 0 < params.top_k < logprobs.shape[-1]:  # then top-p within the k, as vLLM does
            logprobs = top_k_only(logprobs, params.top_k)
        if params.top_p < 1:
            logprobs = nucleus(logprobs, params.top_p)
        token_id = _draw(logprobs, row.generator)
    if row.grammar is not None:
        row.grammar.advance(token_id)
    top: List[Tuple[int, float]] = []
    if params.top_logprobs:
        values, indices = torch.topk(logprobs, params.top_logprobs)
        top = [(int(i), float(v)) for v, i in zip(values, indices) if v > float("-inf")]
    return Token(token_id, float(logprobs[token_id]), top)


#: temperatures below this sample greedily. ``logits / temperature`` overflows float32 for a tiny temperature
#: (1e-40: inf, then NaN), and long before that the tempered distribution is a point mass on the argmax.
GREEDY_BELOW = 1e-5


def _draw(logprobs: Any, generator: Any) -> int:
    """One token drawn from ``exp(logprobs)`` by inverting its cumulative distribution.

    Why not ``torch.multinomial``: on the CPU it draws one exponential variate per vocabulary entry, ~1.1 ms
    for a 49K vocabulary against ~0.1 ms here (one uniform variate), paid for every row at every decode step.
    The sums are in float64 so that the last tokens' share is not lost to rounding; ``right=True`` never
    lands on a token of probability zero (outside the nucleus), since its cumulative sum equals its
    predecessor's.
    """
    cumulative = torch.cumsum(logprobs.exp().double(), 0)
    total = cumulative[-1:]
    mass = float(total)
    if not math.isfinite(mass) or mass <= 0:  # NaN logits: no token can be drawn
        raise ValueError(f"cannot sample: the token distribution sums to {mass} (NaN or zero logits)")
    u = torch.rand((1,), generator=generator, dtype=torch.float64, device=cumulative.device) * total
    index = int(torch.searchsorted(cumulative, u, right=True))
    if index >= cumulative.numel():  # u rounded up to the total: the last token with a share
        index = int(torch.searchsorted(cumulative, total, right=False))
    return index


# --- helpers -----------------------------------------------------------------------------------------------

_seeds = random.SystemRandom()


def _notify(request: _Request, event: Event) -> None:
    """Deliver an event; a listener that fails (its client went away) must not fail the whole batch."""
    try:
        request.listener(event)
    except Exception:
        logger.warning("a request listener failed; cancelling that request", exc_info=True)
        request.handle.cancel()


def _generator(seed: Optional[int], device: Any) -> Any:
    generator = torch.Generator(device=device)
    generator.manual_seed(seed if seed is not None else _seeds.getrandbits(63))
    return generator


def _base_model(model: Any) -> Any:
    """The transformers model under a PEFT wrapper (whose own ``forward`` only takes ``**kwargs``)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def _cache_can_join(cache: Any) -> bool:
    """Only plain dynamic layers (keys/values ``[batch, heads, seq, dim]``) can be padded and stacked."""
    layers = getattr(cache, "layers", None) or []
    return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)


def _pad_left(tensor: Any, width: int, dim: int) -> Any:
    missing = width - tensor.shape[dim]
    if missing <= 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)


def _pad_id(tokenizer: Any) -> int:
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if candidate is not None:
            return int(candidate)
    return 0


def _eos_ids(model: Any, tokenizer: Any) -> frozenset:
    """Tokens that end an answer: the tokenizer's end-of-sequence token and the model's generation config's."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(configured, int):
        ids.add(configured)
    elif isinstance(configured, (list, tuple)):
        ids.update(int(i) for i in configured)
    return frozenset(ids)


__all__ = [
    "FINISH_CANCELLED",
    "FINISH_LENGTH",
    "FINISH_STOP",
    "GREEDY_BELOW",
    "EngineStats",
    "Event",
    "Failed",
    "Finished",
    "Generation",
    "GenerationEngine",
    "Listener",
    "RequestHandle",
    "SamplingParams",
    "Started",
    "Step",
    "Token",
]
