"""Cluster layout math without Ray: placement bundles, strategy, the too-small-cluster error, session ids."""

import pytest

from ditserve.cluster.app import cluster_fit, engine_deployment_options, rank_bundles
from ditserve.cluster.config import AppArgs
from ditserve.cluster.router import session_owner


def test_bundles_one_per_rank_of_one_replica():
    args = AppArgs(model="demo-flux", device="cpu", dp_size=2, num_gpus=4, ulysses_degree=2)
    assert rank_bundles(args) == [{"CPU": 0.1}, {"CPU": 0.1}]
    options = engine_deployment_options(args, "STRICT_PACK")
    assert options["num_replicas"] == 2 and options["placement_group_strategy"] == "STRICT_PACK"
    assert options["ray_actor_options"]["num_cpus"] == pytest.approx(0.05)  # shares bundle 0 with rank 0
    gpu = AppArgs(model="demo-flux", device="cuda", dp_size=1, num_gpus=2, ulysses_degree=2)
    assert rank_bundles(gpu) == [{"GPU": 1, "CPU": 1}, {"GPU": 1}]


def test_strategy_and_clear_error_when_the_cluster_is_too_small():
    args = AppArgs(model="demo-flux", device="cuda", dp_size=2, num_gpus=8, tp_size=4)
    eight = {"CPU": 64, "GPU": 8}
    four = {"CPU": 64, "GPU": 4}
    assert cluster_fit(args, [eight]) == ("STRICT_PACK", None)
    assert cluster_fit(args, [four, four]) == ("STRICT_PACK", None)
    strategy, error = cluster_fit(args, [{"CPU": 64, "GPU": 2}] * 4)
    assert strategy == "PACK" and error is None  # a replica spans nodes
    _, error = cluster_fit(args, [four])
    assert "need 8 GPUs" in error and "has 4" in error


def test_session_id_names_its_owner():
    assert session_owner("abc123.f00d") == "abc123"
    with pytest.raises(ValueError, match="replica_id"):
        session_owner("no-dot")
