"""How the project's tests judge a property run of a built-in adapter: with the adapter's one classifier
(Adapter.classify, the plugin's too), never a table of their own. A declared finding is an xfail only when
the failure matches its declaration (`match`); a declared finding that does not reproduce fails the test
(strict XPASS), so a stale declaration gets removed."""
import pytest


def judged(adapter, prop: str, run) -> None:
    try:
        run()
    except AssertionError as e:
        outcome, note = adapter.classify(prop, str(e))
        if outcome == "known":
            pytest.xfail(f"known finding: {note}")
        raise AssertionError(str(e) + (f"\n{note}" if note else "")) from None
    outcome, note = adapter.classify(prop, None)
    if outcome == "xpass":
        pytest.fail(f"XPASS(strict): {note}", pytrace=False)


def judged_on_the_real_library(adapter, prop: str, report_dir, max_examples: int = 8, min_passed: int = 1) -> None:
    """A built-in adapter's property at the ci profile on its real library (GPU tests): skipped, naming why, where
    the library is unavailable; otherwise judged as above (a declared finding is an xfail only when it matches)."""
    import warnings

    from attnverify.properties import get_property
    from attnverify.properties.driver import run_property

    why = adapter.unavailable_reason()
    if why:
        pytest.skip(f"{adapter.name} unavailable here: {why}")

    def run():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            res = run_property(get_property(prop), adapter, profile="ci", seed=0, database=None,
                               report_dir=str(report_dir), max_examples=max_examples)
        assert res.statuses.get("passed", 0) >= min_passed, res.statuses

    judged(adapter, prop, run)
