"""TorchGRPO's policy-server session: the policy loaded and served by agl's :class:`~agl.serving.PolicyServer`
for as long as a run lasts, and the ``LLM`` resources that send the runners' agents to it, each with the
sampling settings the server applies while that resource's rollouts run."""

from __future__ import annotations

import contextlib
import logging
import os
import random
from typing import Any, Dict, Iterator, List, Mapping, Tuple

import torch

from agl._util.http_thread import WILDCARD_HOSTS, advertised_url
from agl.algorithm.checkpoint import record_published
from agl.algorithm.torch_grpo_config import TorchGRPOBase
from agl.serving.models import load_policy
from agl.types import LLM, Rollout, Task

logger = logging.getLogger("agl.train")


class PolicyServerSession(TorchGRPOBase):
    """The part of :class:`~agl.algorithm.torch_grpo.TorchGRPO` that starts and feeds its policy server (its
    settings and ``server`` are TorchGRPO's)."""

    @contextlib.contextmanager
    def _session(self) -> Iterator[Any]:
        """Load the policy, start its server, publish it; stop the server on the way out (errors too)."""
        from agl.lightningrl.adapter import LightningRL
        from agl.serving import PolicyServer

        adapter = LightningRL.from_config(self.adapter)
        if self.torch_threads or not torch.cuda.is_available():
            torch.set_num_threads(self.torch_threads or os.cpu_count() or 1)
        random.seed(self.seed)
        torch.manual_seed(self.seed)
        model, tokenizer = self._load_model()
        self.attach(model, tokenizer)
        self.server = PolicyServer(
            model,
            self.tokenizer,
            model_name=self.model_name,
            max_batch_size=self.server_batch_size,
            host=self.server_host,
            port=self.server_port,
        )
        self.server.start()
        self._warn_if_unreachable()
        try:
            yield adapter
        finally:
            self.server.stop()

    def _load_model(self) -> Tuple[Any, Any]:
        if isinstance(self.model_spec, tuple):
            model, tokenizer = self.model_spec
            return model, tokenizer
        return load_policy(self.model_spec, dtype=self.dtype, device=self.device, seed=self.seed)

    def _publish(self, sampling: Mapping[str, Any]) -> str:
        """Store an LLM resource pointing at the server with ``sampling``; returns its resources id.

        The settings travel with the resources id: :meth:`_run_rollouts` makes the server apply them to the
        requests that leave them out while that id's rollouts run (see there). Publishing itself does not
        touch the server, so publishing the next training resources before an evaluation (or the reverse)
        cannot change how any other rollouts are sampled."""
        llm = LLM(endpoint=self._endpoint(), model=self.model_name, sampling_parameters=dict(sampling))
        resources_id = self.store.add_resources({self.resource_name: llm}).resources_id
        record_published(self.checkpoint_dir, resources_id)
        self._sampling_of[resources_id] = dict(sampling)
        return resources_id

    def _run_rollouts(self, tasks: List[Task], resources_id: str, **kwargs: Any) -> List[Rollout]:
        """``trainer.run_tasks`` of ``tasks`` with ``resources_id``, the server sampling as that resource says.

        An agent that does not pass ``llm.sampling_parameters`` on (the README's does not) is sampled at the
        server's ``request_defaults``, not at the resource's settings. One policy server serves training and
        validation, so its defaults are set here to the settings published with ``resources_id`` for as long
        as its rollouts run, and put back afterwards (errors too): training rollouts are always sampled with
        the training settings and validation rollouts with ``val_sampling`` (or their ``extra_evals``
        entry), whatever order resources are published and evaluations run in. This holds because the
        trainer runs one batch of rollouts at a time (``run_tasks`` returns once all of them ended), so no
        rollout of another resources id is being served meanwhile."""
        previous = self.server.request_defaults
        self.server.request_defaults = dict(self._sampling_of[resources_id])
        try:
            return self.trainer.run_tasks(tasks, resources_id=resources_id, **kwargs)
        finally:
            self.server.request_defaults = previous

    def _endpoint(self) -> str:
        """The policy server's URL as agents get it: ``server_url``, else the bound address, a wildcard
        ``server_host`` advertised under this machine's name (runners on other machines must reach it)."""
        if self.server_url:
            return self.server_url
        if self.server_host in WILDCARD_HOSTS:
            return advertised_url(self.server_host, self.server.bound_port)
        return self.server.base_url

    def _warn_if_unreachable(self) -> None:
        """Runners only on other machines (``n_runners=0``) cannot reach a server bound to loopback."""
        if (
            self.trainer.n_runners == 0
            and not self.server_url
            and self.server_host in ("127.0.0.1", "localhost", "::1")
        ):
            logger.warning(
                "n_runners=0 (runners on other machines) but the policy server listens on %s only: they would "
                "be sent to their own %s. Pass server_host='0.0.0.0' (published under this machine's name, %s) "
                "or server_url='http://HOST:PORT/v1' with a server_port",
                self.server_host,
                self._endpoint(),
                advertised_url("0.0.0.0", self.server.bound_port),
            )

    def _train_sampling(self) -> Dict[str, Any]:
        # logprobs: the server returns each token's logprob, the exact "old" logprobs of the PPO ratio.
        return {"temperature": self.temperature, "max_tokens": self.max_tokens, "logprobs": True, **self.sampling}
