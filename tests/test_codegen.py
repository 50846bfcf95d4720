"""Stage extraction, transfer records, in-place safety and source export."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torchvision
from torch import fx, nn

from crosscut.codegen import build_stages, program_source
from crosscut.errors import CodegenError
from crosscut.ir.program import INPUT, OUTPUT, StagedProgram, ValueRef

SKIP = ("placeholder", "output", "get_attr")


def chunks(gm: fx.GraphModule, k: int) -> dict[str, int]:
    """k contiguous chunks of the compute nodes in fx order."""
    comp = [n.name for n in gm.graph.nodes if n.op not in SKIP]
    return {name: i * k // len(comp) for i, name in enumerate(comp)}


def run(program: StagedProgram, *args: torch.Tensor) -> Any:
    """Execute stages one after another (no runtime): codegen checked on its own."""
    env: dict[str, Any] = dict(zip(program.placeholders, args))
    for stage in program.stages:
        outs = stage.module(*[env[name] for name, _ in stage.inputs])
        env.update(zip(stage.outputs, outs))
    tpl = program.output_template
    return env[tpl.name] if isinstance(tpl, ValueRef) else tpl


def resnet_cut(gm: fx.GraphModule) -> dict[str, int]:
    """Stage 0 up to layer1_0's output; stage 1 = layer1_1's conv path; stage 2 the rest.

    layer1_0_relu_1 feeds layer1_1_conv1 (stage 1) AND the skip add (stage 2):
    the skip jumps over stage 1.
    """
    names = [n.name for n in gm.graph.nodes if n.op not in SKIP]
    a = names.index("layer1_0_relu_1")
    b = names.index("layer1_1_bn2")
    return {n: 0 if i <= a else 1 if i <= b else 2 for i, n in enumerate(names)}


@pytest.fixture(scope="module")
def resnet() -> tuple[nn.Module, fx.GraphModule]:
    torch.manual_seed(0)
    m = torchvision.models.resnet18().eval()
    return m, fx.symbolic_trace(m)


def test_skip_is_sent_directly_once_per_destination(resnet: Any) -> None:
    m, gm = resnet
    x = torch.randn(2, 3, 64, 64)
    prog = build_stages(gm, resnet_cut(gm), ["cpu"] * 3, example_inputs=[x])
    skip = [t for t in prog.transfers if t.value == "layer1_0_relu_1"]
    assert sorted((t.src_stage, t.dst_stage) for t in skip) == [(0, 1), (0, 2)]
    assert {t.name for t in skip} == {"xfer_layer1_0_relu_1_to_s1", "xfer_layer1_0_relu_1_to_s2"}
    assert all(t.nbytes == 2 * 64 * 16 * 16 * 4 for t in skip)
    assert "layer1_0_relu_1" not in prog.stages[1].outputs  # not relayed through stage 1
    # one transfer per (value, destination), never per consumer
    keys = [(t.value, t.dst_stage) for t in prog.transfers]
    assert len(keys) == len(set(keys))
    assert [t.dst_stage for t in prog.transfers if t.dst_stage == OUTPUT] == [OUTPUT]
    with torch.no_grad():
        assert torch.equal(run(prog, x), m(x))


def test_two_consumers_on_one_stage_share_one_transfer(resnet: Any) -> None:
    _, gm = resnet
    names = [n.name for n in gm.graph.nodes if n.op not in SKIP]
    cut = names.index("layer1_0_relu_1")
    prog = build_stages(gm, {n: int(i > cut) for i, n in enumerate(names)}, ["cpu", "cpu"])
    users = [u.name for u in gm.graph.find_nodes(op="call_module", target="layer1.0.relu")]
    assert users  # sanity: the block's relu exists
    to_s1 = [t for t in prog.transfers if t.value == "layer1_0_relu_1"]
    assert len(to_s1) == 1 and to_s1[0].dst_stage == 1
    assert ("x", INPUT) in prog.stages[0].inputs


def test_parameters_are_copies_and_keys_map_back() -> None:
    m2 = torchvision.models.resnet18()
    gm2 = fx.symbolic_trace(m2)
    prog = build_stages(gm2, chunks(gm2, 3), ["cpu"] * 3)
    assert set(prog.key_sources) == set(m2.state_dict())
    s, local = prog.key_sources["fc.weight"]
    before = prog.stages[s].module.get_parameter(local).detach().clone()
    with torch.no_grad():
        m2.fc.weight.add_(1.0)
    assert torch.equal(prog.stages[s].module.get_parameter(local), before)
    own = {id(p) for st in prog.stages for p in st.module.parameters()}
    assert not own & {id(p) for p in m2.parameters()}


def test_backward_edge_is_named(resnet: Any) -> None:
    _, gm = resnet
    bad = chunks(gm, 2)
    bad["conv1"] = 1
    with pytest.raises(
        CodegenError, match=r"edge conv1 -> bn1 goes backwards \(stage 1 -> stage 0\)"
    ):
        build_stages(gm, bad, ["cpu", "cpu"])
    missing = chunks(gm, 2)
    del missing["fc"]
    with pytest.raises(CodegenError, match="'fc' has none"):
        build_stages(gm, missing, ["cpu", "cpu"])
    with pytest.raises(CodegenError, match=r"stages \[2\] have no nodes"):
        build_stages(gm, chunks(gm, 2), ["cpu"] * 3)


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def test_tied_parameters_across_stages_are_refused() -> None:
    gm = fx.symbolic_trace(Tied())
    with pytest.raises(CodegenError, match=r"tied \(shared\) across stages \[0, 1\]"):
        build_stages(gm, {"a": 0, "relu": 0, "b": 1}, ["cpu", "cpu"])
    prog = build_stages(gm, {"a": 0, "relu": 0, "b": 0}, ["cpu"])
    assert set(prog.key_sources) == {"a.weight", "a.bias", "b.weight", "b.bias"}
    s, _ = prog.key_sources["a.weight"]
    assert prog.key_sources["b.weight"][0] == s


class EarlyReader(nn.Module):
    """``c`` reads ``a`` BEFORE the in-place ReLU mutates it (eager sees the old value)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.lin(x)
        c = a * 2
        b = self.relu(a)
        return b + c


class LateReader(EarlyReader):
    """``c`` reads ``a`` AFTER the in-place ReLU (eager sees the rectified value)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.lin(x)
        b = self.relu(a)
        c = a * 2
        return b + c


def test_inplace_on_a_value_read_by_another_stage_is_made_safe() -> None:
    x = torch.randn(4, 8)
    early = EarlyReader()
    gm = fx.symbolic_trace(early)
    prog = build_stages(gm, {"lin": 0, "relu": 0, "mul": 1, "add": 1}, ["cpu", "cpu"])
    assert len(prog.clones) == 1  # the ReLU now mutates a private copy
    assert torch.equal(run(prog, x), early(x))
    late = LateReader()
    gm = fx.symbolic_trace(late)
    prog = build_stages(gm, {"lin": 0, "relu": 0, "mul": 1, "add": 1}, ["cpu", "cpu"])
    assert prog.clones == []  # rewired to read the ReLU's result instead
    assert torch.equal(run(prog, x), late(x))
    with pytest.raises(CodegenError, match="reads 'lin' after the in-place op 'relu'"):
        build_stages(gm, {"lin": 0, "relu": 1, "mul": 0, "add": 1}, ["cpu", "cpu"])


def test_googlenet_branches_on_different_stages() -> None:
    torch.manual_seed(0)
    m = torchvision.models.googlenet(aux_logits=False, init_weights=False).eval()
    gm = fx.symbolic_trace(m)
    names = [n.name for n in gm.graph.nodes if n.op not in SKIP]
    start = names.index("inception3a_branch1_conv")
    cat = next(n for n in names[start:] if n.startswith("cat"))
    side: set[str] = set()  # branch2 and branch4 of inception3a (functional relus included)
    for node in gm.graph.nodes:
        if node.op in SKIP or names.index(node.name) < start or node.name == cat:
            continue
        if names.index(node.name) > names.index(cat):
            break
        if node.name.startswith(("inception3a_branch2", "inception3a_branch4")) or any(
            u.name in side for u in node.all_input_nodes
        ):
            side.add(node.name)
    # branch2/4 come after branch1's nodes in fx order yet sit on stage 0: not contiguous
    stage_of = {n: 0 if i < start or n in side else 1 for i, n in enumerate(names)}
    x = torch.randn(2, 3, 64, 64)
    prog = build_stages(gm, stage_of, ["cpu", "cpu"], example_inputs=[x])
    feeds = [t for t in prog.transfers if prog.aliases.get(t.value, t.value) == "maxpool2"]
    # branch1 and branch3 on stage 1 interleave with branch2/4 on stage 0: each reader gets
    # its own alias (codegen/fanout.py) so the gradient sum keeps eager's order
    assert len(feeds) == 2 and all(t.value in prog.aliases for t in feeds)
    with torch.no_grad():
        assert torch.equal(run(prog, x), m(x))


def test_source_names_devices_inputs_and_bytes(resnet: Any) -> None:
    _, gm = resnet
    prog = build_stages(gm, resnet_cut(gm), ["cpu"] * 3, example_inputs=[torch.randn(2, 3, 64, 64)])
    src = program_source(prog)
    assert src.count("# ---- stage") == 3
    assert "layer1_0_relu_1                  from stage 0" in src
    assert "128.0 KiB" in src
    assert "def forward(self, layer1_0_relu_1" in src
    assert "xfer_layer1_0_relu_1_to_s2: 0 -> 2" in src
