"""Compile a fixed set of kernel variants to PTX without a GPU and save the text, to prove that a
source restructure leaves the generated code unchanged (and KERNEL_VERSION may stay).

    python tools/ptx_identity.py save OUT_DIR    # before and after the change
    python tools/ptx_identity.py diff OLD_DIR NEW_DIR
    python tools/ptx_identity.py diff OLD_DIR NEW_DIR/legacy   # against a set saved by the first version

The set: for sm_90 and sm_120, each activation policy, the MoE layer's defaults over the tactic
table's token points plus one sampled variant of every family (routing included), and the dense
linear's defaults for each weight format the policy pairs with plus one sampled variant of every
family of its valid space. ``diff`` compares the PTX with ``.loc``/``.file`` lines and the debug
sections removed, and the ``$L__tmp`` labels only those sections read (they name source lines and
inlining scopes, which a restructure moves); every instruction must match.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

ARCHES = ("sm90", "sm120")
POLICIES = ("bf16", "mxfp8", "mxfp4")
DENSE_FORMATS = ("mxfp4", "mxfp8")


def _key(name: str) -> str:
    return hashlib.sha1(name.encode()).hexdigest()[:16]


def _normalize(ptx: str) -> str:
    ptx = ptx.split("\t.section\t.debug", 1)[0]
    # .loc/.file and the $L__tmp labels exist for the line table and inlining scopes only.
    keep = [line for line in ptx.splitlines() if not re.match(r"^\s*(\.(loc|file)\b|\$L__tmp\d+:\s*$)", line)]
    return "\n".join(keep) + "\n"


def _compiler() -> Any:
    try:
        from prepkit.kernels.compile_check import _compiler as compiler_module  # after the split
    except ImportError:
        import prepkit.kernels.compile_check as compiler_module
    return compiler_module


def save(out: Path) -> int:
    os.environ.pop("TRITON_INTERPRET", None)
    from prepkit.kernels import compile_check as cc
    from prepkit.kernels.variants import enumerate_dense_tactics
    from prepkit.layer import resolve_layer

    comp = _compiler()
    target_compiler = getattr(comp, "TargetCompiler", None) or comp._TargetCompiler
    captured: dict[str, str] = {}
    orig_read = target_compiler._read

    current = {"fmt": ""}  # the dense weight format being compiled (reports do not name it)
    legacy: dict[str, str] = {}

    def read(self: Any, base: Any, compiled: Any, tactic: Any) -> Any:
        ptx = compiled.asm.get("ptx", "")
        name = f"{base.arch}.{base.activations}.{base.stage}.{base.kernel}.{base.tactic or 'route'}.{base.origin}"
        # The first version of this script named kernels without the dense weight format, so a
        # later format overwrote an earlier one's file; legacy/ keeps that naming to compare with it.
        legacy[_key(name)] = name
        (out / "legacy" / f"{_key(name)}.ptx").write_text(ptx)
        if current["fmt"]:
            name = f"{name}.w={current['fmt']}"
        captured[_key(name)] = name
        (out / f"{_key(name)}.ptx").write_text(ptx)
        return orig_read(self, base, compiled, tactic)

    target_compiler._read = read
    (out / "legacy").mkdir(parents=True, exist_ok=True)
    shape = resolve_layer(model="gpt-oss-120b", shards=None, tp=1).layer
    for arch in ARCHES:
        device = cc.arch_device(arch)
        for act in POLICIES:
            cands = cc.check_candidates(arch, shape, act, per_family=1)
            cc.compile_variants(arch, shape, act, cands)
            for fmt in DENSE_FORMATS:
                if act == "mxfp4" and fmt != "mxfp4":
                    continue
                dense = _dense_defaults(cc, arch, fmt, act)
                seen = {c.tactic for c in dense}
                groups: dict[str, list[Any]] = {}
                for t in enumerate_dense_tactics(fmt, device, 8, act):
                    groups.setdefault(cc.family(t, act), []).append(t)
                for fam, members in groups.items():
                    t = members[len(members) // 2]
                    if t not in seen:
                        seen.add(t)
                        dense.append(cc.DenseCandidate(fmt, t, f"sample {fam}", 2880, 4096, 8))
                current["fmt"] = fmt
                cc.compile_dense(arch, fmt, act, dense)
                current["fmt"] = ""
            print(f"{arch} {act}: {len(captured)} kernels so far", file=sys.stderr)
    (out / "index.json").write_text(json.dumps(captured, indent=1, sort_keys=True))
    (out / "legacy" / "index.json").write_text(json.dumps(legacy, indent=1, sort_keys=True))
    return 0


def _dense_defaults(cc: Any, arch: str, fmt: str, act: str) -> list[Any]:
    """The dense defaults at gpt-oss-120b's dense shapes (the older API held them itself)."""
    if "shapes" not in inspect.signature(cc.dense_candidates).parameters:
        return list(cc.dense_candidates(arch, fmt, act))
    from prepkit.recipes import load_recipe
    from prepkit.tune.dense import dense_shapes

    shapes = {s.name: (s.n, s.k) for s in dense_shapes(load_recipe("gpt-oss-120b").reference_dims)}
    return list(cc.dense_candidates(arch, fmt, act, shapes))


def diff(old: Path, new: Path) -> int:
    a = json.loads((old / "index.json").read_text())
    b = json.loads((new / "index.json").read_text())
    bad = 0
    for key in sorted(set(a) | set(b)):
        if key not in a or key not in b:
            print(f"only in {'new' if key in b else 'old'}: {(a | b)[key]}")
            bad += 1
            continue
        pa = _normalize((old / f"{key}.ptx").read_text())
        pb = _normalize((new / f"{key}.ptx").read_text())
        if pa != pb:
            print(f"PTX differs: {a[key]}")
            bad += 1
    print(f"{len(set(a) & set(b))} kernels compared, {bad} differ or are missing")
    return 1 if bad else 0


if __name__ == "__main__":
    cmd, *paths = sys.argv[1:]
    sys.exit(save(Path(paths[0])) if cmd == "save" else diff(Path(paths[0]), Path(paths[1])))
