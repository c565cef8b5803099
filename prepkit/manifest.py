"""``manifest.json`` of a prepared shard set, as typed values: written by ``prepare``, read by the
runtime loader, ``verify`` and ``tune``.

The JSON keys are those of format version :data:`MANIFEST_VERSION`; ``to_json`` gives exactly
them, and the writer sorts keys, so the bytes depend on the content alone. A reader refuses any
other version, naming the file and both versions. Standard library only: no torch.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from prepkit.constants import (
    DEFAULT_DENSE_FORMAT,
    DENSE_MX_LAYOUT_ID,
    EXPERTS_FILE,
    JOURNAL_NAME,
    MANIFEST_NAME,
    SHARED_FILE,
)
from prepkit.dims import ModelDims
from prepkit.errors import VerifyError

MANIFEST_FORMAT = "prepkit-shards"
MANIFEST_VERSION = 1  # bump when a key changes meaning or goes away; readers refuse other versions

# How the source folder came to be, and which of the provenance fields each kind records.
FETCHED = "prepkit fetch"
SYNTHESIZED = "prepkit synth"
LOCAL = "local folder"
_PROVENANCE_FIELDS = {
    FETCHED: ("source_repo", "source_revision", "source_commit", "fetched_at", "fetch_record"),
    SYNTHESIZED: ("synth_record", "seed"),
    LOCAL: (),
}


def experts_file(rank: int, layer: int) -> str:
    """Path of one rank's experts of one layer, relative to the output folder."""
    return EXPERTS_FILE.format(rank=rank, layer=layer)


def shared_file(index: int) -> str:
    """Path of one file of non-expert tensors, relative to the output folder."""
    return SHARED_FILE.format(index=index)


@dataclass(frozen=True)
class FileHash:
    """sha256 and size of one file (an output file, or a source file the output came from)."""

    sha256: str
    bytes: int

    def to_json(self) -> dict[str, Any]:
        return {"sha256": self.sha256, "bytes": self.bytes}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> FileHash:
        return cls(sha256=raw["sha256"], bytes=int(raw["bytes"]))


@dataclass(frozen=True)
class LayoutRecord:
    name: str  # CLI spelling, e.g. "trtllm-gen"
    id: str  # versioned id, e.g. "trtllm_gen_v1"
    w13_row_order: str
    options: dict[str, Any]  # the LayoutOptions fields this layout reads

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "id": self.id, "w13_row_order": self.w13_row_order, "options": dict(self.options)}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> LayoutRecord:
        return cls(raw["name"], raw["id"], raw["w13_row_order"], dict(raw.get("options", {})))


@dataclass(frozen=True)
class Provenance:
    """Where the source checkpoint came from, and the sha256 of each of its files.

    ``kind`` says which optional fields are recorded: a fetch cites the repo, revision, commit and
    time of the fetch; a synthetic checkpoint its seed; a plain local folder nothing more.
    """

    kind: str  # FETCHED, SYNTHESIZED or LOCAL
    source_files: dict[str, FileHash] = field(default_factory=dict)
    source_repo: str | None = None
    source_revision: str | None = None
    source_commit: str | None = None
    fetched_at: str | None = None
    fetch_record: str | None = None
    synth_record: str | None = None
    seed: int | None = None

    def to_json(self) -> dict[str, Any]:
        """The keys this kind records; the model entry of the manifest holds them at its top level."""
        out: dict[str, Any] = {"provenance": self.kind}
        out.update({name: getattr(self, name) for name in _PROVENANCE_FIELDS.get(self.kind, ())})
        out["source_files"] = {name: f.to_json() for name, f in self.source_files.items()}
        return out

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Provenance:
        kind = raw["provenance"]
        return cls(
            kind=kind,
            source_files={name: FileHash.from_json(f) for name, f in raw.get("source_files", {}).items()},
            **{name: raw.get(name) for name in _PROVENANCE_FIELDS.get(kind, ())},
        )


@dataclass(frozen=True)
class ModelRecord:
    recipe: str
    repo_id: str
    revision: str
    dims: ModelDims
    config: dict[str, Any]  # the source's config.json
    provenance: Provenance

    def to_json(self) -> dict[str, Any]:
        return {
            "recipe": self.recipe,
            "repo_id": self.repo_id,
            "revision": self.revision,
            "dims": asdict(self.dims),
            "config": self.config,
            **self.provenance.to_json(),
        }

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> ModelRecord:
        return cls(
            recipe=raw["recipe"],
            repo_id=raw["repo_id"],
            revision=raw["revision"],
            dims=ModelDims(**{k: int(v) for k, v in raw["dims"].items()}),
            config=dict(raw.get("config", {})),
            provenance=Provenance.from_json(raw),
        )


@dataclass(frozen=True)
class Parallel:
    tp_size: int
    ep_size: int

    @property
    def world_size(self) -> int:
        return self.tp_size * self.ep_size

    def to_json(self) -> dict[str, Any]:
        return {"tp_size": self.tp_size, "ep_size": self.ep_size}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Parallel:
        return cls(int(raw["tp_size"]), int(raw["ep_size"]))


@dataclass(frozen=True)
class TensorRecord:
    """One output tensor of a rank's layer file: shape, dtype name (``uint8``) and dim names."""

    shape: tuple[int, ...]
    dtype: str
    dims: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "dtype": self.dtype, "dims": list(self.dims)}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> TensorRecord:
        return cls(tuple(int(d) for d in raw["shape"]), raw["dtype"], tuple(raw.get("dims", ())))


@dataclass(frozen=True)
class RankRecord:
    """What one output rank holds: its place in the TP x EP grid, its experts and intermediate rows
    (half-open ranges), the padding, the layout's facts, its tensors per layer and its files."""

    rank: int
    tp_rank: int
    ep_rank: int
    expert_range: tuple[int, int]
    intermediate_range: tuple[int, int]
    valid_intermediate: int
    padded_intermediate: int
    padded_hidden: int
    sharding_rule: str
    facts: dict[str, Any]
    tensors: dict[str, TensorRecord]
    files: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "tp_rank": self.tp_rank,
            "ep_rank": self.ep_rank,
            "expert_range": list(self.expert_range),
            "intermediate_range": list(self.intermediate_range),
            "valid_intermediate": self.valid_intermediate,
            "padded_intermediate": self.padded_intermediate,
            "padded_hidden": self.padded_hidden,
            "sharding_rule": self.sharding_rule,
            "facts": self.facts,
            "tensors": {name: t.to_json() for name, t in self.tensors.items()},
            "files": list(self.files),
        }

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> RankRecord:
        e_lo, e_hi = raw["expert_range"]
        i_lo, i_hi = raw["intermediate_range"]
        return cls(
            rank=int(raw["rank"]),
            tp_rank=int(raw["tp_rank"]),
            ep_rank=int(raw["ep_rank"]),
            expert_range=(int(e_lo), int(e_hi)),
            intermediate_range=(int(i_lo), int(i_hi)),
            valid_intermediate=int(raw["valid_intermediate"]),
            padded_intermediate=int(raw["padded_intermediate"]),
            padded_hidden=int(raw["padded_hidden"]),
            sharding_rule=raw["sharding_rule"],
            facts=dict(raw.get("facts", {})),
            tensors={name: TensorRecord.from_json(t) for name, t in raw["tensors"].items()},
            files=tuple(raw["files"]),
        )


@dataclass(frozen=True)
class DenseTensorRecord:
    """One dense weight stored in MX form: its format, its source shape ``[N, K]``, and the names
    of the two tensors that hold it in the shared files."""

    format: str  # "mxfp8" or "mxfp4"
    shape: tuple[int, ...]
    blocks: str  # "<name>_blocks": [P, N, 128] uint8
    scales: str  # "<name>_scales": [K/32, N] uint8

    def to_json(self) -> dict[str, Any]:
        return {"format": self.format, "shape": list(self.shape), "blocks": self.blocks, "scales": self.scales}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> DenseTensorRecord:
        return cls(raw["format"], tuple(int(d) for d in raw["shape"]), raw["blocks"], raw["scales"])


@dataclass(frozen=True)
class DenseRecord:
    """The dense weights ``prepare --dense`` stored in an MX format (absent for bf16)."""

    format: str  # the --dense value
    layout_id: str  # versioned id of the stored form, DENSE_MX_LAYOUT_ID
    tensors: dict[str, DenseTensorRecord]  # by checkpoint name, e.g. "lm_head.weight"

    def to_json(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "layout_id": self.layout_id,
            "tensors": {name: t.to_json() for name, t in sorted(self.tensors.items())},
        }

    @classmethod
    def from_json(cls, raw: dict[str, Any], path: str | Path) -> DenseRecord:
        if raw["layout_id"] != DENSE_MX_LAYOUT_ID:
            raise VerifyError(
                f"{path}: dense weights of layout {raw['layout_id']!r}, this prepkit reads {DENSE_MX_LAYOUT_ID!r}",
                hint="use the prepkit that prepared them, or prepare the shards again with this one",
            )
        tensors = {name: DenseTensorRecord.from_json(t) for name, t in raw["tensors"].items()}
        return cls(raw["format"], raw["layout_id"], tensors)


@dataclass(frozen=True)
class Manifest:
    """A finished shard set: layout, source model, parallel split, every rank, every file's hash."""

    prepkit_version: str
    fingerprint: str  # of the plan (source files, layout, options, split); a rerun resumes only on a match
    layout: LayoutRecord
    model: ModelRecord
    parallel: Parallel
    expert_tensor_prefix: str  # output tensor prefix with a ``{layer}`` field
    shared_files: tuple[str, ...]  # the non-expert files, written once under shared/
    shared_file_link: str  # how rank folders hold them: "hardlink", "symlink" or "none"
    ranks: tuple[RankRecord, ...]
    files: dict[str, FileHash]  # every file, relative to the output folder
    format_version: int = MANIFEST_VERSION
    dense: DenseRecord | None = None  # None: the dense weights are the checkpoint's bf16

    @property
    def dense_format(self) -> str:
        """How the shared files hold the dense weights (q/k/v/o projections, lm_head): ``"bf16"``
        (as the checkpoint), ``"mxfp8"`` or ``"mxfp4"`` (``X.weight_blocks`` and ``X.weight_scales``
        in place of each ``X.weight``; :attr:`dense` lists them)."""
        return self.dense.format if self.dense is not None else DEFAULT_DENSE_FORMAT

    def rank_shared_files(self, rank: int) -> list[str]:
        """The rank folder's copies (links) of the non-expert files, relative to the output folder.

        Raises:
            VerifyError: the manifest does not list one of them for ``rank``.
        """
        record = self.rank_record(rank)
        held = set(record.files) if record is not None else set()
        wanted = [f"rank{rank}/{Path(rel).name}" for rel in self.shared_files]
        missing = [rel for rel in wanted if rel not in held]
        if missing:
            raise VerifyError(f"manifest.json: rank {rank} does not list {missing[0]}", hint="prepare the shards again")
        return wanted

    def rank_record(self, rank: int) -> RankRecord | None:
        return next((r for r in self.ranks if r.rank == rank), None)

    def to_json(self) -> dict[str, Any]:
        out = {
            "format": MANIFEST_FORMAT,
            "format_version": self.format_version,
            "prepkit_version": self.prepkit_version,
            "fingerprint": self.fingerprint,
            "layout": self.layout.to_json(),
            "model": self.model.to_json(),
            "parallel": self.parallel.to_json(),
            "expert_tensor_prefix": self.expert_tensor_prefix,
            "shared_files": list(self.shared_files),
            "shared_file_link": self.shared_file_link,
            "ranks": [r.to_json() for r in self.ranks],
            "files": {rel: f.to_json() for rel, f in sorted(self.files.items())},
        }
        if self.dense is not None:  # a bf16 set's manifest keeps the keys it always had
            out["dense"] = self.dense.to_json()
        return out

    @classmethod
    def from_json(cls, raw: Any, path: str | Path = MANIFEST_NAME) -> Manifest:
        """Raises VerifyError naming ``path`` when ``raw`` is not a manifest of this version."""
        if not isinstance(raw, dict) or raw.get("format") != MANIFEST_FORMAT:
            found = raw.get("format") if isinstance(raw, dict) else type(raw).__name__
            raise VerifyError(f"{path} is not a prepkit manifest (format={found!r})")
        version = raw.get("format_version")
        if version != MANIFEST_VERSION:
            newer = isinstance(version, int) and version > MANIFEST_VERSION
            raise VerifyError(
                f"{path} has format_version {version}, this prepkit reads format_version {MANIFEST_VERSION}",
                hint="upgrade prepkit" if newer else "prepare the shards again with this prepkit",
            )
        try:
            return cls(
                prepkit_version=raw["prepkit_version"],
                fingerprint=raw["fingerprint"],
                layout=LayoutRecord.from_json(raw["layout"]),
                model=ModelRecord.from_json(raw["model"]),
                parallel=Parallel.from_json(raw["parallel"]),
                expert_tensor_prefix=raw["expert_tensor_prefix"],
                shared_files=tuple(raw["shared_files"]),
                shared_file_link=raw["shared_file_link"],
                ranks=tuple(RankRecord.from_json(r) for r in raw["ranks"]),
                files={rel: FileHash.from_json(f) for rel, f in raw["files"].items()},
                format_version=version,
                dense=DenseRecord.from_json(raw["dense"], path) if "dense" in raw else None,
            )
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise VerifyError(
                f"{path} is not a valid format_version {MANIFEST_VERSION} manifest: {type(err).__name__} {err}",
                hint="prepare the shards again",
            ) from err

    @classmethod
    def read(cls, out_dir: str | Path) -> Manifest:
        """The manifest of a finished shard set; raises VerifyError when absent, foreign or of
        another format version."""
        path = Path(out_dir) / MANIFEST_NAME
        if not path.is_file():
            journal = Path(out_dir) / JOURNAL_NAME
            hint = (
                "the run was interrupted; rerun the same prepare command to finish it"
                if journal.is_file()
                else "run prepkit prepare first"
            )
            raise VerifyError(f"{path} is missing: {out_dir} is not a finished prepkit shard set", hint=hint)
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            raise VerifyError(f"{path} is not valid JSON: {err}") from err
        return cls.from_json(raw, path)
