"""The compiled module is the model in every mode: train/eval, names and order, copies.

fx freezes ``self.training`` into the traced graph, so a model whose forward
reads it (timm's ``BatchNormAct2d``, googlenet's auxiliary heads, hand-written
``if self.training:`` branches) needs the other mode's program too
(``crosscut/codegen/modes.py``). Every check here compiles in one mode, runs
in the other and compares with eager mode on a copy of the model. With one
micro-batch the stages run inline, so the comparisons are bit-exact
(``torch.equal``) against the model run eagerly.
"""

from __future__ import annotations

import copy
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import torchvision
from torch import fx, nn

import crosscut
from crosscut.api import other_mode_graph
from crosscut.codegen import modes
from crosscut.errors import CodegenError, InputError, RuntimeError_
from crosscut.runtime import CompiledModule
from tests.test_transparency import HEAVY  # one list of the heavy classifiers

torch.set_num_threads(1)
SKIP = ("placeholder", "output", "get_attr")


def chunks(gm: fx.GraphModule, k: int) -> dict[str, int]:
    comp = [n.name for n in gm.graph.nodes if n.op not in SKIP]
    return {name: i * k // len(comp) for i, name in enumerate(comp)}


def leaves(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for o in out for t in leaves(o)]


def assert_same(a: Any, b: Any) -> None:
    assert type(a) is type(b), (type(a), type(b))
    la, lb = leaves(a), leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        assert torch.equal(x, y), (x - y).abs().max()


def assert_state(c: nn.Module, ref: nn.Module) -> None:
    got, want = c.state_dict(), ref.state_dict()
    assert list(got) == list(want)
    for k, v in want.items():
        assert torch.equal(got[k], v), k


# ---- hand-written models whose graph depends on self.training ------------------------


class Branchy(nn.Module):
    """Functional batch norm with training=self.training, an if-branch, a train-only head."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8, 5)
        self.aux = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> Any:
        bn = self.bn
        y = F.batch_norm(
            self.c1(x), bn.running_mean, bn.running_var, bn.weight, bn.bias, self.training
        )
        if self.training:
            y = y * 2
        y = self.c2(F.relu(y))
        p = y.mean((2, 3))
        if self.training:
            return self.fc(p), self.aux(p)
        return self.fc(p)


class EvalOnlyHead(nn.Module):
    """The opposite shape: an extra module used only in eval mode, dropout by flag."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 6, 3), nn.ReLU(), nn.Conv2d(6, 6, 3), nn.ReLU())
        self.head = nn.Linear(6, 4)
        self.calib = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = F.dropout(self.body(x).mean((2, 3)), 0.3, self.training)
        out = self.head(p)
        if not self.training:
            out = self.calib(out)
        return out


class TrainCounter(nn.Module):
    """Training-only state (a step counter and an EMA) that eval reads by value after a
    later stage's value: in eval the read needs the state's copy from its stage."""

    def __init__(self, rebind: bool = False) -> None:
        super().__init__()
        self.rebind = rebind
        self.a = nn.Conv2d(3, 4, 3)
        self.b = nn.Conv2d(4, 4, 3)
        self.c = nn.Conv2d(4, 4, 3)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.register_buffer("ema", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.a(x))
        if self.training and self.rebind:  # rebound, kept as in-place writes (python_state.py)
            self.ema = 0.9 * self.ema + 0.1 * y.mean((0, 2, 3)).detach()
            self.steps += 1
        elif self.training:
            self.ema.mul_(0.9).add_(0.1 * y.mean((0, 2, 3)).detach())
            self.steps.add_(1)
        y = torch.relu(self.b(y)) * self.steps
        return self.c(y) + self.ema.view(1, -1, 1, 1)


class TrainOnlyScale(nn.Module):
    """A parameter read by value in one mode only, after a later module: its gradient
    must come back from the stage that reads the copy."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 4, 3)
        self.b = nn.Conv2d(4, 4, 3)
        self.c = nn.Conv2d(4, 4, 3)
        self.gamma = nn.Parameter(torch.full((1, 4, 1, 1), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.b(torch.relu(self.a(x)) * self.gamma))
        if self.training:
            y = y * self.gamma
        return self.c(y)


def run_both_ways(model: nn.Module, x: torch.Tensor, k: int, mode: str) -> None:
    """Compile in ``mode`` on k CPU devices; switch train/eval both ways against eager."""
    model.train(mode == "train")
    ref = copy.deepcopy(model)
    before = copy.deepcopy(model.state_dict())
    c = crosscut.compile(
        model, ["cpu"] * k, x, mode=mode, require_all_devices=True, microbatches=1, replicas=1
    )
    assert_state(model, ref)  # compiling leaves the caller's model alone
    assert all(torch.equal(v, model.state_dict()[key]) for key, v in before.items())
    for flag in (mode != "train", mode == "train", mode != "train"):
        c.train(flag)
        ref.train(flag)
        torch.manual_seed(3)
        out = c(x)
        torch.manual_seed(3)
        want = ref(x)
        assert_same(out, want)
        if flag:
            sum(t.float().pow(2).mean() for t in leaves(out)).backward()
            sum(t.float().pow(2).mean() for t in leaves(want)).backward()
            got = dict(c.named_parameters())
            for name, p in ref.named_parameters():
                g = got[name].grad
                assert (g is None) == (p.grad is None), name
                assert g is None or torch.equal(g, p.grad), name
            c.zero_grad()
            ref.zero_grad()
        assert_state(c, ref)  # running statistics move only in training, as in eager
    c.close()


@pytest.mark.parametrize("mode", ["train", "infer"])
@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize(
    "make", [Branchy, EvalOnlyHead, TrainCounter, lambda: TrainCounter(True), TrainOnlyScale]
)
def test_self_training_branches_follow_the_flag(make: type[nn.Module], k: int, mode: str) -> None:
    torch.manual_seed(0)
    run_both_ways(make(), torch.randn(4, 3, 12, 12), k, mode)


def test_eval_with_microbatches_equals_eager_eval() -> None:
    """Eval is per sample, so any micro-batch count gives eager's eval outputs."""
    torch.manual_seed(0)
    model = Branchy().train()
    x = torch.randn(8, 3, 12, 12)
    c = crosscut.compile(
        model, ["cpu"] * 3, x, microbatches=4, require_all_devices=True, replicas=1
    )
    ref = copy.deepcopy(model)
    c.eval()
    ref.eval()
    torch.testing.assert_close(c(x), ref(x), rtol=1e-5, atol=1e-6)
    assert_state(c, ref)  # eval never touches the running statistics
    c.train()
    out = c(x)
    assert isinstance(out, tuple) and len(out) == 2  # back to the training program
    c.close()


class Reordered(nn.Module):
    """Eval runs the layers in the other order: no placement of the plan can serve both."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 6)
        self.fc2 = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            return self.fc2(torch.relu(self.fc1(x)))
        return self.fc1(torch.relu(self.fc2(x)))


def test_other_mode_that_no_placement_serves_is_refused_at_compile_time() -> None:
    model = Reordered().train()
    gm = fx.symbolic_trace(model)
    other = fx.symbolic_trace(copy.deepcopy(model).eval())
    with pytest.raises(
        CodegenError, match=r"other train/eval mode, node 'fc1' must run on stage 0"
    ):
        CompiledModule(model, gm, {"fc1": 0, "relu": 1, "fc2": 1}, ["cpu", "cpu"], other_gm=other)
    # on one stage both orders run: the same model compiles and switches like eager
    c = CompiledModule(model, gm, {"fc1": 0, "relu": 0, "fc2": 0}, ["cpu"], other_gm=other)
    x = torch.randn(3, 6)
    c.eval()
    assert torch.equal(c(x), model.eval()(x))
    c.close()


@pytest.mark.parametrize(
    ("make", "mode", "key"),
    [(TrainCounter, "train", "steps"), (lambda: TrainCounter(True), "train", "steps"),
     (TrainOnlyScale, "infer", "gamma")],
)  # fmt: skip
def test_state_read_by_value_after_a_later_stage_reads_a_copy(
    make: Any, mode: str, key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The other mode's function nodes that read state after a later stage's value get
    a clone made where the state lives, and both modes run like eager (before, each such
    plan was refused: "must run on stage 0 ... reads a value made on stage 1")."""
    copied: list[str] = []
    real = modes._read_by_copy

    def spy(gm: fx.GraphModule, n: fx.Node) -> None:
        copied.extend(str(u.target) for u in n.all_input_nodes if u.op == "get_attr")
        real(gm, n)

    monkeypatch.setattr(modes, "_read_by_copy", spy)
    for k in (2, 3, 4):
        torch.manual_seed(0)
        run_both_ways(make(), torch.randn(8, 3, 12, 12), k, mode)
    assert copied and set(copied) == {key}, copied


def test_graphs_equal_in_both_modes_need_no_second_program() -> None:
    model = torchvision.models.resnet18(num_classes=10)
    graph = crosscut.trace(model, torch.randn(2, 3, 32, 32))
    assert other_mode_graph(model, graph) is None
    c = crosscut.compile(
        model, ["cpu", "cpu"], torch.randn(2, 3, 32, 32), microbatches=1, replicas=1
    )
    assert c._other is None  # one program: leaf modules switch by their own flags
    c.close()


@pytest.mark.distributed
@pytest.mark.xdist_group("dist")
def test_torchrun_ranks_refuse_the_other_mode_by_name(tmp_path: Path) -> None:
    """2 gloo ranks: training runs as compiled; eval is refused on every rank, no hang."""
    script = Path(__file__).parent / "dist_scripts" / "modes_check.py"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    done = subprocess.run(
        [*cmd, str(script), str(tmp_path)], env=env, capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["refused"] for r in ranks] == [True, True]
    sys.path.insert(0, str(script.parent))
    from modes_check import Branchy  # type: ignore[import-not-found]

    torch.manual_seed(0)  # as the script: the batch first, then the model
    x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 5, (4,))
    model = Branchy()
    with torch.no_grad():
        want = float(F.cross_entropy(model(x), y))
    losses = [r["loss"] for r in ranks if r["loss"] is not None]
    assert losses == [pytest.approx(want, abs=1e-6)]
    # each rank's parameters under the model's names, in the model's order; together all of them
    order = [n for n, _ in model.named_parameters()]
    for r in ranks:
        assert r["params"] == [n for n in order if n in r["params"]]
    assert sorted(n for r in ranks for n in r["params"]) == sorted(order)


# ---- every non-heavy torchvision classifier, compiled in one mode, run in the other --------

TORCHVISION = [
    n for n in sorted(torchvision.models.list_models(module=torchvision.models)) if n not in HEAVY
]


def _torchvision(name: str) -> tuple[nn.Module, torch.Tensor]:
    kw: dict[str, Any] = {"num_classes": 10}
    if name in ("googlenet", "inception_v3"):
        kw["init_weights"] = False  # aux_logits stay on: their heads exist in training only
    if name.startswith("vit_"):
        kw["image_size"] = 64 if "_14" not in name else 56
    model: nn.Module = torchvision.models.get_model(name, weights=None, **kw)
    # inception_v3's auxiliary head (training only) needs 17x17 maps: 299 px
    size = 299 if name == "inception_v3" else 56 if name.startswith("vit_h") else 64
    return model, torch.randn(2, 3, size, size)


@pytest.mark.slow
@pytest.mark.parametrize("name", TORCHVISION)
def test_torchvision_compiled_in_one_mode_runs_in_the_other(name: str) -> None:
    torch.manual_seed(0)
    model, x = _torchvision(name)
    for mode, flag in (("train", False), ("infer", True)):
        model.train(mode == "train")
        graph = crosscut.trace(model, x, mode=mode)
        other = other_mode_graph(model, graph)
        assert graph.gm is not None
        c = CompiledModule(
            model,
            graph.gm,
            chunks(graph.gm, 2),
            ["cpu", "cpu"],
            "1f1b",
            1,
            other_gm=other,
            gm_training=mode == "train",
        )
        ref = copy.deepcopy(model).train(flag)
        c.train(flag)
        torch.manual_seed(1)
        out = c(x)
        torch.manual_seed(1)
        want = ref(x)
        assert type(out) is type(want)  # googlenet: GoogLeNetOutputs in training, else a Tensor
        for a, b in zip(leaves(out), leaves(want)):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)  # fx tracing reorders a few ops
        assert_close_state(c, ref)
        c.close()


def test_a_mode_the_model_cannot_run_at_these_inputs_is_refused_by_name() -> None:
    """inception_v3 at 80 px runs in eval, but its training-only aux head cannot."""
    model = torchvision.models.inception_v3(weights=None, init_weights=False).eval()
    x = torch.randn(2, 3, 80, 80)
    c = crosscut.compile(model, ["cpu", "cpu"], x, mode="infer", microbatches=1, replicas=1)
    assert c(x).shape == (2, 1000)
    c.train()
    with pytest.raises(RuntimeError_, match=r"compiled in eval mode.*cannot be traced.*avg_pool2d"):
        c(x)
    c.eval()
    assert c(x).shape == (2, 1000)
    c.close()


def assert_close_state(c: nn.Module, ref: nn.Module) -> None:
    got, want = c.state_dict(), ref.state_dict()
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=1e-4, atol=1e-5, msg=k)


# ---- timm: norm-act layers that call F.batch_norm(training=self.training) -------------------

TIMM = [
    "efficientnet_b0",  # BatchNormAct2d + SiLU + squeeze-excite
    "mobilenetv3_small_050",  # hard-swish, BatchNormAct2d
    "regnetx_002",  # RegNet, BatchNormAct2d + ReLU
    "resnet10t",  # timm ResNet, plain BatchNorm2d (graphs agree)
    "convnext_atto",  # LayerNorm2d + GELU (graphs agree)
    "mobilevit_xxs",  # conv + transformer blocks
    "rexnet_100",  # ReLU6 / SiLU mix
    "lcnet_050",  # PP-LCNet, hard-swish
    "ese_vovnet19b_slim_dw",  # VoVNet, effective SE
    "gernet_s",  # ByobNet
    "mixnet_s",  # mixed depthwise kernels
    "ghostnet_050",  # ghost modules
    "edgenext_xx_small",  # LayerNorm + attention (graphs agree)
    "cs3darknet_s",  # CSP Darknet
]


@pytest.mark.slow
@pytest.mark.parametrize("name", TIMM)
def test_timm_classifiers_switch_modes_like_eager(name: str) -> None:
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, num_classes=10)
    x = torch.randn(2, 3, 64, 64)
    y = torch.randint(0, 10, (2,))
    for mode in ("train", "infer"):
        model.train(mode == "train")
        ref = copy.deepcopy(model)
        c = crosscut.compile(
            model, ["cpu"] * 3, x, mode=mode, require_all_devices=True, microbatches=1, replicas=1
        )
        # train step, then eval, then train again: each against eager on the same state
        for flag in (True, False, True):
            c.train(flag)
            ref.train(flag)
            torch.manual_seed(1)
            out = c(x)
            torch.manual_seed(1)
            want = ref(x)
            torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
            if flag:
                F.cross_entropy(out, y).backward()
                F.cross_entropy(want, y).backward()
                torch.optim.SGD(c.parameters(), lr=0.1).step()
                torch.optim.SGD(ref.parameters(), lr=0.1).step()
                c.zero_grad()
                ref.zero_grad()
            assert_close_state(c, ref)
        c.close()


# ---- parameters in the model's names and order --------------------------------------------


class Frozen(nn.Module):
    """Frozen, unused and same-shaped parameters: what an index-keyed optimizer trips on."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 4, 3, padding=1)
        self.spare = nn.Linear(4, 4)  # never used in forward
        self.b = nn.Conv2d(4, 4, 3, padding=1)
        self.c = nn.Conv2d(4, 4, 3, padding=1)
        self.d = nn.Conv2d(4, 4, 3, padding=1)
        self.fc = nn.Linear(4, 3)
        self.b.weight.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.b(F.relu(self.a(x)))
        y = self.d(F.relu(y)) + self.c(F.relu(y))  # c and d on different stages in some plans
        return self.fc(y.mean((2, 3)))


def test_named_parameters_and_buffers_follow_the_model() -> None:
    model = torchvision.models.googlenet(weights=None, aux_logits=False, init_weights=False)
    x = torch.randn(2, 3, 64, 64)
    for k in (2, 3):
        c = crosscut.compile(
            model, ["cpu"] * k, x, require_all_devices=True, microbatches=1, replicas=1
        )
        got = list(c.named_parameters())
        want = list(model.named_parameters())
        assert [n for n, _ in got] == [n for n, _ in want]
        assert all(torch.equal(p, q) for (_, p), (_, q) in zip(got, want))
        assert [n for n, _ in c.named_buffers()] == [n for n, _ in model.named_buffers()]
        assert len(list(c.parameters())) == len(want)
        c.close()


def test_optimizer_checkpoint_moves_eager_to_plan_a_to_plan_b() -> None:
    torch.manual_seed(0)
    model = Frozen()
    x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 3, (4,))
    ref = copy.deepcopy(model)

    def sgd(params: Any) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-3)

    def step(m: nn.Module, opt: torch.optim.Optimizer) -> None:
        opt.zero_grad()
        F.cross_entropy(m(x), y).backward()
        opt.step()

    ref_opt = sgd(ref.parameters())
    for _ in range(3):  # uninterrupted eager training
        step(ref, ref_opt)

    opt = sgd(model.parameters())
    step(model, opt)  # step 1 eagerly
    state, opt_state = model.state_dict(), opt.state_dict()
    for k, stages in ((2, [0, 0, 0, 0, 1, 0, 0, 1, 1, 1]), (3, [0, 0, 1, 1, 2, 1, 1, 2, 2, 2])):
        model2 = Frozen()
        gm = fx.symbolic_trace(model2)
        comp = [n.name for n in gm.graph.nodes if n.op not in SKIP]
        assert len(comp) == len(stages)
        c = CompiledModule(model2, gm, dict(zip(comp, stages)), ["cpu"] * k, "1f1b", 1)
        c.load_state_dict(state)
        c_opt = sgd(c.parameters())
        c_opt.load_state_dict(opt_state)
        step(c, c_opt)  # step 2 on plan A, step 3 on plan B
        state, opt_state = c.state_dict(), c_opt.state_dict()
        c.close()
    assert_state_dicts_equal(state, ref.state_dict())
    assert [s.get("momentum_buffer") is None for s in opt_state["state"].values()] == [
        s.get("momentum_buffer") is None for s in ref_opt.state_dict()["state"].values()
    ]
    for key, s in opt_state["state"].items():
        assert torch.equal(
            s["momentum_buffer"], ref_opt.state_dict()["state"][key]["momentum_buffer"]
        )


def assert_state_dicts_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for k in b:
        assert torch.equal(a[k], b[k]), k


# ---- copies ---------------------------------------------------------------------------


@pytest.mark.parametrize("mb", [1, 2])
def test_deepcopy_and_pickle_rebuild_the_executor(mb: int) -> None:
    torch.manual_seed(0)
    model = Branchy()
    x = torch.randn(4, 3, 12, 12)
    c = crosscut.compile(
        model, ["cpu"] * 2, x, microbatches=mb, require_all_devices=True, replicas=1
    )
    c.eval()
    want = c(x)
    for twin in (copy.deepcopy(c), pickle.loads(pickle.dumps(c))):
        assert isinstance(twin, CompiledModule)
        assert torch.equal(twin(x), want)
        twin.train()
        assert isinstance(twin(x), tuple)  # the copy keeps both programs
        with torch.no_grad():  # and owns its state: the original does not move
            next(twin.parameters()).add_(1.0)
        assert torch.equal(c(x), want)
        twin.close()
    c.close()


# ---- modules in another mode than the model (frozen batch norms) ---------------------


class FnNorm(nn.Module):
    """A batch norm traced through (as timm's ``BatchNormAct2d``): ``self.training`` is
    frozen into the graph, so the trace must read the module's own flag."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.rand(c) + 0.5), nn.Parameter(torch.zeros(c))
        self.register_buffer("running_mean", torch.randn(c))
        self.register_buffer("running_var", torch.rand(c) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.batch_norm(
            x, self.running_mean, self.running_var, self.weight, self.bias, self.training
        )


def _frozen_norms() -> nn.Module:
    torch.manual_seed(0)
    bn = nn.BatchNorm2d(8)
    bn.running_mean.normal_(), bn.running_var.uniform_(0.5, 2.0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), bn, nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), FnNorm(8),
        nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5),
    ).train()  # fmt: skip
    for m in (model[1], model[4]):
        m.eval()  # fine-tuning with frozen statistics
    return model


@pytest.mark.parametrize("k", [1, 2, 3])
def test_batch_norms_frozen_by_eval_in_a_training_model_train_as_eager(k: int) -> None:
    """Before, the trace set every module to train and so did the compiled module: a
    frozen torchvision resnet18 trained on batch statistics (loss 1.12 against eager's
    1.54) and updated its running statistics, a frozen timm mobilenetv3 likewise. Each
    module now keeps its own flag in the mode the model was compiled in, also after a
    round trip through eval."""
    from tests.test_forward_state import assert_steps_equal

    x = torch.randn(4, 3, 8, 8)
    model = _frozen_norms()
    c = crosscut.compile(copy.deepcopy(model), ["cpu"] * k, x, microbatches=1, replicas=1)
    c.eval()
    assert not any(m.training for m in c.modules())
    c.train()
    assert [isinstance(m, nn.BatchNorm2d) for m in c.modules() if not m.training] == [True]
    assert_steps_equal(c, model, x, 2)


def test_the_distributed_pipeline_keeps_a_frozen_batch_norm_through_eval_and_train(
    tmp_path: Path,
) -> None:
    """The same rule on a torchrun rank (one gloo rank in this process): ``.train()``
    after ``.eval()`` gives the frozen batch norm its flag back, and the step is eager's."""
    import torch.distributed as dist

    import crosscut.distributed as cd

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 's'}", rank=0, world_size=1)
    try:
        x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 5, (4,))
        pipe = cd.compile_distributed(_frozen_norms(), x, None, replicas=1, microbatches=1)
        pipe.eval()
        pipe.train()
        assert [type(m) for m in pipe.modules() if not m.training] == [nn.BatchNorm2d]
        got = pipe.train_step(x, y, F.cross_entropy)
        pipe.close()
        assert torch.equal(got, F.cross_entropy(_frozen_norms()(x), y))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("devices", "options"),
    [(1, {}), (2, {"replicas": 1, "microbatches": 1}), (2, {"replicas": 2})],
    ids=["one-device", "pipeline", "replicas"],
)
def test_a_model_compiled_in_eval_trains_after_train_like_eager(
    devices: int, options: dict[str, int]
) -> None:
    """The model is in eval when compiled (for training, the default mode); ``.train()`` on
    the compiled module must then set every module, as ``model.train()`` does. Before, the
    eval flags were kept as if each batch norm had been frozen by hand: resnet18 trained
    on its running statistics, outputs 1.31 off eager (1.43 on 2 replicas), no error."""
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=5).eval()
    x = torch.randn(8, 3, 32, 32)
    c = crosscut.compile(copy.deepcopy(model), ["cpu"] * devices, x, **options)
    assert not any(m.training for m in c.modules())
    c.train()
    assert all(m.training for m in c.modules())
    model.train()
    out = c(x)
    want = torch.cat([model(part) for part in x.chunk(c.plan.replication.replicas)])
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    if c.plan.replication.replicas == 1:
        assert_close_state(c, model)
    else:  # replicas keep the first one's running statistics, as DDP does
        model.load_state_dict(c.state_dict())
    c.eval()
    model.eval()
    torch.testing.assert_close(c(x), model(x), rtol=1e-5, atol=1e-5)


def test_a_torchrun_pipeline_of_a_model_in_eval_starts_in_eval(tmp_path: Path) -> None:
    """One gloo rank in this process. A model in eval, compiled for training (the default
    plan mode): the pipeline starts in eval, as the model is, and ``.train()`` sets every
    module. Before, it started in training mode: a dropout written with
    ``training=self.training`` then dropped in what the caller meant as inference (0.19
    off eager's eval output, no error); now that call is refused by name (ranks hold the
    train-mode program only)."""
    import torch.distributed as dist

    import crosscut.distributed as cd

    class Drops(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c = nn.Conv2d(3, 8, 3)
            self.fc = nn.Linear(8, 5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(F.dropout(torch.relu(self.c(x)).mean((2, 3)), 0.5, self.training))

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 's'}", rank=0, world_size=1)
    try:
        x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 5, (4,))
        torch.manual_seed(0)
        model = torchvision.models.resnet18(num_classes=5).eval()
        pipe = cd.compile_distributed(copy.deepcopy(model), x, None, replicas=1, microbatches=1)
        assert not pipe.training
        torch.testing.assert_close(pipe(x), model(x), rtol=1e-5, atol=1e-5)
        pipe.train()
        assert all(m.training for m in pipe.modules() if not isinstance(m, fx.GraphModule))
        got = pipe.train_step(x, y, F.cross_entropy)
        assert torch.equal(got.detach(), F.cross_entropy(model.train()(x), y).detach())
        pipe.close()
        drops = Drops().eval()
        pipe = cd.compile_distributed(drops, x, None, replicas=1, microbatches=1)
        assert not pipe.training
        with pytest.raises(InputError, match=r"reads self\.training"):
            pipe(x)
        pipe.close()
    finally:
        dist.destroy_process_group()
