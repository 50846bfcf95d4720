"""CLI failure paths: one line naming the path or value and a remedy, exit 2, no stray files.

Each case is a row of docs/ERRORS.md ("CLI" section).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from crosscut.cli import main
from crosscut.partitioner.plan import Plan

PLAN_ARGS = ["torchvision:resnet18", "--devices", "2xV100", "--batch", "4", "--input-shape",
             "3x32x32", "--time-limit", "5"]  # fmt: skip


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("plan") / "plan.json"
    assert main(["partition", *PLAN_ARGS, "-o", str(out)]) == 0
    return out


def _one_line_error(capsys: pytest.CaptureFixture[str], *needles: str) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err, err
    last = err.splitlines()[-1]
    assert last.startswith("crosscut") and "error" in last, err
    for needle in needles:
        assert needle in last, (needle, last)
    return last


def _no_tmp(folder: Path) -> None:
    assert not [p for p in folder.rglob("*") if p.name.endswith(".tmp")]


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip().startswith("crosscut 0.")


def test_output_under_a_file_fails_before_the_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], plan_file: Path
) -> None:
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    code = main(["partition", *PLAN_ARGS, "-o", str(blocker / "p.json")])
    assert code == 2
    _one_line_error(capsys, str(blocker), "is a file", "remedy")
    assert main(["show", str(plan_file), "-o", str(blocker / "p.html")]) == 2
    _one_line_error(capsys, "is a file")
    _no_tmp(tmp_path)


def test_output_naming_a_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], plan_file: Path
) -> None:
    assert main(["show", str(plan_file), "-o", str(tmp_path)]) == 2
    _one_line_error(capsys, "is a directory", "remedy")
    assert list(tmp_path.iterdir()) == []


def test_output_into_a_missing_folder_is_created(tmp_path: Path, plan_file: Path) -> None:
    out = tmp_path / "new" / "deeper" / "plan.html"
    assert main(["show", str(plan_file), "-o", str(out)]) == 0
    assert out.stat().st_size > 0
    _no_tmp(tmp_path)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0])
def test_a_plan_with_a_bad_number_is_refused_by_name(
    bad: float, tmp_path: Path, capsys: pytest.CaptureFixture[str], plan_file: Path
) -> None:
    data = json.loads(plan_file.read_text())
    data["cluster"]["devices"][0]["peak_flops"] = bad
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps(data))
    assert main(["show", str(broken)]) == 2
    _one_line_error(capsys, "peak_flops", "remedy")
    with pytest.raises(Exception, match="peak_flops"):
        Plan.load(broken)


@pytest.mark.parametrize(
    ("flag", "value", "needle"),
    [
        ("--port", "70000", "0..65535"),
        ("--port", "-1", ">= 0"),
        ("--timeout", "-5", "positive finite"),
        ("--timeout", "nan", "positive finite"),
        ("--timeout", "inf", "positive finite"),
        ("--replicas", "0", "positive integer"),
    ],
)
def test_run_refuses_bad_values(
    flag: str, value: str, needle: str, plan_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as done:
        main(["run", "--plan", str(plan_file), flag, value, "train.py"])
    assert done.value.code == 2
    _one_line_error(capsys, flag, needle)
