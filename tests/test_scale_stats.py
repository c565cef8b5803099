"""E8M0 scale-byte statistics (prepkit.scale_stats, benchmarks/scale_bytes.py): only the header and
the ``*_scales`` byte ranges are read, locally and from a hub by range requests, and the figures
are numpy's on the whole tensors."""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from safetensors import safe_open

from benchmarks import scale_bytes
from prepkit import scale_stats as ss
from prepkit.errors import CheckpointError, FetchError
from prepkit.synth import SCALE_HIGH, SCALE_LOW, write_synthetic_checkpoint
from tests.fetch import olah_server
from tests.fetch.range_proxy import range_proxy

DOWN = "model.layers.3.mlp.experts.down_proj_scales"
GATE_UP = "model.layers.3.mlp.experts.gate_up_proj_scales"


@pytest.fixture(autouse=True)
def _own_hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No test reads or fills the user's Hugging Face cache."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))


class CountingReader:
    """A reader that records every byte range asked of the one it wraps."""

    def __init__(self, inner: ss.RangeReader) -> None:
        self.inner, self.name, self.size = inner, inner.name, inner.size
        self.ranges: list[tuple[int, int]] = []

    def read(self, offset: int, length: int) -> bytes:
        self.ranges.append((offset, offset + length))
        return self.inner.read(offset, length)

    @property
    def bytes_read(self) -> int:
        return sum(end - start for start, end in self.ranges)


def write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int], bytes]], header_pad: int = 0) -> Path:
    """A safetensors file written by hand: name -> (dtype, shape, raw bytes), in the order given."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    raw = json.dumps(header).encode() + b" " * header_pad
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(d for _, _, d in tensors.values()))
    return path


def scale_ranges(path: Path) -> tuple[int, list[tuple[int, int]]]:
    """The header length and the absolute byte ranges of a file's ``*_scales`` tensors."""
    (header_len,) = struct.unpack("<Q", path.read_bytes()[:8])
    header = json.loads(path.read_bytes()[8 : 8 + header_len])
    spans = [header[n]["data_offsets"] for n in header if n.endswith("_scales")]
    return header_len, sorted((8 + header_len + lo, 8 + header_len + hi) for lo, hi in spans)


def assert_reads_only_scales(reader: CountingReader, path: Path) -> None:
    header_len, spans = scale_ranges(path)
    assert reader.ranges[:2] == [(0, 8), (8, 8 + header_len)]
    for start, end in reader.ranges[2:]:
        assert any(lo <= start < end <= hi for lo, hi in spans), f"read {start}..{end} outside every scales tensor"
    assert reader.bytes_read == 8 + header_len + sum(hi - lo for lo, hi in spans)


def assert_matches_numpy(stats: list[ss.ScaleStats], path: Path) -> None:
    with safe_open(str(path), framework="np") as f:  # the whole tensors, read by safetensors itself
        names = f.keys()
        arrays = {n: f.get_tensor(n) for n in names if n.endswith("_scales")}
    assert sorted(s.tensor for s in stats) == sorted(arrays)
    for s in stats:
        full = arrays[s.tensor]
        assert s.shape == full.shape
        assert s.histogram == tuple(np.bincount(full.ravel(), minlength=256))
        assert (s.min, s.max, s.count) == (full.min(), full.max(), full.size)
        assert s.small == bool(full.max() <= 128)
        assert s.above == int((full > 128).sum())


@pytest.fixture()
def tiny(tmp_path: Path) -> Path:
    """Scales between other tensors; the down scales hold bytes above 128, the gate_up ones do not."""
    rng = np.random.default_rng(0)
    down = np.array([[0, 127, 128], [129, 200, 255]], dtype=np.uint8)
    gate_up = rng.integers(100, 129, size=(2, 5), dtype=np.uint8)
    return write_safetensors(
        tmp_path / "tiny.safetensors",
        {
            "model.embed_tokens.weight": ("BF16", [4, 3], rng.bytes(24)),
            "model.layers.3.mlp.experts.down_proj_blocks": ("U8", [2, 3, 16], rng.bytes(96)),
            DOWN: ("U8", [2, 3], down.tobytes()),
            "model.layers.3.mlp.experts.gate_up_proj_bias": ("BF16", [2, 10], rng.bytes(40)),
            GATE_UP: ("U8", [2, 5], gate_up.tobytes()),
            "model.norm.weight": ("BF16", [3], rng.bytes(6)),
        },
        header_pad=5,
    )


@pytest.fixture(scope="module")
def synth(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # 3 shards: the embedding and head (vocab 1024) fill the first, a layer straddles the other two.
    root = tmp_path_factory.mktemp("synth") / "ckpt"
    return write_synthetic_checkpoint(root, hidden=64, intermediate=64, num_shards=3, vocab_size=1024)


@pytest.mark.parametrize("chunk_bytes", [ss.CHUNK_BYTES, 4])
def test_hand_written_file_reads_only_header_and_scales(tiny: Path, chunk_bytes: int) -> None:
    reader = CountingReader(ss.LocalFile(tiny))
    stats = ss.scale_stats(reader, chunk_bytes=chunk_bytes)
    assert_reads_only_scales(reader, tiny)
    assert_matches_numpy(stats, tiny)
    by_name = {s.tensor: s for s in stats}
    assert (by_name[DOWN].gemm, by_name[DOWN].layer, by_name[DOWN].small) == ("gemm2", 3, False)
    assert (by_name[GATE_UP].gemm, by_name[GATE_UP].small) == ("gemm1", True)
    assert not ss.folded_everywhere(stats)
    assert ss.folded_everywhere([by_name[GATE_UP]])


def test_synthetic_shards_match_numpy_and_sit_where_synth_puts_them(synth: Path) -> None:
    shards = ss.local_shards(synth)
    assert len(shards.shards) == 3
    every: list[ss.ScaleStats] = []
    for name in shards.pick(every=True):
        reader = CountingReader(shards.open(name))
        stats = ss.scale_stats(reader)
        assert_reads_only_scales(reader, synth / name)
        assert_matches_numpy(stats, synth / name)
        every += stats
    assert {s.gemm for s in every} == {"gemm1", "gemm2"} and {s.layer for s in every} == {0, 1}
    assert all(SCALE_LOW <= (s.min or 0) <= (s.max or 0) <= SCALE_HIGH for s in every)
    assert ss.folded_everywhere(every)


def test_the_default_shard_is_the_first_with_expert_scales(synth: Path) -> None:
    shards = ss.local_shards(synth)
    first = shards.default_shard()
    index = json.loads((synth / "model.safetensors.index.json").read_text())["weight_map"]
    assert first == min(f for n, f in index.items() if n.endswith("proj_scales"))
    assert first != shards.shards[0]  # the first shard holds the embedding only, here
    assert shards.pick() == [first]
    assert shards.pick([shards.shards[2]]) == [shards.shards[2]]
    with pytest.raises(CheckpointError, match="has no shard nope.safetensors"):
        shards.pick(["nope.safetensors"])


def test_a_single_file_is_its_own_shard_set(tiny: Path) -> None:
    shards = ss.local_shards(tiny)
    assert shards.shards == (tiny.name,) and shards.pick() == [tiny.name]


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda raw: raw[:5], "too short to be safetensors"),
        (lambda raw: struct.pack("<Q", 10**6) + raw[8:], "header length 1000000 does not fit"),
        (lambda raw: raw[:8] + b"\xff" + raw[9:], "header is not valid JSON"),
        (lambda raw: raw[:-3], "truncated: holds"),
    ],
    ids=["short", "header-length", "json", "truncated-data"],
)
def test_a_damaged_file_names_itself(tiny: Path, damage: Any, message: str) -> None:
    bad = tiny.with_name("damaged.safetensors")
    bad.write_bytes(damage(tiny.read_bytes()))
    with pytest.raises(CheckpointError, match=message) as err:
        ss.scale_stats(ss.LocalFile(bad))
    assert str(err.value).startswith("damaged.safetensors: ")


def test_a_malformed_entry_and_a_scales_tensor_not_u8_are_named(tmp_path: Path) -> None:
    path = write_safetensors(tmp_path / "f.safetensors", {DOWN: ("BF16", [2], b"\0" * 4)})
    with pytest.raises(CheckpointError, match=f"f.safetensors: {DOWN} has dtype BF16"):
        ss.scale_stats(ss.LocalFile(path))
    raw = json.dumps({DOWN: {"dtype": "U8", "shape": [4], "data_offsets": [0, 2]}}).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0\0")
    with pytest.raises(CheckpointError, match=f"f.safetensors: malformed safetensors header: {DOWN}"):
        ss.scale_stats(ss.LocalFile(path))


def test_folded_upcast_reports_the_loaded_layers(synth: Path) -> None:
    from dataclasses import replace

    from prepkit.checkpoint import Checkpoint
    from prepkit.recipes import load_recipe
    from prepkit.runtime.moe import MoeLayer

    experts = Checkpoint(synth, load_recipe("gpt-oss-120b")).read_experts(0)
    small, _ = MoeLayer.from_experts(experts, top_k=4)
    wide_scales = experts.down_proj_scales.clone()
    wide_scales[1, 2, 0] = 129  # one byte of one expert's GEMM2 scales
    wide, _ = MoeLayer.from_experts(replace(experts, down_proj_scales=wide_scales), top_k=4)
    assert small.small_scales == (True, True) and wide.small_scales == (True, False)
    decoder = [SimpleNamespace(mlp=SimpleNamespace(moe_layer=m)) for m in (small, wide, small)]
    decoder.insert(1, SimpleNamespace(mlp=SimpleNamespace()))  # a layer the kernel does not run
    report = ss.folded_upcast(SimpleNamespace(model=SimpleNamespace(layers=decoder)))
    assert report == {
        "layers": 3,
        "gemm1_small": 3,
        "gemm2_small": 2,
        "wide": {"gemm1": [], "gemm2": [2]},
        "every_gemm": False,
    }
    assert ss.folded_upcast({0: small, 5: small})["every_gemm"] is True
    assert ss.folded_upcast({})["every_gemm"] is False


# --- the command ------------------------------------------------------------------------------


def test_the_command_prints_a_table_and_the_verdict(synth: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert scale_bytes.main([str(synth)]) == 0
    out, err = capsys.readouterr()
    assert "folded upcast applies to every expert GEMM: yes" in out.splitlines()
    assert "read 1 of 3 shard(s)" in out and "--all reads every shard" in out
    assert "reading the scales of" in err and "reading" not in out
    assert scale_bytes.main([str(synth), "--all", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["folded_upcast_every_expert_gemm"] is True and len(report["shards_read"]) == 3
    assert report["bytes_read"] == sum(t["count"] for t in report["tensors"])


def test_the_command_says_no_for_wide_scales(tiny: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert scale_bytes.main([str(tiny)]) == 0
    out = capsys.readouterr().out
    assert "folded upcast applies to every expert GEMM: no" in out.splitlines()
    assert " 255  2^128" in out


def test_the_command_fails_with_the_error_code_and_names_the_file(
    tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "cut.safetensors"
    bad.write_bytes(tiny.read_bytes()[:-1])
    assert scale_bytes.main([str(bad)]) == CheckpointError.exit_code
    out, err = capsys.readouterr()
    assert out == "" and "cut.safetensors: truncated" in err
    assert scale_bytes.main([str(bad), "--json"]) == CheckpointError.exit_code
    assert "cut.safetensors" in json.loads(capsys.readouterr().out)["error"]


# --- the hub, by range requests ----------------------------------------------------------------

OLAH_CLI = olah_server.find_olah_cli()
needs_olah = pytest.mark.skipif(OLAH_CLI is None or shutil.which("git") is None, reason="needs olah-cli and git")
REPO = "testorg/scales-gpt-oss"


@pytest.fixture(scope="module")
def olah(synth: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    assert OLAH_CLI is not None
    work = tmp_path_factory.mktemp("olah")
    olah_server.build_mirror_repo(synth, work / "mirrors", REPO)
    with olah_server.serve(work / "mirrors", work, probe_repo=REPO, olah_cli=OLAH_CLI) as endpoint:
        yield endpoint


@needs_olah
def test_the_hub_path_transfers_only_the_header_and_the_scales(olah: str, synth: Path) -> None:
    with range_proxy(olah) as (endpoint, served):
        shards = ss.hub_shards(REPO, "main", endpoint=endpoint)
        assert shards.shards == ss.local_shards(synth).shards
        name = shards.default_shard()
        assert name == ss.local_shards(synth).default_shard()
        reader = CountingReader(shards.open(name))
        stats = ss.scale_stats(reader)
    assert_reads_only_scales(reader, synth / name)
    header_len, spans = scale_ranges(synth / name)
    # On the wire: the index, then exactly what was asked of the shard, never a whole file.
    assert served.whole == []
    assert served.bytes_of(name) == 8 + header_len + sum(hi - lo for lo, hi in spans)
    assert_matches_numpy(stats, synth / name)
    assert {s.file for s in stats} == {f"{REPO}/{name}"}


@needs_olah
def test_the_hub_path_errors_name_the_repo_and_file(olah: str) -> None:
    with range_proxy(olah) as (endpoint, _):
        with pytest.raises(FetchError, match="testorg/missing not found at revision main"):
            ss.hub_shards("testorg/missing", "main", endpoint=endpoint)
        shards = ss.hub_shards(REPO, "main", endpoint=endpoint)
        with pytest.raises(FetchError, match=f"{REPO}/absent.safetensors not found"):
            shards.open("absent.safetensors")
    # Straight to olah, which answers a ranged download with the whole file: refused, not misread.
    shards = ss.hub_shards(REPO, "main", endpoint=olah)
    with pytest.raises(FetchError, match="asked .* for 8 bytes at 0, got") as err:
        ss.scale_stats(shards.open(shards.default_shard()))
    assert "range requests" in (err.value.hint or "")


@needs_olah
def test_the_command_reads_a_hub_repo(olah: str, capsys: pytest.CaptureFixture[str]) -> None:
    with range_proxy(olah) as (endpoint, _):
        assert scale_bytes.main([REPO, "--revision", "main", "--endpoint", endpoint, "--all"]) == 0
    out = capsys.readouterr().out
    assert f"read 3 of 3 shard(s) of {REPO}@main" in out
    assert "folded upcast applies to every expert GEMM: yes" in out


def test_an_unreachable_hub_is_one_clear_error() -> None:
    dead = f"http://127.0.0.1:{olah_server.free_port()}"  # nothing listens there
    with pytest.raises(FetchError, match=f"cannot reach {dead} for {REPO}") as err:
        ss.hub_shards(REPO, "main", endpoint=dead)
    assert "--offline" not in (err.value.hint or "")  # fetch's advice, not this reader's
