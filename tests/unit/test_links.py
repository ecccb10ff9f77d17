"""Shaped links (cli/hosts.py): what a link spec means and what tc is asked for."""

import pytest

from kvfs.cli.hosts import Link


@pytest.mark.parametrize("spec, rate", [("10gbit", 10_000_000_000), ("2.5Gbit", 2_500_000_000),
                                        ("800mbit", 800_000_000), ("64kbit", 64_000)])
def test_a_link_rate_reads_in_tc_units(spec, rate):
    assert Link.parse(spec).rate == rate


@pytest.mark.parametrize("spec", ["10", "fast", "gbit", "-1gbit", "0mbit", "2gbit:1ms", "1gb", "infgbit", "nanmbit"])
def test_a_link_without_a_positive_rate_and_unit_is_refused(spec):
    with pytest.raises(ValueError, match="link rate"):
        Link.parse(spec)


def test_the_token_bucket_holds_a_few_milliseconds_and_whole_segments():
    fast, slow = Link.parse("10gbit").tbf(), Link.parse("100mbit").tbf()
    assert fast[:3] == ["tbf", "rate", "10000000000bit"]
    assert int(fast[fast.index("burst") + 1]) == 10_000_000_000 // 8 // 250  # 4 ms at the rate
    assert int(slow[slow.index("burst") + 1]) == 256 << 10  # never below a few veth segments
