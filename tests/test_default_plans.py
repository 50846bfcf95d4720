"""The plans crosscut makes by default, on whole model families, against eager.

What a user gets from ``crosscut.partition(model, devices, x)`` with every
strategy option left to the planner (replicas, stages, micro-batches, schedule,
groups, recomputation), on 2, 3 and 4 CPU devices, checked by ``verify_plan``
in float64: outputs, loss and the state after one SGD step (the gradients).
Groups and replicas normalise their shares apart and are compared with what
they compute (``crosscut/verify.py``); float64 leaves room for the sums they
reorder and none for a wrong value.

Why a sweep of its own: the family sweeps plan what they ask for (pipelines in
``test_timm_families.py``, stages widened by hand in ``test_group_families.py``),
and planning timm's rdnet_tiny crashed in a path only some options reach (the
side-tree relaxation's fan-out map). CI runs ``SAMPLED``; ``CROSSCUT_HEAVY=1``
runs every family of ``test_group_families.py`` (one process each:
``tests/run_heavy.py``).
"""

from __future__ import annotations

import pytest
import torch

import crosscut
from crosscut.verify import verify_plan
from tests.test_group_families import HEAVY, TIMM, TORCHVISION, build
from tests.test_timm_families import FAMILIES, SIZES

torch.set_num_threads(1)

# a chain with batch norms, and a timm family whose stages are SE blocks and bottlenecks
SAMPLED = ["resnet18", "timm:regnetx_002"]


def _input(name: str) -> torch.Tensor:
    timm_sizes = {f"timm:{FAMILIES[f]}": px for f, px in SIZES.items()}
    size = 96 if name == "inception_v3" else timm_sizes.get(name, 64)
    x = torch.randn(8, 3, size, size, generator=torch.Generator().manual_seed(1))
    return x.double()


@pytest.mark.parametrize("name", TORCHVISION + TIMM if HEAVY else SAMPLED)
def test_default_plans_match_eager_on_the_family(name: str) -> None:
    x = _input(name)
    model = build(name)
    failed = {}
    for n in (2, 3, 4):
        plan = crosscut.partition(model, ["cpu"] * n, x, time_limit=5)
        report = verify_plan(build(name), x, plan, rtol=1e-8, atol=1e-9)
        print(f"{name} on {n} devices: {_shape(plan)}")  # what was checked (pytest -rP)
        if not report.ok:
            failed[f"{n} devices: {_shape(plan)}"] = report.text()
    assert not failed, failed


def _shape(plan: crosscut.Plan) -> str:
    """``"2 replicas, stages [1, 2 batch], M=4, 1f1b"``: what the planner chose."""
    stages = [f"{len(s.devices)}{'' if s.split == 'none' else ' ' + s.split}" for s in plan.stages]
    return (
        f"{plan.replication.replicas} replicas, stages [{', '.join(stages)}], "
        f"M={plan.options.microbatches}, {plan.options.schedule}"
    )
