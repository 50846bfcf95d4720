"""CLI failure paths: one line naming the path or value and a remedy, exit 2, no stray files.

Each case is a row of docs/ERRORS.md ("CLI" section).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from crosscut.cli import main
from crosscut.ir.plan import Plan

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


@pytest.mark.parametrize("command", ["show", "partition"])
def test_output_on_a_read_only_filesystem(
    command: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    plan_file: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """EROFS (a read-only mount; root ignores permission bits, so the OS error is injected
    where the file is created): one line naming the path, exit 2, nothing left behind."""
    import errno
    import tempfile

    def read_only(*args: object, **kwargs: object) -> tuple[int, str]:
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    out = tmp_path / ("p.html" if command == "show" else "p.json")
    argv = ["show", str(plan_file)] if command == "show" else ["partition", *PLAN_ARGS]
    assert main([*argv, "-o", str(out)]) == 2
    _one_line_error(capsys, str(out), "Read-only file system", "remedy")
    assert list(tmp_path.iterdir()) == []


def test_written_files_are_readable_by_others(tmp_path: Path, plan_file: Path) -> None:
    """A plan or a report is meant to be shared: not mkstemp's 0600."""
    import os

    old = os.umask(0o022)
    try:
        out = tmp_path / "p.html"
        assert main(["show", str(plan_file), "-o", str(out)]) == 0
        plan = Plan.load(plan_file).save(tmp_path / "copy.json")
    finally:
        os.umask(old)
    assert oct(out.stat().st_mode & 0o777) == "0o644"
    assert oct(plan.stat().st_mode & 0o777) == "0o644"


@pytest.mark.distributed
@pytest.mark.xdist_group("dist")
def test_a_failed_run_ends_in_one_line(tmp_path: Path) -> None:
    """The script's own traceback, tagged by rank, then one crosscut line naming the rank
    that failed first and where torchrun's report went; no ChildFailedError block."""
    import subprocess
    import sys

    from tests.plan_factory import make_plan

    plan = make_plan(30, 2, cross_shaped=False).save(tmp_path / "plan.json")
    script = tmp_path / "bad.py"
    script.write_text("import os\nraise ValueError('boom on rank ' + os.environ['RANK'])\n")
    logs = tmp_path / "logs"
    proc = subprocess.run(
        [sys.executable, "-m", "crosscut.cli", "run", "--plan", str(plan), "--port", "0",
         "--log-dir", str(logs), str(script)],
        capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-3000:]
    err = proc.stderr.strip().splitlines()
    assert "ChildFailedError" not in proc.stderr and "torch/distributed/run.py" not in proc.stderr
    assert any(line.startswith("[default0]:ValueError: boom on rank 0") for line in err), err
    last = err[-1]
    assert last.startswith("crosscut run: the job failed: rank ") and str(logs) in last, last
    assert "exit code 1" in last
    assert "ChildFailedError" in (logs / "torchrun-report.txt").read_text()
