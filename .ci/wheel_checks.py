"""Checks that ``.ci/wheel-check`` runs inside the installed wheel, from an unrelated folder.

``python wheel_checks.py data``: the recipes and the bundled DB prepkit resolves are the installed
package's ``prepkit/data/`` files, byte for byte the ``recipes/`` and ``tactics.db`` at the top of
the repository (their sources of truth), and a recipe loads from them.

``python wheel_checks.py show < tactics-show.json``: ``prepkit tactics show --json`` read the DB
shipped inside the installed package and lists its winners.

``python wheel_checks.py lookup``: the runtime's tactic lookup (``make_tactic_lookup``, as
``load_moe_layers`` installs it) for gpt-oss-120b TP 1 on an H100 is served by that DB for both
GEMMs, without a miss, and returns tuned tactics that differ from the built-in default (needs the
``gpu`` extra: the kernel version lives in the kernel module).

Each exits non-zero with the reason on stderr.
"""

from __future__ import annotations

import json
import sqlite3
import sys
import sysconfig
from pathlib import Path

SITE = Path(sysconfig.get_paths()["purelib"]).resolve()
SHIPPED_DB = SITE / "prepkit" / "data" / "tactics.db"
SHIPPED_RECIPES = SITE / "prepkit" / "data" / "recipes"
REPO = Path(__file__).resolve().parent.parent
H100 = "NVIDIA H100 80GB HBM3"


def data() -> str | None:
    import prepkit
    from prepkit import recipes
    from prepkit.data import recipes_dir, tactics_db

    if Path(prepkit.__file__).resolve().parent != SITE / "prepkit":
        return f"prepkit imported from {prepkit.__file__}, not {SITE}"
    if tactics_db().resolve() != SHIPPED_DB or recipes_dir().resolve() != SHIPPED_RECIPES:
        return f"resolved {tactics_db()} and {recipes_dir()}, expected {SHIPPED_DB} and {SHIPPED_RECIPES}"
    pairs = [(SHIPPED_DB, REPO / "tactics.db")]
    pairs += [(SHIPPED_RECIPES / p.name, p) for p in sorted((REPO / "recipes").glob("*.json"))]
    differ = [str(top) for shipped, top in pairs if not shipped.is_file() or shipped.read_bytes() != top.read_bytes()]
    if len(pairs) < 3 or differ:
        return f"the installed files differ from the repository top's: {differ or pairs}"
    recipe = recipes.load_recipe("gpt-oss-120b")
    if recipe.path.resolve().parent != SHIPPED_RECIPES:
        return f"gpt-oss-120b loaded from {recipe.path}"
    print(f"{SHIPPED_DB.parent}: {len(pairs)} files equal to the repository top's; {recipe.name} loads from it")
    return None


def show() -> str | None:
    shown = json.load(sys.stdin)
    db = shown["db"]
    if Path(db).resolve() != SHIPPED_DB:
        return f"tactics show read {db}, not {SHIPPED_DB}"
    gpus = sorted({w["gpu_name"] for w in shown["winners"]})
    if H100 not in gpus:
        return f"tactics show lists no H100 winners (GPUs: {gpus})"
    print(f"{db}: {len(shown['winners'])} winner ranges on {gpus}")
    return None


def _h100_triton_version(db: Path) -> str:
    """The Triton version the shipped H100 rows were tuned with (rows never serve another minor)."""
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        row = conn.execute("SELECT triton_version FROM env WHERE gpu_name = ?", (H100,)).fetchone()
    return row[0] if row else ""


def lookup() -> str | None:
    import warnings

    from prepkit.dims import ModelDims
    from prepkit.kernels.device import DeviceInfo
    from prepkit.kernels.mx import KERNEL_VERSION
    from prepkit.kernels.variants import default_tactics
    from prepkit.layer import rank_layer
    from prepkit.runtime import Environment, TacticResolver, make_tactic_lookup
    from prepkit.tactics.lookup import bundled_db_path

    bundled = bundled_db_path()
    if bundled is None or bundled.resolve() != SHIPPED_DB:
        return f"bundled_db_path() is {bundled}, expected {SHIPPED_DB}"
    device = DeviceInfo(name=H100, capability=(9, 0), sm_count=132, max_shared_mem=232448)
    env = Environment(cc_major=9, cc_minor=0, name=H100, sm_count=132, triton_version=_h100_triton_version(bundled))
    # The runtime's own lookup (what load_moe_layers installs); no user DB, and a miss is an error
    # here, not the warning a user would get before the layer falls back to the built-in default.
    resolver = TacticResolver(user_db="/nonexistent/prepkit-user/tactics.db")
    lookup_fn = make_tactic_lookup(resolver=resolver)
    # gpt-oss-120b, TP 1: every expert local, the full intermediate size valid.
    layer = rank_layer(ModelDims(36, 128, 2880, 2880, 4))
    tuned_points = 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for tokens in (1, 8, 64, 512, 4096):
            problem = layer.problem(tokens)
            got = lookup_fn(problem, env)
            if got is None:
                return f"{tokens} tokens: the runtime lookup returned no tactic (built-in default)"
            default = default_tactics(problem, device)
            tuned_points += got != default
            print(f"{tokens:>5} tokens: gemm1 {got[0]}, gemm2 {got[1]}" + ("" if got != default else " (= default)"))
    stats = resolver.stats()
    sources = set(stats["tables"].values())
    if sources != {"bundled/exact"} or stats["misses"]:
        return f"tables came from {stats['tables']} with {stats['misses']} misses, expected bundled/exact only"
    if not tuned_points:
        return "every tuned tactic equals the built-in default: nothing shows the DB was read"
    print(f"kernel v{KERNEL_VERSION} on {H100} (Triton {env.triton_version}): {stats['tables']}, {stats['hits']} hits")
    return _installed_triton(device)


def _installed_triton(device: object) -> str | None:
    """With the Triton this install resolved (often newer than the shipped rows' minor), the
    runtime's resolver still serves the bundled rows, warning that they come from another Triton."""
    import warnings

    from prepkit.dims import ModelDims
    from prepkit.layer import rank_layer
    from prepkit.runtime import Environment, TacticResolver, make_tactic_lookup
    from prepkit.tactics.resolver import _all_decode

    env = Environment.of(device)
    resolver = TacticResolver(user_db="/nonexistent/prepkit-user/tactics.db", smoke_check=_all_decode)
    lookup_fn = make_tactic_lookup(resolver=resolver)
    problem = rank_layer(ModelDims(36, 128, 2880, 2880, 4)).problem(8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = lookup_fn(problem, env)
    stats = resolver.stats()
    if got is None or stats["misses"]:
        return f"Triton {env.triton_version}: no bundled tactic served ({stats['tables']}, {stats['misses']} misses)"
    other = [str(w.message) for w in caught if "another Triton" in str(w.message)]
    if set(stats["tables"].values()) == {"bundled/triton_minor"} and len(other) != 2:
        return f"Triton {env.triton_version}: rows of another Triton served without one warning per GEMM: {other}"
    print(f"installed Triton {env.triton_version}: {stats['tables']}; gemm1 {got[0]}, gemm2 {got[1]}")
    return None


if __name__ == "__main__":
    checks = {"data": data, "show": show, "lookup": lookup}
    if len(sys.argv) != 2 or sys.argv[1] not in checks:
        sys.exit(f"usage: python {sys.argv[0]} {{{'|'.join(checks)}}}")
    error = checks[sys.argv[1]]()
    if error:
        sys.exit(f"FAIL: {error}")
