"""Wall time of `Trainer.dev` on 20 one-call tasks with 4 runner processes, measured after import.

Target: <= 1 s (side by side with Agent Lightning: `nox -s vs_agent_lightning`). Runners sleep in the store's
dequeue and are woken when work arrives; nothing polls. The fake model server is started before timing.
Prints figures; exits 0.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from openai import OpenAI

import agl
from agl.testing import FakeOpenAIServer


@agl.rollout
def one_call(task, llm):
    client = OpenAI(base_url=llm.get_base_url(), api_key="x")
    reply = client.chat.completions.create(model=llm.model, messages=[{"role": "user", "content": task["q"]}])
    return 1.0 if reply.choices[0].message.content else 0.0


def main() -> None:
    agl.instrument()
    tasks = [{"q": f"question {i}"} for i in range(20)]
    with FakeOpenAIServer() as server, tempfile.TemporaryDirectory() as tmp:
        trainer = agl.Trainer(
            n_runners=4,
            store=str(Path(tmp) / "bench.db"),
            initial_resources={"main_llm": agl.LLM(endpoint=server.base_url, model="fake")},
            progress=False,
        )
        start = time.perf_counter()
        rows = trainer.dev(one_call, tasks, print_table=False)
        elapsed = time.perf_counter() - start
    ok = sum(r.status == "succeeded" for r in rows)
    print("Trainer.dev: 20 one-call tasks, 4 runner processes, SQLite store")
    print(f"  wall time      {elapsed:8.3f} s   (target <= 1 s)")
    print(f"  succeeded      {ok:8d} / {len(rows)}")
    print(f"  llm spans      {sum(r.llm_calls for r in rows):8d}")


if __name__ == "__main__":
    main()
