"""Regenerate the main job's bundled task files (deterministic): ``python examples/main_job/make_data.py``.

Each task is a one-step arithmetic request in words ("Subtract 7 from 42."); ``answer`` is the number. The
train and held-out splits share no (wording, numbers) pair.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

DATA = Path(__file__).resolve().parent.parent / "data"
FORMS = [
    ("Add {a} and {b}.", "+"),
    ("What is {a} plus {b}?", "+"),
    ("Subtract {b} from {a}.", "-"),
    ("What is {a} minus {b}?", "-"),
    ("What is {a} times {b}?", "*"),
    ("Multiply {a} by {b}.", "*"),
]


def make(n_train: int = 300, n_heldout: int = 50, seed: int = 7) -> None:
    rng = random.Random(seed)
    seen = set()
    tasks = []
    while len(tasks) < n_train + n_heldout:
        form, op = FORMS[rng.randrange(len(FORMS))]
        a, b = rng.randint(10, 60), rng.randint(2, 9)
        if (form, a, b) in seen:
            continue
        seen.add((form, a, b))
        answer = {"+": a + b, "-": a - b, "*": a * b}[op]
        tasks.append({"question": form.format(a=a, b=b), "answer": answer})
    splits = {"main_job_train.jsonl": tasks[:n_train], "main_job_heldout.jsonl": tasks[n_train:]}
    for name, items in splits.items():
        prefix = "train" if "train" in name else "heldout"
        lines = [json.dumps({"task_id": f"{prefix}-{i:03d}", **t}) for i, t in enumerate(items)]
        (DATA / name).write_text("\n".join(lines) + "\n", encoding="utf-8")
        print(f"wrote {len(items)} tasks to {DATA / name}")


if __name__ == "__main__":
    make()
