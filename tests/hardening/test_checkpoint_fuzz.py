"""The checkpoint reader on damaged input: random truncations and byte flips of a shard's
safetensors header and of the index JSON end in a CheckpointError naming the file, or in a
checkpoint whose every tensor reads back; never in another exception."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prepkit.checkpoint import Checkpoint
from prepkit.constants import INDEX_NAME
from prepkit.errors import CheckpointError
from prepkit.recipes import load_recipe
from prepkit.synth import write_synthetic_checkpoint

RECIPE = load_recipe("gpt-oss-120b")
FUZZ = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,  # the same cases on every run: a failure here is never a fluke
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_synthetic_checkpoint(
        tmp_path_factory.mktemp("fuzz") / "m",
        num_layers=1,
        num_experts=2,
        hidden=64,
        intermediate=64,
        vocab_size=64,
        num_shards=2,
        seed=3,
    )


@contextmanager
def damaged(path: Path, mutate: Callable[[bytes], bytes]) -> Iterator[None]:
    """``path`` damaged for the block, then restored (hypothesis runs every example in one test)."""
    data = path.read_bytes()
    path.write_bytes(mutate(data))
    try:
        yield
    finally:
        path.write_bytes(data)


def _damage(data: bytes, region: int, cut: int | None, flips: list[tuple[int, int]]) -> bytes:
    """Flip bytes at positions within the first ``region`` bytes, or cut the file there."""
    if cut is not None:
        return data[: cut % region]
    out = bytearray(data)
    for pos, mask in flips:
        out[pos % region] ^= mask
    return bytes(out)


def _read_all_or_fail_cleanly(root: Path, culprit: str) -> None:
    try:
        ckpt = Checkpoint(root, RECIPE)
        ckpt.validate()
        with ckpt:
            for name in ckpt.weight_map:
                ckpt.read(name)
    except CheckpointError as err:
        assert culprit in str(err), str(err)


damage = {
    "cut": st.one_of(st.none(), st.integers(min_value=0, max_value=1 << 20)),
    "flips": st.lists(
        st.tuples(st.integers(min_value=0, max_value=1 << 20), st.integers(min_value=1, max_value=255)),
        min_size=1,
        max_size=3,
    ),
}


@FUZZ
@given(shard=st.integers(min_value=0, max_value=1), **damage)
def test_damaged_safetensors_header(model: Path, shard: int, cut: int | None, flips: list[tuple[int, int]]) -> None:
    path = sorted(model.glob("model-*.safetensors"))[shard]
    header_end = 8 + int.from_bytes(path.read_bytes()[:8], "little")
    # cuts reach a little into the tensor data, flips stay in the length prefix and the header
    region = header_end + 64 if cut is not None else header_end
    with damaged(path, lambda data: _damage(data, region, cut, flips)):
        _read_all_or_fail_cleanly(model, path.name)


@FUZZ
@given(**damage)
def test_damaged_index_json(model: Path, cut: int | None, flips: list[tuple[int, int]]) -> None:
    path = model / INDEX_NAME
    with damaged(path, lambda data: _damage(data, len(data), cut, flips)):
        _read_all_or_fail_cleanly(model, INDEX_NAME)


@pytest.mark.parametrize(
    "header",
    [
        [],
        {"t": 5},
        {"t": {"dtype": "U8", "shape": "4", "data_offsets": [0, 4]}},
        {"t": {"dtype": "U8", "shape": [4], "data_offsets": [4, 0]}},
        {"t": {"dtype": "U8", "shape": [4], "data_offsets": [0, 3]}},
        {"t": {"dtype": "U8", "shape": [-4], "data_offsets": [0, 4]}},
        {"t": {"dtype": 8, "shape": [4], "data_offsets": [0, 4]}},
    ],
)
def test_malformed_header_entries_are_named(model: Path, header: object) -> None:
    """Headers that are valid JSON but not safetensors headers (unlikely to come out of random flips)."""
    path = sorted(model.glob("model-*.safetensors"))[0]
    raw = json.dumps(header).encode()
    with (
        damaged(path, lambda data: len(raw).to_bytes(8, "little") + raw + b"\0" * 8),
        pytest.raises(CheckpointError, match=f"{path.name}: malformed safetensors header"),
    ):
        Checkpoint(model, RECIPE).validate()
