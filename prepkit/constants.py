"""Names that more than one module spells: layout ids, and the files prepkit writes and reads.

Standard library only and nothing but constants, so any module (the runtime included) imports it
for free. A layout id is stored in manifests and tactics.db: bump its ``_v<N>`` when even one
output byte of that layout changes.
"""

from __future__ import annotations

# Versioned layout ids (the CLI spells layouts plainly: ``--layout trtllm-gen``).
TRTLLM_GEN_LAYOUT_ID = "trtllm_gen_v1"
TRITON_MOE_LAYOUT_ID = "triton_moe_v3"  # the bundled kernel's weight layout
CUTLASS_SM90_LAYOUT_ID = "cutlass_sm90_v1"
CUTLASS_SM12X_LAYOUT_ID = "cutlass_sm12x_v1"
# Dense MX weights as the bundled kernel family reads them (prepkit.layouts.dense_mx).
DENSE_MX_LAYOUT_ID = "dense_mx_v1"

# A model folder: the checkpoint's index, and the record of whoever wrote the folder.
INDEX_NAME = "model.safetensors.index.json"
FETCH_RECORD = "prepkit-fetch.json"  # written by ``prepkit fetch`` (hub-verified hashes)
SYNTH_RECORD = "prepkit-synth.json"  # written by ``prepkit synth`` (hashes taken at creation)

# A prepared shard set (``prepkit prepare --out``).
MANIFEST_NAME = "manifest.json"  # written last: a folder without it is not finished
JOURNAL_NAME = ".prepkit-journal.json"  # written first; finished files of an interrupted run
PREPARE_LOCK = ".prepkit-lock"  # held by the one prepare writing the folder (holds its pid)
SHARED_DIR = "shared"  # non-expert tensors, written once and linked into every rank folder
EXPERTS_FILE = "rank{rank}/experts-{layer:05d}.safetensors"  # one rank's experts of one layer
SHARED_FILE = SHARED_DIR + "/non-expert-{index:05d}.safetensors"

# Shipped with the package (recipes/ and tactics.db at the repository top, prepkit/data/ in a wheel;
# found by prepkit.data).
RECIPES_FOLDER = "recipes"  # ``<model>.json`` per supported checkpoint
TACTICS_DB_NAME = "tactics.db"  # the bundled DB, and the user's under $XDG_CACHE_HOME/prepkit
