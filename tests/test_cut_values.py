"""Values that cross a cut in less usual ways are eager or refused (issue 27, items 2, 3, 7).

* A ``torch.Size`` read on several stages (attention blocks reading ``x.shape``)
  got a ``view_as`` alias from the fan-out pass and crashed at the first call.
* A value read through an op that returns it itself (dla's ``nn.Identity``
  downsample) adds that reader's gradient at ITS reader's place, not at the
  identity's: the aliases follow autograd's readers, so gradients are eager's.
* A free ``nn.Parameter`` read at both ends of the network lives on its node's
  stage and reaches the other stage as a value (the plan priced that edge).
* A reader of a value after a plain in-place write into it reads the write's
  result, an edge the solver sees, so no plan puts it before the write.

Gradients are compared with ``torch.equal`` against eager running the same
micro-batches in order (one micro-batch on CPU promises eager's bits).
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import crosscut
from crosscut.runtime import CompiledModule

torch.set_num_threads(1)
SKIP = ("placeholder", "output", "get_attr")


def eager_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor, m: int) -> torch.Tensor:
    total = torch.zeros(())
    for xm, ym in zip(x.chunk(m), y.chunk(m)):
        loss = F.cross_entropy(model(xm), ym) * (1.0 / m)
        loss.backward()
        total = total + loss.detach()
    return total


def assert_equal_to_eager(
    model: nn.Module, gm: fx.GraphModule, stage_of: dict[str, int], stages: int, m: int
) -> CompiledModule:
    torch.manual_seed(1)
    x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 4, (4,))
    ref = copy.deepcopy(model)
    want = eager_grads(ref, x, y, m)
    c = CompiledModule(copy.deepcopy(model), gm, stage_of, ["cpu"] * stages, "1f1b", m)
    assert float(c.train_step(x, y, F.cross_entropy)) == float(want)
    got = dict(c.named_parameters())
    for k, p in ref.named_parameters():
        assert torch.equal(got[k].grad, p.grad), k
    c.close()
    return c


class ShapeReader(nn.Module):
    """Attention-style: ``B, C, H, W = x.shape`` read by ops on every stage."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 8, 3, padding=1)
        self.b = nn.Conv2d(8, 8, 3, padding=1)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v = torch.relu(self.a(x))
        s = v.shape
        q = v.reshape(s[0], s[1], s[2] * s[3]).softmax(-1).reshape(s)
        k = self.b(v).flatten(2).mean(-1).reshape(s[0], s[1], 1, 1)
        return self.head((q * k).mean((2, 3)))


@pytest.mark.parametrize("traced", [True, False], ids=["trace", "symbolic_trace"])
def test_a_shape_read_on_several_stages_is_not_aliased(traced: bool) -> None:
    """Item 2: the shape's readers interleave over 2 stages; 2 micro-batches, eager's bits."""
    model = ShapeReader()
    x = torch.randn(2, 3, 8, 8)
    gm = crosscut.trace(model, x).gm if traced else fx.symbolic_trace(model)
    names = [n.name for n in gm.graph.nodes if n.op not in SKIP]
    shape = next(n for n in gm.graph.nodes if n.target == "shape" or n.name.startswith("getattr"))
    readers = sorted(u.name for u in shape.users)
    assert len(readers) >= 3
    late = {"b", readers[1]}  # the conv and one read of the shape, then everything after them
    stage_of: dict[str, int] = {}
    for n in gm.graph.nodes:
        if n.op not in SKIP:
            lowest = max((stage_of.get(u.name, 0) for u in n.all_input_nodes), default=0)
            stage_of[n.name] = 1 if n.name in late else lowest
    assert set(stage_of.values()) == {0, 1} and len(names) == len(stage_of)
    c = assert_equal_to_eager(model, gm, stage_of, 2, 2)
    # with the trace's values the shape is known not to be a tensor; without them
    # its aliases are ``alias_of``, which hands anything but a tensor back as it is
    assert (shape.name in c.program.aliases.values()) is not traced


class IdentityReader(nn.Module):
    """dla's tree: ``v`` read by an Identity (then an add, late), a conv and a concat."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.down = nn.Identity()
        self.c1 = nn.Conv2d(8, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v = torch.relu(self.stem(x))
        skip = self.down(v)
        y = torch.tanh(self.c2(torch.tanh(self.c1(v)))) + skip
        return self.head(torch.cat([y, v], 1).mean((2, 3)))


@pytest.mark.parametrize("m", [1, 2])
def test_a_reader_through_an_identity_sums_in_eagers_order(m: int) -> None:
    """Item 3: Identity and concat on stage 1, the conv chain on stage 0 (dla46_c's cut)."""
    model = IdentityReader()
    x = torch.randn(4 // m, 3, 8, 8)
    for gm in (crosscut.trace(model, x).gm, fx.symbolic_trace(model)):
        late = {"down", "c2", "tanh_1", "add", "cat", "mean", "head"}
        stage_of = {n.name: int(n.name in late) for n in gm.graph.nodes if n.op not in SKIP}
        c = assert_equal_to_eager(model, gm, stage_of, 2, m)
        # looked through the Identity, the readers on stage 1 (add, cat) come last:
        # the pipeline's own order is eager's (before: aliases in the wrong order)
        assert c.program.aliases == {}


class FreeParameter(nn.Module):
    """A free ``nn.Parameter`` (or a buffer) read at the start and at the end of the network."""

    def __init__(self, buffer: bool = False) -> None:
        super().__init__()
        scale = torch.linspace(0.5, 1.5, 8).reshape(1, 8, 1, 1)
        if buffer:
            self.register_buffer("scale", scale)
        else:
            self.scale = nn.Parameter(scale)
        self.convs = nn.ModuleList(nn.Conv2d(3 if i == 0 else 8, 8, 3, padding=1) for i in range(3))
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.convs[0](x) * self.scale
        y = self.convs[2](torch.relu(self.convs[1](torch.relu(y))))
        return self.head((y * self.scale + self.scale).mean((2, 3)))


@pytest.mark.parametrize("buffer", [False, True], ids=["parameter", "buffer"])
@pytest.mark.parametrize("devices,m", [(2, 1), (3, 2)])
def test_a_free_parameter_read_at_both_ends_compiles_and_is_eager(
    devices: int, m: int, buffer: bool
) -> None:
    """Item 7: the plan puts ``scale`` on one stage; the other stages receive it as a value.

    A buffer only read is the same case (codegen refused it as tied state before,
    on plans ``partition`` made).
    """
    torch.manual_seed(0)
    model = FreeParameter(buffer)
    x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 4, (4,))
    c = crosscut.compile(
        copy.deepcopy(model), ["cpu"] * devices, x, microbatches=m, require_all_devices=True
    )
    assert c.plan.num_stages == devices
    ref = copy.deepcopy(model)
    want = eager_grads(ref, x, y, m)
    assert float(c.train_step(x, y, F.cross_entropy)) == float(want)
    got = dict(c.named_parameters())
    for k, p in ref.named_parameters():
        assert torch.equal(got[k].grad, p.grad), k
    assert ("scale" in c.program.aliases.values()) is True
    c.close()


class DropPath(nn.Module):
    """timm's drop path written out: ``bernoulli_`` then ``div_`` in place, read by a product."""

    def __init__(self) -> None:
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(3 if i == 0 else 4, 4, 3, padding=1) for i in range(2))
        self.head = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for c in self.convs:
            x = torch.relu(c(x))
        keep = x.new_empty(x.shape[0], 1, 1, 1).bernoulli_(0.75)
        keep.div_(0.75)
        return self.head((x * keep).mean((2, 3)))


def test_every_plan_of_an_in_place_write_compiles() -> None:
    """Item 7: every edge-respecting 2-stage split of the tail compiles; none reads early."""
    model, x = DropPath(), torch.randn(2, 3, 8, 8)
    graph = crosscut.trace(model, x)
    nodes = {n.name: n for n in graph.gm.graph.nodes}
    assert [u.name for u in nodes["bernoulli_"].users] == ["div_"]  # mul reads the write
    tail = [n for n in nodes if n not in ("x", "output") and not n.startswith(("convs", "relu"))]
    compiled = 0
    for sides in itertools.product([0, 1], repeat=len(tail)):
        stage_of = {n: 0 for n in nodes if n not in ("x", "output")} | dict(zip(tail, sides))
        if any(stage_of[a.name] > stage_of[n] for n in tail for a in nodes[n].all_input_nodes):
            continue
        if not any(sides):
            continue
        c = CompiledModule(copy.deepcopy(model), graph.gm, stage_of, ["cpu", "cpu"], "1f1b", 1)
        c.close()
        compiled += 1
    assert compiled > 5


class WriteIntoACopy(nn.Module):
    """``v`` read on both stages, then written through a view that nothing reads.

    The fuzz draw that broke issue 27's first try, cut down: stage 1 reads
    ``v`` before the write, so the alias pass writes ``v.clone()`` instead. The
    clone once carried ``v``'s own fake value, so the fan-out pass took it for
    an op that hands ``v`` through and rewired the write's view to an alias of
    ``v``: the write landed in ``v``, which stage 1 then read.
    """

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 4, 3, padding=1)
        self.b = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v = torch.relu(self.a(x)) * 1.0
        y = self.bn(self.b(x) + v)
        z = v * 2.0
        v.view(v.shape[0], -1)[:, ::2].mul_(0.5)
        return self.head(torch.cat([y, z], 1).mean((2, 3)))


@pytest.mark.parametrize("m", [1, 2])
def test_a_write_into_the_traces_copy_stays_in_the_copy(m: int) -> None:
    """``v``'s readers interleave (stages 1, 0, 0): aliased, and the write still hits the copy."""
    model = WriteIntoACopy()
    gm = crosscut.trace(model, torch.randn(4 // m, 3, 8, 8)).gm
    clone = next(n for n in gm.graph.nodes if n.target == "clone")
    value, view = clone.args[0], next(iter(clone.users))
    assert isinstance(value, fx.Node) and view.target == "view"
    late = {"b", "add", "bn", "cat", "mean", "head"}
    stage_of = {n.name: int(n.name in late) for n in gm.graph.nodes if n.op not in SKIP}
    c = assert_equal_to_eager(model, gm, stage_of, 2, m)  # bn's output: y as eager made it
    assert value.name in c.program.aliases.values()
    code = "".join(s.module.code for s in c.program.stages)
    assert f"{view.name} = clone.view(" in code  # the write's view reads the copy, not v
    ref, x = copy.deepcopy(model), torch.randn(4, 3, 8, 8)
    with torch.no_grad():
        for xm in x.chunk(m):
            ref(xm)
    c = CompiledModule(copy.deepcopy(model), gm, stage_of, ["cpu"] * 2, "1f1b", m)
    with torch.no_grad():
        c(x)
    got = c.state_dict()
    for k, b in ref.state_dict().items():  # running statistics: one update per micro-batch
        assert torch.allclose(got[k], b, rtol=0, atol=1e-6 if m > 1 else 0), k
    c.close()


class WriteThroughIdentity(nn.Module):
    """``v`` written in place through an ``nn.Identity`` that returned it."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 4, 3, padding=1)
        self.ident = nn.Identity()
        self.head = nn.Linear(12, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v = self.a(x) * 1.0
        i = self.ident(v)
        r1, r2 = v * 2.0, v * 3.0
        w = i.add_(1.0)
        return self.head(torch.cat([r1, r2, w * 4.0], 1).mean((2, 3)))


def test_a_value_written_through_an_op_that_returned_it_is_not_aliased() -> None:
    """Its readers interleave (1, 0, 0), but an alias made before the write would read around it."""
    from crosscut.codegen.fanout import separate_fanout
    from crosscut.frontend.alias import inplace_target

    model = WriteThroughIdentity()
    gm = copy.deepcopy(crosscut.trace(model, torch.randn(2, 3, 8, 8)).gm)
    nodes = {n.name: n for n in gm.graph.nodes}
    assert nodes["ident"].meta["val"] is nodes["mul"].meta["val"]  # looked through
    assert nodes["add_"].meta["val"] is nodes["mul"].meta["val"]  # so is the write, but...
    stage_of = {n.name: 0 for n in gm.graph.nodes if n.op not in SKIP}
    stage_of["mul_1"] = 1
    stage_of |= {n: 1 for n in ("cat", "mean", "head")}
    modules = dict(gm.named_modules())
    mutators = [n for n in gm.graph.nodes if n.op not in SKIP and inplace_target(n, modules)]
    assert separate_fanout(gm, stage_of, mutators) == {}  # ...it stops the rewrite
    # (the trace ties v's class, so codegen would refuse this plan anyway: the
    # rule holds for graphs without the trace's ties too)


class _Stats(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(channels))
        self.register_buffer("var", torch.ones(channels))


class _ReadsWrittenStatsLate(nn.Module):
    """``F.batch_norm`` on a plain module's buffers moves them (no version counter moves),
    and the network reads the moved mean again at its end."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.stats = nn.Conv2d(3, 8, 3, padding=1), _Stats(8)
        self.body = nn.Sequential(*(nn.Conv2d(8, 8, 3, padding=1) for _ in range(4)))
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.stats
        y = F.batch_norm(self.c1(x), s.mean, s.var, training=self.training)
        y = self.body(y) + s.mean.view(1, -1, 1, 1)
        return self.head(y.mean((2, 3)))  # type: ignore[no-any-return]


@pytest.mark.parametrize("devices", [2, 3])
def test_a_buffer_a_functional_norm_writes_keeps_its_readers_on_its_stage(devices: int) -> None:
    """The buffer cannot be sent as a value (a copy would take the write), and codegen refused
    the 3-device plan ``partition`` made ("tied (shared) across stages [0, 2]"): its readers
    are now tied to its stage, and the plan compiles and trains like eager."""
    torch.manual_seed(0)
    model, x = _ReadsWrittenStatsLate(), torch.randn(4, 3, 8, 8)
    graph = crosscut.trace(model, x)
    assert ["stats_mean", "batch_norm", "view"] in graph.ties
    c = crosscut.compile(
        copy.deepcopy(model), ["cpu"] * devices, x, microbatches=1, replicas=1,
        require_all_devices=True, time_limit=5,
    )  # fmt: skip
    assert c.plan.num_stages == devices
    at = c.plan.assignment
    assert at["stats_mean"] == at["batch_norm"] == at["view"]
    ref = copy.deepcopy(model)
    out, want = c(x), ref(x)
    assert torch.equal(out, want)
    out.pow(2).sum().backward()
    want.pow(2).sum().backward()
    params = dict(c.named_parameters())
    assert all(torch.equal(params[k].grad, p.grad) for k, p in ref.named_parameters())
    assert all(torch.equal(v, ref.state_dict()[k]) for k, v in c.state_dict().items())
    c.close()
