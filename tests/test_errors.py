"""The bad-input catalogue (docs/ERRORS.md): rows tested here, and a check that every row
of the catalogue names a test that exists."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch
from torch import nn

import crosscut
from crosscut.cost_models.cluster import Cluster
from crosscut.errors import CrosscutError, DeviceError, RuntimeError_

ROOT = Path(__file__).resolve().parents[1]


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(1, 4, 3, padding=1)
        self.b = nn.Conv2d(4, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 8 * 8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(torch.relu(self.b(torch.relu(self.a(x)))), 1))


@pytest.fixture(scope="module")
def compiled() -> nn.Module:
    return crosscut.compile(
        Tiny(),
        ["cpu", "cpu"],
        torch.randn(4, 1, 8, 8),
        require_all_devices=True,
        microbatches=1,
        replicas=1,
    )


def test_forward_with_wrong_shape_names_stage_and_action(compiled: nn.Module) -> None:
    with pytest.raises(RuntimeError_, match=r"stage0@cpu at action 0F0.*channels"):
        compiled(torch.randn(4, 3, 8, 8))


def test_forward_with_input_on_wrong_device_names_stage(compiled: nn.Module) -> None:
    with pytest.raises(RuntimeError_, match=r"stage0@cpu.*meta"):
        compiled(torch.randn(4, 1, 8, 8, device="meta"))


def test_duplicate_device_names_in_cluster_file() -> None:
    data = Cluster.from_spec("2xV100").to_dict()
    data["devices"][1]["name"] = data["devices"][0]["name"]
    with pytest.raises(DeviceError, match="unique"):
        Cluster.from_dict(data)


def test_every_error_class_states_rule_value_and_remedy() -> None:
    err = crosscut.InputError("microbatches must divide the batch", value=7, remedy="use 8")
    assert str(err) == "microbatches must divide the batch; got: 7; remedy: use 8"
    assert isinstance(err, CrosscutError) and isinstance(err, ValueError)
    assert issubclass(crosscut.InfeasiblePlanError, crosscut.PartitionError)


def _catalogue_tests() -> list[str]:
    text = (ROOT / "docs" / "ERRORS.md").read_text()
    return re.findall(r"`(tests/test_\w+\.py::test_\w+)`", text)


def test_catalogue_has_rows() -> None:
    assert len(_catalogue_tests()) >= 30


@pytest.mark.parametrize("ref", _catalogue_tests())
def test_catalogue_row_names_an_existing_test(ref: str) -> None:
    path, name = ref.split("::")
    tree = ast.parse((ROOT / path).read_text())
    names = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    assert name in names, f"docs/ERRORS.md names {ref}, which does not exist"
