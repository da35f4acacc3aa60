"""benchmarks/verl_gpu_kit.py carries wheels to a GPU machine without network in parts of a tar: the parts must
join back byte for byte, and a lost or damaged part must stop the device command with one line that names it
(a traceback there costs a GPU round trip to read). Small fake wheels here: no network, no downloads."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import stat
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "verl_gpu_kit.py"
PART = 4096
BATCH = 3 * PART + 512  # three parts per batch
PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"


def _load_script() -> Any:
    spec = importlib.util.spec_from_file_location("verl_gpu_kit", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


kit = _load_script()


def _wheel(
    folder: Path, name: str, version: str = "1.0", files: Optional[Dict[str, bytes]] = None, requires: str = ""
) -> Path:
    """A minimal valid pure-Python wheel (pip installs it), with ``files`` besides its dist-info and the
    ``requires`` (comma-separated) as its dependencies."""
    path = folder / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    metadata += "".join(f"Requires-Dist: {r}\n" for r in requires.split(",") if r)
    contents = {
        **(files or {}),
        f"{info}/METADATA": metadata.encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{p},,\n" for p in contents) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as zf:
        for p, data in contents.items():
            zf.writestr(p, data)
        zf.writestr(f"{info}/RECORD", record)
    return path


def _noise_wheels(folder: Path) -> List[Path]:
    """Wheels of incompressible bytes, ~7 parts' worth, so the tar spans several batches."""
    folder.mkdir(exist_ok=True)
    sizes = {"alpha": 9000, "beta": 13000, "gamma": 5000}
    return [_wheel(folder, n, files={f"{n}/blob.bin": os.urandom(size)}) for n, size in sizes.items()]


def _tokenizer(folder: Path) -> Path:
    """A stand-in for SmolLM2's saved tokenizer: a folder of a few files, one of them over a part's size."""
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes(os.urandom(PART + 100))
    (folder / "tokenizer_config.json").write_text('{"model_max_length": 8192}')
    return folder


def _make_kit(
    tmp_path: Path, wheels: List[Path], spares: Tuple[str, ...] = (), tokenizer: Optional[Path] = None
) -> Tuple[Path, Dict[str, Any]]:
    out = tmp_path / "kit"
    out.mkdir()
    info = {"python_version": PYTHON, "part_bytes": PART}
    return out, kit.write_kit(out, wheels, PART, BATCH, info, "kit", spares, tokenizer)


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True)


def _assert_one_line_error(result: subprocess.CompletedProcess, *words: str) -> None:
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    for word in words:
        assert word in lines[0]


def test_the_tar_is_cut_into_parts_of_the_requested_size(tmp_path: Path) -> None:
    out, manifest = _make_kit(tmp_path, _noise_wheels(tmp_path / "wheels"), tokenizer=_tokenizer(tmp_path / "tok"))
    parts = manifest["parts"]
    assert len(parts) > 3 and len(manifest["batches"]) > 1
    assert all(p["bytes"] == PART for p in parts[:-1]) and 0 < parts[-1]["bytes"] <= PART
    assert sum(p["bytes"] for p in parts) == manifest["tar"]["bytes"]
    whole = hashlib.sha256()
    for part in parts:
        data = (out / part["batch"] / part["name"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == part["sha256"]
        whole.update(data)
    assert whole.hexdigest() == manifest["tar"]["sha256"]
    for batch in manifest["batches"]:
        assert batch["bytes"] <= BATCH
        assert json.loads((out / batch["name"] / "manifest.json").read_text())["batch"] == batch["name"]
    assert not (out / "kit.tar").exists()  # only the parts travel


def test_the_same_wheels_give_the_same_tar(tmp_path: Path) -> None:
    files = [(w.name, w) for w in _noise_wheels(tmp_path / "wheels")]
    first = kit.pack(files, tmp_path, PART, BATCH)
    os.utime(files[0][1], (0, 12345))  # a newer download of the same file changes nothing
    assert kit.pack(files[::-1], tmp_path, PART, BATCH)["tar"]["sha256"] == first["tar"]["sha256"]


def test_received_parts_join_back_into_the_same_wheels_and_tokenizer(tmp_path: Path) -> None:
    wheels = _noise_wheels(tmp_path / "wheels")
    tokenizer = _tokenizer(tmp_path / "tok")
    out, manifest = _make_kit(tmp_path, wheels, tokenizer=tokenizer)
    to = tmp_path / "device"
    for batch in manifest["batches"]:
        assert kit.receive(out / batch["name"], to) == batch["parts"]
    tar_path = kit.reassemble(to)
    assert kit._sha256(tar_path) == manifest["tar"]["sha256"]
    extracted = kit.extract(tar_path, to, manifest)
    assert sorted(w.name for w in extracted) == sorted(w.name for w in wheels)
    for original in [*wheels, *tokenizer.iterdir()]:
        folder = "wheels" if original in wheels else "tokenizer"
        assert (to / folder / original.name).read_bytes() == original.read_bytes()


def test_extract_refuses_anything_but_wheels_and_tokenizer_files(tmp_path: Path) -> None:
    evil = tmp_path / "evil.whl"
    evil.write_bytes(b"x")
    for name in ("sub/evil.whl", "tokenizer/../evil.whl"):
        tar_path = tmp_path / "kit.tar"
        with tarfile.open(tar_path, "w") as tar:
            tar.add(evil, arcname=name)
        with pytest.raises(kit.KitError, match="neither a wheel nor a tokenizer file"):
            kit.extract(tar_path, tmp_path / "device", {"wheels": [], "tokenizer": []})


def test_a_part_missing_from_the_carried_batch_is_named(tmp_path: Path) -> None:
    out, manifest = _make_kit(tmp_path, _noise_wheels(tmp_path / "wheels"))
    victim = manifest["batches"][1]["parts"][0]
    (out / "batch-1" / victim).unlink()
    result = _run("receive", "--kit", str(out / "batch-1"), "--to", str(tmp_path / "device"))
    _assert_one_line_error(result, victim, "missing", "command 2 of")


def test_a_corrupted_part_in_the_carried_batch_is_named(tmp_path: Path) -> None:
    out, manifest = _make_kit(tmp_path, _noise_wheels(tmp_path / "wheels"))
    victim = out / "batch-0" / manifest["batches"][0]["parts"][1]
    data = bytearray(victim.read_bytes())
    data[100] ^= 0xFF
    victim.write_bytes(bytes(data))
    result = _run("receive", "--kit", str(out / "batch-0"), "--to", str(tmp_path / "device"))
    _assert_one_line_error(result, victim.name, "corrupted")
    assert not list((tmp_path / "device" / "parts").glob(f"{victim.name}*"))  # nothing half-received stays


def test_install_names_a_part_that_no_command_brought(tmp_path: Path) -> None:
    out, manifest = _make_kit(tmp_path, _noise_wheels(tmp_path / "wheels"))
    to = tmp_path / "device"
    kit.receive(out / "batch-0", to)  # the machine went idle before batch-1 arrived
    result = _run("install", "--to", str(to), "--imports", "")
    first_missing = manifest["batches"][1]["parts"][0]
    _assert_one_line_error(result, first_missing, "missing", "command 2 of", '"kit/batch-1"')


def test_install_names_a_part_damaged_after_receive(tmp_path: Path) -> None:
    out, manifest = _make_kit(tmp_path, _noise_wheels(tmp_path / "wheels"))
    to = tmp_path / "device"
    for batch in manifest["batches"]:
        kit.receive(out / batch["name"], to)
    victim = to / "parts" / manifest["parts"][2]["name"]
    victim.write_bytes(victim.read_bytes()[:-1] + b"\0")
    _assert_one_line_error(_run("install", "--to", str(to), "--imports", ""), victim.name, "corrupted")


def test_install_without_a_manifest_says_what_to_run_first(tmp_path: Path) -> None:
    _assert_one_line_error(_run("install", "--to", str(tmp_path / "empty")), "receive")


def test_receive_refuses_the_whole_kit_folder(tmp_path: Path) -> None:
    out, _ = _make_kit(tmp_path, _noise_wheels(tmp_path / "wheels"))
    _assert_one_line_error(_run("receive", "--kit", str(out), "--to", str(tmp_path / "d")), "batch-N")


def test_install_puts_the_wheels_on_the_path_and_spares_only_where_missing(tmp_path: Path, capsys) -> None:
    folder = tmp_path / "wheels"
    folder.mkdir()
    wheels = [
        _wheel(folder, "kitfake", files={"kitfake/__init__.py": b"__version__ = '1.0'\n"}),
        _wheel(folder, "kitspare", files={"kitspare.py": b""}),  # a spare this Python lacks: installed
        _wheel(folder, "pytest", "0.0.1", files={"pytest_spare_copy.py": b""}),  # a spare it has: not installed
    ]
    out, _ = _make_kit(tmp_path, wheels, spares=("kitspare", "pytest"))
    to = tmp_path / "device"
    kit.receive(out / "batch-0", to)
    timings = kit.install(to, ["kitfake"])
    assert {"reassemble", "extract", "spares", "install", "import check"} <= set(timings)
    site = to / "site"
    assert (site / "kitfake" / "__init__.py").is_file() and (site / "kitspare.py").is_file()
    assert not (site / "pytest_spare_copy.py").exists()
    output = capsys.readouterr().out
    assert "1 of 2 missing here: kitspare" in output
    assert f"kitfake 1.0: {os.path.realpath(site)}" in output


def test_the_import_check_fails_for_a_module_from_outside_the_kit(tmp_path: Path) -> None:
    folder = tmp_path / "wheels"
    folder.mkdir()
    out, _ = _make_kit(tmp_path, [_wheel(folder, "kitfake", files={"kitfake/__init__.py": b""})])
    to = tmp_path / "device"
    kit.receive(out / "batch-0", to)
    result = _run("install", "--to", str(to), "--imports", "kitfake,json")  # json is the stdlib's
    _assert_one_line_error(result, "import check failed", "json was imported from")


def test_without_pip_the_wheels_are_unzipped_with_their_data_and_exec_bits(tmp_path: Path) -> None:
    path = tmp_path / "tool-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("tool/__init__.py", b"")
        executable = zipfile.ZipInfo("tool/core/raylet")
        executable.external_attr = (stat.S_IFREG | 0o755) << 16
        zf.writestr(executable, b"#!/bin/sh\n")
        zf.writestr("tool-1.0.data/purelib/tool_extra.py", b"")
    site = tmp_path / "site"
    kit.unpack_wheels([path], site)
    assert (site / "tool_extra.py").is_file() and not (site / "tool-1.0.data").exists()
    assert os.access(site / "tool" / "core" / "raylet", os.X_OK)


SMOKE = "PYTHONPATH=/tmp/agl-kit/site:core python3 benchmarks/verl_gpu_smoke.py --tokenizer /tmp/agl-kit/tokenizer"


def test_the_plan_ends_with_install_and_the_smoke_run_within_the_limits(tmp_path: Path) -> None:
    out, manifest = _make_kit(tmp_path, _noise_wheels(tmp_path / "wheels"), tokenizer=_tokenizer(tmp_path / "tok"))
    commands = manifest["commands"]
    assert len(commands) == len(manifest["batches"])
    assert all(len(c["command"]) < kit.COMMAND_LIMIT for c in commands)
    assert all(c["carry_bytes"] <= BATCH for c in commands)
    assert [c["carry"] for c in commands] == [[f"kit/{b['name']}"] for b in manifest["batches"]]
    assert commands[-1]["command"].endswith(f" && python3 {kit.SCRIPT} install --to /tmp/agl-kit && {SMOKE}")
    assert all(" install " not in c["command"] and kit.SMOKE not in c["command"] for c in commands[:-1])
    result = _run("plan", "--kit", str(out))
    assert result.returncode == 0
    assert all(c["command"] in result.stdout for c in commands)
    assert f'carry: ["kit/batch-{len(commands) - 1}"]' in result.stdout
    assert result.stdout.strip().splitlines()[-1].endswith(SMOKE)


def test_a_smoke_run_too_long_to_chain_gets_a_command_of_its_own() -> None:
    manifest = {"batches": [{"name": "batch-0", "bytes": 1}]}
    to = "/tmp/" + "x" * 500
    commands = kit.device_commands(manifest, "kit", to, "python3")
    assert len(commands) == 2 and " install " in commands[0]["command"]
    assert commands[1]["command"].startswith(f"PYTHONPATH={to}/site:core python3 {kit.SMOKE} --tokenizer {to}/")
    assert commands[1]["carry"] == [] and all(len(c["command"]) < kit.COMMAND_LIMIT for c in commands)
    assert kit.SMOKE not in kit.device_commands(manifest, "kit", "/tmp/k", "python3", smoke=False)[0]["command"]


def test_a_left_out_distribution_and_what_only_it_needs_are_not_resolved(tmp_path: Path) -> None:
    index = tmp_path / "index"
    index.mkdir()
    _wheel(index, "app", requires="video,shared")
    _wheel(index, "video", "2.0", requires="codec,shared")  # like av: wanted only by what agl does not run
    _wheel(index, "codec")
    _wheel(index, "shared")
    extra = ["--no-index", "--find-links", str(index)]
    everything = kit.resolve_leaving_out(["app"], {}, PYTHON, tmp_path, extra)
    assert everything == {"app": "1.0", "video": "2.0", "codec": "1.0", "shared": "1.0"}
    assert kit.resolve_leaving_out(["app"], {"video": "2.0"}, PYTHON, tmp_path, extra) == {
        "app": "1.0",
        "shared": "1.0",
    }


def test_leave_out_defaults_to_LEAVE_OUT_and_can_be_emptied(tmp_path: Path, monkeypatch) -> None:
    calls: List[Any] = []

    def prepare(*args: Any) -> Dict[str, Any]:
        calls.append(args)
        return {}

    monkeypatch.setattr(kit, "prepare", prepare)
    monkeypatch.setattr(kit, "_summary", lambda manifest: "")
    monkeypatch.setattr(kit, "print_plan", lambda manifest: None)
    assert kit.main(["prepare", "--out", str(tmp_path)]) == 0
    assert kit.main(["prepare", "--out", str(tmp_path), "--leave-out", ""]) == 0
    assert kit.main(["prepare", "--out", str(tmp_path), "--leave-out", "wandb,av"]) == 0
    assert [c[-1] for c in calls] == [list(kit.LEAVE_OUT), [], ["wandb", "av"]]


def test_a_part_larger_than_a_batch_is_refused(tmp_path: Path) -> None:
    with pytest.raises(kit.KitError, match="does not fit"):
        kit.pack([(w.name, w) for w in _noise_wheels(tmp_path / "wheels")], tmp_path, 2 * BATCH, BATCH)


def test_wheel_file_names_give_name_and_version() -> None:
    assert kit.wheel_name_version("Foo_Bar-2.0.1-cp312-cp312-manylinux_2_28_x86_64.whl") == ("foo-bar", "2.0.1")
    with pytest.raises(kit.KitError):
        kit.wheel_name_version("foo-1.0.tar.gz")


def test_a_pip_failure_becomes_one_line() -> None:
    stderr = (
        "Collecting x\nERROR: Cannot install verl because these package versions have conflicting dependencies.\n"
        "Additionally, some packages in these conflicts have no matching distributions available for your "
        "environment:\n    antlr4-python3-runtime\n\nTo fix this you could try to:\n"
    )
    reason = kit._pip_reason(stderr)
    assert "\n" not in reason and "conflicting" in reason and "no wheel: antlr4-python3-runtime" in reason


def test_install_refuses_a_kit_for_another_python(tmp_path: Path) -> None:
    out, manifest = _make_kit(tmp_path, _noise_wheels(tmp_path / "wheels"))
    to = tmp_path / "device"
    for batch in manifest["batches"]:
        kit.receive(out / batch["name"], to)
    saved = json.loads((to / "manifest.json").read_text())
    (to / "manifest.json").write_text(json.dumps({**saved, "python_version": "2.7"}))
    _assert_one_line_error(_run("install", "--to", str(to)), "Python 2.7")


REWARD_RUN = """Ray noise
step  reward  pg_loss grad_norm update_s sync_s gen_tok/s
   1   0.125  -0.0000    2.1523     8.57   0.08      43.1
{second}
cpu: 2 steps in 73 s
trained token ids == served token ids (31 distinct prompt/response pairs)
FAILED: the reward did not rise
"""


@pytest.mark.parametrize(
    ("second", "trained"),
    [
        ("   2   0.172   0.0000    1.8682     8.00   0.07      63.7", True),
        ("   2   0.172  (skipped)\nFAILED: step 2 did not train", False),
    ],
)
def test_the_rehearsal_passes_only_when_every_verl_step_trained(tmp_path: Path, second: str, trained: bool) -> None:
    fake_python = tmp_path / "python"  # stands for the scratch Python running verl_reward.py
    (tmp_path / "out.txt").write_text(REWARD_RUN.format(second=second))
    fake_python.write_text(f"#!/bin/sh\ncat {tmp_path / 'out.txt'}\nexit 1\n")
    fake_python.chmod(0o755)
    log = tmp_path / "verl_reward.log"
    if trained:
        assert len(kit.verl_steps(fake_python, tmp_path, 2, log)) == 2
    else:
        with pytest.raises(kit.KitError, match="step 2 did not train"):
            kit.verl_steps(fake_python, tmp_path, 2, log)
