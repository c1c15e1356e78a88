"""The operator's command line: the peering lifetime it gives kopf is checked before kopf runs."""

from __future__ import annotations

import pytest
from accelerate_operator.__main__ import _parser


def test_the_peering_lifetime_defaults_to_kopfs_and_takes_whole_seconds():
    assert _parser().parse_args([]).peering_lifetime == 60
    assert _parser().parse_args(["--peering-lifetime", "20"]).peering_lifetime == 20


@pytest.mark.parametrize("value, says", [("19", "too short"), ("1.5", "not a whole number")])
def test_a_peering_lifetime_kopf_could_not_renew_in_time_is_refused(value, says, capsys):
    with pytest.raises(SystemExit):
        _parser().parse_args(["--peering-lifetime", value])
    error = capsys.readouterr().err
    assert "--peering-lifetime" in error and says in error, error
