"""Client strings in logs and request fields (services/common/sanitize.py), peer hosts
(services/common/stream_guards.py)."""

import logging

import pytest

from meshtrain.services.common.errors import InvalidRequestError
from meshtrain.services.common.sanitize import check_text, loggable, quiet_undecodable_requests
from meshtrain.services.common.stream_guards import peer_host


def test_loggable_escapes_and_cuts():
    assert loggable("ab\ncd") == "'ab\\ncd'"
    cut = loggable("x" * 10_000, limit=50)
    assert cut == repr("x" * 50) + "... (10000 characters)"
    assert "\n" not in loggable("\n" * 500)


@pytest.mark.parametrize(
    "value, problem",
    [
        ("", "is empty"),
        ("a\0b", "control character '\\x00' at position 1"),
        ("name\n", "'\\n' at position 4"),
        ("x" * 11, "is 11 characters long, over the limit of 10"),
        ("\x7f", "control character '\\x7f'"),
    ],
)
def test_check_text_names_the_field_and_the_problem(value, problem):
    with pytest.raises(InvalidRequestError) as info:
        check_text(value, "box.array", 10, InvalidRequestError)
    assert str(info.value).startswith("box.array ") and problem in str(info.value)


def test_check_text_passes_good_values():
    assert check_text("layers.mlp-é", "name", 20, InvalidRequestError) == "layers.mlp-é"
    assert check_text("", "split", 20, InvalidRequestError, allow_empty=True) == ""


def test_an_undecodable_request_is_one_line(caplog):
    quiet_undecodable_requests()
    quiet_undecodable_requests()  # idempotent: one filter
    logger = logging.getLogger("grpc._common")
    assert sum(type(f).__name__ == "_OneLineUndecodable" for f in logger.filters) == 1
    caplog.set_level(logging.INFO)
    try:
        raise ValueError("Error parsing message" + "!" * 1000)
    except ValueError:
        logger.exception("Exception deserializing message!")
    (record,) = caplog.records
    assert record.exc_info is None and "could not be decoded" in record.getMessage()
    assert len(record.getMessage()) < 400 and "Traceback" not in caplog.text


@pytest.mark.parametrize(
    "peer, host",
    [
        ("ipv4:10.0.0.5:53312", "10.0.0.5"),
        ("ipv6:%5B::1%5D:4000", "::1"),
        ("ipv6:[fe80::1]:4", "fe80::1"),
        ("unix:/tmp/sock", "unix:/tmp/sock"),
    ],
)
def test_peer_host(peer, host):
    assert peer_host(peer) == host
