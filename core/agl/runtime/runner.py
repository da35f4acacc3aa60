"""Runner: takes rollouts from the store, runs the agent under the tracer, reports the outcome.

One runner runs one rollout at a time. The agent runs on a worker thread so the runner can enforce a
per-rollout timeout even on a sync agent that hangs: the attempt is then reported as ``timeout``. An async
agent is cancelled (``CancelledError`` in its coroutine, so its open spans end and are kept) and its thread
goes on to the next rollout; a sync agent, or a coroutine that does not stop within
``CANCEL_GRACE_S``, cannot be stopped: the runner marks itself *stuck* (a process runner exits so its pool
starts a fresh one). Heartbeats go to the store from a small thread while the agent runs.

The agent thread is a daemon: one the runner had to leave behind (stuck, or still busy when its pool stopped
and :meth:`Runner.abandon` was called) does not keep the process alive at exit.

An async agent's coroutine does not run on the agent thread: every runner of the process hands it to the one
event loop that all async agents of the process share (:mod:`agl.runtime.agent_loops`), as a single ``asyncio.run``
program with one task per rollout would, so that async objects the rollouts share (a module-level
``AsyncOpenAI`` client, LangChain's cached httpx client) work with any number of thread runners. The agent
thread waits for it. The trade-off: a rollout that blocks that loop (a sync call inside ``async def``) stalls
the async rollouts of every runner of the process while it blocks; past its timeout its runner is stuck and
the loop is replaced for later rollouts.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import inspect
import logging
import math
import os
import threading
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Set, Tuple, Union

from agl import semconv
from agl.checks import check_number
from agl.errors import AglError, StaleAttemptError, StoreUnavailableError
from agl.runtime import agent_loops
from agl.runtime.litagent import LitAgent
from agl.runtime.runner_threads import AgentThread, Heartbeat
from agl.store.base import LightningStore
from agl.tracing.context import RolloutScope, enter_scope, exit_scope, running
from agl.tracing.emitters import reward_number
from agl.tracing.tracer import Tracer, get_tracer
from agl.types import NamedResources, Rollout, new_id

logger = logging.getLogger("agl.runtime.runner")

StopSignal = Union[threading.Event, Any, Callable[[], bool]]  # Any: a multiprocessing Event
CANCEL_GRACE_S = 5.0  # how long a timed-out async rollout gets to unwind after its cancellation
OUTAGE_LOG_S = 30.0  # while its store is unavailable, a runner says so once this often


def rollout_agent_name(agent: Any) -> str:
    """The name under which a plain-Python agent's own LLM calls are matched by ``agent_match``."""
    fn = getattr(agent, "fn", None)
    return getattr(fn, "__name__", None) or type(agent).__name__


def reward_from_result(result: Any) -> Optional[float]:
    """The episode reward a rollout returned: a number, ``{"reward": number}``, or None (see docs/rewards.md)."""
    if isinstance(result, dict):
        if "reward" not in result:
            raise TypeError(
                f"rollout() returned a dict without a 'reward' key (keys: {sorted(map(str, result))[:8]}): put the "
                "episode reward under 'reward', or return a number, or None and emit rewards with agl.emit_reward"
            )
        result = result["reward"]
    if result is None:
        return None
    return reward_number(result, "the reward rollout() returned", "a number, None, or a dict with a 'reward' key")


ERROR_CHARS = 16_384  # an agent's error kept with its rollout: head and tail of longer ones


def _bounded(error: str) -> str:
    """The error text, cut in the middle if longer than ``ERROR_CHARS``: an exception can carry megabytes (a
    whole document in a ValueError), which a store server refuses as a body over its limit, so the runner
    could not report the failure at all and the rollout ended as "runner presumed dead" instead."""
    if len(error) <= ERROR_CHARS:
        return error
    half = ERROR_CHARS // 2
    return f"{error[:half]}\n... [{len(error) - 2 * half} characters cut] ...\n{error[-half:]}"


class RolloutTimeout(AglError, TimeoutError):
    pass


class StoreOutageError(StoreUnavailableError):
    """A runner gave up: its store did not answer for its whole ``outage_timeout``. The only store error that
    ends a runner (its pool then stops too, as a fresh runner would meet the same outage): any shorter one is
    ridden out."""


class _AsyncRun:
    """Where one rollout's agent thread puts the agent-loop task of an async agent, for its runner to cancel at
    the rollout's timeout. One per rollout, not a runner field: a runner's agent threads overlap (one it left
    behind past a timeout goes on beside its fresh one), and the late end of an abandoned rollout's task
    cleared the field that then held the next rollout's task, which was not cancelled at its own timeout."""

    def __init__(self) -> None:
        self.run: Optional[agent_loops.AgentRun] = None  # None: a sync agent, or its coroutine not started yet


_OPTIONAL_TIMINGS = ("rollout_timeout", "outage_timeout")  # None: no limit
_TIMINGS = ("heartbeat_interval", "flush_timeout") + _OPTIONAL_TIMINGS


def check_runner_settings(**settings: Any) -> None:
    """Refuse runner timings that would break runs quietly (a NaN timeout never fires, a negative one fires at
    once, a heartbeat interval of 0 spins). :class:`RunnerPool` calls it too, before it starts any process;
    settings other than these timings are not looked at."""
    for name in _TIMINGS:
        value = settings.get(name)
        if name in settings and not (value is None and name in _OPTIONAL_TIMINGS):
            check_number(name, value, positive=name != "flush_timeout")


class Runner:
    """Runs rollouts of one agent against one store."""

    def __init__(
        self,
        agent: LitAgent[Any],
        store: LightningStore,
        *,
        runner_id: Optional[str] = None,
        tracer: Optional[Tracer] = None,
        heartbeat_interval: float = 5.0,
        rollout_timeout: Optional[float] = None,
        request_token_ids: bool = True,
        flush_timeout: float = 30.0,
        outage_timeout: Optional[float] = None,
    ) -> None:
        """``outage_timeout``: how long ``run_forever`` keeps asking a store that does not answer (a dequeue or
        a completion raises StoreUnavailableError) before it raises StoreOutageError; None: for ever. ``agl
        runner`` sets it so that runners whose store server is gone for good exit (a Kubernetes Job of them
        then ends)."""
        check_runner_settings(
            heartbeat_interval=heartbeat_interval,
            rollout_timeout=rollout_timeout,
            flush_timeout=flush_timeout,
            outage_timeout=outage_timeout,
        )
        self.agent = agent
        self.store = store
        self.runner_id = runner_id or new_id(f"runner-{os.getpid()}")
        self.tracer = tracer or get_tracer()
        self.heartbeat_interval = heartbeat_interval
        self.rollout_timeout = rollout_timeout
        self.request_token_ids = request_token_ids
        self.flush_timeout = flush_timeout
        self.outage_timeout = outage_timeout
        self.stuck = False
        self._closed = False
        self._warned_left_running = False
        self.abandoned: Optional[str] = None  # why the pool left this runner behind (see abandon)
        self._heartbeat: Optional[Heartbeat] = None  # of the rollout running now
        self._timeouts_warned: Set[float] = set()  # heartbeat timeouts too short for heartbeat_interval, said once
        self._explained_left_running = False  # the advice on agents left running past their timeout: said once
        self.agent_name = rollout_agent_name(agent)
        self._executor = AgentThread()
        self._exits_when_stuck = False  # set by run_forever: a runner process leaves after an agent it gave up on
        self.tracer.set_store(store)

    # -- one rollout ---------------------------------------------------------------------------------------
    def run_rollout(self, rollout: Rollout) -> Rollout:
        """Run a dequeued rollout (``rollout.attempt`` set) to its end and report it to the store."""
        return self._run_rollout(rollout, lambda: False)[0]

    def _run_rollout(self, rollout: Rollout, claim_next: Callable[[], bool]) -> Tuple[Rollout, List[Rollout]]:
        """``run_rollout``; if ``claim_next()`` says so when it reports, it also claims the next rollout in the
        same store call (one round trip less per rollout for a runner on another machine)."""
        if rollout.attempt is None:
            raise ValueError(
                "run_rollout needs a dequeued rollout (rollout.attempt is None): use store.dequeue_rollout"
            )
        if self.abandoned:  # claimed after its pool gave up on this runner, which then ended nothing: end it here
            self._refuse(rollout)
            return rollout, []
        attempt_id = rollout.attempt.attempt_id
        self._check_heartbeat_timeout(rollout)
        scope = RolloutScope(rollout.rollout_id, attempt_id, rollout.mode, self.request_token_ids)
        dropped_before = self.tracer.stats().dropped
        heartbeat = self._heartbeat = Heartbeat(self.store, rollout.rollout_id, attempt_id, self.heartbeat_interval)
        status, reward, error = "succeeded", None, None
        try:
            resources = self._resources(rollout)
            async_run = _AsyncRun()
            future = self._executor.submit(self._execute, rollout, resources, scope, async_run)
            timeout = rollout.config.timeout_seconds or self.rollout_timeout
            try:
                reward = future.result(timeout=timeout)
            except concurrent.futures.TimeoutError:
                raise RolloutTimeout(f"rollout {rollout.rollout_id} ran past its timeout of {timeout} s") from None
        except RolloutTimeout as exc:
            status, error = "timeout", str(exc)
            scope.outcome = "timed out"
            if not self._cancelled(future, async_run.run, rollout.rollout_id):
                self._abandon_stuck_agent(rollout.rollout_id, timeout, async_run.run is not None)
        except Exception as exc:  # noqa: BLE001 - the agent's failure is data, not a runner crash
            status, error = "failed", _bounded("".join(traceback.format_exception_only(type(exc), exc)).strip())
            logger.info("rollout %s failed: %s", rollout.rollout_id, error)
        finally:
            heartbeat.stop()
            self._heartbeat = None
        if self.abandoned:  # the pool ended this attempt as failed when it gave up on the runner: report nothing
            logger.info(
                "rollout %s: its agent returned after its runner %s was left behind (%s); result not recorded",
                rollout.rollout_id,
                self.runner_id,
                self.abandoned,
            )
            return rollout, []
        # what the agent's threads still have open is ended now, so the attempt keeps the tree it ended with
        scope.end()
        if not self.tracer.flush(self.flush_timeout):
            logger.warning(
                "spans of rollout %s were not all stored within %s s", rollout.rollout_id, self.flush_timeout
            )
        dropped = self.tracer.stats().dropped - dropped_before
        if dropped:
            logger.warning("rollout %s: %d spans were dropped (tracer queue full)", rollout.rollout_id, dropped)
        outcome: Dict[str, Any] = {"reward": reward, "error": error}
        try:
            try:
                if claim_next():
                    return self.store.complete_and_dequeue(
                        rollout.rollout_id,
                        attempt_id,
                        status,  # type: ignore[arg-type]  # an attempt status, from the rollout outcome
                        **outcome,
                        runner_id=self.runner_id,
                    )
                return self.store.complete_attempt(rollout.rollout_id, attempt_id, status, **outcome), []  # type: ignore[arg-type]  # an attempt status, from the rollout outcome
            except StoreUnavailableError as exc:  # nothing was claimed (the completion comes first, and decides)
                return self._complete_after_outage(rollout.rollout_id, attempt_id, status, outcome, exc), []
        except StaleAttemptError as exc:
            if self.abandoned:  # the pool ended the attempt just before: expected, said by the pool
                return rollout, []
            if status == "timeout" and self._ended_as(rollout.rollout_id, attempt_id) == "timeout":
                # the store enforces the same deadline and got there first: one timeout, already recorded
                logger.info(
                    "rollout %s: timed out (the store had ended attempt %s at the same deadline)",
                    rollout.rollout_id,
                    attempt_id,
                )
            else:
                logger.warning("rollout %s: result not recorded: %s", rollout.rollout_id, exc)
            return self.store.get_rollout(rollout.rollout_id), []

    def _complete_after_outage(
        self, rollout_id: str, attempt_id: str, status: str, outcome: Dict[str, Any], exc: StoreUnavailableError
    ) -> Rollout:
        """End the attempt after its completion failed with ``exc``: the store did not answer, or (PostgreSQL)
        the connection died while the completion was committing, so it may or may not be stored.

        Rides out the outage as the dequeue loop does (``outage_timeout``; None: for ever), then reads the
        attempt back: ended as we asked means our completion was stored (done); still running means it was not
        (complete it again); ended otherwise raises StaleAttemptError (the store timed it out meanwhile), as the
        first completion would have. Raising instead would end the runner, its whole pool and a Trainer's run
        over one lost connection."""
        unavailable_since = time.monotonic()
        delay = 0.5
        while True:
            self._give_up_after_outage(time.monotonic() - unavailable_since, exc)
            logger.warning(
                "runner %s: ending attempt %s of %s: the store did not confirm it; reading it back: %s",
                self.runner_id,
                attempt_id,
                rollout_id,
                exc,
            )
            time.sleep(delay)  # a store call during an outage also waits (reconnect back-off); this only paces
            delay = min(delay * 2, 5.0)
            try:
                if self._attempt_status(rollout_id, attempt_id) == status:
                    logger.info(
                        "rollout %s: attempt %s had been ended as %s before the store stopped answering",
                        rollout_id,
                        attempt_id,
                        status,
                    )
                    return self.store.get_rollout(rollout_id)
                return self.store.complete_attempt(rollout_id, attempt_id, status, **outcome)  # type: ignore[arg-type]  # an attempt status, from the rollout outcome
            except StoreUnavailableError as again:
                exc = again

    def _attempt_status(self, rollout_id: str, attempt_id: str) -> Optional[str]:
        """The status of one attempt as the store has it now (None: not found); store errors are raised."""
        return next((a.status for a in self.store.query_attempts(rollout_id) if a.attempt_id == attempt_id), None)

    def _check_heartbeat_timeout(self, rollout: Rollout) -> None:
        """Warn (once per value) when the rollout's heartbeat timeout, set by whoever enqueued it (a trainer,
        often on another machine), is not longer than this runner's heartbeat interval: the store would end
        the attempts of this healthy runner as unresponsive, "presumed dead", pointing at the wrong cause."""
        limit = rollout.config.heartbeat_timeout_seconds
        if limit is None or limit > self.heartbeat_interval or limit in self._timeouts_warned:
            return
        self._timeouts_warned.add(limit)
        logger.warning(
            "rollout %s has a heartbeat timeout of %g s, not longer than runner %s's heartbeat interval of %g s: the "
            "store will end its attempts as unresponsive while they run. Lower the runner's heartbeat interval "
            "(agl runner --heartbeat-interval) or raise the trainer's heartbeat_timeout",
            rollout.rollout_id,
            limit,
            self.runner_id,
            self.heartbeat_interval,
        )

    def _ended_as(self, rollout_id: str, attempt_id: str) -> Optional[str]:
        """How the store ended an attempt (None: not found, or the store did not answer)."""
        try:
            return self._attempt_status(rollout_id, attempt_id)
        except Exception:  # noqa: BLE001 - only chooses how loudly a lost result is logged
            return None

    def abandon(self, reason: str) -> None:
        """Give up on this runner (its pool stops and it is still busy): stop heart-beating at once, report
        nothing of the rollout its agent is still running (the pool ends that attempt as failed), and run no
        other. The agent thread cannot be stopped; it is a daemon, so it does not keep the process alive."""
        self.abandoned = reason
        heartbeat = self._heartbeat
        if heartbeat is not None:
            heartbeat.stop()

    def _refuse(self, rollout: Rollout) -> None:
        """End, as failed, an attempt this abandoned runner claimed and will not run; quietly, as the store may
        be closed already (its heartbeat timeout then ends it)."""
        assert rollout.attempt is not None
        try:
            self.store.complete_attempt(
                rollout.rollout_id,
                rollout.attempt.attempt_id,
                "failed",
                error=(f"runner {self.runner_id} was stopped before this rollout started: {self.abandoned}"),
            )
        except Exception as exc:  # noqa: BLE001 - StaleAttemptError, or a closed store
            logger.debug("rollout %s: not ended by abandoned runner %s: %s", rollout.rollout_id, self.runner_id, exc)

    def _resources(self, rollout: Rollout) -> NamedResources:
        update = self.store.get_resources(rollout.resources_id)
        return dict(update.resources) if update is not None else {}

    def _execute(
        self, rollout: Rollout, resources: NamedResources, scope: RolloutScope, async_run: _AsyncRun
    ) -> Optional[float]:
        """Runs on the agent thread: the whole rollout under one root span of kind ``agent``."""
        token = enter_scope(scope)
        try:
            attrs = {
                semconv.AGENT_NAME: self.agent_name,
                semconv.ROLLOUT_TASK_ID: rollout.task_id,
                semconv.ROLLOUT_MODE: rollout.mode,
            }
            with running(), self.tracer.span("agl.rollout", "agent", attrs):
                try:
                    result = self.agent.run(rollout.input, resources, rollout)
                    if inspect.isawaitable(result):
                        result = self._await_on_agent_loop(result, rollout.rollout_id, async_run)
                finally:
                    scope.end_open_work()  # streams the agent stopped reading end inside its rollout
                if scope.outcome == "timed out":  # reported as a timeout already: its reward judges nothing
                    return None
                return self._episode_reward(self._returned_reward(result, scope), scope)
        finally:
            scope.end()  # what still runs in its context records nothing into it (agl.tracing.context.current_scope)
            exit_scope(token)

    def _await_on_agent_loop(self, awaitable: Any, rollout_id: str, async_run: _AsyncRun) -> Any:
        """On the agent thread: run the coroutine the agent returned on the process's agent loop, in this
        thread's context (the rollout scope and the root span), and wait for it. ``_cancelled`` cancels it."""
        run = async_run.run = agent_loops.start(awaitable, contextvars.copy_context())
        try:
            return run.result()
        finally:
            self._say_tasks_left_running(run.left_running, rollout_id)

    def _say_tasks_left_running(self, left: List[asyncio.Task[Any]], rollout_id: str) -> None:
        """Warn (once per runner) about asyncio tasks the rollout started and left running (only its own: the
        loop records which rollout created each task, see :mod:`agl.runtime.agent_loops`). The event loop
        outlives the rollout, so they go on during the next rollouts: an OpenAI Agents
        SDK run whose stream the agent stopped reading kept calling the model, and stored its calls in the
        finished attempt, where a batch read later found calls its reward never saw. They are not cancelled
        (an MCP session or an AutoGen runtime kept for the next rollouts is such a task too: cancelled, those
        broke); once the rollout has returned, what they record is not stored
        (``agl.tracing.context.current_scope``)."""
        if self._warned_left_running or not left:
            return
        self._warned_left_running = True
        names = sorted({agent_loops.task_name(task) for task in left})
        logger.warning(
            "rollout %s left %d asyncio task(s) running when it returned (%s): a model stream it stopped reading, "
            "an agent run it did not await, or a session or runtime it keeps for the next rollouts. They go on "
            "running, but nothing they record for this rollout from now on is stored (an AutoGen runtime's work for "
            "messages a later rollout sends is recorded in that rollout). If they are runs the rollout gave up on, "
            "cancel them before returning (OpenAI Agents SDK: result.cancel()), or they keep calling the model. "
            "Said once per runner",
            rollout_id,
            len(left),
            ", ".join(names[:5]),
        )

    @staticmethod
    def _returned_reward(result: Any, scope: RolloutScope) -> Optional[float]:
        """The reward ``rollout()`` returned. A rollout that emitted its episode reward may return anything
        else that is not a reward (the agent's own output, e.g. a LangChain result dict): ignored."""
        try:
            return reward_from_result(result)
        except TypeError:
            if scope.episode_rewards:
                return None
            raise

    def _episode_reward(self, returned: Optional[float], scope: RolloutScope) -> Optional[float]:
        """Apply the reward rule of agl.tracing.emitters: the returned value wins; emitted ones are not added."""
        emitted = scope.episode_rewards[-1] if scope.episode_rewards else None
        if returned is None:
            return emitted
        if emitted is not None and emitted != returned:
            logger.warning(
                "rollout %s returned reward %s but emitted %s: using the returned value",
                scope.rollout_id,
                returned,
                emitted,
            )
        if emitted != returned:  # the stored reward spans end with the value that counts (agl inspect shows it)
            attrs = {
                semconv.REWARD_VALUE: returned,
                semconv.REWARD_PRIMARY: "primary",
                semconv.REWARD_SOURCE: "returned",
                semconv.REWARD_SCOPE: "episode",
            }
            with self.tracer.span(semconv.SPAN_REWARD, "reward", attrs):
                pass
        return returned

    def _cancelled(
        self, future: concurrent.futures.Future[Any], run: Optional[agent_loops.AgentRun], rollout_id: str
    ) -> bool:
        """Cancel the timed-out rollout if it is a coroutine (``run``); True once its thread is free again. One
        that does not end in time because the shared loop is blocked has that loop replaced (AgentRun.give_up)."""
        if run is None:
            return False
        run.cancel()
        try:
            future.result(timeout=CANCEL_GRACE_S)
        except concurrent.futures.TimeoutError:
            run.give_up(rollout_id)
            return False
        except BaseException:  # noqa: BLE001 - CancelledError, or what the agent raised while unwinding
            pass
        return True

    def _abandon_stuck_agent(self, rollout_id: str, timeout: Optional[float], is_async: bool) -> None:
        # The agent thread cannot be killed; leave it and take a fresh one. A process runner exits after
        # reporting so no thread leaks for long.
        self.stuck = True
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._executor = AgentThread()
        self._say_agent_left_running(rollout_id, timeout, is_async)

    def _say_agent_left_running(self, rollout_id: str, timeout: Optional[float], is_async: bool) -> None:
        """Warn, naming the rollout, that its agent did not stop at its timeout: otherwise only an INFO line
        said it timed out, as for an agent cancelled cleanly, while its thread (and an async agent's task, on
        the loop every async rollout shares) went on unseen, one more for each such rollout."""
        why = (
            (
                f"its coroutine did not end within {CANCEL_GRACE_S:g} s of its cancellation (it catches "
                "CancelledError, or blocks the event loop)"
            )
            if is_async
            else "its sync agent cannot be interrupted"
        )
        if self._explained_left_running:  # the advice once per runner: a loaded machine times out many in a row
            logger.warning("rollout %s did not stop at its timeout of %s s either: %s", rollout_id, timeout, why)
            return
        self._explained_left_running = True
        fate = (
            f"runner process {self.runner_id} leaves after reporting it and its pool starts a fresh one"
            if self._exits_when_stuck
            else f"runner {self.runner_id} leaves its agent thread running and goes on with a fresh one"
        )
        logger.warning(
            "rollout %s did not stop at its timeout of %s s: %s. It is reported as timed out; %s. What the agent "
            "does from now on is not stored, and its model calls through the OpenAI client are refused "
            "(RolloutTimedOutError). Make the agent finish within the timeout, raise rollout_timeout%s",
            rollout_id,
            timeout,
            why,
            fate,
            ""
            if self._exits_when_stuck
            else ", or use runner_mode='process', whose runner process is replaced when its agent does not stop",
        )

    # -- loop ----------------------------------------------------------------------------------------------
    def run_forever(
        self,
        stop: StopSignal,
        *,
        max_rollouts: Optional[int] = None,
        wait_timeout: float = 1.0,
        exit_when_stuck: bool = False,
        on_busy: Optional[Callable[[Optional[Rollout]], None]] = None,
    ) -> int:
        """Dequeue and run rollouts until ``stop`` is set; returns the number run.

        ``dequeue`` sleeps until work arrives (the store wakes it), up to ``wait_timeout`` between checks
        of ``stop``. While the loop goes on, each rollout's completion also claims the next one
        (``complete_and_dequeue``: one store call, one round trip to a store server); a rollout claimed
        that way is run even if ``stop`` is set meanwhile, as one just dequeued is.

        ``on_busy`` is told the rollout the runner works on (one claimed for later included), or None when it
        has none: the pool of a runner process ends that attempt if it has to kill the process.
        """
        should_stop = stop.is_set if hasattr(stop, "is_set") else stop  # threading or multiprocessing Event
        self._exits_when_stuck = exit_when_stuck
        done = 0
        claimed: List[Rollout] = []  # claimed with the last completion: run even if a stop came meanwhile

        def go_on() -> bool:
            return not should_stop() and not self.abandoned and (max_rollouts is None or done < max_rollouts)

        def claim_next() -> bool:  # asked when a rollout is reported: will this loop run another one?
            return (
                go_on() and (max_rollouts is None or done + 1 < max_rollouts) and not (self.stuck and exit_when_stuck)
            )

        unavailable_since: Optional[float] = None  # when the store's current outage began
        said_at = -math.inf  # when this runner last logged that outage
        while claimed or go_on():
            if claimed:
                rollout: Optional[Rollout] = claimed.pop(0)
            else:
                asked = time.monotonic()
                try:
                    rollout = self.store.dequeue_rollout(self.runner_id, timeout=wait_timeout)
                except StoreUnavailableError as exc:  # a store server restarting, a full disk: wait it out
                    unavailable_since = unavailable_since or asked
                    now = time.monotonic()
                    self._give_up_after_outage(now - unavailable_since, exc)
                    if now - said_at >= OUTAGE_LOG_S:
                        said_at = now
                        logger.warning(
                            "runner %s: store unavailable for %.0f s, asking again: %s",
                            self.runner_id,
                            now - unavailable_since,
                            exc,
                        )
                    # a store that fails at once (a full disk; an HTTP client has backed off already) is asked
                    # once per wait_timeout, as an idle one is, so a stop is still seen within wait_timeout
                    time.sleep(max(0.0, wait_timeout - (now - asked)))
                    continue
                unavailable_since, said_at = None, -math.inf
            if rollout is None:
                continue
            if on_busy:
                on_busy(rollout)
            try:
                _, claimed = self._run_rollout(rollout, claim_next)
            finally:
                if on_busy:
                    on_busy(claimed[0] if claimed else None)
            done += 1
            if self.stuck and exit_when_stuck and not claimed:
                break
        return done

    def _give_up_after_outage(self, waited: float, exc: StoreUnavailableError) -> None:
        """Raise StoreOutageError once the store has not answered for ``outage_timeout`` seconds."""
        if self.outage_timeout is not None and waited >= self.outage_timeout:
            raise StoreOutageError(
                f"runner {self.runner_id}: the store has not answered for {waited:.0f} s, past the outage timeout "
                f"of {self.outage_timeout:g} s (--outage-timeout); giving up. Last error: {exc}"
            ) from exc

    def close(self) -> None:
        """Let the agent thread go (the agent loop is the process's: :mod:`agl.runtime.agent_loops`). Safe to call
        twice."""
        if self._closed:
            return
        self._closed = True
        self._executor.shutdown(wait=False, cancel_futures=True)
