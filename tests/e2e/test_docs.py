"""The documentation's commands, run as written against one real ``ditserve serve`` (CPU, demo models).

Every fenced shell or Python block of README.md and docs/operations.md carries a marker on the line
before its fence (an HTML comment, which GitHub does not render):

    <!-- runnable -->                       run it; it must exit 0
    <!-- runnable: makes out.png; prints "b64_json"; needs grpcurl; last; xfail REASON -->
    <!-- not runnable: REASON -->           never run (docker, kubectl, GPUs, the setup CI runs)

Options of ``runnable``, separated by ``;``: ``makes FILE`` (the block writes FILE, and it is what its
extension says: a PNG, an MP4, YAML), ``prints "TEXT"`` (its output contains TEXT), ``needs TOOL`` (skipped
where TOOL is not installed), ``last`` (runs after every other block: it shuts the server down),
``xfail REASON`` (known to fail until REASON is fixed).

``console`` blocks are transcripts: each ``$ command`` runs in one shell, in order; the lines under a
command are its expected output, ``...`` standing for any text, matched in order against its lines. A
command shown without output must exit 0 (unless the next command is ``echo $?``, which shows its status).
Other shell blocks run with ``set -e -o pipefail``. ``curl`` runs as ``curl --fail-with-body``, so an HTTP
error is a failing command. Addresses, adapter files and model folders of the docs are replaced by this
test's (``substitutions``, the one place that says how).
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from PIL import Image

from tests.helpers import REPO_ROOT, ServeProcess

DOCS = ("README.md", "docs/operations.md")
SHELL = {"bash", "sh", "shell", "console"}
PYTHON = {"python", "py"}
KEY = "docs-admin-key"
MODEL_DIR = REPO_ROOT / "replica" / "models" / "demo_scenes"  # a diffusers folder holding a FluxPipeline

MARKER = re.compile(r"^<!--\s*(runnable|not runnable)\s*(?::\s*(.*?))?\s*-->$")
OPTION = re.compile(
    r'^(makes (?P<makes>\S+)|prints "(?P<prints>[^"]+)"|needs (?P<needs>\S+)|(?P<last>last)|xfail (?P<xfail>.+))$'
)


@dataclass(frozen=True)
class Block:
    doc: str
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    marker: str | None  # "runnable", "not runnable" or None
    options: tuple[str, ...]

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"

    def option(self, name: str) -> list[str]:
        return [m[name] for m in (OPTION.match(o) for o in self.options) if m and m[name]]


def doc_blocks(doc: str) -> list[Block]:
    """Every fenced code block of ``doc`` with the marker on the line before its fence."""
    lines = (REPO_ROOT / doc).read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        fence = re.match(r"^\s*(```+|~~~+)\s*(\S*)", lines[i])  # indented fences (in lists) too
        if not fence:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip().startswith(fence.group(1)))
        marker = MARKER.match(lines[i - 1].strip()) if i else None
        options = tuple(o.strip() for o in (marker.group(2) or "").split(";") if o.strip()) if marker else ()
        kind = marker.group(1) if marker else None
        if kind == "not runnable":
            options = ()  # the text after the colon is the reason
        blocks.append(
            Block(
                doc,
                i + 1,
                fence.group(2).lower(),
                textwrap.dedent("\n".join(lines[i + 1 : end])),
                kind,
                options,
            )
        )
        i = end + 1
    return blocks


ALL_BLOCKS = [b for doc in DOCS for b in doc_blocks(doc) if b.lang in SHELL | PYTHON]
RUNNABLE = sorted((b for b in ALL_BLOCKS if b.marker == "runnable"), key=lambda b: bool(b.option("last")))


def test_every_shell_and_python_block_is_marked():
    unmarked = [b.id for b in ALL_BLOCKS if b.marker is None]
    assert not unmarked, f"mark these blocks <!-- runnable --> or <!-- not runnable: reason -->: {unmarked}"
    bad = [(b.id, o) for b in RUNNABLE for o in b.options if not OPTION.match(o)]
    assert not bad, f"unknown runnable options (see tests/e2e/test_docs.py): {bad}"
    assert len(RUNNABLE) >= 10  # the parser still finds the blocks


# -- the server and what the docs' placeholders stand for -------------------------------------------------
@pytest.fixture(scope="module")
def lora_root(tmp_path_factory) -> Path:
    from tests.unit.test_lora_engine import weights, write_kohya  # adapters that fit the demo models

    root = tmp_path_factory.mktemp("loras")
    write_kohya(root / "style.safetensors", weights(1))
    write_kohya(root / "watercolor.safetensors", weights(2))
    return root


@pytest.fixture(scope="module")
def server(lora_root):
    proc = ServeProcess("--api-key", KEY, "--lora-root", str(lora_root))  # the default model, demo-scenes
    yield proc
    assert proc.stop() == 0, proc.output()


def substitutions(server: ServeProcess, lora_root: Path) -> list[tuple[str, str]]:
    """What the docs write → what this test runs (the only place where doc text is changed)."""
    return [
        ("http://127.0.0.1:8000", server.base_url),
        ("127.0.0.1:8000", f"127.0.0.1:{server.port}"),
        ("localhost:8000", f"127.0.0.1:{server.port}"),
        ("127.0.0.1:9000", f"127.0.0.1:{server.grpc_port}"),
        ("/loras/style.safetensors", str(lora_root / "style.safetensors")),
        ("/models/loras/watercolor.safetensors", str(lora_root / "watercolor.safetensors")),
        ("/models/new-checkpoint", str(MODEL_DIR)),
        ("/models/FLUX.1-dev-finetune-0042", str(MODEL_DIR)),
        ("/path/to/FLUX.1-dev --width 1024 --height 1024", f"{MODEL_DIR} --width 64 --height 64"),
    ]


def substitute(text: str, pairs: list[tuple[str, str]]) -> str:
    for old, new in pairs:
        text = text.replace(old, new)
    return text


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("docs-run")


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, str]:
    """The blocks' environment: this venv's python and ditserve first, curl failing on HTTP errors, the
    admin key in $KEY and $DITSERVE_API_KEY."""
    shims = tmp_path_factory.mktemp("shims")
    real_curl = shutil.which("curl")
    if real_curl:
        shim = shims / "curl"
        shim.write_text(f'#!/bin/sh\nexec {real_curl} --fail-with-body "$@"\n')
        shim.chmod(shim.stat().st_mode | stat.S_IEXEC)
    path = os.pathsep.join([str(shims), str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return {**os.environ, "PATH": path, "KEY": KEY, "DITSERVE_API_KEY": KEY}


# -- running a block --------------------------------------------------------------------------------------
def transcript(text: str) -> list[tuple[str, list[str]]]:
    """A console block → [(command, expected output lines)]; ``\\`` continues a command."""
    commands: list[tuple[str, list[str]]] = []
    continued = False
    for line in text.splitlines():
        if continued:
            commands[-1] = (commands[-1][0] + "\n" + line, commands[-1][1])
        elif line.startswith("$ "):
            commands.append((line[2:], []))
        elif line.strip() and not line.startswith("#"):
            assert commands, f"output before the first command: {line!r}"
            commands[-1][1].append(line)
        continued = (continued or line.startswith("$ ")) and line.rstrip().endswith("\\")
    return commands


def matches(expected: list[str], output: str) -> bool:
    """Each expected line (``...`` = any text) matches a line of ``output``, in order."""
    lines = iter(output.splitlines())
    for want in expected:
        pattern = re.compile(".*".join(re.escape(part) for part in want.strip().split("...")))
        if not any(pattern.fullmatch(line.strip()) for line in lines):
            return False
    return True


def run_console(text: str, cwd: Path, env: dict[str, str]) -> list[str]:
    """Run a transcript in one shell; the problems found (empty: it does what it shows)."""
    commands = transcript(text)
    script = []
    for i, (command, _) in enumerate(commands):
        script += ["{", command, f"}} > out{i} 2>&1", f"__rc=$?; echo $__rc > rc{i}; (exit $__rc)"]
    proc = subprocess.run(
        ["bash", "-c", "\n".join(script)], cwd=cwd, env=env, timeout=600, capture_output=True
    )
    problems = [proc.stderr.decode()] if proc.stderr else []
    for i, (command, expected) in enumerate(commands):
        output = (cwd / f"out{i}").read_text(errors="replace")
        rc = int((cwd / f"rc{i}").read_text())
        shows_status = i + 1 < len(commands) and commands[i + 1][0].strip() == "echo $?"
        if expected and not matches(expected, output):
            problems.append(
                f"$ {command}\nexpected:\n" + "\n".join(expected) + f"\ngot (exit {rc}):\n{output}"
            )
        elif not expected and rc != 0 and not shows_status:
            problems.append(f"$ {command}\nexited {rc}:\n{output}")
    return problems


def check_made(path: Path) -> None:
    assert path.is_file() and path.stat().st_size > 0, f"{path.name} was not written"
    data = path.read_bytes()
    if path.suffix == ".png":
        assert Image.open(path).size[0] > 0 and data[:4] == b"\x89PNG"
    elif path.suffix == ".mp4":
        assert data[4:8] == b"ftyp", f"{path.name} is not an MP4"
    elif path.suffix in (".yaml", ".yml"):
        docs = [d for d in yaml.safe_load_all(data) if d is not None]
        assert docs and all(isinstance(d, dict) for d in docs), f"{path.name} is not a YAML mapping"


@pytest.mark.parametrize(
    "block",
    [
        pytest.param(b, marks=[pytest.mark.xfail(reason=r[0])] if (r := b.option("xfail")) else [])
        for b in RUNNABLE
    ],
    ids=[b.id for b in RUNNABLE],
)
def test_documented_block_does_what_its_text_says(block, server, lora_root, workdir, env):
    for tool in block.option("needs") + (["curl"] if "curl " in block.text else []):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed here")
    text = substitute(block.text, substitutions(server, lora_root))
    made = [workdir / name for name in block.option("makes")]
    for path in made:
        path.unlink(missing_ok=True)
    if block.lang == "console":
        problems = run_console(text, workdir, env)
        assert not problems, f"{block.id}:\n" + "\n\n".join(problems)
        output = ""
    else:
        if block.lang in PYTHON:
            cmd = [sys.executable, "-c", text]
        else:
            cmd = ["bash", "-e", "-o", "pipefail", "-c", text]
        proc = subprocess.run(cmd, cwd=workdir, env=env, timeout=600, capture_output=True, text=True)
        output = proc.stdout + proc.stderr
        assert proc.returncode == 0, f"{block.id} exited {proc.returncode}:\n{text}\n{output}"
    for path in made:
        check_made(path)
    for needle in block.option("prints"):
        assert needle in output, f"{block.id} did not print {needle!r}:\n{output}"


def test_serve_prints_what_the_readme_says(server, lora_root):
    said = re.search(r"`ditserve serve` prints `([^`]+)`", (REPO_ROOT / "README.md").read_text())
    assert said, "the README's quickstart no longer says what `ditserve serve` prints"
    assert substitute(said.group(1), substitutions(server, lora_root)) in server.output()
