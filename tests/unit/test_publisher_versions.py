"""What a publisher's version allows (applier.subscriptions.common.check_publisher_version): PostgreSQL 14 and up;
two-phase from 15, origin = none from 16, failover from 17, failover with two-phase from 18."""

from __future__ import annotations

import pytest

from applier.subscriptions import SubscriptionError
from applier.subscriptions.common import check_publisher_version

CASES = [
    (130015, {}, "applier needs 14 or later"),
    (140023, {}, None),
    (140023, {"two_phase": True}, "two-phase needs a publisher of PostgreSQL 15"),
    (150018, {"two_phase": True}, None),
    (150018, {"origin": "none"}, "origin = none needs a publisher of PostgreSQL 16"),
    (160010, {"origin": "none"}, None),
    (160010, {"failover": True}, "failover needs a publisher of PostgreSQL 17"),
    (170006, {"failover": True}, None),
    (
        170006,
        {"failover": True, "two_phase": True},
        "failover and two-phase together need a publisher of PostgreSQL 18",
    ),
    (180001, {"failover": True, "two_phase": True, "origin": "none"}, None),
]


@pytest.mark.parametrize(("version", "options", "refusal"), CASES)
def test_check_publisher_version(version: int, options: dict, refusal: str | None) -> None:
    if refusal is None:
        check_publisher_version(version, **options)
    else:
        with pytest.raises(SubscriptionError, match=refusal):
            check_publisher_version(version, **options)
