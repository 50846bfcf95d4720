"""The command line: every command, its --help, bad arguments, and a full round trip."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import crosscut
from crosscut.cli import main
from crosscut.ir.plan import Plan
from crosscut.partitioner.validate import validate_plan

LENET = str(Path(__file__).resolve().parents[1] / "examples" / "digits_lenet.py") + ":LeNet"
SMALL = ["--batch", "4", "--input-shape", "1x16x16"]
COMMANDS = ["partition", "show", "verify", "profile", "bench", "diff"]


@pytest.fixture(scope="module")
def plan_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("cli") / "plan.json"
    code = main(
        [
            "partition",
            LENET,
            "--devices",
            "cpu,cpu",
            *SMALL,
            "--microbatches",
            "2",
            "--replicas",  # a pipeline over both devices, whatever the load lets the search try
            "1",
            "--time-limit",
            "5",
            "-o",
            str(out),
        ]
    )
    assert code == 0
    return out


@pytest.mark.parametrize("command", COMMANDS)
def test_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    assert "usage: crosscut " + command in capsys.readouterr().out


def test_partition_writes_a_valid_plan(plan_path: Path) -> None:
    plan = Plan.load(plan_path)
    validate_plan(plan)
    assert plan.model.name == LENET
    assert plan.options.microbatches == 2
    assert plan.solver.status in ("OPTIMAL", "FEASIBLE", "FALLBACK")


@pytest.mark.parametrize("suffix", [".html", ".svg", ".dot", ".png"])
def test_show_writes_each_format(
    plan_path: Path, tmp_path: Path, suffix: str, request: pytest.FixtureRequest
) -> None:
    if suffix in (".svg", ".png"):
        request.getfixturevalue("graphviz")
    out = tmp_path / f"plan{suffix}"
    assert main(["show", str(plan_path), "-o", str(out)]) == 0
    data = out.read_bytes()
    assert len(data) > 500
    if suffix == ".png":
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
    if suffix in (".svg", ".html"):
        assert b"cluster_stage_0" in data or b"stage 0" in data


def test_show_prints_summary(plan_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["show", str(plan_path)]) == 0
    text = capsys.readouterr().out
    assert "stage" in text and "solver" in text


def test_round_trip_partition_show_compile(plan_path: Path) -> None:
    """partition → show → compile(plan=...) on a fresh model instance."""
    from examples.digits_lenet import LeNet

    model = LeNet()
    compiled = crosscut.compile(model, ["cpu", "cpu"], torch.randn(4, 1, 16, 16), plan=plan_path)
    out = compiled(torch.randn(4, 1, 16, 16))
    assert out.shape == (4, 10)


def test_verify_passes(plan_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", LENET, *SMALL, "--plan", str(plan_path)]) == 0
    assert capsys.readouterr().out.startswith("OK")


def test_bench_reports_ratios(plan_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", LENET, *SMALL, "--plan", str(plan_path), "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "compiled" in out and "eager" in out and "predicted" in out


def test_profile_writes_cost_table(tmp_path: Path) -> None:
    out = tmp_path / "costs.json"
    assert main(["profile", LENET, *SMALL, "--devices", "cpu", "-o", str(out)]) == 0
    table = json.loads(out.read_text())
    assert table["source"] == "profiled"
    assert any(v["fwd"]["cpu"] > 0 for v in table["nodes"].values())


def test_diff(plan_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["diff", str(plan_path), str(plan_path)]) == 0
    assert "identically" in capsys.readouterr().out
    other = tmp_path / "one.json"
    assert (
        main(
            [
                "partition",
                LENET,
                "--devices",
                "cpu",
                *SMALL,
                "--microbatches",
                "2",
                "-o",
                str(other),
            ]
        )
        == 0
    )
    capsys.readouterr()
    assert main(["diff", str(plan_path), str(other)]) == 0
    assert "cluster differs" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (
            ["partition", "torchvision:no_such_net", "--devices", "2xV100", "-o", "x.json"],
            "torchvision:NAME",
        ),
        (["partition", LENET, "--devices", "3xQuantumChip", *SMALL, "-o", "x.json"], "QuantumChip"),
        (["show", "does/not/exist.json"], "existing file"),
        (["partition", "nonsense", "--devices", "cpu", "-o", "x.json"], "model reference"),
        (
            ["partition", LENET, "--devices", "2xV100", "--measure", *SMALL, "-o", "x.json"],
            "device list",
        ),
    ],
)
def test_user_errors_are_one_line(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("crosscut: error:")
    assert needle in err
    assert "\n" not in err and "Traceback" not in err


def test_partition_measure_prices_this_cpu(tmp_path: Path) -> None:
    """--measure prices the device list at the rates measured here, not the reference
    core's, and the plan's record says so."""
    out = tmp_path / "measured.json"
    argv = ["partition", LENET, "--devices", "cpu,cpu", *SMALL, "--time-limit", "5"]
    assert main([*argv, "--measure", "-o", str(out)]) == 0
    plan = Plan.load(out)
    (rate,) = plan.rates
    assert "measured or described" in rate.efficiency
    assert plan.cluster.devices[0].peak_flops > 0 and plan.cluster.devices[0].mem_bw > 0
    assert main([*argv, "-o", str(tmp_path / "preset.json")]) == 0
    (rate,) = Plan.load(tmp_path / "preset.json").rates
    assert "reference core" in rate.efficiency


def test_malformed_json_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema_version": 1, "model": ')
    assert main(["show", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert "valid JSON" in err and "\n" not in err


def test_bad_argument_values_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["partition", LENET, "--devices", "cpu", "--batch", "0", "-o", "x.json"])
    assert info.value.code == 2
    assert "positive integer" in capsys.readouterr().err


def test_console_script_without_traceback(tmp_path: Path) -> None:
    """The installed `crosscut` entry point: a user error is one line and exit code 2."""
    exe = Path(sys.executable).with_name("crosscut")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "crosscut.cli"]
    proc = subprocess.run(
        [*cmd, "show", str(tmp_path / "missing.json")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr


def test_partition_cross_shaped_and_no_colocate(tmp_path: Path) -> None:
    # classifier-heavy nets (vgg11) get a co-located tail (batch-split convolutions, then
    # the classifier split by channel on the same devices: one replica on K20c's PCIe at
    # batch 256); --no-colocate must give a plan whose stages use distinct devices (what
    # `crosscut run` needs). (alexnet stopped choosing it once 3x3 convolutions were
    # priced as Winograd: its convolutions got cheaper than its classifier's transfers.)
    plans = {}
    for flag in ([], ["--no-colocate"]):
        out = tmp_path / f"plan{len(flag)}.json"
        args = ["partition", "torchvision:vgg11", "--devices", "4xK20c", "--batch", "256",
                "--replicas", "1"]  # fmt: skip
        assert main([*args, "--cross-shaped", *flag, "-o", str(out)]) == 0
        plans[bool(flag)] = Plan.load(out)
    colocated, distinct = plans[False], plans[True]
    assert any(len(s.devices) > 1 for s in colocated.stages)
    assert [s.devices for s in colocated.stages][-1] == [s.devices for s in colocated.stages][-2]
    used = [d for s in distinct.stages for d in s.devices]
    assert len(used) == len(set(used))
    # a restriction: never a quicker step than the search that may co-locate
    assert distinct.predicted.step_time_s >= colocated.predicted.step_time_s
