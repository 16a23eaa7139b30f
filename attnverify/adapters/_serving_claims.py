"""Validation of the serving claims of `@av.adapter`: kv_cache, paged, page_sizes, append, cache_leftpad,
num_splits."""
from __future__ import annotations


def validate_serving_claims(c: dict, bad) -> None:
    """Normalise the serving keywords of `c` in place; `bad(arg, why)` makes the error to raise."""
    for flag in ("kv_cache", "paged", "append", "cache_leftpad"):
        if flag in c and not isinstance(c[flag], bool):
            raise bad(flag, f"must be True or False, got {c[flag]!r}")
    if "page_sizes" in c:
        if not c.get("paged"):
            raise bad("page_sizes", "page sizes mean something only for a paged cache: add paged=True")
        if not callable(c["page_sizes"]):
            try:
                ps = tuple(int(x) for x in c["page_sizes"])
            except TypeError:
                ps = ()
            if not ps or any(x < 1 for x in ps):
                raise bad("page_sizes", "give positive ints, e.g. (16, 256), or a predicate int -> bool")
            c["page_sizes"] = ps
    if c.get("append") and not (c.get("kv_cache") or c.get("paged")):
        raise bad("append", "k_new/v_new are appended to a KV cache: add kv_cache=True and/or paged=True")
    if c.get("cache_leftpad") and not (c.get("kv_cache") or c.get("paged")):
        raise bad("cache_leftpad", "left padding is a KV-cache feature: add kv_cache=True and/or paged=True")
    if "num_splits" in c:
        ns = c["num_splits"]
        ns = (ns,) if isinstance(ns, int) and not isinstance(ns, bool) else ns
        try:
            ns = tuple(ns)
        except TypeError:
            ns = (None,)
        if any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in ns):
            raise bad("num_splits", "give the split counts the adapter accepts as ints >= 1, e.g. (1, 2, 4, 8) "
                                    "(1 = no split); leave it out when the kernel takes no num_splits")
        c["num_splits"] = tuple(sorted(set(ns)))
