"""Regenerate the multi-turn job's bundled task files (deterministic): ``python examples/multi_turn/make_data.py``.

Each task is a two-step arithmetic request in words ("Add 17 and 4, then multiply the result by 3."), one
step for each tool; ``answer`` is the number. The train and held-out splits share no (wording, numbers) triple.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

DATA = Path(__file__).resolve().parent.parent / "data"
FORMS: List[Tuple[str, Callable[[int, int, int], int]]] = [
    ("Add {a} and {b}, then multiply the result by {c}.", lambda a, b, c: (a + b) * c),
    ("What is {a} plus {b}, times {c}?", lambda a, b, c: (a + b) * c),
    ("Multiply {a} by {b}, then add {c}.", lambda a, b, c: a * b + c),
    ("What is {a} times {b}, plus {c}?", lambda a, b, c: a * b + c),
]


def make(n_train: int = 300, n_heldout: int = 50, seed: int = 11) -> None:
    rng = random.Random(seed)
    seen = set()
    tasks: List[Dict[str, Any]] = []
    while len(tasks) < n_train + n_heldout:
        form = rng.randrange(len(FORMS))
        a, b, c = rng.randint(10, 40), rng.randint(2, 9), rng.randint(2, 9)
        if (form, a, b, c) in seen:
            continue
        seen.add((form, a, b, c))
        text, answer = FORMS[form]
        tasks.append({"question": text.format(a=a, b=b, c=c), "answer": answer(a, b, c)})
    for name, items in (("train", tasks[:n_train]), ("heldout", tasks[n_train:])):
        lines = [json.dumps({"task_id": f"{name}-{i:03d}", **t}) for i, t in enumerate(items)]
        path = DATA / f"multi_turn_{name}.jsonl"
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        print(f"wrote {len(items)} tasks to {path}")


if __name__ == "__main__":
    make()
