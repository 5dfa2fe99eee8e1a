"""ParallelDims: validation messages a user acts on, from_flags semantics, the 8-rank layout."""

from __future__ import annotations

import itertools
import re

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
    assert "--num-gpus 8 GPUs in the replica, but" in message and "--dp-size" not in message
    assert "--ulysses-degree 2" in message and "`--num-gpus 8 --ulysses-degree 8`" in message
    with pytest.raises(ValueError, match=r"--num-gpus 8 / --dp-size 2 = 4 GPUs per replica"):
        ParallelDims.from_flags(num_gpus=8, dp_size=2, ulysses=2)


def test_from_flags_dp_must_divide_num_gpus() -> None:
    with pytest.raises(
        ValueError, match=r"--num-gpus 6 is not divisible by --dp-size 4.*`--num-gpus 4 --dp-size 4`"
    ):
        ParallelDims.from_flags(num_gpus=6, dp_size=4)


SUGGESTION = re.compile(r"`(--[^`]+)`")
FLAG_TO_ARG = {
    "--num-gpus": "num_gpus",
    "--dp-size": "dp_size",
    "--cfg-parallel-size": "cfg",
    "--tp-size": "tp",
}
FLAG_TO_ARG.update(
    {"--ulysses-degree": "ulysses", "--ring-degree": "ring", "--kv-gather-degree": "kv_gather"}
)


def suggestions(message: str) -> list[dict[str, int]]:
    """The layouts a message suggests, as from_flags arguments (flags not named are 1)."""
    out = []
    for text in SUGGESTION.findall(message.split("Legal layouts:", 1)[-1]):
        words = text.split()
        out.append(
            {FLAG_TO_ARG[flag]: int(value) for flag, value in zip(words[::2], words[1::2], strict=True)}
        )
    return out


def test_the_readme_layout_mistake_suggests_layouts_that_run() -> None:
    """4 GPUs with Ulysses 3 on 8 heads: not --num-gpus 3 (3 does not divide 8), but layouts of 4 GPUs."""
    with pytest.raises(ValueError) as info:
        ParallelDims.from_flags(num_gpus=4, ulysses=3, num_heads=8)
    legal = suggestions(str(info.value))
    assert legal[0] == {"num_gpus": 4, "ulysses": 4}
    assert all(layout["num_gpus"] == 4 for layout in legal)


LAYOUTS = [
    dict(num_gpus=g, dp_size=dp, cfg=c, tp=t, ulysses=u, ring=r, kv_gather=k)
    for g, dp, c, t, u, (r, k) in itertools.product(
        (None, 3, 4, 6, 8), (1, 2), (1, 2), (1, 2, 3), (1, 3, 4), ((1, 1), (2, 1), (1, 2), (2, 2))
    )
]


# Z-Image-Turbo: 30 heads, a 10240-feature SwiGLU that --tp-size 3 and 6 cannot split
@pytest.mark.parametrize(
    ("num_heads", "features"), [(None, None), (8, None), (24, None), (30, {"its transformer's w1": 10240})]
)
def test_every_suggestion_fed_back_validates(num_heads: int | None, features: dict | None) -> None:
    refused = offered = 0
    for flags in LAYOUTS:
        try:
            ParallelDims.from_flags(**flags, num_heads=num_heads, tp_features=features)
        except ValueError as exc:
            refused += 1
            for layout in suggestions(str(exc)):
                offered += 1
                # raises if a suggestion is wrong
                ParallelDims.from_flags(**layout, num_heads=num_heads, tp_features=features)
    assert refused > 100 and offered > refused  # the sweep did hit illegal layouts, each with suggestions


@pytest.mark.parametrize(
    ("sp_degree", "expected"),
    [(1, (1, 1, 1)), (2, (1, 1, 2)), (4, (4, 1, 1)), (8, (8, 1, 1))],
)
def test_from_flags_sp_degree_alone(sp_degree: int, expected: tuple[int, int, int]) -> None:
    dims = ParallelDims.from_flags(sp_degree=sp_degree)
    assert (dims.ulysses, dims.ring, dims.kv_gather) == expected


def test_tp_size_must_split_the_features_too() -> None:
    """--tp-size 3 divides Z-Image-Turbo's 30 heads but not its 10240 MLP features: refused naming the module,
    with the sizes that fit both, and no TP size in the suggestions that would fail in turn."""
    features = {"its transformer's layers.0.feed_forward.w1": 10240}
    with pytest.raises(ValueError, match=r"^--tp-size 3 divides the model's 30 attention heads but not the 10240 "
                       r"features of its transformer's layers.0.feed_forward.w1.*divides both \(1, 2, 5, 10\)"):  # fmt: skip
        ParallelDims.from_flags(tp=3, num_heads=30, tp_features=features)
    with pytest.raises(
        ValueError, match=r"divides 30 and the features tensor parallelism splits \(1, 2, 5, 10"
    ) as info:
        ParallelDims.from_flags(num_gpus=6, tp=4, num_heads=30, tp_features=features)
    assert all(layout.get("tp", 1) in (1, 2, 5, 10) for layout in suggestions(str(info.value)))
    assert ParallelDims.from_flags(tp=5, num_heads=30, tp_features=features).tp == 5


def test_from_flags_sp_degree_refusal_names_sp_degree() -> None:
    """--sp-degree alone becomes another degree; a refusal names the flag typed, not only that degree."""
    with pytest.raises(ValueError, match=r"^--sp-degree 3 runs as --ulysses-degree 3: 8 heads"):
        ParallelDims.from_flags(sp_degree=3, num_heads=8)
    with pytest.raises(ValueError, match=r"^--sp-degree 2 runs as --kv-gather-degree 2: --num-gpus 4"):
        ParallelDims.from_flags(sp_degree=2, num_gpus=4)


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


def test_dims_does_not_import_the_mesh() -> None:
    """Imports point one way: mesh.py builds on dims.py, never the reverse (not even inside a function)."""
    import ast
    from pathlib import Path

    import ditserve.replica.parallel.dims as dims_module

    tree = ast.parse(Path(dims_module.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not {m for m in imported if m and "mesh" in m}, imported
