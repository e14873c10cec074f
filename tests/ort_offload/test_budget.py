"""Budget strings: bytes, units, fractions, and clear errors for anything else."""

import pytest

from ort_offload.budget import Budget, format_bytes, parse_budget
from ort_offload.errors import BudgetParseError, OffloadError


@pytest.mark.parametrize(
    "text, nbytes",
    [("1048576", 1048576), ("64MiB", 64 * 2**20), ("1.5GiB", int(1.5 * 2**30)), ("200MB", 200 * 10**6),
     ("512 KiB", 512 * 1024), ("3k", 3 * 1024), (4096, 4096)],
)
def test_absolute_budgets(text, nbytes):
    assert parse_budget(text) == Budget(nbytes=nbytes)


def test_fraction_resolves_against_the_unplanned_peak():
    budget = parse_budget("0.25x")
    assert budget.is_fraction and budget.fraction == 0.25
    assert budget.resolve(1000) == 250
    assert parse_budget("1x").resolve(777) == 777


def test_none_is_unlimited():
    assert parse_budget(None) is None


@pytest.mark.parametrize("text", ["", "abc", "12QB", "-5MiB", "0", "0x", "1.5.2GiB", "x", True])
def test_unparsable_budgets_raise_one_clear_error(text):
    with pytest.raises(BudgetParseError) as info:
        parse_budget(text)
    assert isinstance(info.value, OffloadError)
    assert "\n" not in str(info.value)


def test_format_bytes():
    assert format_bytes(512) == "512 B"
    assert format_bytes(3 * 2**20) == "3.00 MiB"
    assert format_bytes(None) == "unlimited"
