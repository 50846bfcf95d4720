"""The other mode's program: a model whose traced graph depends on ``self.training``.

torch.fx runs the model's Python once, so ``if self.training:``,
``F.dropout(x, training=self.training)`` or ``F.batch_norm(...,
training=self.training)`` are frozen into the graph as the constant they had
while tracing (timm's ``BatchNormAct2d``, torchvision's googlenet auxiliary
heads). Leaf modules (``nn.BatchNorm2d``, ``nn.Dropout``) read their flag at
run time and need nothing; a graph that *differs* between the modes needs a
second program, or ``.eval()`` on the compiled module would silently keep
running the training graph.

So a compiled module may hold two programs: the plan's (the mode it was
compiled for) and the other mode's, traced separately. The second one is
placed by the first one, not solved again: every node that reads a parameter
or buffer goes to the stage that holds that tensor in the plan's program (so
both programs share ONE tensor per state key — :func:`share_state` — and an
optimizer step or ``load_state_dict`` reaches both), every other node keeps
the plan's stage where the names match and moves no earlier than its inputs.
A function that reads state by value (``x * self.steps``, ``y + self.gamma``)
and whose other inputs come from a later stage reads a copy instead: a
``clone`` of the tensor made on the stage holding it, which travels like any
activation (its gradient flows back to the holder). Where that cannot hold
(a module whose weights live on a stage before one of its inputs arrives),
:class:`~crosscut.errors.CodegenError` refuses at compile time.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence

import torch
from torch import fx

from crosscut.codegen.dotted_attrs import get_attr, set_attr
from crosscut.codegen.grouped_stages import BatchStage
from crosscut.codegen.split import build_stages
from crosscut.errors import CodegenError
from crosscut.frontend.alias import GROUP, MUTATED
from crosscut.ir.program import StagedProgram

__all__ = [
    "derive_assignment",
    "mode_differences",
    "other_program",
    "share_state",
    "used_stages",
]

_SKIP_OPS = ("placeholder", "get_attr", "output")


def mode_differences(a: fx.GraphModule, b: fx.GraphModule, limit: int = 6) -> list[str]:
    """Lines of generated code that differ between two traces ([] when identical)."""
    if a.code == b.code:
        return []
    diff = difflib.unified_diff(a.code.splitlines(), b.code.splitlines(), lineterm="", n=0)
    lines = [
        d.strip()
        for d in diff
        if d[:1] in "+-" and not d.startswith(("+++", "---")) and d[1:].strip()
    ]
    return lines[:limit] or ["(the generated code differs)"]


def _keys_read(gm: fx.GraphModule, n: fx.Node) -> list[str]:
    """State keys a node reads directly: a module's tensors, or get_attr inputs."""
    keys: list[str] = []
    if n.op == "call_module":
        mod = gm.get_submodule(str(n.target))
        for k, _ in [
            *mod.named_parameters(remove_duplicate=False),
            *mod.named_buffers(remove_duplicate=False),
        ]:
            keys.append(f"{n.target}.{k}")
    for u in n.all_input_nodes:
        if u.op == "get_attr":
            keys.append(str(u.target))
    return keys


class _ReadTooEarly(Exception):
    """A function node reads state held on an earlier stage than its other inputs."""

    def __init__(self, node: fx.Node) -> None:
        super().__init__(node.name)
        self.node = node


def _read_by_copy(gm: fx.GraphModule, n: fx.Node) -> None:
    """Give ``n`` a clone of each state tensor it reads: made where the tensor lives, it
    travels to ``n``'s stage as an activation (module docstring)."""
    for u in [u for u in n.all_input_nodes if u.op == "get_attr"]:
        with gm.graph.inserting_before(n):
            copy = gm.graph.call_method("clone", (u,))
        copy.meta.update({k: v for k, v in u.meta.items() if k in ("val", "tensor_meta")})
        n.replace_input_with(u, copy)
    gm.recompile()


def _by_value(n: fx.Node) -> bool:
    """Whether ``n`` may read its state inputs as copies: a function that writes none."""
    written = set(n.meta.get(MUTATED, []))
    reads = [u for u in n.all_input_nodes if u.op == "get_attr"]
    return n.op in ("call_function", "call_method") and not any(u.name in written for u in reads)


def derive_assignment(
    gm: fx.GraphModule,
    plan_gm: fx.GraphModule,
    stage_of: Mapping[str, int],
    key_stage: Mapping[str, int],
) -> dict[str, int]:
    """Place the other mode's graph ``gm`` on the plan's stages (module docstring).

    ``stage_of`` is the plan's assignment of ``plan_gm``; ``key_stage`` maps a
    state key to the stage holding it in the plan's program. A node that reads
    state goes where that state lives. Any other node keeps the plan's stage
    when ``plan_gm`` has a node of the same name, op and target (fx numbers
    nodes per target, so a branch traced in one mode only renames later ones),
    and otherwise goes as early as its inputs allow. If the hints lead to a
    conflict, placing every free node as early as possible is tried: that
    fails only where no placement exists.
    """
    plan_nodes = {n.name: (n.op, n.target) for n in plan_gm.graph.nodes}
    hints = {
        n.name: int(stage_of[n.name])
        for n in gm.graph.nodes
        if n.name in stage_of and plan_nodes.get(n.name) == (n.op, n.target)
    }
    for _ in range(len(gm.graph.nodes)):
        try:
            try:
                out = _place_tied(gm, hints, key_stage)
                if _ties_hold(gm, out):
                    return out
            except CodegenError:
                pass
            return _place_tied(gm, {}, key_stage)
        except _ReadTooEarly as early:  # each round removes one node's state reads
            _read_by_copy(gm, early.node)
    return _place_tied(gm, {}, key_stage)


def _ties_hold(gm: fx.GraphModule, out: Mapping[str, int]) -> bool:
    """Whether every mutation tie (``frontend/alias.py``) sits on one stage."""
    stages: dict[int, set[int]] = {}
    for n in gm.graph.nodes:
        if n.name in out and n.meta.get(GROUP) is not None:
            stages.setdefault(n.meta[GROUP], set()).add(out[n.name])
    return all(len(s) == 1 for s in stages.values())


def _place_tied(
    gm: fx.GraphModule, hints: Mapping[str, int], key_stage: Mapping[str, int]
) -> dict[str, int]:
    """:func:`_place`, re-run with each mutation tie (``frontend/alias.py``) raised to the
    stage of its latest member until every tie shares one stage (or, when state pins a
    member earlier, the placement is left for ``build_stages`` to refuse by name)."""
    raised = dict(hints)
    out = _place(gm, raised, key_stage)
    for _ in range(len(gm.graph.nodes)):
        top: dict[int, int] = {}
        tied = [n for n in gm.graph.nodes if n.name in out and n.meta.get(GROUP) is not None]
        for n in tied:
            top[n.meta[GROUP]] = max(top.get(n.meta[GROUP], 0), out[n.name])
        late = {n.name: top[n.meta[GROUP]] for n in tied if out[n.name] < top[n.meta[GROUP]]}
        if not late or all(raised.get(k) == v for k, v in late.items()):
            return out
        raised.update(late)
        out = _place(gm, raised, key_stage)
    return out


def _place(
    gm: fx.GraphModule, hints: Mapping[str, int], key_stage: Mapping[str, int]
) -> dict[str, int]:
    out: dict[str, int] = {}
    for n in gm.graph.nodes:
        if n.op in _SKIP_OPS:
            continue
        lowest = max((out[u.name] for u in n.all_input_nodes if u.name in out), default=0)
        held = {key_stage[k] for k in _keys_read(gm, n) if k in key_stage}
        if len(held) > 1:
            raise CodegenError(
                f"in the other train/eval mode, node {n.name!r} reads state held on "
                f"several stages {sorted(held)}",
                value={"node": n.name, "keys": _keys_read(gm, n)},
                remedy="keep the modules this node reads on one stage of the plan, or "
                "compile in the mode you will run",
            )
        if held:
            s = held.pop()
            if s < lowest and _by_value(n):
                raise _ReadTooEarly(n)
            if s < lowest:
                raise CodegenError(
                    f"in the other train/eval mode, node {n.name!r} must run on stage {s} "
                    f"(which holds its parameters) but reads a value made on stage {lowest}",
                    value={"node": n.name, "stage": s, "input_stage": lowest},
                    remedy="compile in the mode you will run, or keep the model's "
                    "self.training branches out of the forward",
                )
        else:
            s = max(hints.get(n.name, lowest), lowest)
        out[n.name] = s
    return out


def used_stages(assignment: Mapping[str, int]) -> list[int]:
    """The plan stages that hold at least one node, in order (the others are dropped)."""
    return sorted(set(assignment.values()))


def _tensor(program: StagedProgram, stage: int, local: str) -> torch.Tensor:
    t = get_attr(program.stages[stage].module, local)
    assert isinstance(t, torch.Tensor)
    return t


def share_state(primary: StagedProgram, other: StagedProgram, stage_map: Sequence[int]) -> None:
    """Point every state tensor of ``other`` at ``primary``'s tensor for the same key.

    ``stage_map[k]`` is the primary stage that ``other``'s stage ``k`` stands for.
    Keys only ``other`` reads keep ``other``'s own tensors (there is no copy to
    share). Shards are shared shard by shard and must be cut alike.
    """
    for key, (s2, local2) in other.key_sources.items():
        if key in primary.shard_sources:
            raise CodegenError(
                f"state {key!r} is channel-sharded in the compiled mode but whole in the other "
                "train/eval mode",
                value=key,
                remedy="compile without cross_shaped=True, or in the mode you will run",
            )
        if key not in primary.key_sources:
            continue
        s1, local1 = primary.key_sources[key]
        if s1 != stage_map[s2]:
            raise CodegenError(
                f"state {key!r} would live on stage {s1} in one train/eval mode and on stage "
                f"{stage_map[s2]} in the other",
                value=key,
                remedy="compile in the mode you will run",
            )
        set_attr(other.stages[s2].module, local2, _tensor(primary, s1, local1))
    for key, (s2, names2, _) in other.shard_sources.items():
        if key not in primary.shard_sources and key not in primary.key_sources:
            continue
        s1, names1, _ = primary.shard_sources.get(key, (-1, [], None))
        if s1 != stage_map[s2] or len(names1) != len(names2):
            raise CodegenError(
                f"state {key!r} is sharded differently in the two train/eval modes",
                value=key,
                remedy="compile without cross_shaped=True, or in the mode you will run",
            )
        for n1, n2 in zip(names1, names2):
            set_attr(other.stages[s2].module, n2, _tensor(primary, s1, n1))


def other_program(
    program: StagedProgram,
    gm: fx.GraphModule,
    other_gm: fx.GraphModule,
    stage_of: Mapping[str, int],
    stage_devices: Sequence[torch.device | str],
    groups: Sequence[tuple[Sequence[torch.device | str], str]] | None,
    batch_stage: BatchStage | None = None,
) -> tuple[StagedProgram, list[int]]:
    """The other train/eval mode's graph placed by the plan's program, sharing its state.

    Also returns, per stage of the other program, the plan stage it stands for.
    """
    key_stage = {k: s for k, (s, _) in program.key_sources.items()}
    key_stage.update({k: s for k, (s, _, _) in program.shard_sources.items()})
    assignment = derive_assignment(other_gm, gm, stage_of, key_stage)
    used = used_stages(assignment)  # stages the other graph leaves empty are dropped
    index = {s: i for i, s in enumerate(used)}
    other = build_stages(
        other_gm,
        {n: index[s] for n, s in assignment.items()},
        [stage_devices[s] for s in used],
        groups=[groups[s] for s in used] if groups is not None else None,
        batch_stage=batch_stage,
    )
    share_state(program, other, used)
    return other, used
