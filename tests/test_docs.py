"""The docs keep up with the code: every manifest key is in docs/manifest.md, every environment
variable prepkit reads is in the README, and no doc points at a file outside the repository."""

from __future__ import annotations

import re
import subprocess
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from prepkit.dims import ModelDims
from prepkit.manifest import (
    FETCHED,
    LOCAL,
    MANIFEST_VERSION,
    SYNTHESIZED,
    DenseRecord,
    DenseTensorRecord,
    FileHash,
    LayoutRecord,
    Manifest,
    ModelRecord,
    Parallel,
    Provenance,
    RankRecord,
    TensorRecord,
)

ROOT = Path(__file__).resolve().parent.parent
MANIFEST_DOC = ROOT / "docs" / "manifest.md"
README = ROOT / "README.md"


def _manifest(provenance: Provenance) -> Manifest:
    rank = RankRecord(
        rank=0, tp_rank=0, ep_rank=0, expert_range=(0, 4), intermediate_range=(0, 2880),
        valid_intermediate=2880, padded_intermediate=2880, padded_hidden=2880, sharding_rule="balanced-32-groups",
        facts={}, tensors={"w2_bias": TensorRecord((4, 2880), "float32", ("E", "H"))},
        files=("rank0/experts-00000.safetensors",),
    )  # fmt: skip
    return Manifest(
        prepkit_version="0.1.0",
        fingerprint="0" * 64,
        layout=LayoutRecord("triton-moe", "triton_moe_v3", "interleaved", {}),
        model=ModelRecord("gpt-oss-120b", "openai/gpt-oss-120b", "abc", ModelDims(1, 4, 2880, 2880, 4), {}, provenance),
        parallel=Parallel(1, 1),
        expert_tensor_prefix="model.layers.{layer}.mlp.experts.",
        shared_files=(),
        shared_file_link="none",
        ranks=(rank,),
        files={"rank0/experts-00000.safetensors": FileHash("0" * 64, 1)},
    )


def _keys(value: Any, free: frozenset[str]) -> set[str]:
    """Every object key in ``value``, not descending into the objects keyed by data (``free``)."""
    if isinstance(value, list):
        return set().union(*(_keys(v, free) for v in value)) if value else set()
    if not isinstance(value, dict):
        return set()
    keys = set(value)
    for k, v in value.items():
        if k in free and isinstance(v, dict):  # file paths, tensor names, the source's config: data
            for inner in v.values():
                keys |= _keys(inner, free)
        else:
            keys |= _keys(v, free)
    return keys


@pytest.mark.parametrize(
    "provenance",
    [
        Provenance(LOCAL, {"config.json": FileHash("0" * 64, 1)}),
        Provenance(SYNTHESIZED, synth_record="prepkit-synth.json", seed=0),
        Provenance(
            FETCHED,
            source_repo="o/m",
            source_revision="main",
            source_commit="c",
            fetched_at="t",
            fetch_record="prepkit-fetch.json",
        ),
    ],  # fmt: skip
    ids=lambda p: p.kind,
)
def test_manifest_doc_names_every_key(provenance: Provenance) -> None:
    doc = MANIFEST_DOC.read_text()
    keys = _keys(_manifest(provenance).to_json(), frozenset({"files", "source_files", "tensors", "config", "facts"}))
    missing = sorted(k for k in keys if f"`{k}`" not in doc)
    assert not missing, f"docs/manifest.md does not document {missing}"


def test_manifest_doc_names_every_dense_key() -> None:
    doc = MANIFEST_DOC.read_text()
    head = DenseTensorRecord("mxfp4", (8, 64), "lm_head.weight_blocks", "lm_head.weight_scales")
    manifest = replace(
        _manifest(Provenance(LOCAL)), dense=DenseRecord("mxfp4", "dense_mx_v1", {"lm_head.weight": head})
    )
    keys = _keys(manifest.to_json(), frozenset({"files", "source_files", "tensors", "config", "facts"}))
    assert "dense" in keys and "layout_id" in keys and "blocks" in keys
    missing = sorted(k for k in keys if f"`{k}`" not in doc)
    assert not missing, f"docs/manifest.md does not document {missing}"


def test_manifest_doc_states_the_version_the_loader_checks() -> None:
    doc = MANIFEST_DOC.read_text()
    assert f"| `format_version` | `{MANIFEST_VERSION}`, the only version this prepkit reads |" in doc


def test_readme_lists_every_environment_variable_prepkit_reads() -> None:
    read = set()
    for path in (ROOT / "prepkit").rglob("*.py"):
        read |= set(re.findall(r"\b(PREPKIT_[A-Z_]+)\b", path.read_text()))
    read = {v for v in read if not v.startswith("PREPKIT_TEST_")}  # hooks of the crash tests, not for users
    assert read, "no PREPKIT_ variable found: the scan is broken"
    readme = README.read_text()
    missing = sorted(v for v in read if f"| `{v}` |" not in readme)
    assert not missing, f"README's variable table lacks {missing}"


def test_readme_starts_with_the_two_set_up_commands() -> None:
    first_block = README.read_text().split("```")[1].strip().splitlines()
    assert [line.split("#")[0].strip() for line in first_block] == ["make demo", "make test"]


def test_nothing_points_at_a_file_outside_the_repository() -> None:
    tracked = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=False
    ).stdout.split("\0")
    if not any(tracked):
        pytest.skip("not a git checkout")
    # a parent folder's shared notes; spelled in two pieces so this file does not match itself
    outside = re.compile(r"\.\./shared|" + "shared" + "/docs")
    hits = []
    for rel in filter(None, tracked):
        path = ROOT / rel
        if path.suffix in {".db", ".png"} or not path.is_file():
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        hits += [f"{rel}:{n}" for n, line in enumerate(text.splitlines(), 1) if outside.search(line)]
    assert not hits, hits
