"""The desired control state of all engine replicas, kept in one named, detached Ray actor.

Control operations (weights, LoRA, memory) change the desired state here first and then ask every replica
to converge to it; a replica converges at start (in its constructor, before Serve sends it traffic) and
whenever it sees a newer version. So a replica that Serve restarts after a crash comes back with the same
weights, adapters and memory state as its peers.

State shape (plain JSON, versioned; every change increments ``version``)::

    {"version": 3,
     "weights": {"version": 1, "path": "/ckpt/flux-v2", "tag": "3f2a"},  # version 0: the served model
     "memory": "resident",                                      # or "released"
     "loras": {"ink": {"source": "/loras/ink.safetensors", "scale": 0.8}},
     "shutdown": false}                                         # true after POST /v1/admin/shutdown
"""

from __future__ import annotations

import copy
from typing import Any

import ray

from ditserve.replica.lora.loader import parse_lora_spec

NAMESPACE = "ditserve"


def initial_state(loras: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    return {
        # Adapters given at start (--lora-path) are a change replicas must apply: version 1, not 0.
        "version": 1 if loras else 0,
        "weights": {"version": 0, "path": None, "tag": None},
        "memory": "resident",
        "loras": dict(loras or {}),
        "shutdown": False,
    }


class ControlState:
    """Ray actor body: the versioned desired state. Pure Python, one method per change."""

    def __init__(self, state: dict[str, Any]):
        self.state = copy.deepcopy(state)
        self.started = False  # a replica of this deploy loaded the adapters given at start (not state)

    def confirm_start(self) -> None:
        self.started = True

    def start_confirmed(self) -> bool:
        return self.started

    def get(self) -> dict[str, Any]:
        return self.state

    def _bump(self) -> dict[str, Any]:
        self.state["version"] += 1
        return self.state

    def set_weights(self, path: str, tag: str) -> dict[str, Any]:
        """``tag`` names what the replicas staged for this update (they commit it instead of reloading)."""
        version = self.state["weights"]["version"] + 1
        self.state["weights"] = {"version": version, "path": path, "tag": tag}
        return self._bump()

    def set_memory(self, memory: str) -> dict[str, Any]:
        assert memory in ("resident", "released"), memory
        self.state["memory"] = memory
        return self._bump()

    def set_shutdown(self) -> dict[str, Any]:
        """Shut down for good: a replica Serve starts later comes up shut down too."""
        self.state["shutdown"] = True
        return self._bump()

    def set_lora(self, name: str, source: str, scale: float, target: str | None = None) -> dict[str, Any]:
        self.state["loras"][name] = lora_spec(source, scale, target)
        return self._bump()

    def remove_lora(self, name: str) -> dict[str, Any]:
        self.state["loras"].pop(name, None)
        return self._bump()


def lora_spec(source: str, scale: float, target: str | None = None) -> dict[str, Any]:
    """An adapter of the state: its file, default scale and, where given, the expert it loads into
    (``transformer_2``: Wan 2.2 A14B's second expert)."""
    return {"source": source, "scale": scale} | ({"target": target} if target else {})


def parse_lora_paths(items: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """``NAME[@TARGET]=PATH[:SCALE]`` flags → the state's ``loras`` mapping."""
    loras = {}
    for item in items:
        name, path, scale, target = parse_lora_spec(item, flag="lora_path:", with_target=True)
        loras[name] = lora_spec(path, scale, target)
    return loras


def state_actor_name(app_name: str, deploy_id: str) -> str:
    return f"{app_name}-control-state-{deploy_id}"


def get_or_create_state_actor(app_name: str, deploy_id: str, initial: dict[str, Any]):
    """The desired state of one deploy of the app; the first caller creates it (detached: it outlives any
    replica, so replicas Serve restarts within this deploy converge to it).

    ``deploy_id`` is minted by the builder each time Serve builds the application (a first deploy, or a
    redeploy whose arguments changed; a replica restart reuses the bound arguments): a new deploy starts
    from its own config, never from an old ``shutdown`` or stale adapters."""
    return (
        ray.remote(ControlState)
        .options(
            name=state_actor_name(app_name, deploy_id),
            namespace=NAMESPACE,
            lifetime="detached",
            get_if_exists=True,
            num_cpus=0,
            max_restarts=0,
            # Replicas create it from inside their placement group, which captures child actors by
            # default: without this the state would die with the first replica that Serve replaces.
            scheduling_strategy="DEFAULT",
        )
        .remote(initial)
    )


def delete_state_actors(app_name: str, keep: str | None = None) -> None:
    """Forget the desired state of the app's deploys, but ``keep``'s (``ditserve serve`` deletes all when it
    stops the app; a new deploy's frontend deletes its predecessors')."""
    prefix = state_actor_name(app_name, "")
    for actor in ray.util.list_named_actors(all_namespaces=True):
        name = actor["name"]
        if actor["namespace"] != NAMESPACE or not name.startswith(prefix) or name == keep:
            continue
        try:
            ray.kill(ray.get_actor(name, namespace=NAMESPACE))
        except ValueError:
            pass  # gone meanwhile
