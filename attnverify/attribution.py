"""Attribution: which features a shrunk failure needs, from its single-feature neighbours.

For every shrunk failure the driver re-judges the failing case with one feature changed at a time,
inside the adapter's claims: B -> 1; heads -> 1; Hkv -> Hq; causal -> none; Lq -> Lk; mask, window,
softcap, ALiBi, dropout off; Lq and Lk -> a multiple of the claimed tile, and -> one tile (tile - 1
when it was not a multiple); dtype -> float32 when claimed; layout -> contiguous; D -> another claimed
head dim; Dv -> D; scale -> default; values -> plain N(0, 1); LSE off; NaN/Inf inputs off; and for a
property judging gradients, the forward alone. A neighbour that passes means the failure needs the
feature ("fails only with" it); one that still fails means it holds without it ("still fails with" the
neighbour); one that cannot be judged (not claimed, or not a case the property judges) leaves it untested:

    fails only with B >= 2; fails only with Lk not a multiple of 64; still fails with causal=none

Every neighbour is judged through the run's runner, i.e. in the forked judging child under crash
isolation (attnverify.isolation): the driving process only edits recipes (plain data) and inspects CPU
probes, as the strategies do; it never calls the adapter or builds a case on its device. A neighbour
the property cannot take (it removes a feature the property always draws) is judged by the property
itself with a stand-in where one makes the case acceptable (STAND_INS: B -> 1 with twice the heads for
batch_head_independence, which needs B >= 2 or Hkv >= 2); else by forward_matches_reference
(gradients_match_reference for a property judging gradients): its pass means the feature is needed, its
failure leaves the feature untested (it may be another bug: docs/reference.md#distinct-bugs). return_lse
is needed only where the output is right (judged with a tile of keys where the case has one key, whose
output no score bug can change). A pass that compared nothing of what failed, and the property's own calls of
other shapes: attnverify.attribution_calls; a KV-cache case's neighbours: attnverify.attribution_cache.

`matches(needs, recipe)` is the filter the continued search uses (properties.driver): a case that has every case
feature of a found bug's needs is that bug again. `signature(needs, describe)` names a distinct bug across
properties and adapters: the same needs are the same bug; a failure that needs nothing is told apart by its shrunk case.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

from .attribution_cache import cache_why, fix_cache
from .attribution_calls import backward_only, judged_nothing, through_calls, with_params
from .attribution_text import attribution_text
from .case import CaseRecipe

DEFAULT_TILE = 64  # the tile used for the length neighbours when the adapter claims none
_FLOAT32 = "float32"
IMPLIED = {"heads": ("gqa",)}  # a need another need implies is not one of its own: Hkv < Hq implies Hq >= 2
_FLAGS = {  # attention_cases' tri-state switches -> whether a recipe has the feature
    "gqa": lambda r: r.heads_q != r.heads_kv,
    "window": lambda r: r.window is not None,
    "softcap": lambda r: r.softcap is not None,
    "alibi": lambda r: bool(r.alibi),
    "attn_mask": lambda r: r.mask != "none",
    "varlen": lambda r: r.seqlens_q is not None,
    "dropout": lambda r: r.dropout_p > 0,
    "return_lse": lambda r: bool(r.return_lse),
    "poison": lambda r: bool(r.poison),
    "lq_ne_lk": lambda r: r.len_q != r.len_k,
    "dv_ne_d": lambda r: r.head_dim_v is not None and r.head_dim_v != r.head_dim,
    "scale": lambda r: r.scale is not None,
}


@dataclass
class Verdict:
    feature: str
    verdict: str  # needed | not needed | untested
    label: str  # what the failure needs: "B >= 2"
    holds: str  # the neighbour: "B=1"
    arg: Any = None  # what `matches` compares with (a tile, a value)
    judged_by: str = ""  # the property that judged the neighbour
    status: str = ""  # the neighbour's status
    why: str = ""  # untested: why

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class Attribution:
    verdicts: List[Verdict] = field(default_factory=list)
    describe: str = ""
    seconds: float = 0.0
    reduced: Any = None  # (drawn, ExampleResult) of a simpler failing neighbour the verdicts are about
    through: str = ""  # the property's own call the verdicts are about (attribution_calls.through_calls)

    @property
    def needs(self) -> List[str]:
        got = {v.feature for v in self.verdicts if v.verdict == "needed"}
        return [v.label for v in self.verdicts if v.verdict == "needed" and not got & set(IMPLIED.get(v.feature, ()))]

    @property
    def holds(self) -> List[str]:
        return [v.holds for v in self.verdicts if v.verdict == "not needed"]

    @property
    def untested(self) -> List[str]:
        return [f"{v.holds} ({v.why})" for v in self.verdicts if v.verdict == "untested"]

    def filter_needs(self) -> List[dict]:
        """The needs a drawn case can have or lack (the forward-only neighbour is not one of them)."""
        if self.through:  # the needs are another call's: the case's own features do not select the bug
            return []
        return [{"feature": v.feature, "arg": v.arg, "label": v.label} for v in self.verdicts
                if v.verdict == "needed" and v.feature in FEATURES]

    def text(self) -> str:
        text = attribution_text(self.needs, self.holds) or "no single-feature neighbour could be judged"
        return f"seen through {self.through} (forward_matches_reference fails there): {text}" if self.through else text

    def signature(self) -> str:
        return signature(self.needs, self.describe)

    def to_dict(self) -> dict:
        return {"needs": self.needs, "holds": self.holds, "untested": self.untested, "text": self.text(),
                "through": self.through,
                "signature": self.signature(), "filter": self.filter_needs(), "seconds": round(self.seconds, 3),
                "verdicts": [v.to_dict() for v in self.verdicts]}


def signature(needs: List[str], describe: str = "") -> str:
    """One distinct bug: its needs (sorted); a bug needing nothing is told apart by its shrunk case."""
    key = {"needs": sorted(needs)} if needs else {"needs": [], "case": describe}
    return hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]


# --------------------------------------------------------------------------------- recipe editing


def _fix(old: CaseRecipe, new: CaseRecipe) -> CaseRecipe:
    """Keep the recipe's index-bearing fields inside the new shape."""
    full_o = (old.batch, old.heads_q, old.len_q, old.len_k)
    full_n = (new.batch, new.heads_q, new.len_q, new.len_k)
    ms = new.mask_shape
    if ms is not None:
        ms = tuple(1 if (m == 1 and fo != 1) else fn for m, fo, fn in zip(ms, full_o, full_n))
    rows = tuple(i for i in new.masked_rows if i < new.len_q)
    kb = new.key_block
    if kb is not None:
        kb = (kb[0], min(kb[1], new.len_k)) if kb[0] < new.len_k else None
    late = new.late_from if new.late_from is not None and new.late_from < new.len_k else None
    poison = []
    for name, b, h, i, d, val in new.poison:
        hh = new.heads_q if name == "q" else new.heads_kv
        ll = new.len_q if name == "q" else new.len_k
        dd = (new.head_dim_v or new.head_dim) if name == "v" else new.head_dim
        poison.append((name, min(b, new.batch - 1), min(h, hh - 1), min(i, max(ll - 1, 0)), min(d, dd - 1), val))
    return fix_cache(dataclasses.replace(new, mask_shape=ms, masked_rows=rows, key_block=kb, late_from=late,
                                         late_boost=new.late_boost if late is not None else 1.0, poison=tuple(poison)))


def _rep(r: CaseRecipe, **kw) -> CaseRecipe:
    return _fix(r, dataclasses.replace(r, **kw))


def _multiple(n: int, t: int) -> int:
    return max(t, t * round(n / t))


def _one_tile(n: int, t: int) -> int:
    return t if n % t == 0 or t == 1 else t - 1


@dataclass(frozen=True)
class Feature:
    key: str
    present: Callable[[CaseRecipe, Any], bool]  # (recipe, arg) -> has the feature
    arg: Callable[[CaseRecipe, dict], Any]  # (failing recipe, context) -> arg
    neighbour: Callable[[CaseRecipe, Any, dict], Optional[CaseRecipe]]
    label: Callable[[CaseRecipe, Any], str]  # what the failure needs
    holds: Callable[[CaseRecipe], str]  # the neighbour, said briefly


def _none(r, ctx):
    return None


def _other_dim(r: CaseRecipe, ctx: dict) -> Optional[int]:
    for d in ctx["head_dims"]:
        if d != r.head_dim:
            return d
    return None


def _values_plain(r):
    return dataclasses.replace(r, q_std=1.0, k_std=1.0, v_std=1.0, v_mean=0.0, late_from=None, late_boost=1.0,
                               equal_scores=False, row_shift=0.0)


def _extreme(r, a=None):
    return (r.q_std, r.k_std, r.v_std, r.v_mean, r.late_from, r.equal_scores, r.row_shift) != (1.0, 1.0, 1.0, 0.0, None, False, 0.0)


_MASK_OFF = dict(mask="none", mask_shape=None, masked_rows=(), key_block=None, masked_garbage=0.0)
_dense = lambda r: r.seqlens_q is None  # noqa: E731 - lengths of a varlen pack are the segments'

FEATURES: Dict[str, Feature] = {f.key: f for f in (
    Feature("batch", lambda r, a: r.batch >= 2, _none, lambda r, a, c: _rep(r, batch=1), lambda r, a: "B >= 2",
            lambda r: "B=1"),
    Feature("heads", lambda r, a: r.heads_q >= 2, _none, lambda r, a, c: _rep(r, heads_q=1, heads_kv=1),
            lambda r, a: "Hq >= 2", lambda r: "one head"),
    Feature("gqa", lambda r, a: r.heads_q != r.heads_kv, _none, lambda r, a, c: _rep(r, heads_kv=r.heads_q),
            lambda r, a: "Hkv < Hq (GQA)", lambda r: "Hkv = Hq"),
    Feature("causal", lambda r, a: r.causal != "none" and (not a or r.causal == a), lambda r, c: r.causal,
            lambda r, a, c: _rep(r, causal="none"), lambda r, a: f"causal={a}", lambda r: "causal=none"),
    Feature("lq_ne_lk", lambda r, a: _dense(r) and r.len_q != r.len_k, _none,
            lambda r, a, c: _rep(r, len_q=r.len_k), lambda r, a: "Lq != Lk", lambda r: "Lq = Lk"),
    Feature("mask", lambda r, a: r.mask != "none" or bool(r.masked_rows) or r.key_block is not None, _none,
            lambda r, a, c: _rep(r, **_MASK_OFF), lambda r, a: "an attention mask", lambda r: "no mask"),
    Feature("window", lambda r, a: r.window is not None, _none, lambda r, a, c: _rep(r, window=None),
            lambda r, a: "a sliding window", lambda r: "no window"),
    Feature("softcap", lambda r, a: r.softcap is not None, _none, lambda r, a, c: _rep(r, softcap=None),
            lambda r, a: "softcap", lambda r: "no softcap"),
    Feature("alibi", lambda r, a: bool(r.alibi), _none, lambda r, a, c: _rep(r, alibi=False),
            lambda r, a: "ALiBi", lambda r: "no ALiBi"),
    Feature("dropout", lambda r, a: r.dropout_p > 0, _none, lambda r, a, c: _rep(r, dropout_p=0.0),
            lambda r, a: "dropout", lambda r: "no dropout"),
    Feature("lk_partial", lambda r, a: _dense(r) and r.len_k % a != 0, lambda r, c: c["tiles"][1],
            lambda r, a, c: _rep(r, len_k=_multiple(r.len_k, a)), lambda r, a: f"Lk not a multiple of {a}",
            lambda r: f"Lk={r.len_k}"),
    Feature("lk_tiles", lambda r, a: _dense(r) and r.len_k > a, lambda r, c: c["tiles"][1],
            lambda r, a, c: _rep(r, len_k=_one_tile(r.len_k, a)), lambda r, a: f"Lk > {a} (several key tiles)",
            lambda r: f"Lk={r.len_k}"),
    Feature("lq_partial", lambda r, a: _dense(r) and r.len_q % a != 0, lambda r, c: c["tiles"][0],
            lambda r, a, c: _rep(r, len_q=_multiple(r.len_q, a)), lambda r, a: f"Lq not a multiple of {a}",
            lambda r: f"Lq={r.len_q}"),
    Feature("lq_tiles", lambda r, a: _dense(r) and r.len_q > a, lambda r, c: c["tiles"][0],
            lambda r, a, c: _rep(r, len_q=_one_tile(r.len_q, a)), lambda r, a: f"Lq > {a} (several query tiles)",
            lambda r: f"Lq={r.len_q}"),
    Feature("dtype", lambda r, a: r.dtype != _FLOAT32, _none, lambda r, a, c: _rep(r, dtype=_FLOAT32),
            lambda r, a: f"a dtype other than float32 ({r.dtype})", lambda r: "float32"),
    Feature("layout", lambda r, a: r.layout != "contiguous" and (not a or r.layout == a), lambda r, c: r.layout,
            lambda r, a, c: _rep(r, layout="contiguous"), lambda r, a: f"layout={a}", lambda r: "contiguous"),
    Feature("head_dim", lambda r, a: r.head_dim == a, lambda r, c: r.head_dim,
            lambda r, a, c: (None if _other_dim(r, c) is None else _rep(r, head_dim=_other_dim(r, c))),
            lambda r, a: f"D={a}", lambda r: f"D={r.head_dim}"),
    Feature("dv", lambda r, a: r.head_dim_v is not None and r.head_dim_v != r.head_dim, _none,
            lambda r, a, c: _rep(r, head_dim_v=None), lambda r, a: "Dv != D", lambda r: "Dv = D"),
    Feature("scale", lambda r, a: r.scale is not None, _none, lambda r, a, c: _rep(r, scale=None),
            lambda r, a: "a custom scale", lambda r: "the default scale"),
    Feature("values", _extreme, _none, lambda r, a, c: _values_plain(r),
            lambda r, a: "extreme values", lambda r: "plain N(0, 1) values"),
    Feature("lse", lambda r, a: bool(r.return_lse), _none, lambda r, a, c: _rep(r, return_lse=False),
            lambda r, a: "return_lse", lambda r: "no LSE"),
    Feature("poison", lambda r, a: bool(r.poison), _none, lambda r, a, c: _rep(r, poison=()),
            lambda r, a: "NaN/Inf inputs", lambda r: "finite inputs"),
)}


def matches(needs: List[dict], recipe: Any) -> bool:
    """Whether a drawn case has every case feature in `needs` (a `filter_needs()` list): then it is
    the found bug again, and the continued search skips it."""
    if not needs:
        return False
    try:
        r = recipe if isinstance(recipe, CaseRecipe) else CaseRecipe.from_dict(dict(recipe))
    except Exception:  # noqa: BLE001 - not a recipe: not this bug
        return False
    for n in needs:
        f = FEATURES.get(n.get("feature"))
        if f is None or not f.present(r, n.get("arg")):
            return False
    return True


# ------------------------------------------------------------------------------------ judging


def _fits(prop, adapter, r: CaseRecipe) -> Optional[str]:
    """Why `prop` would not draw `r` (None: it would): its keep() filter and the switches it forces."""
    from .properties import CaseProperty

    if not isinstance(prop, CaseProperty):
        return None
    if not prop.keep(r):
        return f"{prop.name} judges no such case"
    kw = prop.kwargs(adapter)
    for name, has in _FLAGS.items():
        v = kw.get(name)
        if v is True and not has(r):
            return f"{prop.name} always draws {name}"
        if v is False and has(r):
            return f"{prop.name} never draws {name}"
    for name, value in (("causal", r.causal), ("layouts", r.layout), ("dtypes", r.dtype)):
        allowed = kw.get(name)
        if allowed is not None and value not in tuple(allowed):
            return f"{prop.name} draws {name} {tuple(allowed)} only"
    if kw.get("batch") is not None and r.batch != kw["batch"]:
        return f"{prop.name} draws B={kw['batch']} only"
    fm = kw.get("fully_masked")
    if fm is not None or adapter.claims.fully_masked == "unsupported":
        from .strategies import fully_masked_row_count

        n = fully_masked_row_count(r)
        if fm is True and not n:
            return f"{prop.name} always draws fully-masked rows"
        if (fm is False or adapter.claims.fully_masked == "unsupported") and n:
            return "it would mask whole rows, which are not claimed"
    return None


def _claims_why(adapter, r: CaseRecipe) -> Optional[str]:
    from .case import build_probe
    from .check import unclaimed
    try:
        return unclaimed(adapter, build_probe(r))  # a CPU probe: never starts CUDA here
    except Exception as e:  # noqa: BLE001
        return cache_why(r) or f"cannot be built ({type(e).__name__}: {e})"


def _base_property(prop, adapter, backward: bool):
    from .properties import get_property

    name = "gradients_match_reference" if backward and adapter.claims.backward else "forward_matches_reference"
    p = get_property(name)
    return None if p is prop or p.why_skipped(adapter) else p


# stand-ins: a neighbour the property does not judge because it removed a feature the property asks for in one of
# several ways (batch_head_independence: B >= 2 or Hkv >= 2) is judged by the property itself with another of those
# ways in its place; the stand-in of a feature never re-adds that feature
STAND_INS = (
    ("batch", lambda r: r.batch < 2, lambda r: _rep(r, batch=2), lambda r: "B=2"),
    ("heads", lambda r: True, lambda r: _rep(r, heads_q=2 * r.heads_q, heads_kv=2 * r.heads_kv),
     lambda r: f"Hq={r.heads_q} Hkv={r.heads_kv}"),
)
_SAME_FAMILY = {"batch": ("batch",), "heads": ("heads", "gqa")}


def _stand_in(prop, adapter, r: CaseRecipe, nb: CaseRecipe, v: Verdict):
    """(the neighbour with a stand-in feature, what stands in) that `prop` judges and the claims cover,
    or None."""
    f = FEATURES.get(v.feature)
    for key, applies, edit, said in STAND_INS:
        if v.feature in _SAME_FAMILY[key] or not applies(nb):
            continue
        alt = edit(nb)
        if f is not None and f.present(alt, v.arg):
            continue
        if _claims_why(adapter, alt) is None and _fits(prop, adapter, alt) is None:
            return alt, said(alt)
    return None


def _output_wrong(prop, adapter, nb: CaseRecipe, runner, journal, ctx: dict, judged: bool = False) -> bool:
    """Whether forward_matches_reference fails on the output of `nb` (the case without the LSE; `judged`:
    judged there and passed). On one key a row's output is that key's value whatever its score (softmax
    over one key is 1), so a one-key `nb` is also judged with a key tile of keys."""
    base = _base_property(prop, adapter, backward=False)
    todo = [] if judged else [nb]
    if _dense(nb) and nb.len_k == 1:
        todo.append(_rep(nb, len_k=max(2, ctx["tiles"][1])))
    for case in todo if base is not None else ():
        if _claims_why(adapter, case) or _fits(base, adapter, case):
            continue
        nd = {"recipe": case.to_dict()}
        res = runner(base, adapter, nd)
        if journal is not None:
            journal({"event": "neighbour", "property": prop.name, "judged_by": base.name, "feature": "lse",
                     "drawn": nd, "status": res.status, "passed": res.passed})
        if not res.passed and res.status != "skipped":
            return True
    return False


def _is_backward(prop) -> bool:
    return bool(getattr(prop, "backward_cases", False)) or "backward" in tuple(getattr(prop, "needs", ()))


def context(adapter, profile: str) -> dict:
    from .strategies import head_dim_candidates, profile_limits

    t = tuple(adapter.claims.tiles or ()) or (DEFAULT_TILE, DEFAULT_TILE)
    tiles = (int(t[0]), int(t[-1]))
    return {"tiles": tiles, "head_dims": head_dim_candidates(adapter.claims, profile_limits(profile).head_dims)}


# features whose neighbour is a simpler case: a failing one becomes the case attributed (an unshrunk
# @example failure, or one the shrinking budget cut short, is reduced to what it needs)
REDUCING = ("batch", "heads", "gqa", "causal", "mask", "window", "softcap", "alibi", "dropout", "lk_tiles",
            "lq_tiles", "dtype", "layout", "dv", "scale", "values", "lse", "poison")
MAX_PASSES = 4


def attribute(prop, adapter, drawn: Any, runner, *, profile: str = "dev", describe: str = "",
              journal: Optional[Callable[[dict], None]] = None, result: Any = None) -> Optional[Attribution]:
    """Judge the single-feature neighbours of a shrunk failing example through `runner`; None when the
    example holds no recipe (nothing to vary). A neighbour that is simpler and still fails becomes the
    case (`Attribution.reduced`: (drawn, ExampleResult)), and its neighbours are judged in turn.
    `result` (the example's ExampleResult): for a property that judges gradients beside other things
    (outputs_fully_written), a failing call whose output matched and whose gradients did not needs the
    backward."""
    recipe = drawn.get("recipe") if isinstance(drawn, dict) else None
    if recipe is None:
        return None
    t0 = time.perf_counter()
    r = CaseRecipe.from_dict(dict(recipe))
    params = {k: v for k, v in drawn.items() if k != "recipe"}
    ctx = context(adapter, profile)
    reduced = None
    cur = result
    for i in range(MAX_PASSES + 1):
        verdicts, step = _judge_all(prop, adapter, r, params, runner, ctx, journal, reduce=i < MAX_PASSES,
                                    failing=cur)
        if step is None:  # nothing simpler fails: the verdicts are all about r
            break
        r, reduced, cur = step[0], step, step[1]
    if not _is_backward(prop) and backward_only(cur):
        verdicts.append(Verdict("backward", "needed", "the backward", "the forward alone (the failing call's "
                                "output matched; only its gradients did not)", judged_by=prop.name, status="failed"))
    out = Attribution(verdicts=verdicts, describe=describe)
    if reduced is not None:
        out.reduced = ({"recipe": r.to_dict(), **params}, reduced[1])
        out.describe = (reduced[1].case or {}).get("describe") or describe
    if not out.needs:  # no feature of the case explains it: maybe one of the property's own calls does
        kit = dict(attribute=attribute, fix=_fix, claims_why=_claims_why, fits=_fits, features=FEATURES, context=context)
        sub = through_calls(prop, adapter, r, params, runner, kit=kit, failing=cur, profile=profile, journal=journal)
        if sub is not None:
            out.verdicts, out.through = sub[0].verdicts, sub[1]
    out.seconds = time.perf_counter() - t0
    return out


def _judge_all(prop, adapter, r: CaseRecipe, params: dict, runner, ctx: dict, journal, reduce: bool,
               failing: Any = None):
    """-> (verdicts about r, None); when reducing, every simpler neighbour that still fails replaces r as
    it is met, and the result is (verdicts, (the reduced r, its result)) if any did. `failing`: r's failing
    ExampleResult, when known (a neighbour's pass that compared none of what failed there proves nothing)."""
    verdicts: List[Verdict] = []
    step = None
    for key in list(FEATURES) + ["backward"]:
        if key == "backward":
            if not _is_backward(prop):
                continue
            judge = _base_property(prop, adapter, backward=False)
            v = Verdict("backward", "untested", "the backward", "the forward alone")
            if judge is None:
                v.why = "forward_matches_reference does not apply"
            nb = r if judge is not None else None
        else:
            f = FEATURES[key]
            arg = f.arg(r, ctx)
            if not f.present(r, arg):
                continue
            judge = prop
            v = Verdict(f.key, "untested", f.label(r, arg), "", arg=arg)
            nb = f.neighbour(r, arg, ctx)
            if nb is None:
                v.holds, v.why = "(no neighbour)", "no other value is claimed"
            else:
                v.holds = f.holds(nb)
        verdicts.append(v)
        if nb is None or judge is None:
            continue
        claims_why = _claims_why(adapter, nb)
        why = claims_why or _fits(judge, adapter, nb)
        stood_in = False
        if why and judge is prop and not claims_why:  # the property requires the feature
            alt = _stand_in(prop, adapter, r, nb, v)
            if alt is not None:  # the property judges it itself, another feature in its place
                nb, stood_in, why = alt[0], True, None
                v.holds = f"{v.holds} ({alt[1]} in its place)"
            else:
                base = _base_property(prop, adapter, _is_backward(prop))
                if base is not None and _fits(base, adapter, nb) is None:
                    judge, why = base, None
        if why:
            v.why = why
            continue
        nb = nb if judge is prop else with_params(nb, params, adapter)  # sinks drawn beside the recipe join it
        nd = {"recipe": nb.to_dict(), **(params if judge is prop else {})}
        res = runner(judge, adapter, nd)
        v.judged_by, v.status = judge.name, res.status
        if journal is not None:
            journal({"event": "neighbour", "property": prop.name, "judged_by": judge.name, "feature": v.feature,
                     "drawn": nd, "status": res.status, "passed": res.passed})
        if res.status == "skipped":
            v.why = (res.message or "skipped").splitlines()[0]
            continue
        if not res.passed and judge is not prop and v.feature != "backward":
            # always drawn, no stand-in fits: the base failing without it may be another bug; it says nothing
            v.why = f"{prop.name} always draws it; {judge.name} fails without it too: maybe another bug"
            continue
        if res.passed and v.feature == "lse" and _output_wrong(prop, adapter, nb, runner, journal, ctx,
                                                               judged=judge is not prop):
            # the property sees it only through the LSE, but the output is wrong there too (or, on one key, with a
            # tile of keys): the LSE is how this property sees the bug, not what the bug needs
            v.why = f"{prop.name} sees it only through the LSE; forward_matches_reference fails on the output too"
            continue
        blind = judged_nothing(failing, res) if res.passed and judge is prop else None
        if blind:
            # e.g. nonfinite_inputs_propagate with one head: a poisoned key makes every row NaN, and the
            # rows the failure was in are no longer judged; the pass says nothing about the feature
            v.why = f"{prop.name} judges none of {blind} there (every element excluded): nothing seen"
            continue
        v.verdict = "needed" if res.passed else "not needed"
        if reduce and not res.passed and judge is prop and not stood_in and (
                v.feature in REDUCING or (v.feature == "head_dim" and nb.head_dim < r.head_dim)):
            r = nb
            step = (nb, res)
    return verdicts, step
