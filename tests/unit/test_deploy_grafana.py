"""The Grafana dashboard has a panel for every metric the replicas export, with valid queries' shape."""

import json
import re
from pathlib import Path

from ditserve.cluster.metrics import EXPORTED

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "ditserve.json"


def test_every_metric_has_a_panel():
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"ray_ditserve_\w+", e)}
    used = {re.sub(r"_bucket$", "", m) for m in used}
    assert set(EXPORTED) <= used, set(EXPORTED) - used
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    for e in exprs:  # brackets balance and every selector is filtered by the application variable
        assert e.count("(") == e.count(")") and e.count("{") == e.count("}"), e
        assert '{application=~"$application"}' in e, e
