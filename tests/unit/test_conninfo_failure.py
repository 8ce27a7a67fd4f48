"""How a connection that could not be made is explained (:func:`applier.conninfo.connection_failure`): which side,
whether the connection string or the server is at fault, libpq's reason on one line, never the password. The
messages the command line prints are tested end to end in tests/integration/test_cli_errors.py."""

from __future__ import annotations

import psycopg
import pytest

from applier.conninfo import connection_failure, failure_reason


def _error(conninfo: str) -> psycopg.Error:
    with pytest.raises(psycopg.Error) as caught:
        psycopg.connect(conninfo, connect_timeout=5)
    return caught.value


def test_a_value_libpq_refuses_is_the_connection_strings_fault() -> None:
    conninfo = "host=/nonexistent port=abc password=s3cr3t"
    message, invalid = connection_failure("target", conninfo, _error(conninfo))
    assert invalid
    assert message == (
        'invalid target connection string (host=/nonexistent port=abc): invalid integer value "abc" for '
        'connection option "port"'
    )


def test_a_server_that_is_not_there_is_unreachable() -> None:
    conninfo = "host=/nonexistent password=s3cr3t"
    message, invalid = connection_failure("publisher", conninfo, _error(conninfo))
    assert not invalid
    assert message.startswith("could not connect to the publisher (host=/nonexistent): connection to server")
    assert "\n" not in message and "connection is bad" not in message and "s3cr3t" not in message


def test_the_reason_loses_psycopgs_prefix_and_the_password() -> None:
    reason = failure_reason("connection failed: FATAL:  password hunter2 wrong\n\tHINT", "password=hunter2")
    assert reason == "FATAL: password ******** wrong HINT"
