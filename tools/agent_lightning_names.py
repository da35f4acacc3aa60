"""Write docs/agent-lightning.md's "Migrating from Agent Lightning v0.3" section from what the code does now.

The guide must state only what a command reproduces. This tool lists every name Agent Lightning v0.3.0's
``agentlightning/__init__.py`` exports, read from the peer's source with ``ast`` (nothing of it is imported or
copied), asks the installed ``agl`` what ``agl.NAME`` and ``from agl.<module> import NAME`` give for each, and
adds the examples' results that ``tools/agent_lightning_examples.py --json`` wrote.

    mkdir -p /tmp/al-peer
    git -C /work/.mirror/microsoft+agent-lightning/repo archive v0.3.0 agentlightning examples docs \\
        | tar -x -C /tmp/al-peer
    .venv-peer/bin/python tools/agent_lightning_examples.py --peer /tmp/al-peer --json /tmp/al_results.json
    .venv-peer/bin/python tools/agent_lightning_names.py --peer /tmp/al-peer --results /tmp/al_results.json --write

Without ``--write`` it prints the section; with it, it replaces the section (everything from its heading to
the end of the file) and keeps what comes before.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import logging
import re
import sys
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

PEER = "agentlightning"
DOC = Path(__file__).resolve().parent.parent / "docs" / "agent-lightning.md"
HEADING = "## Migrating from Agent Lightning v0.3"
REFUSAL = re.compile(r"^.*? \(Agent Lightning\) is not in agl: (?P<instead>.*?)(; see docs/agent-lightning\.md)?$")

# Functions agl serves without a docstring -> what the code does (a docstring, once written, wins).
NOTES: Dict[str, str] = {
    "is_reward_span": "true when get_reward_value finds a reward on the span.",
    "get_active_tracer": "the tracer whose trace_context is open, else None.",
    "clear_active_tracer": "forgets the active tracer.",
}
COUNT_WORDS = ("No", "One", "Two", "Three", "Four", "Five")
# Names shown as examples of importing from an Agent Lightning module path; shown only while that works.
ILLUSTRATIONS = ("LightningStoreClient", "OtelTracer")
STATUSES = ("PASS", "OUT-OF-REACH", "REFUSED", "FAIL")  # agent_lightning_examples.py's, best first


# --- The peer's names, from its source -------------------------------------------------------------------


@dataclass(frozen=True)
class PeerName:
    """A name ``agentlightning`` exports, the submodule its root imports it from, and the module defining it."""

    name: str
    module: str
    origin: str


class PeerSource:
    """Agent Lightning's package source under ``root``, read with ``ast`` only: its code is never run."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._trees: Dict[str, ast.Module] = {}  # each module is parsed once, however often it is imported
        self._bindings: Dict[str, Dict[str, str]] = {}

    def path(self, module: str) -> Optional[Path]:
        """The file of a dotted module name, or None when the source has no such module."""
        base = self.root.joinpath(*module.split("."))
        for candidate in (base / "__init__.py", base.with_suffix(".py")):
            if candidate.is_file():
                return candidate
        return None

    def tree(self, module: str) -> ast.Module:
        if module not in self._trees:
            path = self.path(module)
            if path is None:
                raise SystemExit(f"{self.root} has no module {module}: is it Agent Lightning v0.3.0's source?")
            self._trees[module] = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        return self._trees[module]

    def imported_module(self, module: str, node: ast.ImportFrom) -> Optional[str]:
        """The peer module a ``from X import ...`` statement in ``module`` reads, or None for other packages."""
        if node.level == 0:
            top = (node.module or "").split(".")[0]
            return node.module if top == PEER else None
        parts = module.split(".")
        path = self.path(module)
        package = parts if path is not None and path.name == "__init__.py" else parts[:-1]
        base = package[: len(package) - (node.level - 1)]
        return ".".join(base + ([node.module] if node.module else []))

    def statements(self, module: str) -> Iterator[Tuple[str, str, str]]:
        """Each top-level binding of ``module`` in source order: (name, module it comes through, defining module).

        Bindings under ``if`` (such as ``TYPE_CHECKING`` imports) are left out: they are not there at run time.
        """
        for node in self.tree(module).body:
            if isinstance(node, ast.ImportFrom):
                source = self.imported_module(module, node)
                if source is not None:
                    yield from self.imported(source, node.names)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                yield node.name, module, module
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    if isinstance(target, ast.Name):
                        yield target.id, module, module

    def imported(self, source: str, aliases: Sequence[ast.alias]) -> Iterator[Tuple[str, str, str]]:
        """The bindings one ``from source import ...`` makes, star imports expanded."""
        for alias in aliases:
            if alias.name == "*":
                for name, origin in self.exports(source).items():
                    yield name, source, origin
            elif self.path(f"{source}.{alias.name}") is not None:
                yield alias.asname or alias.name, source, f"{source}.{alias.name}"
            else:
                yield alias.asname or alias.name, source, self.bindings(source).get(alias.name, source)

    def bindings(self, module: str) -> Dict[str, str]:
        """Every top-level name of ``module`` -> the module defining it (the last binding wins, as in Python)."""
        if module not in self._bindings:
            self._bindings[module] = {name: origin for name, _, origin in self.statements(module)}
        return self._bindings[module]

    def declared_all(self, module: str) -> Optional[List[str]]:
        for node in self.tree(module).body:
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
            ):
                return [ast.literal_eval(e) for e in getattr(node.value, "elts", [])]
        return None

    def exports(self, module: str) -> Dict[str, str]:
        """What ``from module import *`` binds -> defining module: ``__all__``, else the public names.

        Without ``__all__`` Python also copies the submodules the package imported; they are modules, not API,
        and are left out.
        """
        bindings = self.bindings(module)
        names = self.declared_all(module)
        if names is None:
            return {name: origin for name, origin in bindings.items() if not name.startswith("_")}
        return {name: bindings.get(name, module) for name in names}

    def root_names(self) -> List[PeerName]:
        """Every name ``agentlightning`` binds at its root (``__version__`` included), in source order."""
        found: Dict[str, PeerName] = {}
        for name, through, origin in self.statements(PEER):
            found[name] = PeerName(name, through, origin)
        return list(found.values())


# --- What agl gives for each name ------------------------------------------------------------------------


@dataclass(frozen=True)
class Lookup:
    """The outcome of asking agl for one name: the object, or the error raised."""

    value: Any = None
    error: Optional[BaseException] = None


@dataclass(frozen=True)
class Row:
    """One peer name with what ``agl.NAME`` and ``from agl.<module> import NAME`` give."""

    peer: PeerName
    top: Lookup
    sub: Lookup

    @property
    def agl_module(self) -> str:
        return to_agl(self.peer.module)


def to_agl(module: str) -> str:
    return module.replace(PEER, "agl", 1)


def lookup(statement: str, name: str) -> Lookup:
    """Run ``statement`` as user code would, and take ``name`` from it, or the error it raised.

    Deprecation warnings are silenced: the section reports what is there, the warnings are for users.
    """
    namespace: Dict[str, Any] = {}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            exec(statement, namespace)  # the statement the guide documents; names come from ast
    except Exception as error:  # noqa: BLE001 - the error is the finding
        return Lookup(error=error)
    return Lookup(value=namespace[name])


def probe(peer: PeerName) -> Row:
    """``agl.NAME`` (the name from agl's root) and ``from agl.<module> import NAME`` for one peer name."""
    top = lookup(f"import agl\nvalue = agl.{peer.name}", "value")
    sub = lookup(f"from {to_agl(peer.module)} import {peer.name}", peer.name)
    return Row(peer, top, sub)


def instead(error: BaseException) -> str:
    """What an agl refusal says to use instead (its one line, without the name and the pointer to this guide)."""
    match = REFUSAL.match(str(error))
    return match.group("instead") if match else str(error)


def escape(text: str) -> str:
    return text.replace("|", "\\|")


def first_sentence(obj: Any, name: str) -> str:
    """The first sentence of the object's docstring (its own, not an inherited one), else its note."""
    doc = obj.__dict__.get("__doc__") if inspect.isclass(obj) else getattr(obj, "__doc__", None)
    if not (inspect.isclass(obj) or inspect.isfunction(obj)) or not doc:
        return NOTES.get(name, "")
    text = " ".join(inspect.cleandoc(doc).split("\n\n")[0].split())
    match = re.match(r"(.+?[.])(\s+[A-Z`(]|$)", text)
    return (match.group(1) if match else text).replace("``", "`")


def construction_refusal(cls: type) -> Optional[str]:
    """For agl's stand-ins of v0.1 classes: what constructing one says to use instead, else None."""
    if not getattr(cls, "instead", None):
        return None
    try:
        cls()
    except NotImplementedError as error:
        return instead(error)
    return None


def kind(obj: Any, name: str) -> str:
    """What ``agl.NAME`` is, for the last column: agl's own object, an alias, a compat shim or a type alias."""
    if name == "__version__":
        return f"agl's own version (`{obj}`), not 0.3.0"
    module = getattr(obj, "__module__", "") or ""
    qualname = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", "")
    if not inspect.isclass(obj) and (module == "typing" or type(obj).__module__ == "typing"):
        return f"type alias: `{str(obj).replace('typing.', '')}`"
    refusal = construction_refusal(obj) if inspect.isclass(obj) else None
    if refusal is not None:
        return f"importable; constructing it raises NotImplementedError: {refusal}"
    target = f"{module}.{qualname}"
    if module.startswith("agl.compat"):
        label = f"shim `{target}`"
    elif qualname == name:
        label = f"same name (`{target}`)"
    else:
        label = f"alias to `{target}`"
    note = first_sentence(obj, name)
    return f"{label}: {note}" if note else label


def in_agl(row: Row) -> str:
    error = row.top.error
    if error is None:
        return kind(row.top.value, row.peer.name)
    if isinstance(error, AttributeError):
        return f"refused: {instead(error)}"
    return f"raises {type(error).__name__}: {instead(error)}"


def table_row(row: Row) -> str:
    peer = row.peer
    where = f"`{peer.module}`" if peer.origin == peer.module else f"`{peer.module}` (`{peer.origin}`)"
    return f"| `{peer.name}` | {where} | {escape(in_agl(row))} |"


# --- The prose that depends on the findings --------------------------------------------------------------


def described(obj: Any) -> str:
    target = f"{obj.__module__}.{obj.__qualname__}"
    return f"the shim `{target}`" if target.startswith("agl.compat.") else f"`{target}`"


def count_word(n: int) -> str:
    return COUNT_WORDS[n] if n < len(COUNT_WORDS) else str(n)


def same(row: Row) -> bool:
    return row.top.error is None and row.sub.error is None and row.sub.value is row.top.value


def submodule_paragraph(rows: Sequence[Row]) -> str:
    """How ``from agl.<module> import NAME`` compares with ``agl.NAME``, from the probe, not from memory."""
    served = [r for r in rows if r.peer.module != PEER]
    examples = [r for r in served if r.peer.name in ILLUSTRATIONS and same(r)]
    shown = ", ".join(f"`from {r.agl_module} import {r.peer.name}`" for r in examples)
    differences = [
        f"`{r.agl_module}.{r.peer.name}` is {described(r.sub.value)}, not `agl.{r.peer.name}`."
        for r in served
        if r.top.error is None and r.sub.error is None and r.sub.value is not r.top.value
    ]
    plain = sorted({r.agl_module for r in served if r.top.error is not None and type(r.sub.error) is ImportError})
    if plain:
        listed = ", ".join(f"`{m}`" for m in plain[:-1]) + (" or " if len(plain) > 1 else "") + f"`{plain[-1]}`"
        differences.append(
            f"A refused name imported from {listed} gives Python's plain `ImportError`, without the text above."
        )
    count = count_word(len(differences))
    noun = "difference" if len(differences) == 1 else "differences"
    return " ".join(
        [f"Each name also imports from its Agent Lightning module: {shown}.", f"{count} {noun}."] + differences
    )


def wrap(text: str, width: int = 115) -> str:
    """Break prose into lines of at most ``width`` characters, as the rest of the guide is written."""
    lines: List[str] = []
    for word in re.findall(r"(?:`[^`]*`|[^\s`])+", text):  # a code span is never split
        if lines and len(lines[-1]) + 1 + len(word) <= width:
            lines[-1] += " " + word
        else:
            lines.append(word)
    return "\n".join(lines)


def example_rows(results: Sequence[Mapping[str, Any]]) -> str:
    """The examples' table; local file paths in the details are dropped, they differ from machine to machine."""
    rows = []
    for result in results:
        what = "; ".join(text for text in (result["detail"], result["stored"]) if text)
        what = re.sub(r" \(/[^)]*\.py\)", "", what)
        rows.append(f"| `{result['example']}` | {result['status']} | {escape(what)} |")
    return "\n".join(rows)


def status_counts(results: Sequence[Mapping[str, Any]]) -> str:
    counts = Counter(str(result["status"]) for result in results)
    order = [s for s in STATUSES if s in counts] + sorted(set(counts) - set(STATUSES))
    return ", ".join(f"{counts[status]} {status}" for status in order) + f" of {len(results)} runs"


def module_lists() -> Tuple[str, str]:
    """The peer module paths agl serves from ``agl.compat``, and those it refuses with their reasons."""
    from agl.compat.aliases import MISSING_MODULES, MODULES

    served = ", ".join(f"`{to_peer(m)}`" for m in sorted(MODULES))
    missing = "\n".join(f"- `{to_peer(m)}`: {why}." for m, why in sorted(MISSING_MODULES.items()))
    return served, missing


def to_peer(module: str) -> str:
    return module.replace("agl", PEER, 1)


def results_part(results: Optional[Sequence[Mapping[str, Any]]]) -> str:
    if results is None:
        return "The result: run with `--results FILE` to fill this table."
    return (
        f"The result: {status_counts(results)}.\n\n"
        "| Example | Status | Stored, or the first failure |\n|---|---|---|\n" + example_rows(results)
    )


SECTION = """\
{heading}

Change the import lines and nothing else:

- `import agentlightning as agl` becomes `import agl`.
- `from agentlightning.X import Y` becomes `from agl.X import Y`.

{served_paragraph}
Importing one of them gives the agl module that implements it.

These paths have no counterpart. Importing one raises `ModuleNotFoundError` with what to use instead:

{missing}

agl's stores are synchronous. Called from your own `async def`, a store method returns an awaitable, so
`await store.query_spans(rollout_id)` works there as in Agent Lightning. Called from plain code, it returns the value.

agl keeps its own span format. Code that asserts Agent Lightning's span names or attributes
(`agentlightning.annotation`, `agentlightning.reward.0.value`, LiteLLM's `raw_gen_ai_request`, AgentOps session
spans) fails at that assert. Read rewards with `agl.find_final_reward(spans)` or the rollout's `final_reward`.

`tools/agent_lightning_names.py` writes this section from agl's code and the examples' results. The command is at
the end.

### Every name `agentlightning` exports

The list is `agentlightning/__init__.py` at v0.3.0 with its star imports expanded: {count} names.
The last column is what `agl.NAME` is, checked with `python -c "import agl; agl.NAME"`.

- *same name*: agl's own object, under the same name.
- *alias*: agl's own object, under another name.
- *shim*: Agent Lightning's API, written on agl's machinery in `agl.compat`. Its note says what it does.
- *type alias*: a typing alias; use it in annotations.
- *refused*: `agl.NAME` raises `AttributeError` with this text, then "see docs/agent-lightning.md".

| Agent Lightning name | Agent Lightning module | In agl |
|---|---|---|
{names_table}

{submodules}

### Which Agent Lightning examples run

`tools/agent_lightning_examples.py` runs Agent Lightning v0.3.0's examples on agl. It copies them, rewrites only
their import lines (it prints the count per file and checks that nothing else changed), and runs each entry point
against agl's fake OpenAI server (`agl.testing.fake_openai.FakeOpenAIServer`). It also makes the small data
files the examples read, starts `agl store serve` where an example expects a store server, and puts a `uvx`
stand-in on `PATH` for calc_x's MCP calculator. The fake model gives answers of the shape each example parses
(a JSON judgement, a score, a fenced SQL query, a calculator call).

Set up once, in this repository. The archive holds Agent Lightning's package source (`agentlightning`, read
for the names above) and its examples:

```bash
python3.11 -m venv .venv-peer
.venv-peer/bin/pip install -e ".[dev,langgraph,autogen,parquet]" langchain langchain-community pandas pyarrow \\
    sympy termcolor aiohttp portpicker datasets nltk sqlparse tqdm prometheus_client mcp-server-calculator \\
    "autogen-ext[openai,mcp]"
mkdir -p /tmp/al-peer
git -C PATH/TO/agent-lightning archive v0.3.0 agentlightning examples docs | tar -x -C /tmp/al-peer
```

Run:

```bash
.venv-peer/bin/python tools/agent_lightning_examples.py --peer /tmp/al-peer
```

Each run gets one status:

- PASS: it ran to the end. The result says what the store holds, or what the example printed when its store
  lives only in its own process.
- OUT-OF-REACH: it ran, then stopped at its own assert on Agent Lightning's span format.
- REFUSED: agl refused a peer feature it lacks, with its one-line error.
- FAIL: anything else.

To write this section again (both tables), run the examples with `--json`, then this repository's
`tools/agent_lightning_names.py`:

```bash
.venv-peer/bin/python tools/agent_lightning_examples.py --peer /tmp/al-peer --json /tmp/al_results.json
.venv-peer/bin/python tools/agent_lightning_names.py --peer /tmp/al-peer --results /tmp/al_results.json --write
```

{results}
"""


def section(peer: Path, results: Optional[Sequence[Mapping[str, Any]]]) -> str:
    """The whole section, from the peer's source, the installed agl and the examples' results."""
    logging.disable(logging.CRITICAL)  # agl's compat modules log as they load; the section is the output
    rows = [probe(name) for name in PeerSource(peer).root_names()]
    served, missing = module_lists()
    return SECTION.format(
        heading=HEADING,
        served_paragraph=wrap(f"Agent Lightning's module paths that agl lacks are served from `agl.compat`: {served}."),
        missing=missing,
        count=len(rows),
        names_table="\n".join(table_row(row) for row in rows),
        submodules=wrap(submodule_paragraph(rows)),
        results=results_part(results),
    )


def replace_section(doc: Path, text: str) -> None:
    """Keep everything before the section's heading, and put ``text`` in place of the rest."""
    current = doc.read_text(encoding="utf-8")
    head, found, _ = current.partition("\n" + HEADING + "\n")
    if not found:
        raise SystemExit(f"{doc} has no line '{HEADING}': add it where the section belongs, then run again")
    doc.write_text(head + "\n" + text, encoding="utf-8")


def load_results(path: Path) -> List[Dict[str, Any]]:
    """The JSON that ``agent_lightning_examples.py --json`` wrote, checked for the fields the table uses."""
    try:
        results = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise SystemExit(
            f"cannot read --results {path}: {error}; write it with agent_lightning_examples.py --json"
        ) from error
    fields = {"example", "status", "detail", "stored"}
    if not isinstance(results, list) or not all(isinstance(r, dict) and fields <= r.keys() for r in results):
        raise SystemExit(
            f"--results {path} is not a list of {sorted(fields)} objects: use agent_lightning_examples.py --json"
        )
    return results


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--peer", type=Path, required=True, help="folder holding Agent Lightning v0.3.0's agentlightning/"
    )
    parser.add_argument("--results", type=Path, help="JSON written by agent_lightning_examples.py --json")
    parser.add_argument(
        "--write", action="store_true", help=f"replace the section in {DOC.name} instead of printing it"
    )
    args = parser.parse_args(argv)
    if not (args.peer / PEER / "__init__.py").is_file():
        raise SystemExit(
            f"--peer {args.peer} has no {PEER}/__init__.py: extract it with "
            f"`git -C PATH/TO/agent-lightning archive v0.3.0 {PEER} examples docs | tar -x -C {args.peer}`"
        )
    if args.write and args.results is None:
        raise SystemExit("--write needs --results FILE: the section's table of examples comes from it")
    results = load_results(args.results) if args.results else None
    text = section(args.peer.resolve(), results)
    if args.write:
        replace_section(DOC, text)
        print(f"wrote the section to {DOC}")
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
