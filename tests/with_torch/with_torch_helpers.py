"""Setup shared by the torch tests: the tiny TorchGRPO run, its Trainer, ``agl train`` argument lists, training
samples, greedy reference generation. Imported as ``with_torch_helpers`` (pytest puts this folder on sys.path)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List

import torch

import agl
from agl.algorithm.torch_grpo import TorchGRPO
from agl.lightningrl.types import Sample
from agl.serving.models import load_policy

#: How the agents that ``agl train`` runs in these tests end (source text): one chat call, and the answer's length
#: parity as the reward, so that rewards vary.
CHAT_CALL_REWARDED_BY_LENGTH = """
    with openai.OpenAI(base_url=llm.get_base_url(), api_key="x", max_retries=0) as client:
        reply = client.chat.completions.create(
            model=llm.model, messages=[{"role": "user", "content": task["question"]}], **llm.sampling_parameters
        )
    return float(len(reply.choices[0].message.content or "") % 2)
"""


def tiny_grpo(tmp_path: Path, **overrides: Any) -> TorchGRPO:
    """TorchGRPO on the tiny Llama (seed 0): 2 tasks x 2 rollouts, 1 step, 6 tokens; ``overrides`` win."""
    settings: Dict[str, Any] = dict(
        model=load_policy("tiny", device="cpu", seed=0),
        group_size=2,
        batch_tasks=2,
        steps=1,
        max_tokens=6,
        temperature=1.0,
        lr=1e-3,
        output_dir=tmp_path / "run",
        checkpoint_dir=tmp_path / "ckpt",
        seed=0,
    )
    settings.update(overrides)
    return TorchGRPO(**settings)


def thread_trainer(tmp_path: Path, algorithm: Any, **options: Any) -> agl.Trainer:
    """A Trainer of ``algorithm``: four thread runners, the store tmp_path/store.db, no progress bar."""
    store = str(tmp_path / "store.db")
    return agl.Trainer(algorithm=algorithm, store=store, n_runners=4, runner_mode="thread", progress=False, **options)


def write_train_files(folder: Path, agent: str) -> Path:
    """Write agent.py (the source ``agent``) and train.jsonl (four "Say i." questions) into ``folder``."""
    (folder / "agent.py").write_text(agent)
    (folder / "train.jsonl").write_text("".join(json.dumps({"question": f"Say {i}."}) + "\n" for i in range(4)))
    return folder


def tiny_train_args(agent: str, data: Path, out: Path, *extra: str) -> List[str]:
    """``agl train`` of ``agent`` on the tiny model: 2 tasks x 2 rollouts a step, 4 tokens, 4 runners, seed 1."""
    tiny_run = ["--model", "tiny", "--group-size", "2", "--batch-tasks", "2", "--max-tokens", "4", "--n-runners", "4"]
    return ["train", agent, "--data", str(data), *tiny_run, "--set", "seed=1", "--out", str(out), *extra]


def trained_sample(
    rollout_id: str, prompt_ids: List[int], response_ids: List[int], reward: float, policy: str = "p", **fields: Any
) -> Sample:
    """A Sample of task "t" whose every response token was generated (``response_mask`` all ones)."""
    ids = dict(prompt_ids=prompt_ids, response_ids=response_ids, response_mask=[1] * len(response_ids))
    return Sample(rollout_id=rollout_id, task_id="t", policy=policy, reward=reward, **ids, **fields)


def greedy_generate(model: Any, prompt: List[int], n: int) -> List[int]:
    """transformers' own greedy ``generate``: the ``n`` ids after ``prompt``."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=n,
            do_sample=False,
        )
    return out[0, len(prompt) :].tolist()
