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
