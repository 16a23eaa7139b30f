"""benchmarks/calibrate_tolerances.py --shape-pool and benchmarks/tolerance_tables.py --merge: the pooled cases
keep a pool entry's structure (what a compiled kernel specialises on) and draw fresh data; merged shards count
every case once and take the worst over all of them."""
import dataclasses
import importlib.util
import json
import pathlib
import random

from attnverify.adapters import registry

BENCH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_pooled_cases_reuse_the_pools_structures_with_fresh_seeds_and_values():
    cal = _load("calibrate_tolerances")
    a = registry.get("naive")
    rng = random.Random(0)
    pool = [cal.random_recipe(rng, a, "float16", "cpu", False, 64, 64) for _ in range(3)]
    assert all(r.len_q <= 64 and r.len_k <= 64 and r.head_dim <= 64 for r in pool)
    values = set(cal._VALUE_FIELDS) | {"seed"}

    def structure(r):
        return {f.name: getattr(r, f.name) for f in dataclasses.fields(r) if f.name not in values}

    drawn = [cal.pooled_recipe(rng, a, pool) for _ in range(40)]
    keys = [structure(p) for p in pool]
    assert all(structure(r) in keys for r in drawn)  # nothing but the seed and the values changes
    assert len({r.seed for r in drawn}) == 40
    assert len({structure(r)["len_k"] for r in drawn}) == len({k["len_k"] for k in keys})  # every entry used
    kinds = {(r.q_std, r.row_shift, r.late_from is not None, r.equal_scores, r.v_mean) for r in drawn}
    assert len(kinds) > 3  # adversarial values drawn afresh, not copied from the pool


def test_merged_shards_count_every_case_and_keep_the_worst(tmp_path, capsys):
    tab = _load("tolerance_tables")

    def shard(seed, ratios, failures=()):
        d = {"torch": "x", "device": "cpu", "gpu": None, "seed": seed,
             "summary": {"naive/float16": {"status_passed": len(ratios) - len(failures), "status_failed": len(failures)}},
             "values": {"naive/float16": {"out_norm_vs_bound": ratios, "dq_elem_vs_bound": [r / 2 for r in ratios]}},
             "failures": list(failures)}
        p = tmp_path / f"s{seed}.json"
        p.write_text(json.dumps(d))
        return str(p)

    fp = {"adapter": "naive", "dtype": "float16", "status": "failed", "message": "out: MISMATCH\n  Relative L2 error: 2"}
    paths = [shard(1, [0.1, 0.2, 0.3]), shard(2, [0.5, 1.2], [fp])]
    rows = tab.rows(paths, merge=True)
    (r,) = rows.values()
    assert r["seeds"] == [1, 2] and sum(r["status"].values()) == 5
    assert r["metric"]["out_norm_vs_bound"]["max"] == 1.2 and r["metric"]["out_norm_vs_bound"]["n"] == 5
    tab.main(["--merge", *paths])
    line = capsys.readouterr().out.strip().splitlines()[-1]
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[3] == "5" and cells[7] == "1" and cells[8] == "1.20"  # cases, false positives, worst
    assert len(tab.rows(paths, merge=False)) == 2  # without --merge: a row per file


def test_head_dims_option_draws_only_the_listed_dims_and_refuses_an_empty_set():
    """--head-dims keeps a declared finding's head dims out of a row (flash-attn4's F18): only the listed dims that
    the adapter claims are drawn, and a list the adapter claims none of is an error naming the option."""
    import pytest

    cal = _load("calibrate_tolerances")
    a = registry.get("naive")
    rng = random.Random(1)
    drawn = {cal.random_recipe(rng, a, "float16", "cpu", False, 64, 0, [24, 96]).head_dim for _ in range(60)}
    assert drawn == {24, 96}
    fussy = dataclasses.replace(a, claims=dataclasses.replace(a.claims, head_dims=lambda d: d % 8 == 0))
    with pytest.raises(SystemExit, match="--head-dims"):
        cal.random_recipe(rng, fussy, "float16", "cpu", False, 64, 0, [59, 111])
    with pytest.raises(SystemExit):
        cal.main(["--head-dims", "x,64", "--n", "1"])
