"""`check` on a KV-cache case (the public `av.check`, as a stranger calls it): a cache call is forward only, and an
append must leave the caches as the contract says (k_new / v_new at cache_seqlens[b].., nothing else touched)."""
from __future__ import annotations


import attnverify as av
from attnverify.adapters.base import Adapter
from attnverify.adapters.registry import get
from attnverify.case import CaseRecipe, build_case

NAIVE = get("naive")


def _case(new_len=2):
    return build_case(CaseRecipe(batch=3, heads_q=2, heads_kv=1, len_q=2, len_k=18 + new_len, head_dim=8, cache_lens=[18, 3, 0],
                                 new_len=new_len, page_size=21, num_pages=4, cache_batch_idx=[2, 0, 3], garbage="mixed",
                                 causal="bottom_right", dtype="float32", seed=1))


def _like_naive(name, before=None):
    """An adapter claiming what naive claims, calling naive after `before(q, k, v, spec)` (a planted cache bug)."""
    def fn(q, k, v, spec):
        if before is not None:
            before(q, k, v, spec)
        return NAIVE(q, k, v, spec)
    return Adapter(name, fn, NAIVE.claims)


def test_a_correct_append_passes_and_is_judged_forward_only():
    res = av.check(NAIVE, _case())  # naive claims backward: a cache call is still forward only
    assert res.status == "passed", res.message()
    assert any("forward only" in n for n in res.notes)
    assert not any(c.name.startswith("d") for c in res.comparisons)


def test_an_append_written_nowhere_fails():
    def fn(q, k, v, spec):  # attends as if it had appended, but into copies: the caller's caches stay as they were
        return NAIVE(q, k.clone(), v.clone(), spec)

    res = av.check(Adapter("no-append", fn, NAIVE.claims), _case())
    assert res.status == "failed" and "k_new / v_new written" in res.message(), res.message()


def test_an_append_at_the_wrong_slot_fails():
    def shifted(q, k, v, spec):  # also writes k_new one slot early (the old value there is lost)
        k[2, 17] = spec.k_new[0, :, 0].to(k.dtype)

    res = av.check(_like_naive("append-shifted", shifted), _case())
    assert res.status == "failed" and "cache(s) k after the call" in res.message(), res.message()


def test_a_cache_call_without_append_must_not_touch_the_caches():
    def scribble(q, k, v, spec):
        v[3, 20] = 7.0  # a slot no sequence uses: still the caller's memory

    res = av.check(_like_naive("scribbles", scribble), _case(new_len=0))
    assert res.status == "failed" and "modified its input(s) v in place" in res.message(), res.message()
    assert av.check(NAIVE, _case(new_len=0)).status == "passed"
