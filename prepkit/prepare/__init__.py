"""``prepare``: plan first (validated, printable, nothing written), then one streaming pass.

Each layer's experts are read once, in chunks of experts, and every rank's file for that layer
is filled from the same chunk, so ``--tp 8`` reads the source once and memory stays at a chunk
plus its outputs whatever the model size. Files are written under temporary names, renamed
when complete, hashed, and recorded in a journal; the manifest comes last.

The journal is the first file a run writes (after taking the folder's lock), so a run killed at any
instant leaves a folder that the same command resumes, and that a run of another plan refuses
with what differs.

By concern: ``plan`` (what goes where), ``guard`` (the output folder and resume identity),
``write`` (the streaming pass), ``provenance`` (the source record, read once),
``manifest_build`` (indexes and the manifest) and ``run`` (one run, start to manifest).
"""

from prepkit.prepare.plan import CHUNK_BYTES, SHARED_FILE_BYTES, PreparePlan, plan_prepare
from prepkit.prepare.run import PrepareResult, prepare
from prepkit.prepare.write import ProgressFn

__all__ = [
    "CHUNK_BYTES",
    "SHARED_FILE_BYTES",
    "PreparePlan",
    "PrepareResult",
    "ProgressFn",
    "plan_prepare",
    "prepare",
]
