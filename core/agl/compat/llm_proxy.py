"""Agent Lightning's ``LLMProxy`` (a LiteLLM server), served by agl's own recording proxy.

Agent Lightning code writes ``LLMProxy(port=, model_list=[{"model_name": NAME, "litellm_params": {"model":
"hosted_vllm/NAME", "api_base": URL}}], store=)``, ``await proxy.start()`` and publishes
``proxy.as_resource()``. Here that runs :class:`agl.instrumentation.proxy.LLMProxy` in front of ``api_base``:
a request under ``/rollout/{rollout_id}/attempt/{attempt_id}/v1/...`` is recorded as an ``llm`` span with its
token ids in that rollout, as agl's proxy always does. agl's proxy speaks the OpenAI API to one model (on one
or more servers), so the ``model_list`` entries must name one model behind OpenAI-compatible servers
(``hosted_vllm/`` or ``openai/``). LiteLLM's other settings have no use here; each is accepted and logged
once per process.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple, TypedDict
from urllib.parse import urlsplit

from agl._util.http_thread import advertised_url
from agl.compat.aliases import unavailable
from agl.compat.execution import say_once
from agl.instrumentation.proxy import LLMProxy as RecordingProxy
from agl.types import LLM, ProxyLLM

logger = logging.getLogger("agl.compat.llm_proxy")

OPENAI_BASE = "https://api.openai.com/v1"
_PROVIDERS = ("hosted_vllm/", "openai/")  # LiteLLM providers that are an OpenAI-compatible server
_USED_PARAMS = {"model", "api_base"}


class ModelConfig(TypedDict):
    """One entry of LiteLLM's ``model_list``: the name agents ask for and where it is served."""

    model_name: str
    litellm_params: Dict[str, Any]


def _note_once(key: str, message: str) -> None:
    """Log once per process that an Agent Lightning setting has no use in agl's proxy."""
    say_once(f"llm_proxy:{key}", "LLMProxy: %s (docs/agent-lightning.md)", message)


def _served_model(entry: Any) -> Tuple[str, str]:
    """(the model name the server serves, its OpenAI base URL) of one ``model_list`` entry."""
    params = entry.get("litellm_params") if isinstance(entry, dict) else None
    if not isinstance(params, dict) or not isinstance(entry.get("model_name"), str):
        raise ValueError(
            "a model_list entry is {'model_name': NAME, 'litellm_params': {'model': 'hosted_vllm/NAME', "
            f"'api_base': URL}}}}, got {entry!r:.120}"
        )
    model = str(params.get("model") or entry["model_name"])
    provider = next((p for p in _PROVIDERS if model.startswith(p)), "")
    if not provider and "/" in model and not params.get("api_base"):
        raise ValueError(
            f"LiteLLM model {model!r}: agl's LLMProxy forwards to OpenAI-compatible servers only; write "
            "'hosted_vllm/NAME' or 'openai/NAME' with the server's api_base"
        )
    for key in sorted(set(params) - _USED_PARAMS):
        _note_once(f"param:{key}", f"litellm_params[{key!r}] is not used: requests go to api_base as sent")
    base = str(params.get("api_base") or os.environ.get("OPENAI_BASE_URL") or OPENAI_BASE)
    return model[len(provider) :], base.rstrip("/")


def _one_model(model_list: Sequence[Any]) -> Tuple[str, List[str]]:
    """(the served model name, its servers) for a ``model_list`` that names one model, else a clear error."""
    served = [_served_model(entry) for entry in model_list]
    asked = sorted({entry["model_name"] for entry in model_list})
    models = sorted({model for model, _ in served})
    if len(asked) > 1 or len(models) > 1:
        raise ValueError(
            f"agl's LLMProxy serves one model, the model_list names {asked} ({models}): run one LLMProxy per model"
        )
    return models[0], list(dict.fromkeys(base for _, base in served))


class LLMProxy:
    """Agent Lightning's ``LLMProxy`` API on agl's recording proxy (see the module docstring)."""

    def __init__(
        self,
        port: Optional[int] = None,
        model_list: Optional[List[ModelConfig]] = None,
        store: Any = None,
        host: Optional[str] = None,
        litellm_config: Optional[Dict[str, Any]] = None,
        num_retries: int = 0,
        num_workers: int = 1,
        launch_mode: Optional[str] = None,
        launcher_args: Any = None,
        middlewares: Optional[Sequence[Any]] = None,
        callbacks: Optional[Sequence[Any]] = None,
    ) -> None:
        self.store = store
        self.port = getattr(launcher_args, "port", None) if launcher_args is not None else port
        self.host = (getattr(launcher_args, "host", None) if launcher_args is not None else host) or "127.0.0.1"
        self._proxy: Optional[RecordingProxy] = None
        self.model_list: List[ModelConfig] = []
        self.update_model_list(list(model_list or []))
        ignored = {
            "litellm_config": "LiteLLM's config has no use: agl's proxy is not LiteLLM",
            "num_retries": "num_retries is not used: agents' OpenAI clients retry themselves",
            "num_workers": "num_workers is not used: the proxy is one asyncio server in a thread",
            "launch_mode": "launch_mode is not used: the proxy always runs in a thread of this process",
            "middlewares": "middlewares are not used: agl routes /rollout/{rid}/attempt/{aid} and keeps streams",
            "callbacks": "callbacks are not used: agl always records spans with token ids and logprobs",
        }
        given = {
            "litellm_config": bool(litellm_config),
            "num_retries": num_retries != 0,
            "num_workers": num_workers != 1,
            "launch_mode": launch_mode is not None,
            "middlewares": middlewares is not None,
            "callbacks": callbacks is not None,
        }
        for name, message in ignored.items():
            if given[name]:
                _note_once(name, message)

    # -- configuration -------------------------------------------------------------------------------------
    def get_store(self) -> Any:
        return self.store

    def set_store(self, store: Any) -> None:
        """Record into ``store`` from now on (also while running)."""
        self.store = store
        if self._proxy is not None:
            self._proxy.store = store

    def update_model_list(self, model_list: List[ModelConfig]) -> None:
        """Replace the model list; a running proxy forwards to the new servers at once."""
        if model_list:
            model, upstreams = _one_model(model_list)
            if self._proxy is not None:
                self._proxy.set_upstreams(upstreams)
                self._proxy.model = model
        self.model_list = list(model_list)

    # -- lifecycle -----------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Start serving (in a thread); returns once the proxy accepts connections."""
        if self.store is None:
            raise ValueError("LLMProxy has no store to record into: pass store= or call set_store() before start()")
        if not self.model_list:
            raise ValueError("LLMProxy has no model: pass model_list= or call update_model_list() before start()")
        if self.is_running():
            return
        model, upstreams = _one_model(self.model_list)
        proxy = RecordingProxy(upstreams, self.store, host=self.host, port=self.port or 0, model=model)
        await asyncio.to_thread(proxy.start)
        self.port = urlsplit(proxy.base_url).port  # a restart keeps the address agents were given
        self._proxy = proxy

    async def stop(self) -> None:
        if self._proxy is None:
            logger.warning("LLMProxy is not running: nothing to stop")
            return
        proxy, self._proxy = self._proxy, None
        await asyncio.to_thread(proxy.stop)

    async def restart(self, *, _port: Optional[int] = None) -> None:
        """Stop (if running) and start again, on ``_port`` if given, else on the same port."""
        if self.is_running():
            await self.stop()
        if _port is not None:
            self.port = _port
        await self.start()

    def is_running(self) -> bool:
        return self._proxy is not None

    def initialize(self) -> None:
        """Agent Lightning wires LiteLLM's hooks here; agl's proxy needs none."""
        _note_once("initialize", "initialize() does nothing: start() sets the proxy up")

    # -- resources -----------------------------------------------------------------------------------------
    @property
    def base_url(self) -> str:
        """``http://host:port/v1``: where agents reach the proxy."""
        if self._proxy is not None:
            return self._proxy.base_url
        if not self.port:
            raise RuntimeError("the LLMProxy has no port yet: give port= or start() it first")
        return advertised_url(self.host, self.port)

    def as_resource(
        self,
        rollout_id: Optional[str] = None,
        attempt_id: Optional[str] = None,
        model: Optional[str] = None,
        sampling_parameters: Optional[Dict[str, Any]] = None,
    ) -> LLM:
        """The resource agents use: a ``ProxyLLM`` (each rollout reaches it under its own route) or, with
        both ids, a plain ``LLM`` whose endpoint is that rollout's route."""
        name = model or self._default_model()
        sampling = dict(sampling_parameters or {})
        if rollout_id is None and attempt_id is None:
            return ProxyLLM(endpoint=self.base_url, model=name, sampling_parameters=sampling)
        if rollout_id is None or attempt_id is None:
            raise ValueError("as_resource() takes both rollout_id and attempt_id, or neither")
        endpoint = ProxyLLM(endpoint=self.base_url, model=name).get_base_url(rollout_id, attempt_id)
        return LLM(endpoint=endpoint, model=name, sampling_parameters=sampling)

    def _default_model(self) -> str:
        names = list(dict.fromkeys(entry["model_name"] for entry in self.model_list))
        if len(names) == 1:
            return names[0]
        raise ValueError(f"as_resource() needs model=: the model_list names {names or 'no model'}")


def get_active_llm_proxy() -> LLMProxy:
    """Agent Lightning's process-global proxy: agl keeps none (the Trainer passes its proxy along)."""
    raise RuntimeError(unavailable("get_active_llm_proxy()", "keep the LLMProxy object you started"))


__all__ = ["LLMProxy", "ModelConfig", "get_active_llm_proxy"]
