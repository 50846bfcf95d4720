"""LeNet on scikit-learn's handwritten digits, trained on one device and on two.

The Caffe tutorial's classic MNIST LeNet run, on data that ships with
scikit-learn (1,797 8x8 digits, upsampled to 16x16) so it works offline. The
same model, seed and data order are trained twice: eagerly on one device, and
compiled by crosscut across two devices as a 2-stage pipeline with 2
micro-batches. crosscut's promise is Mariana's: the split model trains to the
same errors as the single-device one.

    python examples/digits_lenet.py --epochs 5
    python examples/digits_lenet.py --precision fp16   # the split model in fp16, loss scaled

With ``--precision fp16`` (or ``bf16``) the compiled model is planned and run
under autocast with that dtype; fp16 training scales the loss with
``torch.amp.GradScaler`` so small gradients do not flush to zero.
"""

from __future__ import annotations

import argparse
import copy
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

import crosscut


class LeNet(nn.Module):
    """LeNet-5 shaped for 1x16x16 inputs (conv-pool-conv-pool-fc-fc-fc)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 6, 3, padding=1)
        self.conv2 = nn.Conv2d(6, 16, 3, padding=1)
        self.fc1 = nn.Linear(16 * 4 * 4, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def load_digits(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Train/test tensors: images scaled to [0, 1] and upsampled to 16x16."""
    from sklearn.datasets import load_digits as sk_digits

    data = sk_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    x = F.interpolate(x, size=(16, 16), mode="bilinear", align_corners=False)
    y = torch.tensor(data.target, dtype=torch.long)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    x, y = x[perm], y[perm]
    split = int(0.8 * len(x))
    return x[:split], y[:split], x[split:], y[split:]


def train(
    model: nn.Module,
    data: tuple[torch.Tensor, ...],
    epochs: int,
    batch: int,
    label: str = "",
    log: Callable[[str], None] = print,
    scale_loss: bool = False,
) -> float:
    """Plain SGD with momentum; returns test accuracy in percent (one line per epoch).

    ``scale_loss``: fp16 training, the loss multiplied by a GradScaler's factor.
    """
    x_tr, y_tr, x_te, y_te = data
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", enabled=scale_loss)
    order = torch.Generator().manual_seed(1)
    for epoch in range(epochs):
        t0 = time.perf_counter()
        log(f"{label}: epoch {epoch + 1}/{epochs} ...")
        model.train()
        perm = torch.randperm(len(x_tr), generator=order)
        for i in range(0, len(x_tr) - batch + 1, batch):  # full batches only
            idx = perm[i : i + batch]
            loss = F.cross_entropy(model(x_tr[idx]), y_tr[idx])
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        log(f"{label}: epoch {epoch + 1}/{epochs} done, last loss {float(loss.detach()):.3f} "
            f"({time.perf_counter() - t0:.1f} s)")  # fmt: skip
    model.eval()
    correct = 0
    with torch.no_grad():
        for i in range(0, len(x_te) - batch + 1, batch):
            pred = model(x_te[i : i + batch]).argmax(1)
            correct += int((pred == y_te[i : i + batch]).sum())
    total = (len(x_te) // batch) * batch
    return 100.0 * correct / total


def run(
    epochs: int = 5, batch: int = 32, devices: int = 2, precision: str = "fp32"
) -> tuple[float, float, int]:
    """Test accuracy of (single device fp32, crosscut on ``devices`` CPU devices in
    ``precision``), and the number of devices the plan runs on."""
    torch.manual_seed(0)
    data = load_digits()
    base = LeNet()
    single = copy.deepcopy(base)
    compiled = crosscut.compile(
        copy.deepcopy(base),
        ["cpu"] * devices,
        data[0][:batch],
        microbatches=2,
        time_limit=5,
        require_all_devices=True,  # LeNet is tiny: without this one stage is fastest
        precision=precision,
    )
    acc_single = train(single, data, epochs, batch, "single device")
    plan = compiled.plan
    label = f"crosscut, {plan.num_stages} stages ({plan.options.schedule}), {precision}"
    acc_split = train(compiled, data, epochs, batch, label, scale_loss=precision == "fp16")
    return acc_single, acc_split, len(set(compiled.plan.used_devices()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32")
    args = parser.parse_args()
    single, split, stages = run(args.epochs, args.batch, args.devices, args.precision)
    print(
        f"test accuracy: single device fp32 {single:.2f}%, crosscut ({stages} stages, "
        f"{args.precision}) {split:.2f}%"
    )
    print(f"difference: {abs(single - split):.2f} points (target: within 0.5)")


if __name__ == "__main__":
    main()
