"""The suite's own rules: what runs by default is said by markers on the tests and on their
parameters (never by matching test ids), and every parametrised test has a case in the default
run (`python -m pytest`), unless the whole test is marked slow where it is written."""

import pytest

from tests.families import NO_DEFAULT_CASE, params


def test_every_parametrised_test_has_a_default_case(request):
    """tests/conftest.py records, before `-m 'not slow'` deselects, the parametrised tests all of
    whose collected cases are marked slow through their parameters."""
    missing = request.config.stash[NO_DEFAULT_CASE]
    assert not missing, (
        f"{missing}: every case is marked slow, so the default run never checks them; leave one "
        "case without the mark (or mark the test itself slow where it is written)"
    )


def test_a_default_case_is_named_by_the_list_not_by_a_string_that_can_go_stale():
    """A default named outside tests/families.py's list is an error, not a silent slow case."""
    cases = params({"llama"})
    assert [case for case in cases if isinstance(case, str)] == ["llama"]  # the others are slow
    assert all(case.marks[0].name == "slow" for case in cases if not isinstance(case, str))
    with pytest.raises(KeyError, match="llama-4"):
        params({"llama-4"})
