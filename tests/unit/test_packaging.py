"""The repository's top-level folders never shadow an installed distribution, whatever ``sys.path`` holds.

``python -m pytest`` from the root and Ray's workers (which get the driver's working directory on their
path) both put the repository root first on ``sys.path``. ``cluster/``, ``replica/`` and ``kernels/`` are
namespace portions mapped to ``ditserve.*``; a regular package anywhere on the path wins over them, so
Hugging Face's ``kernels`` (which transformers requires) is what ``import kernels`` finds.
"""

from __future__ import annotations

import importlib.metadata
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.helpers import REPO_ROOT

CODE_ROOTS = ("cluster", "replica", "kernels")
# The repository's own folders (a virtual environment inside the checkout, `.venv`, is not one of them).
TOP_LEVEL = {p.name for p in REPO_ROOT.iterdir() if p.is_dir() and p.name.isidentifier()}


def in_repo_folders(origin: str | None) -> bool:
    """Whether a module file lies in one of the repository's top-level folders."""
    if origin is None:
        return False
    path = Path(origin).resolve()
    return path.is_relative_to(REPO_ROOT) and path.relative_to(REPO_ROOT).parts[0] in TOP_LEVEL


def run_with_root_first(code: str, cwd: Path = REPO_ROOT) -> str:
    """Run ``code`` in a fresh interpreter whose ``sys.path`` starts with the repository root."""
    prelude = f"import sys; sys.path.insert(0, {str(REPO_ROOT)!r})\n"
    done = subprocess.run(
        [sys.executable, "-c", prelude + code], cwd=cwd, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


def test_root_first_on_path_imports_the_installed_kernels_diffusers_transformers():
    out = run_with_root_first(
        "import json, kernels, diffusers, transformers\n"
        "from transformers import AutoModel\n"  # transformers' own lazy import reaches into `kernels`
        "import diffusers.pipelines\n"
        "print(json.dumps({'kernels': kernels.__file__, 'version': kernels.__version__}))\n"
    )
    found = json.loads(out.strip().splitlines()[-1])
    assert not in_repo_folders(found["kernels"]), found
    assert found["version"] == importlib.metadata.version("kernels")


def test_no_top_level_folder_shadows_an_installed_distribution():
    installed = set(importlib.metadata.packages_distributions())
    # tests/ is the test suite's own package (no distribution worth running the suite against is named so).
    clashes = sorted((TOP_LEVEL & installed) - {"tests"})
    for root in CODE_ROOTS:
        assert not (REPO_ROOT / root / "__init__.py").exists(), f"{root}/__init__.py makes {root} shadowing"
    out = run_with_root_first(
        "import importlib.util, json\n"
        f"print(json.dumps({{n: importlib.util.find_spec(n).origin for n in {clashes!r}}}))\n"
    )
    origins = json.loads(out.strip().splitlines()[-1])
    shadowed = {n: o for n, o in origins.items() if o is None or in_repo_folders(o)}
    assert not shadowed, f"the repository's folders win over installed distributions: {shadowed}"


def test_ditserve_imports_from_the_root_and_from_elsewhere(tmp_path):
    code = (
        "import ditserve.cluster.app, ditserve.replica.engine, ditserve.kernels.lora, kernels\n"
        "print(ditserve.kernels.lora.__file__)\n"
    )
    for cwd in (REPO_ROOT, tmp_path):
        assert run_with_root_first(code, cwd=cwd).strip().endswith("kernels/lora.py")


def repo_modules() -> set[str]:
    names = set()
    for root in CODE_ROOTS:
        for path in (REPO_ROOT / root).rglob("*.py"):
            rel = path.relative_to(REPO_ROOT).with_suffix("")
            parts = ("ditserve", *rel.parts)
            names.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    # Built from a copy of the checkout's files (tracked and not ignored): setuptools writes build/ next
    # to the sources, and the checkout stays as it was.
    source, out = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("wheel")
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO_ROOT, capture_output=True, text=True
    ).stdout.split()
    for name in files:
        if (REPO_ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO_ROOT / name, source / name)
    command = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "-q",
        "-w",
        str(out),
    ]
    done = subprocess.run([*command, "."], cwd=source, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    (built,) = out.glob("ditserve-*.whl")
    return built


def test_wheel_holds_every_module_and_the_demo_model(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    in_wheel = {
        n[: -len(".py")].replace("/", ".").removesuffix(".__init__") for n in names if n.endswith(".py")
    }
    assert repo_modules() <= in_wheel, sorted(repo_modules() - in_wheel)
    assert "ditserve/replica/models/demo_scenes/transformer/diffusion_pytorch_model.safetensors" in names
    # the trained video model (ditserve train-demo-video), the default video model
    video = "ditserve/replica/models/demo_scenes_video"
    assert {f"{video}/{c}/diffusion_pytorch_model.safetensors" for c in ("transformer", "vae")} <= set(names)
    assert f"{video}/model_index.json" in names
    assert "ditserve/cluster/grpc_gen/ditserve_pb2.py" in names
    # the playground served at GET / works from an installed wheel
    assert {f"ditserve/cluster/static/{f}" for f in ("index.html", "app.js", "style.css")} <= set(names)
    # No bare top-level package besides ditserve.
    assert {n.split("/")[0] for n in names if not n.startswith("ditserve-")} == {"ditserve"}


def test_installed_wheel_serves_imports_with_the_root_on_path(wheel, tmp_path):
    target = tmp_path / "site"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    # The wheel's copy first, then the repository root: the installed modules load, `kernels` stays HF's.
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            f"import sys; sys.path[:0] = [{str(target)!r}, {str(REPO_ROOT)!r}]\n"
            "import ditserve.cluster.app, ditserve.replica.models.registry as r, kernels\n"
            "print(ditserve.cluster.app.__file__, kernels.__file__, r.__file__)\n",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    app, hf_kernels, registry = out.stdout.split()
    assert app.startswith(str(target)) and registry.startswith(str(target))
    assert not in_repo_folders(hf_kernels)
