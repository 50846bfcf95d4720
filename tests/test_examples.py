"""Every example runs, at a tiny size, and says what it promises."""

from __future__ import annotations

from pathlib import Path

import pytest

from examples import (
    digits_lenet,
    inception_latency,
    mariana_alexnet,
    plan_roundtrip,
    resnet50_pipeline,
)


def test_digits_lenet_same_accuracy_on_two_devices() -> None:
    single, split, used = digits_lenet.run(epochs=2, batch=32, devices=2)
    assert used == 2  # really split across the two devices
    assert single > 50.0  # it learned something (10 classes: chance is 10%)
    assert abs(single - split) <= 0.5


def test_digits_lenet_in_fp16_matches_fp32_accuracy() -> None:
    """Issue 17: the split LeNet in fp16 with a loss scaler against fp32 on one device.

    Deterministic (tests/test_precision.py). Measured at 5/10/20 epochs: fp16
    84.4/95.7/98.0 % vs fp32 90.9/96.0/95.7 % on 360 test digits (one digit = 0.28
    points): the short runs are noisy both ways. What must hold is that fp16 costs
    no accuracy: at 10 epochs it is within 0.5 points of fp32 or better (after the
    issue-24 costs moved the split: fp16 96.6 % vs fp32 95.7 %).
    """
    single, half, used = digits_lenet.run(epochs=10, batch=32, devices=2, precision="fp16")
    assert used == 2 and single > 90.0
    assert half >= single - 0.5, (single, half)


def test_resnet_pipeline_trains() -> None:
    """The loss on the example's fixed batch falls (it used to double: lr too high)."""
    losses = resnet50_pipeline.main(
        [
            "--model",
            "resnet18",
            "--batch",
            "4",
            "--size",
            "32",
            "--microbatches",
            "2",
            "--steps",
            "4",
        ]
    )
    assert len(losses) == 4 and losses[-1] < losses[0], losses


def test_mariana_alexnet_plan_checks_out() -> None:
    assert mariana_alexnet.main(["--batch", "16"])


def test_inception_latency_never_worse_than_one_device() -> None:
    one, many = inception_latency.main(["--size", "75"])
    assert many <= one * (1 + 1e-6)


def test_plan_roundtrip(tmp_path: Path) -> None:
    path = plan_roundtrip.main(["--out", str(tmp_path), "--size", "32"])
    assert path.exists() and (tmp_path / "plan.html").stat().st_size > 1000


@pytest.mark.parametrize(
    "module", [digits_lenet, inception_latency, mariana_alexnet, plan_roundtrip, resnet50_pipeline]
)
def test_examples_document_themselves(module: object) -> None:
    doc = getattr(module, "__doc__", "") or ""
    assert "python examples/" in doc
