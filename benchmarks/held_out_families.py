"""Model families outside the suite's sweeps, on forced pipelines and default plans.

The suite sweeps 19 torchvision classifiers and 42 timm CNN families
(``tests/test_timm_families.py``, ``tests/test_default_plans.py``). This runs
the families those leave out: timm's hybrid convolution/attention families
(MobileViT, EdgeNeXt, FastViT, EfficientViT, PoolFormer, MambaOut, CoAtNet,
MaxViT, BoTNet, HaloNet, LambdaNet, TinyViT, EfficientFormer, MobileNetV4
hybrid), more CNN families (MixNet, GhostNetV2, TF-"same"-padded
EfficientNet, anti-aliased and blur-pooled ResNets, RepVGG, MobileOne,
RegNetZ, LCNet, FBNetV3, HGNet, NF-RegNet, GC and ECA ResNets, CSP-Darknet,
timm's own test models) and torchvision's segmentation (a dict output) and
video (5-D inputs) models.

Per model, each in its own process (a crash or a kernel's OOM kill stays a
row): four forced pipelines in fp32 compared with eager running the same
micro-batches **bit for bit** (loss, every gradient, every buffer) — 2
devices one micro-batch; 3 devices two micro-batches, with and without
recomputation; 2 devices four micro-batches under ZB-H1 — and the default
plan (every strategy option left to the planner) on 2, 3 and 4 devices,
replayed by ``verify_plan`` in float64 (1e-8). With ``--torchrun``, three
runs on gloo ranks instead (2 ranks M=2 1F1B, 3 ranks M=1, 3 ranks default),
one SGD step against eager in float64. Dropouts are at p = 0 wherever the
plan has several micro-batches or ranks (they draw per-op seeds there; README,
"not bit for bit").

A row is ``EQUAL``, ``REFUSED: <rule>`` (every refusal seen was an input the
model rejects eagerly too: a fixed input size, or a one-row micro-batch
reaching a batch norm over 1x1 maps), ``DIFFERS`` or ``CRASH``; any of the
last two makes the exit status 1.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python benchmarks/held_out_families.py``
(``--models a,b`` for a subset, ``--torchrun`` for the gloo runs).
"""

from __future__ import annotations

import argparse
import copy
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.test_timm_families import without_random_ops  # noqa: E402

# name: input size (px); "tv:" is torchvision; video models take 8 frames
MODELS: dict[str, int] = {
    "test_byobnet": 64, "test_convnext": 64, "test_efficientnet_evos": 64,
    "test_efficientnet_gn": 64, "test_efficientnet_ln": 64, "test_mambaout": 64,
    "test_nfnet": 64, "test_resnet": 64, "test_coatnet": 160, "test_maxvit": 160,
    "tf_efficientnet_b0": 65, "mixnet_s": 64, "ghostnetv2_100": 64, "mobilevit_xxs": 64,
    "mobilevitv2_050": 64, "edgenext_xx_small": 64, "fastvit_t8": 64, "efficientvit_b0": 64,
    "efficientvit_m0": 64, "poolformerv2_s12": 64, "mobilenetv4_conv_small": 64,
    "tv:lraspp_mobilenet_v3_large": 64, "tv:deeplabv3_mobilenet_v3_large": 64,
    "tv:r3d_18": 32, "tv:r2plus1d_18": 32, "resnetaa34d": 64, "resnetblur18": 64,
    "lambda_resnet26t": 64, "botnet26t_256": 256, "halonet26t": 256, "gcresnet33ts": 64,
    "eca_resnet33ts": 64, "cs3darknet_focus_s": 64, "mobileone_s0": 64, "repvgg_a0": 64,
    "regnetz_b16": 64, "lcnet_050": 64, "fbnetv3_b": 64, "tiny_vit_5m_224": 64,
    "nf_regnet_b0": 64, "mobilenetv4_hybrid_medium": 64, "hgnet_tiny": 64,
}  # fmt: skip
VIDEO = ("tv:r3d_18", "tv:mc3_18", "tv:r2plus1d_18", "tv:s3d")


def build(name: str, still: bool) -> nn.Module:
    """The model, seeded; ``still``: its dropouts at p = 0."""
    torch.manual_seed(0)
    if name.startswith("tv:"):
        import torchvision

        kw: dict[str, Any] = {"weights_backbone": None} if "_mobilenet_v3" in name else {}
        if name.startswith("tv:deeplabv3"):
            kw["aux_loss"] = False
        model = torchvision.models.get_model(name[3:], weights=None, num_classes=5, **kw)
    else:
        import timm

        model = timm.create_model(name, pretrained=False, num_classes=5, drop_rate=0.0)
    return without_random_ops(model) if still else model


def inputs(name: str, size: int, batch: int) -> torch.Tensor:
    shape = (batch, 3, 8, size, size) if name in VIDEO else (batch, 3, size, size)
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1))


def logits(out: Any) -> torch.Tensor:
    """Class scores from a classifier's output, a segmentation dict or a per-pixel map."""
    out = out["out"] if isinstance(out, dict) else out
    return out.mean((2, 3)) if out.dim() == 4 else out


def pipeline(name: str, size: int, devices: int, m: int, recompute: bool, sched: str) -> str:
    """A forced pipeline in fp32 against eager on the same micro-batches, bit for bit."""
    import crosscut
    from crosscut.errors import CrosscutError

    model, x = build(name, m > 1), inputs(name, size, 4)
    y = torch.randint(0, 5, (4,), generator=torch.Generator().manual_seed(2))
    try:
        c = crosscut.compile(
            copy.deepcopy(model), ["cpu"] * devices, x, microbatches=m, time_limit=5,
            recompute=recompute, replicas=1, cross_shaped=False, schedule=sched,
        )  # fmt: skip
    except CrosscutError as e:
        return f"REFUSED: {type(e).__name__}: {str(e)[:240]}"
    ref = copy.deepcopy(model).train()
    torch.manual_seed(3)  # one micro-batch keeps eager's draws
    total = torch.zeros(())  # summed as train_step sums its micro-batches' losses
    for xm, ym in zip(x.chunk(m), y.chunk(m)):
        total = total + _backward(F.cross_entropy(logits(ref(xm)), ym) / m)
    want = float(total)
    torch.manual_seed(3)
    got = float(c.train_step(x, y, lambda o, t: F.cross_entropy(logits(o), t)))
    bad = [] if got == want else [f"loss {got} vs {want}"]
    params, buffers = dict(c.named_parameters()), dict(c.named_buffers())
    for k, p in ref.named_parameters():
        g = params[k].grad
        if (g is None) != (p.grad is None) or (g is not None and not torch.equal(g, p.grad)):
            bad.append(f"gradient of {k}")
    bad += [f"buffer {k}" for k, b in ref.named_buffers() if not torch.equal(buffers[k], b)]
    c.close()
    return "EQUAL" if not bad else f"DIFFERS ({len(bad)}): " + "; ".join(bad[:4])


def _backward(loss: torch.Tensor) -> torch.Tensor:
    loss.backward()
    return loss.detach()


def default(name: str, size: int, n: int) -> str:
    """The planner's default plan on ``n`` CPU devices, replayed against eager in float64."""
    import crosscut
    from crosscut.errors import CrosscutError
    from crosscut.verify import verify_plan

    x = inputs(name, size, 8).double()
    try:
        plan = crosscut.partition(build(name, True).double(), ["cpu"] * n, x, time_limit=5)
    except CrosscutError as e:
        return f"REFUSED: {type(e).__name__}: {str(e)[:240]}"
    report = verify_plan(build(name, True).double(), x, plan, rtol=1e-8, atol=1e-9)
    stages = [f"{len(s.devices)}{'' if s.split == 'none' else ' ' + s.split}" for s in plan.stages]
    shape = (
        f"{plan.replication.replicas} replicas, stages [{', '.join(stages)}], "
        f"M={plan.options.microbatches}, {plan.options.schedule}"
    )
    return ("EQUAL " if report.ok else "DIFFERS ") + shape + ("" if report.ok else report.text())


def rank_main(name: str, size: int, out: Path, mode: str, m: int, sched: str) -> None:
    """One torchrun rank: compile, one SGD step, this rank's state saved under ``out``."""
    import crosscut
    import crosscut.distributed as cd

    cd.init(timeout_s=300)
    torch.set_num_threads(1)
    x = inputs(name, size, 8).double()
    y = torch.randint(0, 5, (8,), generator=torch.Generator().manual_seed(2))
    opts: dict[str, Any] = {} if mode == "default" else {"replicas": 1, "microbatches": m}
    if mode != "default":
        opts.update(schedule=sched, cross_shaped=False)
    pipe = crosscut.compile(build(name, True).double(), None, x, time_limit=5, **opts)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    pipe.train_step((x,), y, lambda o, t: F.cross_entropy(logits(o), t))
    opt.step()
    shape = f"S={pipe.plan.num_stages} M={pipe.plan.options.microbatches}"
    state = {k: v.detach().clone() for k, v in pipe.local_state_dict().items()}
    torch.save({"plan": shape, "state": state}, out / f"rank{torch.distributed.get_rank()}.pt")
    pipe.close()


def torchrun(name: str, size: int, ranks: int, mode: str, m: int, sched: str) -> str:
    """Launch ``rank_main`` on ``ranks`` gloo ranks; compare their state with eager's step."""
    out = Path(tempfile.mkdtemp(prefix="held-out-"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={ranks}", __file__, "--rank-main", name, str(size), str(out),
           mode, str(m), sched]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env, cwd=ROOT)
    if run.returncode:
        return "CRASH: " + " | ".join(run.stderr.strip().splitlines()[-3:])[:400]
    records = [torch.load(out / f"rank{r}.pt") for r in range(ranks)]
    got = {k: v for r in records for k, v in r["state"].items()}
    m = int(records[0]["plan"].split("M=")[1])
    model = build(name, True).double().train()
    x = inputs(name, size, 8).double()
    y = torch.randint(0, 5, (8,), generator=torch.Generator().manual_seed(2))
    for xm, ym in zip(x.chunk(m), y.chunk(m)):
        (F.cross_entropy(logits(model(xm)), ym) / m).backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    want = model.state_dict()
    bad = [k for k, v in want.items() if k not in got or not torch.allclose(got[k], v, 1e-8, 1e-9)]
    return ("EQUAL " if not bad else f"DIFFERS {bad[:4]} ") + records[0]["plan"]


def one_model(name: str, size: int, ranks: bool) -> list[tuple[str, str]]:
    """Every run of one model: ``(label, verdict)``."""
    runs: list[tuple[str, Any]] = (
        [(f"torchrun {r} ranks {mo} M={m}", (torchrun, r, mo, m, s))
         for r, mo, m, s in [(2, "pipe", 2, "1f1b"), (3, "pipe", 1, "auto"),
                             (3, "default", 0, "auto")]]
        if ranks
        else [("pipe 2 M=1", (pipeline, 2, 1, False, "auto")),
              ("pipe 3 M=2", (pipeline, 3, 2, False, "auto")),
              ("pipe 3 M=2 recompute", (pipeline, 3, 2, True, "auto")),
              ("pipe 2 M=4 zb-h1", (pipeline, 2, 4, False, "zb-h1"))]
        + [(f"default {n}", (default, n)) for n in (2, 3, 4)]
    )  # fmt: skip
    out = []
    for label, (fn, *args) in runs:
        try:
            verdict = fn(name, size, *args)
        except Exception as exc:  # a crash on a plan crosscut accepted is a finding
            verdict = "CRASH: " + traceback.format_exception_only(exc)[-1].strip()[:400]
        out.append((label, verdict))
    return out


def main(argv: list[str] | None = None) -> int:
    if argv is None and sys.argv[1:2] == ["--rank-main"]:
        name, size, out, mode, m, sched = sys.argv[2:8]
        rank_main(name, int(size), Path(out), mode, int(m), sched)
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated names")
    parser.add_argument("--torchrun", action="store_true", help="gloo ranks instead")
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # name size: in-process
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.one:
        for label, verdict in one_model(args.one[0], int(args.one[1]), args.torchrun):
            print(f"{args.one[0]:32s} {label:28s} {verdict}", flush=True)
        return 0
    bad = 0
    for name in args.models.split(","):
        start = time.time()
        cmd = [sys.executable, __file__, "--one", name, str(MODELS.get(name, 64))]
        cmd += ["--torchrun"] if args.torchrun else []
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
        rows = run.stdout.strip() or f"{name:32s} CRASH: exit {run.returncode} {run.stderr[-300:]}"
        print(rows + f"\n{name:32s} ({time.time() - start:.0f} s)", flush=True)
        bad += sum(("DIFFERS" in r or "CRASH" in r) for r in rows.splitlines())
    print(f"{bad} runs differ or crash")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
