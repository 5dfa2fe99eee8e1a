"""Rank launchers for served replicas: Ray actors inside the replica's placement group.

A Serve replica of the engine deployment owns a placement group with one bundle per rank (see
``app.engine_deployment_options``); the replica actor itself sits in bundle 0. ``RayRankLauncher``
starts one :class:`RankActor` per bundle, so rank 0 shares the replica's node and the replica can pick
the rendezvous (its own node IP and a free port) before any rank exists. The rank actors are owned by the
replica actor: when Serve (or ``ray.kill``) ends the replica, its ranks end with it.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import ray
from ray.exceptions import ActorDiedError, RayActorError
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ditserve.replica.config import EngineConfig
from ditserve.replica.launcher import InProcessLauncher, RankDied, RankError, RankLauncher, free_port

logger = logging.getLogger("ditserve")


def node_info() -> dict[str, Any]:
    """Where the calling Ray worker runs."""
    ctx = ray.get_runtime_context()
    return {
        "node_id": ctx.get_node_id(),
        "node_ip": ray.util.get_node_ip_address(),
        "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
    }


class RankActor:
    """One SPMD rank as a Ray actor (made remote in :meth:`RayRankLauncher.start`)."""

    def __init__(self, config: EngineConfig, rank: int, world_size: int, init_method: str):
        from ditserve.replica.rank_control import ServingRankWorker

        self.rank = rank
        # Ray sets CUDA_VISIBLE_DEVICES to this actor's one GPU: it is always device 0 here.
        device_index = 0 if config.device == "cuda" else None
        self.worker = ServingRankWorker(
            config, rank=rank, world_size=world_size, init_method=init_method, device_index=device_index
        )

    def where(self) -> dict[str, Any]:
        return {"rank": self.rank, "pid": os.getpid(), **node_info()}

    def ping(self) -> int:
        """Liveness: answered from a second thread of the actor, also while ``call`` runs a step."""
        return self.rank

    def call(self, method: str, *args: Any) -> Any:
        result = getattr(self.worker, method)(*args)
        return result if self.rank == 0 else None


class RayRankLauncher(RankLauncher):
    """``world_size`` rank actors, actor i in bundle i of the current placement group."""

    def __init__(self, world_size: int, num_cpus: float, num_gpus: int, start_timeout_s: float = 600.0):
        self.world_size = world_size
        self.num_cpus = num_cpus
        self.num_gpus = num_gpus
        self.start_timeout_s = start_timeout_s
        self.actors: list[Any] = []
        self.ranks: list[dict[str, Any]] = []
        self.dead: list[int] = []

    def start(self, config: EngineConfig) -> None:
        pg = get_current_placement_group()
        if pg is None:
            raise RuntimeError("RayRankLauncher must run inside a placement group (the Serve replica's)")
        # Rank 0 shares bundle 0 with this replica actor, so this node's IP is rank 0's.
        ip = ray.util.get_node_ip_address()
        backend = "nccl" if config.device == "cuda" else "gloo"
        init_method = f"tcp://{ip}:{free_port('0.0.0.0')}"
        logger.info("starting %d %s ranks, rendezvous %s", self.world_size, backend, init_method)
        remote_cls = ray.remote(RankActor)
        self.actors = [
            remote_cls.options(
                # Two threads: ``ping`` answers while ``call`` holds the other in a step or a collective.
                max_concurrency=2,
                num_cpus=self.num_cpus,
                num_gpus=self.num_gpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=rank
                ),
            ).remote(config, rank, self.world_size, init_method)
            for rank in range(self.world_size)
        ]
        # The constructors rendezvous with each other; wait for all of them together.
        try:
            self.ranks = ray.get([a.where.remote() for a in self.actors], timeout=self.start_timeout_s)
        except Exception as exc:
            self.shutdown()
            raise RankError(f"rank start failed: {exc}") from exc

    def call(self, method: str, *args: Any) -> Any:
        if self.dead:
            raise RankDied(f"ranks {self.dead} are gone; this replica cannot run {method}")
        refs = [a.call.remote(method, *args) for a in self.actors]
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        pending, errors = list(refs), []
        # Answers as they come: a dead rank fails the call at once, not after its peers' collective
        # timeout (they may be waiting for it inside one).
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(ready[0])
            except RayActorError as exc:  # the actor, not the method: its process is gone
                self.dead.append(rank_of[ready[0]])
                raise RankDied(f"rank {rank_of[ready[0]]} is gone during {method}: {exc}") from None
            except Exception as exc:
                errors.append(f"rank {rank_of[ready[0]]}: {exc}")
        if errors:
            raise RankError("\n".join(errors))
        return ray.get(refs[0])

    def dead_ranks(self, timeout_s: float = 5.0) -> list[int]:
        """Ranks whose actor is gone (a ping answers from a second actor thread even during a step)."""
        refs = [a.ping.remote() for a in self.actors]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        for rank, ref in enumerate(refs):
            if ref in ready and rank not in self.dead:
                try:
                    ray.get(ref)
                except ActorDiedError:
                    self.dead.append(rank)
        return list(self.dead)

    def shutdown(self) -> None:
        for actor in self.actors:
            try:
                ray.get(actor.call.remote("shutdown"), timeout=30)
            except Exception:
                pass
            ray.kill(actor)
        self.actors = []


class InProcessRankLauncher(InProcessLauncher):
    """World size 1: the rank lives in the replica process (no placement-group actors, no pickling)."""

    def start(self, config: EngineConfig) -> None:
        from ditserve.replica.rank_control import ServingRankWorker

        self.worker = ServingRankWorker(config)
        self.ranks = [{"rank": 0, "pid": os.getpid(), **node_info()}]


def build_launcher(config: EngineConfig, replica_num_cpus: float) -> RankLauncher:
    world = config.parallel.world_size
    if world == 1:
        return InProcessRankLauncher()
    if config.device == "cuda":
        return RayRankLauncher(world, num_cpus=0, num_gpus=1)
    # On CPU the replica actor and rank actor share bundle 0: each takes half of every bundle.
    return RayRankLauncher(world, num_cpus=replica_num_cpus / 2, num_gpus=0)
