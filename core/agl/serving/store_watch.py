"""Following a store's resources: each new resources version says which weights the server should serve.

How a resources version names a checkpoint (the trainer publishes it this way, docs/serving.md): the
policy's ``LLM`` resource (named ``main_llm`` by default; else the only LLM resource of the version) has
``endpoint`` = the server's base URL and ``model`` = the checkpoint to load: a folder written by
``save_pretrained`` (full weights or a peft LoRA adapter) or a ``.safetensors`` / ``.pt`` file. When
``model`` is not a path on this machine (a plain name such as ``"policy"``), the weights are unchanged and
only the version the server reports moves on.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Optional

from agl.types import LLM, ResourcesUpdate

logger = logging.getLogger(__name__)

DEFAULT_RESOURCE = "main_llm"


def checkpoint_of(update: ResourcesUpdate, resource: str = DEFAULT_RESOURCE) -> Optional[str]:
    """The checkpoint path a resources version names for the policy, or None (see the module docs)."""
    llm = update.resources.get(resource)
    if llm is None:
        llms = [r for r in update.resources.values() if isinstance(r, LLM)]
        llm = llms[0] if len(llms) == 1 else None
    if isinstance(llm, LLM) and os.path.exists(llm.model):
        return llm.model
    return None


class StoreWatcher:
    """Polls ``store.get_resources()`` every ``interval_s`` and brings ``server`` to the latest version.

    A checkpoint that fails to load is logged and skipped; the server keeps serving what it had.
    """

    def __init__(self, store: Any, server: Any, resource: str = DEFAULT_RESOURCE, interval_s: float = 1.0) -> None:
        self.store = store
        self.server = server
        self.resource = resource
        self.interval_s = interval_s
        self._applied: Optional[str] = None  # resources_id of the last version handled
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def check(self) -> bool:
        """One poll: apply the latest resources version if it is new. True if the served version changed."""
        update = self.store.get_resources()
        if update is None or update.resources_id == self._applied:
            return False
        self._applied = update.resources_id
        path = checkpoint_of(update, self.resource)
        if path is None:
            self.server.set_version(update.version)
            return True
        try:
            self.server.load_weights(path, version=update.version)
        except Exception as exc:  # noqa: BLE001 - bad weights (WeightsError), unreadable files: keep serving
            logger.error(
                "resources version %d: cannot load %s (%s: %s); still serving version %d",
                update.version,
                path,
                type(exc).__name__,
                exc,
                self.server.version,
            )
            return False
        return True

    def start(self) -> StoreWatcher:
        self.check()
        self._thread = threading.Thread(target=self._run, name="agl-store-watch", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.check()
            except Exception:  # a store hiccup must not stop the watching
                logger.exception("checking the store for new resources failed; trying again")
