"""The contract every agl instrumentor follows (after OpenTelemetry contrib's BaseInstrumentor).

- ``instruments``: requirement strings of the package it hooks; outside that range ``instrument()``
  warns once and does nothing instead of crashing the user's program.
- ``instrument()`` is idempotent; ``uninstrument()`` restores exactly what was there before.
- Instances of one instrumentor class share one set of hooks: ``agl.instrument()``'s and one a user or a
  library made (OpenInference-style) must not trace every call twice, and neither may leave the other
  hooking nothing while it says it is instrumented. The first ``instrument()`` hooks the framework, later
  instances join those hooks (with the first one's settings), and the last ``uninstrument()`` takes them out,
  whichever instance hooked.
- Third parties register their own instrumentor class under the entry-point group ``agl.integrations``.
"""

from __future__ import annotations

import abc
import contextlib
import importlib.metadata
import logging
import re
import threading
from typing import Any, ClassVar, Dict, Optional, Tuple

logger = logging.getLogger("agl.instrumentation")

_REQ = re.compile(r"^\s*([A-Za-z0-9_.\-\[\]]+)\s*(.*)$")

_active_lock = threading.Lock()
# instrumentors hooked now, by name, however made (agl.instrument() or an Instrumentor of one's own)
_active: Dict[str, int] = {}

_hooks_lock = threading.RLock()  # re-entrant: an adapter's _instrument may instrument another layer


class _SharedHooks:
    """The hooks of one instrumentor class: the instance whose ``_instrument`` put them in place (it takes
    them out again) and how many instances use them now."""

    def __init__(self, owner: Instrumentor) -> None:
        self.owner = owner
        self.users = 0


_hooks: Dict[type, _SharedHooks] = {}


def hooks_owner(cls: type) -> Optional[Instrumentor]:
    """The instance of instrumentor class ``cls`` whose hooks are in place (None: not hooked), for state an
    adapter hands out, such as the LangChain callback handler."""
    with _hooks_lock:
        shared = _hooks.get(cls)
        return shared.owner if shared is not None else None


def any_instrumented() -> bool:
    """Whether any agl instrumentor is hooked in this process (see ``Trainer.runners``)."""
    return any(_active.values())


def is_hooked(name: str) -> bool:
    """Whether an instrumentor named ``name`` (e.g. ``"openai"``, the layer that records LLM calls) is hooked."""
    return _active.get(name, 0) > 0


def _count_active(name: str, delta: int) -> None:
    with _active_lock:
        _active[name] = _active.get(name, 0) + delta


def _version_tuple(version: str) -> Tuple[int, ...]:
    parts = []
    for piece in re.split(r"[.+-]", version):
        if not piece.isdigit():
            break
        parts.append(int(piece))
    return tuple(parts)


def requirement_problem(requirement: str) -> Optional[str]:
    """None when ``requirement`` (e.g. ``"openai>=1.60,<4"``) is installed, else a sentence saying why not."""
    match = _REQ.match(requirement)
    if not match:
        return f"cannot parse requirement {requirement!r}"
    dist, spec = match.group(1).split("[")[0], match.group(2)
    try:
        installed = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return f"{dist} is not installed"
    have = _version_tuple(installed)
    for clause in filter(None, (c.strip() for c in spec.split(","))):
        op = re.match(r"(>=|<=|==|!=|>|<)\s*(.+)", clause)
        if not op:
            continue
        want = _version_tuple(op.group(2))
        size = max(len(have), len(want))
        a, b = have + (0,) * (size - len(have)), want + (0,) * (size - len(want))
        ok = {
            ">=": a >= b,
            "<=": a <= b,
            ">": a > b,
            "<": a < b,
            "==": a == b,
            "!=": a != b,
        }[op.group(1)]
        if not ok:
            return f"{dist} {installed} is outside the supported range {spec.strip()}"
    return None


class Instrumentor(abc.ABC):
    """Base class: subclasses set ``name`` and ``instruments`` and implement the two hooks."""

    name: ClassVar[str]
    instruments: ClassVar[Tuple[str, ...]] = ()

    def __init__(self) -> None:
        self._active = False
        self._warned = False
        # Whether the hooks this instance put in place are still in (whoever uses them now): what a wrapper
        # bound to this instance asks before recording, since the instance itself may have been uninstrumented
        # while another instance of its class still shares its hooks.
        self.hooks_live = False

    @property
    def is_instrumented(self) -> bool:
        return self._active

    def dependency_problem(self) -> Optional[str]:
        for requirement in self.instruments:
            problem = requirement_problem(requirement)
            if problem:
                return problem
        return None

    def instrument(self, **kwargs: Any) -> bool:
        """Hook the framework; True if it is (now) hooked. Calling it twice equals calling it once.

        If another instance of this class has hooked it already, this one joins those hooks (``kwargs`` are
        then those of the instance that hooked, and a debug line says so)."""
        with _hooks_lock:
            if self._active:
                return True
            shared = _hooks.get(type(self))
            if shared is None:
                problem = self.dependency_problem()
                if problem:
                    # A framework that is simply not installed is not worth a warning; one outside the
                    # supported range is, once.
                    log = logger.debug if problem.endswith("is not installed") or self._warned else logger.warning
                    self._warned = True
                    log("agl: not instrumenting %s: %s", self.name, problem)
                    return False
                try:
                    self._instrument(**kwargs)
                except Exception as exc:  # noqa: BLE001 - a broken hook must not break the user's program
                    logger.warning("agl: instrumenting %s failed and was undone: %s", self.name, exc)
                    with contextlib.suppress(Exception):
                        self._uninstrument()
                    return False
                shared = _hooks[type(self)] = _SharedHooks(self)
                self.hooks_live = True
            elif kwargs:
                logger.debug(
                    "agl: %s is hooked already; this instrumentor shares its hooks, %s unused", self.name, kwargs
                )
            shared.users += 1
            self._active = True
            _count_active(self.name, 1)
            return True

    def uninstrument(self) -> None:
        """Stop using the hooks; the last instance to do so takes them out."""
        with _hooks_lock:
            if not self._active:
                return
            self._active = False
            _count_active(self.name, -1)
            shared = _hooks[type(self)]
            shared.users -= 1
            if shared.users == 0:
                del _hooks[type(self)]
                shared.owner.hooks_live = False
                shared.owner._uninstrument()

    @abc.abstractmethod
    def _instrument(self, **kwargs: Any) -> None: ...

    @abc.abstractmethod
    def _uninstrument(self) -> None: ...
