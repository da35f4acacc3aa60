"""A PostgreSQL URL that cannot be used gets one line saying why, with no part of its password (issue 36):
libpq's error for bad percent-encoding quoted the password's token, and psycopg's own check of
``connect_timeout`` ended `agl store stats` in a traceback."""

from __future__ import annotations

import pytest

from agl.cli import main


def _one_line_error(capsys: pytest.CaptureFixture[str], store: str) -> str:
    """What `agl store stats --store STORE` says; it must fail with one line of error and no traceback."""
    code = main(["store", "stats", "--store", store])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and err.count("\n") == 1, err
    assert err.startswith("agl: the PostgreSQL URL given for the store is not valid: "), err
    return err


@pytest.mark.parametrize(
    "store",
    [
        "postgresql://agl:s3cr%ZZet@127.0.0.1:1/agl",  # libpq: invalid percent-encoded token: "s3cr%ZZet"
        "postgresql://agl:s3cr%2@127.0.0.1:1/agl?sslmode=disable",
        "postgresql://127.0.0.1:1/agl?user=agl&password=s3cr%ZZet",
        "host=127.0.0.1 port=1 user=agl password=s3cr et",  # key=value: a space the password did not quote
    ],
)
def test_a_password_libpq_cannot_read_is_not_shown(capsys: pytest.CaptureFixture[str], store: str) -> None:
    err = _one_line_error(capsys, store)
    assert "s3cr" not in err and '"et"' not in err, err  # libpq quoted the token it could not read
    assert "its password cannot be read (not shown here)" in err and "percent-encode" in err


def test_what_else_is_wrong_in_a_url_is_still_named(capsys: pytest.CaptureFixture[str]) -> None:
    err = _one_line_error(capsys, "postgresql://agl:s3cr%2Eet@127.0.0.1:1/agl?fsync=off")
    assert 'invalid URI query parameter: "fsync"' in err and "s3cr" not in err


def test_a_connect_timeout_that_is_not_a_number_gets_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    err = _one_line_error(capsys, "postgresql://agl:s3cr%2Eet@127.0.0.1:1/agl?connect_timeout=x")
    assert "bad value for connect_timeout: 'x'" in err and "s3cr" not in err
