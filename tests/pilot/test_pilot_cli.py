"""``ort-offload pilot train``: bad input exits 2 with one line and leaves no file."""

from __future__ import annotations

import pytest

from ort_offload.cli import EXIT_USAGE, main


@pytest.mark.parametrize("argv, message", [
    (["--out", "{tmp}/missing"], "not an existing directory"),
    (["--out", "{tmp}", "--holdout", "no-such-net"], "unknown families"),
    (["--out", "{tmp}", "--samples", "0"], "--samples must be at least 1"),
    (["--out", "{tmp}", "--families", "var-lstm", "--holdout", "var-lstm"], "every family is held out"),
])
def test_bad_input_exits_2_and_writes_nothing(tmp_path, capsys, argv, message):
    argv = [a.format(tmp=tmp_path) for a in argv]
    assert main(["pilot", "train", *argv]) == EXIT_USAGE
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_unknown_subcommand_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        main(["pilot", "fly"])
    assert info.value.code == EXIT_USAGE
