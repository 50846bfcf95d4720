"""One rank of the torchrun check of output merging and autocast (tests/test_output_merge.py).

Two gloo ranks, two stages, two micro-batches. The model returns ``(logits,
logits.pow(2).sum())``: compiled without a rule it must be refused on every
rank; with ``output_merge={1: "sum"}`` the last rank's forward returns the
whole batch's sum. Under bfloat16 autocast the stages compute and exchange
bfloat16 activations (and gradients), as eager mode computes them; a
``PipelineGradScaler`` skips a step on every rank when one rank's gradients
hold an inf. Each rank dumps what it saw; the test compares with eager mode.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
from torch import nn

import crosscut.distributed as cd
from crosscut.errors import CrosscutError


class Energy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 6, 3, padding=1)
        self.c2 = nn.Conv2d(6, 6, 3, padding=1)
        self.fc = nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(self.c2(torch.relu(self.c1(x))))
        logits = self.fc(h.mean((2, 3)))
        return logits, logits.pow(2).sum()


def build() -> nn.Module:
    torch.manual_seed(0)
    return Energy()


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)


def loss_fn(out: tuple[torch.Tensor, torch.Tensor], y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out[0], y) + 1e-3 * out[1]


def scaler_steps(pipe: Any, x: torch.Tensor, y: torch.Tensor, rank: int) -> dict[str, Any]:
    """Rank 0 alone finds an inf: every rank skips; then every rank steps, same scale."""
    scaler = cd.PipelineGradScaler("cpu", init_scale=2.0**8)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    before = {k: v.clone() for k, v in pipe.local_state_dict().items()}
    out: dict[str, Any] = {}
    for step in (1, 2):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            pipe.train_step(x, y, lambda o, t: scaler.scale(loss_fn(o, t)))
        if step == 1 and rank == 0:
            next(iter(pipe.parameters())).grad.view(-1)[0] = float("inf")
        scaler.step(opt)
        scaler.update()
        now = pipe.local_state_dict()
        out[f"unchanged{step}"] = all(torch.equal(before[k], v) for k, v in now.items())
        out[f"scale{step}"] = scaler.get_scale()
    out["state"] = pipe.local_state_dict()
    return out


def main() -> int:
    ctx = cd.init(timeout_s=60)
    x, y = batch()
    seen: dict[str, Any] = {}
    kw: dict[str, Any] = {"microbatches": 2, "replicas": 1, "schedule": "gpipe", "timeout_s": 60}
    try:
        try:
            cd.compile_distributed(build(), x, **kw)
        except CrosscutError as exc:
            seen["refused"] = f"{type(exc).__name__}: {exc}"
        pipe = cd.compile_distributed(build(), x, output_merge={1: "sum"}, **kw)
        seen["plain"] = pipe(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            seen["autocast"] = pipe(x)
            loss = pipe.train_step(x, y, loss_fn)
        seen["loss"] = None if loss is None else float(loss)
        seen["grads"] = pipe.local_grads()
        # precision="bf16": the plan says it, the ranks run every call under that autocast
        half = cd.compile_distributed(build(), x, output_merge={1: "sum"}, precision="bf16", **kw)
        seen["bf16"] = half(x)
        seen["bf16_loss"] = half.train_step(x, y, loss_fn)
        seen["bf16_loss"] = None if seen["bf16_loss"] is None else float(seen["bf16_loss"])
        seen.update(scaler_steps(pipe, x, y, ctx.rank))
    except CrosscutError as exc:
        sys.stderr.write(f"CROSSCUT-ERROR rank {ctx.rank}: {type(exc).__name__}: {exc}\n")
        return 3
    except Exception:
        traceback.print_exc()
        return 4
    out = Path(sys.argv[sys.argv.index("--out") + 1])
    out.mkdir(parents=True, exist_ok=True)
    torch.save(seen, out / f"merge_rank{ctx.rank}.pt")
    return 0


if __name__ == "__main__":
    code = main()
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(code)
