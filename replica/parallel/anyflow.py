"""AnyFlow-FAR's parallel plan: none yet. ``validate_layout`` refuses every layout of more than one rank for
this family (``families/anyflow.py``: ``single_rank``) before any process starts, so ``parallelize`` never
sees this model; the name exists because every family declares a plan."""

ANYFLOW_PLAN = None
