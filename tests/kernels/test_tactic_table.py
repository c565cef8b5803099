"""The knob table of GemmTactic: the stored forms it derives (JSON, key) read back unchanged for
every tactic of the bundled DB, and the variant space, families and launch checks follow it."""

from __future__ import annotations

import json
import sqlite3
from dataclasses import fields, replace

import pytest

from prepkit.kernels.tactic import FAMILY_KNOBS, KNOB_NAMES, KNOBS, GemmTactic, knob
from prepkit.tactics.keys import canon, tactic_hash
from prepkit.tactics.lookup import bundled_db_path


def _bundled_tactics() -> list[tuple[str, str]]:
    path = bundled_db_path()
    assert path is not None, "the package ships a tactics DB"
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
        return list(db.execute("SELECT tactic_hash, params_json FROM tactic ORDER BY tactic_hash"))


def _key_as_first_stored(t: GemmTactic) -> str:
    """The key as the first DB rows spelled it, and each later knob's suffix off its default."""
    key = f"m{t.block_m}n{t.block_n}k{t.block_k}w{t.num_warps}s{t.num_stages}sk{t.split_k}"
    for name, tag, default in (("upcast", "u", "bits"), ("weight_load", "l", "ptr"), ("k_loop", "k", "tail"),
                               ("swapped_dot", "d", "split")):  # fmt: skip
        value = getattr(t, name)
        key += "" if value == default else f"{tag}{value}"
    return key


def test_every_bundled_tactic_reads_back_byte_identical() -> None:
    rows = _bundled_tactics()
    assert len(rows) >= 10
    off_default = 0
    for stored_hash, params_json in rows:
        t = GemmTactic.from_json(params_json)
        assert canon(t) == params_json, params_json
        assert t.to_json() == json.dumps(json.loads(params_json), sort_keys=True)
        assert tactic_hash(t.to_json()) == stored_hash
        assert GemmTactic.from_json(t.to_json()) == t
        assert t.key() == _key_as_first_stored(t)
        off_default += any(v != k.default for k, v in t.knob_values() if k.key_omits_default)
    assert off_default > 0  # rows whose keys carry a path suffix are among them


def test_the_table_is_the_dataclass() -> None:
    assert tuple(f.name for f in fields(GemmTactic)) == KNOB_NAMES
    assert GemmTactic() == GemmTactic(**{k.name: k.default for k in KNOBS})
    for k in KNOBS:
        assert k.default in k.domain, k.name
    assert [k.name for k in FAMILY_KNOBS] == ["upcast", "weight_load", "k_loop", "swapped_dot"]


def test_defaults_are_written_only_where_stored_rows_had_them() -> None:
    t = GemmTactic()
    assert json.loads(t.to_json()).keys() == {k.name for k in KNOBS if not k.json_omits_default}
    assert t.key() == "m16n64k128w4s3sk1"
    off_default = replace(t, k_loop="masked", swapped_dot="joined", upcast="asm", weight_load="tma")
    assert off_default.key() == "m16n64k128w4s3sk1uasmltmakmaskeddjoined"
    assert json.loads(off_default.to_json()).keys() == set(KNOB_NAMES)


def test_from_json_refuses_a_field_outside_the_table() -> None:
    with pytest.raises(ValueError, match=r"unknown tactic fields \['epilogue'\]"):
        GemmTactic.from_json('{"block_m": 16, "epilogue": "fused"}')


def test_reject_names_the_knob_and_its_domain() -> None:
    assert knob("block_k").reject(32) == "block_k=32 not in (64, 128, 256)"
    assert knob("upcast").reject("fp8") == "unknown upcast 'fp8' (expected one of ('bits', 'asm', 'dot_scaled'))"
    assert knob("upcast").reject("asm") is None


def test_the_variant_space_spans_the_table() -> None:
    from prepkit.kernels.device import ARCH_DEVICES
    from prepkit.kernels.variants import enumerate_tactics

    space = enumerate_tactics("gemm2", ARCH_DEVICES["sm90"])
    for k in KNOBS:
        assert {getattr(t, k.name) for t in space} == set(k.domain), k.name
    assert space == sorted(space, key=lambda t: tuple(k.domain.index(v) for k, v in t.knob_values()))


def test_launchers_know_every_path_of_the_table() -> None:
    from prepkit.kernels.mx._ids import UPCAST_IDS
    from prepkit.kernels.mx.launch import _check_tactic

    assert set(UPCAST_IDS) == set(knob("upcast").domain)
    base = GemmTactic(16, 64, 128, 4, 3, 1, "bits")
    for k in FAMILY_KNOBS:
        with pytest.raises(ValueError, match=f"gemm2: unknown {k.name} 'bogus'"):
            _check_tactic(replace(base, **{k.name: "bogus"}), "gemm2")
    _check_tactic(replace(base, block_k=32), "gemm2")  # the tile rule, wider than the tuner's sizes
