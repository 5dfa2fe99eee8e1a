"""Shared test setup: a private model cache, no Ray token auth for private local clusters, each test file
leaving the environment as it found it."""

import os
import tempfile

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
