"""``agl export-model``: a TorchGRPO checkpoint's trained policy as a Hugging Face model folder."""

from __future__ import annotations

import argparse
import json
from typing import Any


def add_export_model_parser(sub: Any) -> None:
    """``agl export-model RUN|CHECKPOINT --out DIR [--model M]``: the trained policy as an HF model folder."""
    export = sub.add_parser(
        "export-model",
        help="write a TorchGRPO checkpoint's trained policy as a Hugging Face model folder (LoRA merged)",
        description="Merge a checkpoint's training (LoRA adapter or full weights) into its base model and save "
        "config, safetensors weights and tokenizer to --out, for vLLM, transformers or `agl serve --model DIR`.",
    )
    export.add_argument("checkpoint", help="an `agl train --out` folder, a checkpoint_dir, or one step-NNNNNN folder")
    export.add_argument("--out", required=True, help="the folder to write (must be new or empty)")
    export.add_argument("--model", help="the base model (default: the one the checkpoint was trained from)")
    export.add_argument("--dtype", default=None, help="float32 (default), bfloat16 or float16")
    export.add_argument("--overwrite", action="store_true", help="write into a folder that is not empty")
    export.set_defaults(func=cmd_export_model)


def cmd_export_model(args: argparse.Namespace) -> int:
    from agl.algorithm.model_export import MANIFEST, export_model

    out = export_model(args.checkpoint, args.out, model=args.model, dtype=args.dtype, overwrite=args.overwrite)
    manifest = json.loads((out / MANIFEST).read_text(encoding="utf-8"))
    print(f"agl export-model: step {manifest['step']} of {manifest['checkpoint']} ({manifest['base_model']}) -> {out}")
    print(f"serve it with: agl serve --model {out}")
    return 0
