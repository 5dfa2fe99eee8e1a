"""Shared test setup: a private model cache, no Ray token auth for private local clusters."""

import os
import tempfile

# Before anything imports ditserve: demo models are written to a per-run cache, not the user's.
os.environ.setdefault("DITSERVE_HOME", tempfile.mkdtemp(prefix="ditserve-test-"))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
