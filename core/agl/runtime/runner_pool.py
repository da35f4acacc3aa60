"""A pool of runners: ``n_runners`` worker processes (default) or threads, respawned if they die.

Processes are forked on Linux, so the agent object needs no pickling and they start in milliseconds; on
macOS (and with ``$AGL_START_METHOD=spawn``) they are spawned: the agent is pickled (a module-level agent
pickles by name) and each process hooks what ``agl.instrument()`` hooked in the parent.
Idle workers sleep inside the store's dequeue and are woken when work arrives. On stop, an idle worker
process exits at once (SIGTERM); a busy one finishes its rollout first, up to the stop timeout. Then a busy
process is killed, and a busy thread left behind (threads cannot be killed; see ``Runner.abandon``); either
way the pool ends its attempt as failed at once, saying why, so the rollout is retried now.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import time
from types import SimpleNamespace
from typing import Any, Callable, Dict, List, Literal, Optional, Tuple, Union

from agl.errors import StaleAttemptError, StoreAuthError, StoreClosedError, StoreUnavailableError
from agl.instrumentation import instrumented
from agl.runtime import agent_loops
from agl.runtime.litagent import LitAgent
from agl.runtime.runner import Runner, StoreOutageError, check_runner_settings
from agl.store.base import LightningStore
from agl.tracing.tracer import get_tracer
from agl.types import Rollout

logger = logging.getLogger("agl.runtime.runner_pool")

RunnerMode = Literal["process", "thread"]
_STUCK_EXIT_CODE = 75  # a worker whose agent hung past its timeout exits with this to be replaced
_UNAVAILABLE_EXIT_CODE = 76  # a worker whose store did not answer for its outage timeout: respawning cannot help
_STORE_FAILED_EXIT_CODE = 1  # a store error before the outage timeout passed: replaced like any crashed worker
_REFUSED_EXIT_CODE = 77  # a worker the store refused (its token): respawning cannot help
_CURRENT_BYTES = 260  # "ROLLOUT_ID ATTEMPT_ID": two ids of at most 128 characters
_CRASH_LOOP = 3  # workers that die this many times in a row soon after starting: give up
_QUICK_DEATH_S = 5.0  # "soon": longer than the one-second interval at which agl runner checks its workers
_RECORD_ON_STOP_S = 3.0  # how long a stopping pool waits for the store to record the attempts it ends


PARENT_CHECK_S = 1.0  # how often a runner process checks that its pool process is alive
START_METHOD_ENV = "AGL_START_METHOD"


def _mp_context() -> Any:
    """``fork`` on Linux; ``spawn`` on macOS (Python's own default there: macOS system libraries, which the
    HTTP clients reach through the proxy settings, abort a forked child of a threaded process) and where
    there is no fork. ``$AGL_START_METHOD`` chooses (e.g. ``spawn`` when the parent has initialised CUDA)."""
    methods = multiprocessing.get_all_start_methods()
    method = os.environ.get(START_METHOD_ENV)
    if method and method not in methods:
        raise ValueError(f"{START_METHOD_ENV}={method!r} is not a start method here; use one of {methods}")
    if not method:
        method = "fork" if "fork" in methods and sys.platform != "darwin" else "spawn"
    return multiprocessing.get_context(method)


def _run_worker(runner: Runner, stop: Any, **options: Any) -> int:
    """``runner.run_forever``; its exit code: 0, or why the pool must not start a fresh runner (the store
    refused it, or did not answer for the runner's outage timeout; said once, here) or should (stuck)."""
    try:
        runner.run_forever(stop, **options)
    except StoreAuthError as exc:  # a revoked or wrong token
        logger.error("runner %s: the store refused it: %s", runner.runner_id, exc)
        return _REFUSED_EXIT_CODE
    except StoreOutageError as exc:  # the store server or database did not answer for the whole outage timeout
        logger.error("runner %s: %s", runner.runner_id, exc)
        return _UNAVAILABLE_EXIT_CODE
    except (
        StoreUnavailableError
    ):  # a shorter outage the runner did not ride out: a fresh runner may (not the pool's end)
        logger.exception("runner %s: a store call failed", runner.runner_id)
        return _STORE_FAILED_EXIT_CODE
    return _STUCK_EXIT_CODE if runner.stuck else 0


def _tracking(current: Any) -> Callable[[Optional[Rollout]], None]:
    """A worker's ``on_busy``: keeps "ROLLOUT_ID ATTEMPT_ID" of the rollout it works on in ``current`` (shared
    memory for a process, a plain object for a thread), so that the pool can end that attempt at once if the
    worker is still busy when the pool stops (see RunnerPool._end_attempt_of)."""

    def on_busy(rollout: Optional[Rollout]) -> None:
        attempt = rollout.attempt if rollout is not None else None
        current.value = f"{attempt.rollout_id} {attempt.attempt_id}".encode() if attempt else b""

    return on_busy


def _death(code: Optional[int], mode: str) -> str:
    """How a worker died, from its exit code (a process killed by signal N has exit code -N)."""
    if mode == "thread":
        return "raised an exception: see the traceback above"
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "an unknown signal"
        if -code == signal.SIGKILL:
            return f"killed by signal {-code}: out of memory or kill -9?"
        return f"killed by signal {-code}, {name}"
    return f"exit code {code}"


class _RunnerThread(threading.Thread):
    """A thread-mode worker, with an ``exitcode`` like a process's (None while it runs)."""

    def __init__(self, runner: Runner, stop: threading.Event, current: Any, max_rollouts: Optional[int] = None) -> None:
        super().__init__(name=f"agl-{runner.runner_id}", daemon=True)
        self.runner = runner
        self.max_rollouts = max_rollouts
        self.stop_event = stop
        self.current = current
        self.exitcode: Optional[int] = None

    def run(self) -> None:
        track = _tracking(self.current)
        last: List[Optional[Rollout]] = [None]

        def on_busy(rollout: Optional[Rollout]) -> None:
            last[0] = rollout or last[0]
            track(rollout)

        try:  # threads cannot be signalled: check the stop flag often
            self.exitcode = _run_worker(
                self.runner, self.stop_event, wait_timeout=0.25, on_busy=on_busy, max_rollouts=self.max_rollouts
            )
        except BaseException:
            # run_forever's ``finally`` cleared the record while the exception unwound: put back the rollout it ran
            # so that the pool ends its attempt (one that already ended is left alone: StaleAttemptError)
            track(last[0])
            raise


def _process_main(
    agent: LitAgent[Any],
    store: LightningStore,
    runner_id: str,
    stop: Any,
    kwargs: Dict[str, Any],
    instrumentation: Optional[Dict[str, Any]] = None,
    current: Any = None,
    parent: Optional[int] = None,
    max_rollouts: Optional[int] = None,
) -> None:
    """A runner process. ``current`` (shared memory) holds "ROLLOUT_ID ATTEMPT_ID" of the rollout it works on,
    so that the pool can end that attempt at once if it has to kill the process. ``parent`` is the pool
    process's pid, taken there: one read here would be its reaper's if the pool died while this one started."""
    if instrumentation is not None:  # a spawned process: hook what the parent hooked
        from agl.instrumentation import instrument

        instrument(**instrumentation)
    busy = {"now": False}

    def on_sigterm(signum: int, frame: Any) -> None:
        if not busy["now"]:
            _send_otlp_queue()
            os._exit(0)
        stop.set()  # finish the current rollout, then leave

    signal.signal(signal.SIGTERM, on_sigterm)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and stops us cleanly
    parent = os.getppid() if parent is None else parent
    threading.Thread(target=_leave_with_parent, args=(parent, on_sigterm), daemon=True).start()
    runner = Runner(agent, store, runner_id=runner_id, **kwargs)
    track = _tracking(current) if current is not None else None

    def set_busy(rollout: Optional[Rollout]) -> None:
        busy["now"] = rollout is not None
        if track is not None:
            track(rollout)

    code = _run_worker(runner, stop, exit_when_stuck=True, on_busy=set_busy, max_rollouts=max_rollouts)
    if code in (0, _STUCK_EXIT_CODE):
        runner.close()
        agent_loops.close()  # os._exit skips atexit: end what agents left (an abandoned stream's span too)
        runner.tracer.flush(5.0)
        _send_otlp_queue()
    os._exit(code)


def _send_otlp_queue(timeout: float = 5.0) -> None:
    """Send what the OTLP exporter (``agl.instrument(otlp_endpoint=...)``) holds: a runner process leaves with
    ``os._exit``, which skips the exporter's own exit hook. Nothing without an endpoint."""
    otlp = get_tracer().otlp
    if otlp is not None:
        otlp.flush(timeout)


def _leave_with_parent(parent: int, leave: Callable[[int, Any], None]) -> None:
    """A runner process whose pool process died (``kill -9`` of ``agl runner``) leaves as on SIGTERM: idle at
    once, busy after its rollout. Else orphans go on claiming work that nobody watches, and a restarted
    ``agl runner`` doubles the runners. Checked at once, then every :data:`PARENT_CHECK_S`.

    A plain sleep, not the pool's stop event: a process killed while it waits on a multiprocessing Event
    leaves the Event's ``set()`` in every other process waiting forever for it to wake."""
    while os.getppid() == parent:
        time.sleep(PARENT_CHECK_S)
    logger.warning("runner process %d: its pool process %d is gone; leaving", os.getpid(), parent)
    leave(signal.SIGTERM, None)


def end_attempt(store: LightningStore, rollout_id: str, attempt_id: str, error: str, *, dead: bool = True) -> None:
    """End, as failed with ``error``, the attempt of a runner that died or was killed or left behind, so that
    the store retries the rollout now. An attempt the runner ended itself just before raises
    StaleAttemptError: nothing to do."""
    try:
        store.complete_attempt(rollout_id, attempt_id, "failed", error=error)
        logger.warning("rollout %s: attempt %s ended as failed: %s", rollout_id, attempt_id, error)
    except StaleAttemptError:
        pass
    except StoreClosedError:  # a stop that gave up on it (said then) and closed the store: nothing more to say
        logger.debug("rollout %s: attempt %s not ended: the store was closed", rollout_id, attempt_id)
    except Exception as exc:  # noqa: BLE001 - the heartbeat timeout still ends it
        logger.warning(
            "rollout %s: could not end attempt %s of a %s runner: %s",
            rollout_id,
            attempt_id,
            "dead" if dead else "killed",
            exc,
        )


class RunnerPool:
    """Starts, watches and stops the runners of one training or dev run."""

    def __init__(
        self,
        agent: LitAgent[Any],
        store: LightningStore,
        n_runners: int = 1,
        *,
        mode: RunnerMode = "process",
        runner_kwargs: Optional[Dict[str, Any]] = None,
        max_rollouts: Optional[int] = None,
    ) -> None:
        """``max_rollouts``: each runner stops after that many rollouts and is not replaced (None: no limit)."""
        if n_runners < 1:
            raise ValueError(f"n_runners must be at least 1, got {n_runners}")
        check_runner_settings(**(runner_kwargs or {}))
        if mode == "process" and not getattr(store, "multiprocess_safe", False):
            raise ValueError(
                f"{type(store).__name__} lives inside one process, so process runners cannot share it: "
                "use runner_mode='thread', or a SqliteLightningStore (the default)"
            )
        self.agent = agent
        self.store = store
        self.n_runners = n_runners
        self.mode = mode
        self.runner_kwargs = runner_kwargs or {}
        self.max_rollouts = max_rollouts
        self.respawned = 0
        self._ctx = _mp_context()
        self._stop: Union[threading.Event, Any] = self._ctx.Event() if mode == "process" else threading.Event()
        self._workers: List[Any] = []
        self._current: List[Any] = []  # per worker: "ROLLOUT_ID ATTEMPT_ID" it works on (see _tracking)
        self._started_at: List[float] = []
        self._quick_deaths = 0
        self._runners: List[Runner] = []

    def start(self) -> RunnerPool:
        for i in range(self.n_runners):
            process = self.mode == "process"
            self._current.append(self._ctx.RawArray("c", _CURRENT_BYTES) if process else SimpleNamespace(value=b""))
            self._workers.append(self._spawn(i))
            self._started_at.append(time.monotonic())
        return self

    def _spawn(self, index: int) -> Any:
        runner_id = f"runner-{index}-{os.getpid()}-{self.respawned}"
        if self.mode == "process":
            # Let the span writer go idle first: the fork waits for this process's store operations in flight
            # (agl._util.fork_safety), and an idle writer has none.
            get_tracer().flush(1.0)
            method = self._ctx.get_start_method()
            hooks = None if method == "fork" else instrumented()  # a forked child inherits the hooks
            proc = self._ctx.Process(
                target=_process_main,
                args=(
                    self.agent,
                    self.store,
                    runner_id,
                    self._stop,
                    self.runner_kwargs,
                    hooks,
                    self._current[index],
                    os.getpid(),
                    self.max_rollouts,
                ),
                name=f"agl-{runner_id}",
                daemon=True,
            )
            try:
                proc.start()
            except (pickle.PicklingError, AttributeError, TypeError) as exc:
                if method == "fork":
                    raise
                raise RuntimeError(
                    f"runner processes start with {method!r} here, so the agent, the store and the runner options "
                    f"are pickled for them, and that failed: {exc}. Define the agent at module level (an importable "
                    "module or the main script), or use runner_mode='thread'"
                ) from exc
            return proc
        runner = Runner(self.agent, self.store, runner_id=runner_id, **self.runner_kwargs)
        self._runners.append(runner)
        self._current[index].value = b""
        thread = _RunnerThread(runner, self._stop, self._current[index], self.max_rollouts)
        thread.start()
        return thread

    def _ran_its_share(self, worker: Any) -> bool:
        """Whether ``worker`` left after running its ``max_rollouts``: done, not dead."""
        return self.max_rollouts is not None and getattr(worker, "exitcode", None) == 0

    @property
    def finished(self) -> bool:
        """Every runner ran its ``max_rollouts`` and left: no rollout will run any more."""
        return bool(self._workers) and all(self._ran_its_share(worker) for worker in self._workers)

    @property
    def left_agents_running(self) -> bool:
        """Whether a thread runner of this pool gave up on an agent that did not stop at its rollout's timeout
        (its thread runs on; a runner process would have left with it)."""
        return any(runner.stuck for runner in self._runners)

    def check(self) -> int:
        """Replace workers that died (crashed, killed, or left after a stuck agent). Returns how many.

        A worker that died while running a rollout (it had started and claimed work) is no start-up failure:
        its attempt is ended as failed at once and a fresh worker starts. Only workers that die soon after
        starting, before claiming anything, count towards the crash loop that makes the pool give up, so a
        few tasks that crash their runner (a segfault in a tool library, an OOM kill) fail on their own,
        per ``max_attempts``, without taking down every runner."""
        if self._stop.is_set():
            return 0
        replaced = 0
        for i, worker in enumerate(self._workers):
            if worker.is_alive() or self._ran_its_share(worker):
                continue
            code = getattr(worker, "exitcode", None)
            how = _death(code, self.mode)
            mid_rollout = bool(self._current[i].value)
            # first, whatever happens next: its rollout is retried now (while max_attempts allows), not after its
            # heartbeat timeout, and its error says why rather than "presumed dead"
            self._end_attempt_of(
                i, f"runner {self.mode} {worker.name} died ({how}) while running this rollout", dead=True
            )
            if code == _REFUSED_EXIT_CODE:  # an AglError: `agl runner` exits 2 with this message
                raise StoreAuthError(
                    f"runner {worker.name} stopped: the store refused its token (revoked, or not the server's; the "
                    f"error is logged above). Start the runners with a token the store server accepts "
                    f"(--token or $AGL_STORE_TOKEN)"
                )
            if code == _UNAVAILABLE_EXIT_CODE:
                raise StoreUnavailableError(
                    f"runner {worker.name} stopped: its store did not answer for its whole outage timeout "
                    "(--outage-timeout; the error is logged above); is the store server or database still there?"
                )
            if code == _STUCK_EXIT_CODE:
                logger.info("runner %s left after a stuck rollout; starting a fresh one", worker.name)
            elif mid_rollout:  # it started and claimed work: its rollout killed it, not its start-up
                logger.warning("runner %s died (%s) while running a rollout; starting a fresh one", worker.name, how)
                self._quick_deaths = 0
            else:
                logger.warning("runner %s died (%s); starting a fresh one", worker.name, how)
                quick = time.monotonic() - self._started_at[i] < _QUICK_DEATH_S
                self._quick_deaths = self._quick_deaths + 1 if quick else 0
                if self._quick_deaths >= _CRASH_LOOP:
                    raise RuntimeError(
                        f"runners keep dying right after they start, before running any rollout ({self._quick_deaths} "
                        f"in a row, last exit code {code}); the agent or store fails in the runner process: see the "
                        "traceback above"
                    )
            self.respawned += 1
            self._workers[i] = self._spawn(i)
            self._started_at[i] = time.monotonic()
            replaced += 1
        return replaced

    def stop(self, timeout: float = 10.0, *, reason: Optional[str] = None) -> None:
        """Stop every worker: idle ones at once, busy ones after their rollout; ``timeout`` bounds the whole
        stop, not each worker. Processes still running then are killed; threads, which cannot be killed, are
        left behind (``Runner.abandon``: no more heartbeats or reports; their agent threads are daemons, so
        they do not keep the process alive).

        The attempt of a worker killed or left behind is ended as failed at once, the error naming ``reason``
        (why the pool stops), so the rollout is retried now (while ``max_attempts`` allows) rather than after
        its heartbeat timeout, and nobody mistakes it for a runner that hung."""
        self._stop.set()
        deadline = time.monotonic() + timeout
        if self.mode == "process":
            for proc in self._workers:
                if proc.is_alive():
                    proc.terminate()
        for worker in self._workers:
            worker.join(max(0.0, deadline - time.monotonic()))
        why = reason or f"its pool stopped and gave busy runners {timeout:g} s"
        ends: List[Tuple[int, str, bool]] = []  # (worker, error, dead) whose attempt is ended as failed
        for i, worker in enumerate(self._workers):
            if not worker.is_alive():  # died before or while stopping (a check() that raised left it): end its attempt
                how = _death(getattr(worker, "exitcode", None), self.mode)
                ends.append((i, f"runner {self.mode} {worker.name} died ({how}) while running this rollout", True))
            elif self.mode == "process":
                logger.warning("runner %s did not stop within %s s; killing it", worker.name, timeout)
                worker.kill()
                worker.join(1.0)
                ends.append((i, f"runner {worker.name} was killed before this rollout ended: {why}", False))
            else:
                logger.warning("runner %s did not stop within %s s; leaving it behind", worker.name, timeout)
                worker.runner.abandon(why)  # first: it must not report (or heartbeat) the attempt ended here
                ends.append((i, f"runner {worker.name} was stopped before this rollout ended: {why}", False))
        self._end_attempts(ends, within=_RECORD_ON_STOP_S)
        for runner in self._runners:
            runner.close()
        self._workers.clear()
        self._current.clear()

    def _end_attempts(self, ends: List[Tuple[int, str, bool]], *, within: float) -> None:
        """``_end_attempt_of`` for each of ``ends``, together, waiting at most ``within`` seconds in all.

        Stopping must stay bounded by its timeout (a process manager kills ``agl runner`` soon after
        ``--stop-timeout``), but a store server that is down would keep each call retrying for the store's
        outage timeout (10 minutes for ``agl runner``). What is not recorded by then is said in the log; the
        store's heartbeat timeout ends that attempt later (its call goes on in a daemon thread meanwhile)."""
        calls = []
        for i, error, dead in ends:
            ids = self._take_current(i)
            if ids is not None:
                call = threading.Thread(
                    target=self._end_attempt, args=(*ids, error, dead), name="agl-end-attempt", daemon=True
                )
                calls.append((ids, error, call))
                call.start()
        deadline = time.monotonic() + within
        for (rollout_id, attempt_id), error, call in calls:
            call.join(max(0.0, deadline - time.monotonic()))
            if call.is_alive():
                logger.warning(
                    "rollout %s: the store did not answer within %g s, so attempt %s is not recorded as failed (%s); "
                    "the store's heartbeat timeout ends it",
                    rollout_id,
                    within,
                    attempt_id,
                    error,
                )

    def _take_current(self, index: int) -> Optional[Tuple[str, str]]:
        """The (rollout id, attempt id) worker ``index`` works on, if any, forgotten by the pool from now on."""
        current = self._current[index] if index < len(self._current) else None
        if current is None or not current.value:
            return None
        rollout_id, attempt_id = current.value.decode().split(" ")
        current.value = b""
        return rollout_id, attempt_id

    def _end_attempt_of(self, index: int, error: str, *, dead: bool = False) -> None:
        """End, as failed with ``error``, the attempt that worker ``index`` (killed, dead, or a thread left behind)
        was running."""
        ids = self._take_current(index)
        if ids is not None:
            self._end_attempt(*ids, error, dead)

    def _end_attempt(self, rollout_id: str, attempt_id: str, error: str, dead: bool) -> None:
        end_attempt(self.store, rollout_id, attempt_id, error, dead=dead)

    def __enter__(self) -> RunnerPool:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
