"""The adapter contract: `@av.adapter(name, **claims)` turns a function into an `Adapter`.

Every keyword defaults to the least claim (fp32 only, cpu only, no optional feature, no backward),
so an adapter is never tested on something it did not promise.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, Optional, Tuple, Union


from ..spec import CAUSAL_MODES, FULLY_MASKED_MODES, KEYLESS_LSE_MODES
from ..devices import cuda_present
from ..timesplit import phase

KNOWN_DTYPES = ("float16", "bfloat16", "float32", "float64", "float8_e4m3fn", "float8_e5m2")
KNOWN_DEVICES = ("cpu", "cuda")
MEMORY_MODES = ("quadratic", "linear")
SINK_DTYPES = ("float32", "input")
DEFAULT_HEAD_DIMS = (16, 32, 64, 128)
DEFAULT_PAGE_SIZES = (1, 3, 7, 16, 64, 128, 256)


@dataclass(frozen=True)
class Claims:
    dtypes: Tuple[str, ...] = ("float32",)
    devices: Tuple[str, ...] = ("cpu",)
    head_dims: Union[Tuple[int, ...], Callable[[int], bool]] = DEFAULT_HEAD_DIMS
    max_seqlen: int = 4096
    causal: Tuple[str, ...] = ("none",)
    window: bool = False
    softcap: bool = False
    alibi: bool = False
    attn_mask: bool = False
    gqa: bool = False
    varlen: bool = False
    dropout: bool = False
    backward: bool = False
    lse: bool = False
    dv_ne_d: bool = False  # value head dim may differ from the query/key head dim
    fully_masked: str = "unsupported"
    # with fully_masked="zeros" and lse: the LSE of a row with no visible key (and no sink), "-inf" (the reference's)
    # or "+inf" (FlashMLA's, FA2/FA3's stored softmax_lse); verdicts.keyless_lse_expected is the one rule
    keyless_lse: str = "-inf"
    # with sinks and lse: whether the returned LSE has the sink in its sum (the contract's, FA4's) or is over the
    # visible keys only (False: FlashMLA's attn_sink, "no affect on the returned softmax_lse"); the output has the
    # sink in its denominator either way. lse_conventions.py is the one rule
    sink_in_lse: bool = True
    deterministic: bool = False
    tiles: Optional[Tuple[int, int]] = None
    memory: str = "quadratic"
    # serving (attnverify/paged.py): a contiguous KV cache with cache_seqlens / cache_batch_idx, a paged
    # one (block_table) with these page sizes, k_new/v_new appended into the cache, num_splits values
    kv_cache: bool = False
    paged: bool = False
    page_sizes: Union[Tuple[int, ...], Callable[[int], bool]] = DEFAULT_PAGE_SIZES
    append: bool = False
    num_splits: Tuple[int, ...] = ()
    cache_leftpad: bool = False  # spec.cache_leftpad: batch b's keys start at slot cache_leftpad[b] (paged.py)
    # issue 23 (docs/adapters.md): learnable per-head sinks (forward; their gradient with backward),
    # chunked local attention (Spec.attention_chunk)
    sinks: bool = False
    # the dtype the library takes sink logits in: "float32" (SPEC's) or "input" (the query's dtype, e.g. onnxruntime's
    # `head_sink` of type T): then the sinks drawn for this adapter are representable in the input dtype, so that the
    # rounding its own interface forces is not counted as the kernel's error (attnverify.sink_logits)
    sink_dtype: str = "float32"
    attention_chunk: bool = False
    # fp8 inputs with spec.q_descale / k_descale / v_descale, float32 (B, Hkv) (FA3's convention; attnverify/fp8.py)
    descales: bool = False
    # MLA's absorbed form with one latent: the kernel reads V as the first Dv columns of K (FlashMLA's
    # flash_mla_with_kvcache has no V argument); only mla_latent_views draws such cases, every other property skips
    latent_kv: bool = False

    def page_size_ok(self, s: int) -> bool:
        ps = self.page_sizes
        return bool(ps(s)) if callable(ps) else s in ps

    def head_dim_ok(self, d: int) -> bool:
        hd = self.head_dims
        return bool(hd(d)) if callable(hd) else d in hd

    def head_dim_choices(self, candidates: Iterable[int]) -> Tuple[int, ...]:
        return tuple(d for d in candidates if self.head_dim_ok(d))

    def feature(self, name: str) -> bool:
        if name == "causal":
            return any(c != "none" for c in self.causal)
        return bool(getattr(self, name))

    def summary(self) -> str:
        feats = [f for f in ("window", "softcap", "alibi", "attn_mask", "gqa", "varlen", "dropout", "backward", "lse",
                             "deterministic", "kv_cache", "paged", "append", "cache_leftpad", "sinks", "attention_chunk",
                             "descales", "latent_kv") if getattr(self, f)]
        hd = "predicate" if callable(self.head_dims) else ",".join(map(str, self.head_dims))
        causal = "/".join(c for c in self.causal)
        return (
            f"dtypes={','.join(self.dtypes)} devices={','.join(self.devices)} head_dims={hd} max_seqlen={self.max_seqlen} "
            f"causal={causal} fully_masked={self.fully_masked} memory={self.memory}"
            + (f" tiles={self.tiles}" if self.tiles else "")
            + (f" num_splits={','.join(map(str, self.num_splits))}" if self.num_splits else "")
            + (f" sink_dtype={self.sink_dtype}" if self.sink_dtype != "float32" else "")
            + (f" keyless_lse={self.keyless_lse}" if self.keyless_lse != "-inf" else "")
            + (" sink_in_lse=False" if not self.sink_in_lse else "")
            + (" " + " ".join(feats) if feats else "")
        )


def _validate_claims(name: str, kw: dict) -> Claims:
    def bad(arg, why):
        return ValueError(f"attnverify.adapter({name!r}, {arg}=...): {why}")

    c = dict(kw)
    for arg, eg in (("dtypes", "('float16', 'bfloat16')"), ("devices", "('cuda',)"), ("head_dims", "(64, 128)"),
                    ("tiles", "(128, 64)")):
        v = c.get(arg)
        if v is not None and not callable(v) and (isinstance(v, (str, int, float)) or not hasattr(v, "__iter__")):
            raise bad(arg, f"{v!r} is one value; give a tuple, e.g. {arg}={eg}"
                      + (", or a predicate int -> bool" if arg == "head_dims" else ""))
    flags = sorted(f.name for f in dataclasses.fields(Claims) if isinstance(f.default, bool))
    for arg in flags:
        if arg in c and not isinstance(c[arg], bool):
            raise bad(arg, f"a claim that is on or off: give True or False, not {c[arg]!r}")
    if "dtypes" in c:
        c["dtypes"] = tuple(str(d).replace("torch.", "") for d in c["dtypes"])
        for d in c["dtypes"]:
            if d not in KNOWN_DTYPES:
                raise bad("dtypes", f"unknown dtype {d!r}; use names from {KNOWN_DTYPES}")
    if "devices" in c:
        c["devices"] = tuple(c["devices"])
        for d in c["devices"]:
            if d not in KNOWN_DEVICES:
                raise bad("devices", f"unknown device {d!r}; use {KNOWN_DEVICES}")
    if "causal" in c:
        cv = c["causal"]
        if cv is True:
            raise bad("causal", "give the alignments, e.g. causal=('none', 'bottom_right'), not True")
        cv = (cv,) if isinstance(cv, str) else tuple(cv) if cv else ("none",)
        for m in cv:
            if m not in CAUSAL_MODES:
                raise bad("causal", f"unknown alignment {m!r}; use {CAUSAL_MODES}")
        c["causal"] = cv
    if "head_dims" in c and not callable(c["head_dims"]):
        hd = tuple(int(x) for x in c["head_dims"])
        if not hd or any(x <= 0 for x in hd):
            raise bad("head_dims", "give positive ints, e.g. (64, 128), or a predicate int -> bool")
        c["head_dims"] = hd
    if c.get("fully_masked", "unsupported") not in FULLY_MASKED_MODES:
        raise bad("fully_masked", f"must be one of {FULLY_MASKED_MODES}")
    if c.get("keyless_lse", "-inf") not in KEYLESS_LSE_MODES:
        raise bad("keyless_lse", f"{c['keyless_lse']!r}: use one of {KEYLESS_LSE_MODES} (the LSE your kernel returns on "
                                 f"a row with no visible key; FlashMLA's is '+inf')")
    if c.get("keyless_lse", "-inf") != "-inf" and (c.get("fully_masked") != "zeros" or not c.get("lse")):
        raise bad("keyless_lse", "is the LSE of a keyless row whose output is 0: claim fully_masked='zeros' and lse=True "
                                 "too, or leave keyless_lse out")
    if c.get("sink_in_lse", True) is False and (not c.get("sinks") or not c.get("lse")):
        raise bad("sink_in_lse", "says whether the returned LSE has the sink in its sum: claim sinks=True and lse=True "
                                 "too, or leave sink_in_lse out")
    if c.get("memory", "quadratic") not in MEMORY_MODES:
        raise bad("memory", f"must be one of {MEMORY_MODES}")
    if c.get("tiles") is not None:
        t = tuple(int(x) for x in c["tiles"])
        if len(t) != 2 or min(t) <= 0:
            raise bad("tiles", "give (BLOCK_M, BLOCK_N), e.g. (128, 64)")
        c["tiles"] = t
    if "max_seqlen" in c and int(c["max_seqlen"]) < 1:
        raise bad("max_seqlen", "must be >= 1")
    if c.get("sink_dtype", "float32") not in SINK_DTYPES:
        raise bad("sink_dtype", f"{c['sink_dtype']!r}: use one of {SINK_DTYPES} ('input': the library takes sink "
                                f"logits in the query's dtype)")
    if c.get("sink_dtype", "float32") != "float32" and not c.get("sinks"):
        raise bad("sink_dtype", "says how sinks are passed: claim sinks=True too, or leave sink_dtype out")
    if "descales" in c and not isinstance(c["descales"], bool):
        raise bad("descales", f"must be True or False, got {c['descales']!r}")
    if c.get("descales") and not any(d.startswith("float8") for d in c.get("dtypes", ())):
        raise bad("descales", "descales scale fp8 inputs: add 'float8_e4m3fn' and/or 'float8_e5m2' to dtypes")
    if c.get("latent_kv"):
        hd = c.get("head_dims", DEFAULT_HEAD_DIMS)
        ok = lambda d: bool(hd(d)) if callable(hd) else d in hd  # noqa: E731
        if not c.get("dv_ne_d") or not any(ok(d) and ok(dv) for d, dv in ((576, 512), (192, 128))):
            raise bad("latent_kv", "V read as the first Dv columns of K is MLA's absorbed form: claim dv_ne_d=True and "
                                   "the head dims of a pair, e.g. head_dims=(576, 512) (or 192 and 128)")
    from ._serving_claims import validate_serving_claims

    validate_serving_claims(c, bad)
    known = {f.name for f in dataclasses.fields(Claims)}
    unknown = set(c) - known
    if unknown:
        raise TypeError(f"attnverify.adapter({name!r}): unknown keyword(s) {sorted(unknown)}; known: {sorted(known)}")
    return Claims(**c)


@dataclass
class Adapter:
    """A named attention implementation plus what it claims."""

    name: str
    fn: Callable
    claims: Claims = field(default_factory=Claims)
    description: str = ""
    # Returns None when usable here, else the reason (library missing, no device, ...).
    availability: Optional[Callable[[], Optional[str]]] = None
    # Optional per-case veto for limits the claims cannot express; returns a reason or None.
    refuses: Optional[Callable[[Any], Optional[str]]] = None
    # property name -> why it fails: a known, documented finding about the implementation (a library
    # bug with its evidence). The property still runs; its failure is reported as a known finding
    # (pytest xfail), and a pass as XPASS, so a fix upstream shows.
    known_failures: Dict[str, str] = field(default_factory=dict)
    # property name -> regular expression a failure's message must match to be that known finding
    # (from known_failures={prop: {"why": ..., "match": ...}}); a failure that does not match is new
    known_patterns: Dict[str, str] = field(default_factory=dict)
    # the declared findings that a run may not show ({"strict": False}: intermittent, or seen only by rare
    # draws): a pass of such a property is a pass, not a strict XPASS
    known_not_strict: Tuple[str, ...] = ()
    # Seconds one example may take at the least under subprocess isolation, whatever --attn-timeout says:
    # for adapters whose first call on a new shape compiles (torch.compile'd flex on a CPU: minutes).
    min_timeout: Optional[float] = None
    # Called once before the run's first property, in the process that forks the judges (the plugin's session
    # start): for what must happen before a library is first imported, e.g. switching the Triton interpreter on.
    prepare: Optional[Callable[[], None]] = None
    # Why `attnverify run` without --adapter leaves this built-in out on a machine without a GPU (its measured
    # time there); None: it runs by default wherever it is available
    on_request_cpu: Optional[str] = None
    # `prewarm(scratch)`: a context manager inside which this adapter's calls (forward and backward) compile their
    # kernels and run none, or None where nothing would compile (attnverify.prewarm, `--attn-prewarm`; only
    # adapters with a JIT have one; `scratch`: a folder the pre-warm's processes share)
    prewarm: Optional[Callable[[str], Any]] = None

    def __call__(self, q, k, v, spec):
        with phase("adapter"):  # the example's time split (attnverify.timesplit); free when not timed
            return self.fn(q, k, v, spec)

    def unavailable_reason(self) -> Optional[str]:
        if self.availability is not None:
            try:
                why = self.availability()
            except Exception as e:  # an availability probe must never crash the tool
                return f"availability check raised {type(e).__name__}: {e}"
            if why:
                return why
        if not any(_device_present(d) for d in self.claims.devices):
            return f"no device among its claimed devices {self.claims.devices} is present here"
        return None

    def known_finding(self, prop: str, message: str) -> Optional[str]:
        """The declared reason when this failure of `prop` (its message) is a declared known finding, else
        None (a new failure): declared for `prop`, and its `match`, if any, found in the message (re.search)."""
        why = self.known_failures.get(prop)
        pattern = self.known_patterns.get(prop)
        if why and (pattern is None or re.search(pattern, message or "")):
            return why
        return None

    def classify(self, prop: str, message: Optional[str]) -> Tuple[str, str]:
        """The one classifier of a property's result for this adapter (plugin, CLI and tests):
        `message` None for a pass, else the failure's text. Returns (outcome, note):
        "passed"; "xpass" (a declared finding did not reproduce: remove it from known_failures);
        "known" (note: the declared reason); "failed" (note: why a declaration did not cover it, or "")."""
        why = self.known_failures.get(prop)
        if message is None:
            if why and prop in self.known_not_strict:
                return "passed", (f"{self.name}'s declared finding for {prop} did not show in this run (declared "
                                  f"not strict: {why})")
            if why:
                return "xpass", (f"{self.name} declares a known finding for {prop} ({why}), but it did not reproduce: "
                                 f"if it is fixed, remove it from known_failures")
            return "passed", ""
        known = self.known_finding(prop, message)
        if known:
            return "known", known
        if why:
            return "failed", (f"note: {self.name} declares a known finding for {prop} ({why}), but this failure does "
                              f"not match it (/{self.known_patterns.get(prop)}/): it is a new failure")
        return "failed", ""

    def run_device(self, preference: str = "auto") -> str:
        """The device cases for this adapter are made on: cuda when claimed and present (auto)."""
        if preference not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device={preference!r}: use auto, cpu or cuda")
        if preference != "auto":
            return preference
        if "cuda" in self.claims.devices and _device_present("cuda"):
            return "cuda"
        return "cpu" if "cpu" in self.claims.devices else self.claims.devices[0]


def _device_present(dev: str) -> bool:
    if dev == "cpu":
        return True
    if dev == "cuda":
        return cuda_present()  # NVML: no CUDA context, fork stays safe
    return False


def validate_known_failures(name: str, known) -> Tuple[Dict[str, str], Dict[str, str], Tuple[str, ...]]:
    """{property name: reason} or {property name: {"why": reason, "match": regex, "strict": bool}} ->
    (reasons, patterns, not_strict). Each reason says what fails and where the evidence is; a `match` narrows the
    finding to failures whose message it matches (re.search), so the declaration cannot hide a different failure
    of the property; `"strict": False` (default True) for a finding a run may not show (intermittent, or only on
    rare draws; the reason says why): its property passing is then a pass, not a strict XPASS."""
    usage = (f"attnverify.adapter({name!r}, known_failures=...): give a dict of property name -> reason, e.g. "
             "{'nonfinite_inputs_propagate': 'swallows NaN rows (upstream issue #123)'}, or -> {'why': reason, "
             "'match': a regular expression the failure's message must match, 'strict': False for a finding a run "
             "may not show}")
    if known is None:
        return {}, {}, ()
    if not isinstance(known, dict) or not all(isinstance(k, str) for k in known):
        raise TypeError(usage)
    if known:
        from ..properties import PROPERTIES  # lazily: the properties import this module

        names = [p.name for p in PROPERTIES]
        for prop in known:
            if prop not in names:
                raise ValueError(f"attnverify.adapter({name!r}, known_failures={{{prop!r}: ...}}): unknown property "
                                 f"{prop!r}; use a property name: {', '.join(names)}")
    reasons, patterns, not_strict = {}, {}, []
    for prop, v in known.items():
        if isinstance(v, dict):
            extra = sorted(set(v) - {"why", "match", "strict"})
            if extra or "why" not in v:
                raise TypeError(f"attnverify.adapter({name!r}, known_failures[{prop!r}]={v!r}): "
                                + (f"unknown key(s) {extra}" if extra else "no 'why'")
                                + "; give {'why': the reason and its evidence, 'match': an optional regular "
                                  "expression the failure's message must match, 'strict': False for a finding a "
                                  "run may not show}")
            why, pattern = v["why"], v.get("match")
            if not isinstance(v.get("strict", True), bool):
                raise TypeError(f"attnverify.adapter({name!r}, known_failures[{prop!r}]['strict']="
                                f"{v['strict']!r}): give True (the default: a pass is a strict XPASS) or False "
                                f"(a run may not show the finding: a pass is a pass)")
            if v.get("strict") is False:
                not_strict.append(prop)
        else:
            why, pattern = v, None
        if not isinstance(why, str) or not why.strip() or not (pattern is None or isinstance(pattern, str)):
            raise TypeError(usage)
        if pattern is not None:
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(f"attnverify.adapter({name!r}, known_failures[{prop!r}]['match']={pattern!r}): "
                                 f"not a regular expression ({e})") from None
            patterns[prop] = pattern
        reasons[prop] = why
    return reasons, patterns, tuple(not_strict)


def _validate_min_timeout(name: str, min_timeout) -> Optional[float]:
    if min_timeout is not None and not (isinstance(min_timeout, (int, float)) and not isinstance(min_timeout, bool)
                                        and 0 < min_timeout < float("inf")):
        raise ValueError(f"attnverify.adapter({name!r}, min_timeout={min_timeout!r}): give seconds > 0 (the least "
                         f"time one example may take, e.g. 600 for an adapter that compiles), or leave it out")
    return None if min_timeout is None else float(min_timeout)


def adapter(name: str, *, description: str = "", availability=None, refuses=None, register: bool = True,
            known_failures: Optional[Dict[str, Any]] = None, min_timeout: Optional[float] = None,
            deferred_claims: Optional[Callable[[], Dict[str, Any]]] = None,
            prepare: Optional[Callable[[], None]] = None, on_request_cpu: Optional[str] = None,
            prewarm: Optional[Callable[[str], Any]] = None, **claims):
    """Decorator: declare an attention implementation and what it claims (see SPEC.md).

    `deferred_claims`: a function returning more keywords (claims, `known_failures`, `min_timeout`) that
    depend on the machine (a GPU present, a library's plugin installed); called once, on first use of the
    adapter's claims, and merged over the keywords given here (attnverify/adapters/deferred.py).
    `prepare`: a function called once at the run's start, before any property (e.g. switch an interpreter on).
    `on_request_cpu`: why `attnverify run` without --adapter leaves this built-in out on a CPU-only machine.
    `prewarm`: for an adapter with a JIT, `(scratch) -> context manager or None`: inside the context the adapter's
    calls compile their kernels and run none (`--attn-prewarm`, attnverify/prewarm.py; Triton kernels:
    attnverify.triton_prewarm.compile_only_here)."""
    if not isinstance(name, str) or not name or any(ch in name for ch in " ,:/"):
        raise ValueError(f"attnverify.adapter(name={name!r}): a non-empty name without spaces, ',' ':' or '/'")
    timeout = _validate_min_timeout(name, min_timeout)
    c = _validate_claims(name, claims)
    known, patterns, not_strict = validate_known_failures(name, known_failures)
    if deferred_claims is not None and not callable(deferred_claims):
        raise TypeError(f"attnverify.adapter({name!r}, deferred_claims={deferred_claims!r}): give a function "
                        f"() -> dict of keywords (claims, known_failures, min_timeout), called on first use")
    if prepare is not None and not callable(prepare):
        raise TypeError(f"attnverify.adapter({name!r}, prepare={prepare!r}): give a function () -> None, called "
                        f"once before the run's first property")
    if prewarm is not None and not callable(prewarm):
        raise TypeError(f"attnverify.adapter({name!r}, prewarm={prewarm!r}): give a function (scratch folder) -> a "
                        f"context manager in which the adapter's calls compile and do not run (Triton kernels: "
                        f"attnverify.triton_prewarm.compile_only_here), or None where nothing compiles")
    if on_request_cpu is not None and not (isinstance(on_request_cpu, str) and on_request_cpu.strip()):
        raise ValueError(f"attnverify.adapter({name!r}, on_request_cpu={on_request_cpu!r}): give the reason, e.g. "
                         f"'ci profile 229 s on a 2-core CPU', or leave it out")

    def wrap(fn):
        if not callable(fn):
            raise TypeError(f"attnverify.adapter({name!r}) must decorate a callable (q, k, v, spec)")
        kw = dict(name=name, fn=fn, description=description or (fn.__doc__ or "").strip().split("\n")[0],
                  availability=availability, refuses=refuses, prepare=prepare, on_request_cpu=on_request_cpu,
                  prewarm=prewarm)
        if deferred_claims is None:
            a = Adapter(claims=c, known_failures=known, known_patterns=patterns, known_not_strict=not_strict,
                        min_timeout=timeout, **kw)
        else:
            from .deferred import DeferredAdapter

            a = DeferredAdapter(deferred_claims, claims=claims, known_failures=known_failures,
                                min_timeout=min_timeout, **kw)
        if register:
            from .registry import register_adapter

            register_adapter(a)
        return a

    return wrap
