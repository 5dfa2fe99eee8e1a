"""Per-family tests and the tiny random model folders they build offline (one builder module per family)."""
