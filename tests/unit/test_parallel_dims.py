"""ParallelDims: validation messages a user acts on, from_flags semantics, the 8-rank layout."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from ditserve.replica.parallel import ParallelDims


def test_world_size_is_the_product() -> None:
    assert ParallelDims(cfg=2, tp=2, ulysses=2, ring=1, kv_gather=1).world_size == 8
    assert ParallelDims().world_size == 1


def test_ring_and_kv_gather_are_one_slot() -> None:
    with pytest.raises(ValidationError, match=r"--ring-degree 2 and --kv-gather-degree 2 are alternatives"):
        ParallelDims(ring=2, kv_gather=2)


def test_dims_are_frozen_and_strict() -> None:
    dims = ParallelDims(ulysses=2)
    with pytest.raises(ValidationError):
        dims.ulysses = 4  # type: ignore[misc]
    with pytest.raises(ValidationError):
        ParallelDims(dp=2)  # type: ignore[call-arg]


def test_heads_must_split_over_tp() -> None:
    with pytest.raises(
        ValueError, match=r"--tp-size 3 does not divide the model's 8 attention heads.*1, 2, 4, 8"
    ):
        ParallelDims(tp=3).validate(num_heads=8)


def test_heads_per_tp_rank_must_split_over_ulysses() -> None:
    ParallelDims(tp=2, ulysses=4).validate(num_heads=56)  # 28 heads per TP rank, 7 per Ulysses rank
    with pytest.raises(ValueError) as info:
        ParallelDims(tp=4, ulysses=4).validate(num_heads=56)
    message = str(info.value)
    assert "56 heads / --tp-size 4 = 14 heads per TP rank" in message
    assert "--ulysses-degree 4" in message and "(1, 2, 7, 14)" in message and "--ring-degree" in message


def test_ring_needs_lse_backend() -> None:
    ParallelDims(ring=2).validate(num_heads=8, attention_supports_lse=True)
    ParallelDims(kv_gather=2).validate(num_heads=8, attention_supports_lse=False)
    with pytest.raises(ValueError, match=r"--ring-degree 2 needs an attention backend.*--kv-gather-degree 2"):
        ParallelDims(ring=2).validate(num_heads=8, attention_supports_lse=False)


def test_from_flags_without_num_gpus_uses_the_product() -> None:
    dims = ParallelDims.from_flags(dp_size=3, cfg=2, tp=2, ulysses=2)
    assert (dims.cfg, dims.tp, dims.ulysses, dims.ring, dims.kv_gather) == (2, 2, 2, 1, 1)


def test_from_flags_num_gpus_counts_every_replica() -> None:
    dims = ParallelDims.from_flags(num_gpus=16, dp_size=2, cfg=2, ulysses=2, ring=2)
    assert dims.world_size == 8
    with pytest.raises(ValueError) as info:
        ParallelDims.from_flags(num_gpus=8, dp_size=1, ulysses=2)
    message = str(info.value)
    assert "--num-gpus 8 / --dp-size 1 = 8 GPUs per replica" in message
    assert "--ulysses-degree 2" in message and "pass --num-gpus 2" in message


def test_from_flags_dp_must_divide_num_gpus() -> None:
    with pytest.raises(ValueError, match=r"--num-gpus 6 is not divisible by --dp-size 4.*e\.g\. 4\)"):
        ParallelDims.from_flags(num_gpus=6, dp_size=4)


@pytest.mark.parametrize(
    ("sp_degree", "expected"),
    [(1, (1, 1, 1)), (2, (1, 1, 2)), (4, (4, 1, 1)), (8, (8, 1, 1))],
)
def test_from_flags_sp_degree_alone(sp_degree: int, expected: tuple[int, int, int]) -> None:
    dims = ParallelDims.from_flags(sp_degree=sp_degree)
    assert (dims.ulysses, dims.ring, dims.kv_gather) == expected


def test_from_flags_sp_degree_conflicts_with_explicit_degrees() -> None:
    with pytest.raises(ValueError, match=r"--sp-degree 4 cannot be combined with --ulysses-degree"):
        ParallelDims.from_flags(sp_degree=4, ring=2)


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"tp": 0}, "--tp-size"),
        ({"dp_size": 0}, "--dp-size"),
        ({"ring": -1}, "--ring-degree"),
        ({"num_gpus": 0}, "--num-gpus"),
        ({"sp_degree": 0}, "--sp-degree"),
        ({"cfg": 3}, "--cfg-parallel-size"),
    ],
)
def test_from_flags_names_the_bad_flag(kwargs: dict, flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        ParallelDims.from_flags(**kwargs)


def test_eight_rank_layout_cfg_ring_ulysses() -> None:
    """cfg outermost, ring strided, ulysses contiguous (mesh.py's docstring example)."""
    dims = ParallelDims(cfg=2, ring=2, ulysses=2)
    assert dims.groups("cfg") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert dims.groups("ring") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert dims.groups("ulysses") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dims.groups("sp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert dims.groups("tp") == [[r] for r in range(8)]


def test_eight_rank_layout_tp_innermost() -> None:
    dims = ParallelDims(tp=2, ulysses=2, kv_gather=2)
    assert dims.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dims.groups("ulysses") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert dims.groups("kv_gather") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert dims.groups("sp") == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_legal_layouts_respect_heads() -> None:
    from ditserve.replica.parallel.testing import legal_layouts

    layouts = list(legal_layouts(8, num_heads=8))
    assert ParallelDims(cfg=2, tp=2, ulysses=2) in layouts
    assert all(d.world_size <= 8 and not (d.ring > 1 and d.kv_gather > 1) for d in layouts)
    assert not any(d.ulysses == 3 or d.tp == 3 for d in layouts)
    assert ParallelDims(ring=3) in layouts  # the ring does not split heads
