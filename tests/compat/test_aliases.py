"""Agent Lightning's module paths and top-level names resolve in agl (agl.compat.aliases), lazily."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import agl
from agl.compat import aliases

# Every name Agent Lightning v0.3.0 exports from its package root (agentlightning/__init__.py and the
# __all__ of the modules it star-imports): the interface agl's package root serves.
AL_V030_NAMES = """
APO Adapter AgentLightningClient AgentLightningServer AgentOpsTracer Algorithm Attempt AttemptStatus
AttemptedRollout AttributeValue Attributes Baseline ClientServerExecutionStrategy CollectionBasedLightningStore
Dataset DevTaskLoader DummyTracer EnqueueRolloutRequest Event ExecutionEvent ExecutionStrategy FastAlgorithm
FilterField FilterOptions GenericResponse Hook InMemoryLightningStore LLM LLMProxy LegacyAgentRunner
LightningEnvVar LightningStore LightningStoreCapabilities LightningStoreClient LightningStoreServer
LightningStoreStatistics LightningStoreThreaded Link LitAgent LitAgentRunner LlmProxyTraceToTriplet
MultiprocessingEvent NamedResources OtelResource OtelTraceAdapter OtelTracer PaginatedResult ParallelWorkerBase
PromptTemplate ProxyLLM Resource ResourceUnion ResourcesUpdate Rollout RolloutConfig RolloutLegacy RolloutMode
RolloutRawResult RolloutRawResultLegacy RolloutStatus Runner SharedMemoryExecutionStrategy SortOptions Span
SpanAttributeNames SpanContext SpanCoreFields SpanLike SpanNames SpanRecordingContext StatusCode Task TaskIfAny
TaskInput ThreadingEvent TraceAdapter TraceState TraceStatus TraceToMessages TraceToTripletBase Tracer
TracerTraceToTriplet Trainer Triplet VERL Worker WorkerStatus algo build_component clear_active_tracer
configure_logger emit_annotation emit_exception emit_message emit_object emit_reward find_final_reward
find_reward_spans get_active_tracer get_message_value get_object_value get_reward_value get_rewards_from_span
is_reward_span lightning_cli llm_rollout operation prompt_rollout resolve_bool_env_var resolve_int_env_var
resolve_str_env_var reward rollout set_active_tracer setup_logging setup_module_logging
""".split()


def test_import_agl_loads_no_compat_module_but_the_tables():
    code = "import agl, sys; print(sorted(m for m in sys.modules if m.startswith('agl.compat')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['agl.compat', 'agl.compat.aliases']"


@pytest.mark.parametrize("alias", sorted(aliases.MODULES))
def test_an_agent_lightning_module_path_is_the_compat_module(alias):
    target = aliases.MODULES[alias]
    module = importlib.import_module(alias)
    assert module is importlib.import_module(target)
    assert module.__spec__ is not None and module.__spec__.name == target  # the alias did not overwrite it


def test_import_statements_of_the_examples_resolve():
    import agl.runner
    from agl.llm_proxy import LLMProxy, ModelConfig
    from agl.reward import find_final_reward, reward
    from agl.tracer.agentops import AgentOpsTracer
    from agl.utils.otel import make_link_attributes

    assert agl.runner.LitAgentRunner is agl.LitAgentRunner
    assert AgentOpsTracer is agl.AgentOpsTracer and LLMProxy is agl.LLMProxy and ModelConfig
    assert reward is agl.emitter.reward and find_final_reward is agl.find_final_reward
    assert make_link_attributes is agl.compat.utils.make_link_attributes


def test_a_module_path_is_an_attribute_of_agl_too():
    assert agl.tracer is importlib.import_module("agl.compat.tracer")


@pytest.mark.parametrize("path", sorted(aliases.MISSING_MODULES))
def test_a_module_agl_lacks_says_what_to_use_in_one_line(path):
    with pytest.raises(ModuleNotFoundError) as raised:
        importlib.import_module(path)
    message = str(raised.value)
    assert path in message and aliases.GUIDE in message and "\n" not in message
    assert path not in sys.modules


def test_every_agent_lightning_name_is_served_or_explained():
    assert set(AL_V030_NAMES) - set(aliases.NAMES) - set(agl.__all__) - set(dir(agl)) == set()
    for name in AL_V030_NAMES:
        try:
            getattr(agl, name)
        except AttributeError as exc:
            message = str(exc)
            assert f"agl.{name}" in message and aliases.GUIDE in message and "\n" not in message, message


def test_a_name_agl_cannot_offer_names_the_replacement():
    with pytest.raises(AttributeError, match=r"agl\.lightning_cli .*agl train --set.*docs/agent-lightning\.md"):
        agl.lightning_cli  # noqa: B018


def test_an_unknown_name_is_a_plain_attribute_error():
    with pytest.raises(AttributeError, match=r"^module 'agl' has no attribute 'no_such_name'$"):
        agl.no_such_name  # noqa: B018
    assert not hasattr(agl, "no_such_name")


def test_the_legacy_server_classes_import_and_say_what_replaces_them():
    from agl.server import AgentLightningServer

    with pytest.raises(NotImplementedError, match=r"AgentLightningServer .*agl store serve"):
        AgentLightningServer(port=8000)
    with pytest.raises(NotImplementedError, match=r"DevTaskLoader .*\.dev\(agent, tasks\)"):
        agl.DevTaskLoader([], {})
