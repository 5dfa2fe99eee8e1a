"""Shared test setup: a private model cache, no Ray token auth for private local clusters."""

import os
import tempfile

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
