"""``load_shards``: one rank's prepared tensors plus the manifest's facts, for any layout.

An engine integration can take these tensors as they are and skip its own weight preparation;
the bundled kernel's runtime loads its layout through the same function.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from prepkit.errors import LayoutError, VerifyError
from prepkit.fsutil import sha256_file
from prepkit.manifest import Manifest, RankRecord, experts_file
from prepkit.runtime.arguments import check_layer_list, check_layers_in, check_rank, parse_device

_DTYPES = {
    "uint8": torch.uint8,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "int32": torch.int32,
    "int64": torch.int64,
    "float16": torch.float16,
}


@dataclass
class LoadedShards:
    """A rank's expert tensors by layer (names without the layer prefix) and its facts.

    ``manifest`` is the whole shard set's :class:`~prepkit.manifest.Manifest` and ``rank_entry``
    this rank's record in it; the properties below are shortcuts into them.
    """

    out_dir: Path
    rank: int
    device: torch.device
    manifest: Manifest
    rank_entry: RankRecord
    layers: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)

    @property
    def layout_id(self) -> str:
        return self.manifest.layout.id

    @property
    def layout_name(self) -> str:
        return self.manifest.layout.name

    @property
    def w13_row_order(self) -> str:
        return self.manifest.layout.w13_row_order

    @property
    def tp_size(self) -> int:
        return self.manifest.parallel.tp_size

    @property
    def ep_size(self) -> int:
        return self.manifest.parallel.ep_size

    @property
    def tp_rank(self) -> int:
        return self.rank_entry.tp_rank

    @property
    def ep_rank(self) -> int:
        return self.rank_entry.ep_rank

    @property
    def expert_range(self) -> tuple[int, int]:
        return self.rank_entry.expert_range

    @property
    def intermediate_range(self) -> tuple[int, int]:
        return self.rank_entry.intermediate_range

    @property
    def valid_intermediate(self) -> int:
        return self.rank_entry.valid_intermediate

    @property
    def padded_intermediate(self) -> int:
        return self.rank_entry.padded_intermediate

    @property
    def padded_hidden(self) -> int:
        return self.rank_entry.padded_hidden

    @property
    def facts(self) -> dict[str, Any]:
        return dict(self.rank_entry.facts)

    @property
    def dims(self) -> dict[str, int]:
        """The model's dims as a dict (``num_layers``, ``num_experts``, ``hidden``, ``intermediate``,
        ``top_k``); ``manifest.model.dims`` holds them typed."""
        return asdict(self.manifest.model.dims)

    @property
    def config(self) -> dict[str, Any]:
        return dict(self.manifest.model.config)

    def layer(self, index: int) -> dict[str, torch.Tensor]:
        try:
            return self.layers[index]
        except KeyError:
            raise LayoutError(f"layer {index} was not loaded (have {sorted(self.layers)})") from None


def load_shards(
    out_dir: str | Path,
    rank: int = 0,
    device: str | torch.device = "cpu",
    *,
    expect_layout: str | None = None,
    layers: list[int] | None = None,
    check_hashes: bool = False,
) -> LoadedShards:
    """Load rank ``rank`` of a prepared shard set onto ``device``.

    ``expect_layout`` (a layout id like ``trtllm_gen_v1`` or a CLI name) is checked against the
    manifest; a mismatch raises ``LayoutError`` naming both. ``check_hashes`` re-hashes the files
    first (slow on big models; ``prepkit verify`` does the same offline).

    Raises:
        DeviceError: ``device`` is not a device this machine has (checked before any file is read).
        RecipeError: ``rank`` is not an int, or ``layers`` not a list of ints (checked first too).
        LayoutError: the layout is not ``expect_layout``, the set lacks ``rank`` or a layer of
            ``layers`` (checked against the manifest before any shard file is opened).
        VerifyError: a file is missing, truncated or unreadable, or disagrees with the manifest.
    """
    target = parse_device(device)
    rank = check_rank(rank)
    layers = check_layer_list(layers)
    root = Path(out_dir)
    manifest = Manifest.read(root)
    layout = manifest.layout
    if expect_layout is not None and expect_layout not in (layout.id, layout.name):
        raise LayoutError(
            f"{root} holds layout {layout.id!r} ({layout.name}), expected {expect_layout!r}",
            hint=f"prepare it for that layout: prepkit prepare --layout ... --out {root}-other",
        )
    entry = manifest.rank_record(rank)
    if entry is None:
        raise LayoutError(
            f"{root} holds ranks {sorted(r.rank for r in manifest.ranks)}, not rank {rank}",
            hint="pass one of those ranks or prepare the missing one with --rank",
        )
    num_layers = manifest.model.dims.num_layers
    if layers is not None:
        check_layers_in(layers, num_layers, str(root))
    wanted = list(range(num_layers)) if layers is None else sorted(set(layers))
    shards = LoadedShards(root, rank, target, manifest, entry)
    for layer in wanted:
        rel = experts_file(rank, layer)
        path = root / rel
        hint = f"run: prepkit verify {root}"
        if not path.is_file():
            raise VerifyError(f"{path} is missing", hint=hint)
        recorded = manifest.files.get(rel)
        # A truncated file is named here, not by safetensors' reader (which names no file).
        if recorded is not None and path.stat().st_size != recorded.bytes:
            raise VerifyError(f"{path} is {path.stat().st_size} bytes, the manifest says {recorded.bytes}", hint=hint)
        if check_hashes and sha256_file(path) != manifest.files[rel].sha256:
            raise VerifyError(f"{rel}: sha256 differs from the manifest", hint=hint)
        prefix = manifest.expert_tensor_prefix.format(layer=layer)
        try:
            raw = load_file(str(path), device=str(shards.device))
        except SafetensorError as err:
            raise VerifyError(f"{path} cannot be read: {err}", hint=hint) from err
        tensors: dict[str, torch.Tensor] = {}
        for name, spec in entry.tensors.items():
            t = raw.get(prefix + name)
            if t is None:
                raise VerifyError(f"{rel}: tensor {prefix + name} is missing")
            if tuple(t.shape) != spec.shape or t.dtype != _DTYPES.get(spec.dtype):
                raise VerifyError(
                    f"{rel}: {prefix + name} is {list(t.shape)} {t.dtype}, the manifest says "
                    f"{list(spec.shape)} {spec.dtype}"
                )
            tensors[name] = t
        shards.layers[layer] = tensors
    return shards
