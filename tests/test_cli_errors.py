"""`moe-place analyze BADFILE`: exit 2, exactly one line on stderr naming the file/field, no traceback."""

import pytest

from moe_place.cli.main import main
from test_traces_load import BAD_FILES  # the same catalog of bad inputs load_trace is tested on


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_analyze_bad_file_exits_2_with_one_line(tmp_path, capsys, case):
    make, fragment = BAD_FILES[case]
    path = make(tmp_path)
    code = main(["analyze", str(path)])
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert code == 2
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("moe-place analyze: error: ") and str(path) in lines[0] and fragment in lines[0]
    assert "Traceback" not in captured.err and captured.out == ""


@pytest.mark.parametrize(("option", "value"), [("--ep", "0"), ("--ep", "abc"), ("--layers", "x")])
def test_analyze_bad_option_exits_2_with_one_line(tmp_path, capsys, option, value):
    with pytest.raises(SystemExit) as exit_info:
        main(["analyze", str(tmp_path / "t.npz"), option, value])
    lines = capsys.readouterr().err.splitlines()
    assert exit_info.value.code == 2 and len(lines) == 1 and option in lines[0]


def test_analyze_good_file_exits_0(tmp_path, capsys):
    import numpy as np

    path = tmp_path / "t.npz"
    np.savez(path, format_version=1, num_experts=8, top_k=1, counts=np.array([[[600, 560, 120, 120, 20, 10, 10, 10]]]))
    assert main(["analyze", str(path), "--ep", "2,4", "--format", "json"]) == 0
    assert '"num_experts": 8' in capsys.readouterr().out
