"""Shared test setup: a private model cache, no Ray token auth for private local clusters, each test file
leaving the environment as it found it."""

import os
import re
import tempfile
from pathlib import Path

import pytest

# Before anything imports ditserve: demo models are written to a per-run cache, not the user's.
os.environ.setdefault("DITSERVE_HOME", tempfile.mkdtemp(prefix="ditserve-test-"))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _no_cuda() -> bool:
    import torch

    return not torch.cuda.is_available()


# Triton kernels run in the interpreter on CPU-only machines. It must be on before any test module imports
# triton (the kernels' mode is fixed when they are decorated), so it is set here, in the first conftest.
if "TRITON_INTERPRET" not in os.environ and _no_cuda():
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(scope="module", autouse=True)
def _environment_per_file():
    """Each test file leaves the process environment as it found it. Libraries set variables for the rest of
    the process (``ray.init``: PYTHONBREAKPOINT, RAY_USAGE_STATS_ENABLED), and the engine's local ranks fork
    from the process's fork server only while the environment is the one it started with: after one such
    file, every later multi-rank engine of the same test process spawned fresh interpreters instead (seconds
    of imports per rank)."""
    saved = dict(os.environ)
    yield
    for key in set(os.environ) - set(saved) - {"PYTEST_CURRENT_TEST"}:
        del os.environ[key]
    for key, value in saved.items():
        if key != "PYTEST_CURRENT_TEST" and os.environ.get(key) != value:
            os.environ[key] = value


# -- the order files are handed to the xdist workers ------------------------------------------------------
# `--dist loadfile` gives each worker one file at a time, and the next one as soon as its current file has 2
# tests or fewer left to run. By default (`--loadscope-reorder`) xdist hands out the files with the most
# tests first, so the files of one or two tests came last, and most of those start a `ditserve serve` or a
# Ray cluster of their own (a minute or more each): fetched two at a time at the end, one worker still ran
# two of them while the other had nothing left. Here the files that start servers or clusters go first, then
# the family, multi-rank engine and other end-to-end files (CLI runs, training) and the other files known to
# take long, then the rest (most tests first, as xdist orders them): the run ends on short files.
_STARTS = re.compile(r"\b(?:ServeProcess|served|Cluster)\(")  # a server or a Ray cluster of the file's own
# Files that start no server yet take long, handed out with the family and engine files: ranked by their test
# count among the unit and kernel files, some came among the last files handed out (test_step_cache,
# test_demo_video_transformer, test_imports: 3 to 12 tests), and the run could end with one worker on one
# of them while the other had nothing left. Seconds: each file alone (-n 0) on the shared 2-core box; the
# run's "slowest test files" summary below tells the current figures. The unit and kernel files left after
# them take 20 s or less each.
_LONG = {
    "tests/unit/test_lora_engine.py": 145,  # 296 s on a busier box
    "tests/kernels/test_lora_gemm.py": 169,
    "tests/unit/test_step_cache.py": 124,
    "tests/unit/test_demo_video_transformer.py": 105,
    "tests/kernels/test_qk_norm_rope.py": 102,
    "tests/kernels/test_lora_kernels.py": 97,
    "tests/kernels/test_lora_linear.py": 89,
    "tests/unit/test_benchmark_smoke.py": 58,
    "tests/unit/test_imports.py": 44,
    "tests/unit/test_batching.py": 28,  # 57 s beside another worker
    "tests/unit/test_demo_video_vae.py": 26,
}
_ROOT = Path(__file__).resolve().parents[1]


def _file_rank(path, tests: int) -> tuple:
    """Sort key of a test file, heaviest first (see above)."""
    try:
        starts = len(_STARTS.findall(path.read_text()))
    except OSError:
        starts = 0
    try:
        long = path.resolve().relative_to(_ROOT).as_posix() in _LONG
    except ValueError:
        long = False
    group = 0 if starts else 1 if long or path.parent.name in ("families", "distributed", "e2e") else 2
    return (group, -starts, -tests)


def pytest_configure(config):
    if getattr(config.option, "dist", "no") == "loadfile":
        config.option.loadscopereorder = False  # keep the order of pytest_collection_modifyitems


def pytest_collection_modifyitems(config, items):
    if getattr(config.option, "dist", "no") != "loadfile":
        return
    tests: dict = {}
    for item in items:
        tests[item.path] = tests.get(item.path, 0) + 1
    rank = {path: _file_rank(path, n) for path, n in tests.items()}
    items.sort(key=lambda item: rank[item.path])  # stable: each file's tests keep their order


# -- where the time went ----------------------------------------------------------------------------------
# At the end of a run, the test files that took longest (setup, call and teardown of their tests, module
# fixtures such as servers and clusters included) and each xdist worker's busy time: with `--dist loadfile` a
# file runs whole on one worker, so these are what balancing the workers (or splitting a file) works from.
_FILE_SECONDS: dict[str, float] = {}
_WORKER_SECONDS: dict[str, float] = {}
_SLOWEST_FILES = 15


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::", 1)[0]
    _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + report.duration
    node = getattr(report, "node", None)  # xdist (in the controller): the worker that ran it
    worker = getattr(getattr(node, "gateway", None), "id", None)
    if worker is not None:
        _WORKER_SECONDS[worker] = _WORKER_SECONDS.get(worker, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    if len(_FILE_SECONDS) < 2:
        return
    terminalreporter.section(f"slowest {_SLOWEST_FILES} test files")
    for path, seconds in sorted(_FILE_SECONDS.items(), key=lambda item: -item[1])[:_SLOWEST_FILES]:
        terminalreporter.write_line(f"{seconds:8.1f}s {path}")
    if _WORKER_SECONDS:
        busy = ", ".join(f"{w} {s:.0f}s" for w, s in sorted(_WORKER_SECONDS.items()))
        terminalreporter.write_line(f"busy time per worker: {busy}")
