"""`python -m gateway serve --set FIELD=VALUE`: any GatewayConfig field, typed, or a clear exit."""

import pytest

from gateway.cli import _overrides


def test_set_parses_each_field_as_its_type():
    got = _overrides(["max_long_polls=7", "lease_seconds=2.5", "dtype=float32"])
    assert got == {"max_long_polls": 7, "lease_seconds": 2.5, "dtype": "float32"}
    assert type(got["max_long_polls"]) is int and type(got["lease_seconds"]) is float


@pytest.mark.parametrize(
    "item, message",
    [
        ("nope=1", "--set: expected FIELD=VALUE for a GatewayConfig field, got 'nope=1'"),
        ("max_engines", "--set: expected FIELD=VALUE for a GatewayConfig field, got 'max_engines'"),
        (
            "backends=a,b",
            "--set: expected FIELD=VALUE for a GatewayConfig field, got 'backends=a,b'",
        ),
        ("max_engines=many", "--set max_engines: expected int, got 'many'"),
    ],
)
def test_set_refuses_unknown_fields_and_bad_values(item, message):
    with pytest.raises(SystemExit) as err:
        _overrides([item])
    assert str(err.value) == message
