"""Split a traced model into stage GraphModules, one per (logical) device.

Placement is a callback (``stage_of[node.name]``) into torch.fx's
``split_module``; this module decides nothing about placement. It adds what
``split_module`` leaves out and a runtime needs:

* each stage owns deep copies of its parameters and buffers on its device (no
  storage shared with the caller's model), and ``get_attr`` tensors live in
  the stage that reads them rather than being passed in as inputs;
* a map from every stage tensor back to the ORIGINAL ``state_dict`` keys, so a
  compiled module can save and load checkpoints of the original model;
* per stage, the values it reads (and from which stage) and the values it
  exports, plus one :class:`~crosscut.ir.program.Transfer` per (value,
  destination stage);
* safety checks: backward edges, empty stages, tied parameters on different
  stages, and in-place ops on values that cross a cut (rewritten so every
  consumer sees what it would see in eager mode); writes through views are
  ordered earlier, in the trace (``frontend/alias.py``), and a plan that
  splits one of those mutation ties is refused here;
* for cross-shaped plans (``groups``), the width split of a stage over its
  device group (``codegen/width.py``): channel shards with explicit gathers,
  or batch replicas whose gradients reduce onto the group leader.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import fx
from torch.fx.passes.shape_prop import ShapeProp
from torch.fx.passes.split_module import split_module

from crosscut.codegen.dotted_attrs import get_attr, set_attr
from crosscut.codegen.fanout import separate_fanout, share_state_reads
from crosscut.codegen.grouped_stages import BatchStage, apply_groups, check_groups
from crosscut.codegen.stage_order import order_by_stage
from crosscut.codegen.transfers import plan_transfers
from crosscut.errors import CodegenError
from crosscut.frontend.alias import GROUP, MUTATES, inplace_target
from crosscut.ir.program import INPUT, Stage, StagedProgram, ValueRef, map_structure

__all__ = ["build_stages"]

_SKIP_OPS = ("placeholder", "get_attr", "output")


def _fail(rule: str, value: object, remedy: str) -> CodegenError:
    return CodegenError(rule, value=value, remedy=remedy)


def _check_assignment(gm: fx.GraphModule, stage_of: Mapping[str, int], num_stages: int) -> None:
    """Every compute node has a stage in range, and no edge goes backwards."""
    names = {n.name for n in gm.graph.nodes}
    unknown = sorted(set(stage_of) - names)
    if unknown:
        raise _fail(
            "stage_of names nodes that are not in the graph",
            unknown[:5],
            "build stage_of from the same trace (node names must match)",
        )
    for n in gm.graph.nodes:
        if n.op in _SKIP_OPS:
            continue
        if n.name not in stage_of:
            raise _fail(
                f"every compute node needs a stage; {n.name!r} has none",
                n.name,
                "assign it in stage_of (placeholders/get_attr/output may be absent)",
            )
        s = stage_of[n.name]
        if not 0 <= s < num_stages:
            raise _fail(
                f"node {n.name!r} is on stage {s}, outside 0..{num_stages - 1}",
                s,
                "use one stage per entry of stage_devices",
            )
        for u in n.all_input_nodes:
            if u.op not in _SKIP_OPS and stage_of[u.name] > s:
                raise _fail(
                    f"edge {u.name} -> {n.name} goes backwards (stage {stage_of[u.name]} -> "
                    f"stage {s}); stages must form a chain",
                    (u.name, n.name),
                    f"put {n.name!r} on stage >= {stage_of[u.name]} or {u.name!r} earlier",
                )
    used = {stage_of[n.name] for n in gm.graph.nodes if n.op not in _SKIP_OPS}
    empty = sorted(set(range(num_stages)) - used)
    if empty:
        raise _fail(
            f"stages {empty} have no nodes",
            empty,
            "pass fewer stage_devices or give every stage at least one node",
        )


def _check_mutation_ties(gm: fx.GraphModule, stage_of: Mapping[str, int]) -> None:
    """The trace's mutation ties (``frontend/alias.py``) hold: one stage per tie.

    The solvers honour them; a hand-made plan may not, and then a write through
    a view would happen on another stage than a reader that must see it (or
    must not), which no rewiring here can repair.
    """
    first: dict[int, fx.Node] = {}
    for n in gm.graph.nodes:
        group = n.meta.get(GROUP)
        if group is None or n.name not in stage_of:
            continue
        head = first.setdefault(group, n)
        if stage_of[n.name] != stage_of[head.name]:
            writes = [
                m.name for m in gm.graph.nodes if m.meta.get(GROUP) == group and m.meta.get(MUTATES)
            ]
            raise _fail(
                f"{n.name!r} (stage {stage_of[n.name]}) and {head.name!r} (stage "
                f"{stage_of[head.name]}) share storage that {writes} write in place (through "
                "a view); eager order holds only if they run on one stage",
                {"nodes": (head.name, n.name), "writes": writes},
                f"put {n.name!r} on stage {stage_of[head.name]} (OpGraph.ties lists the group; "
                "plans from crosscut.partition keep it), or make the write out-of-place",
            )


def _protect_inplace(gm: fx.GraphModule, st: dict[str, int]) -> list[str]:
    """Rewrite in-place ops whose mutated value is also read on another stage.

    Eager semantics: consumers before the in-place op see the old value, those
    after it see the new one. Across stages the order is lost (and same-device
    stages alias tensors), so later consumers are rewired to read the in-place
    op's result, and the op mutates a clone when an earlier consumer on another
    stage still needs the old value. Returns the inserted clone names.
    """
    modules = dict(gm.named_modules())
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    clones: list[str] = []
    for node in list(gm.graph.nodes):
        v = inplace_target(node, modules) if node.op not in _SKIP_OPS else None
        if v is None or v.op == "get_attr":
            continue
        s = st[node.name]
        others = [u for u in v.users if u is not node]
        if all(u.op != "output" and st[u.name] == s for u in others):
            continue
        for u in others:
            if u.op == "output" or order.get(u, -1) > order[node]:
                if u.op != "output" and st[u.name] < s:
                    raise _fail(
                        f"{u.name!r} (stage {st[u.name]}) reads {v.name!r} after the in-place op "
                        f"{node.name!r} (stage {s}) changed it",
                        (v.name, node.name, u.name),
                        f"put {u.name!r} on stage >= {s}, or make {node.name!r} out-of-place",
                    )
                u.replace_input_with(v, node)
        if any(u.op != "output" and st[u.name] != s for u in v.users if u is not node):
            with gm.graph.inserting_before(node):
                c = gm.graph.call_method("clone", (v,))
            st[c.name] = s
            node.replace_input_with(v, c)
            clones.append(c.name)
    gm.graph.lint()
    gm.recompile()
    return clones


def _bytes_of(obj: Any) -> int:
    shape, dtype = getattr(obj, "shape", None), getattr(obj, "dtype", None)
    if shape is not None and isinstance(dtype, torch.dtype):
        n = 1
        for d in shape:
            n *= int(d)
        return n * dtype.itemsize
    if isinstance(obj, (tuple, list)):
        return sum(_bytes_of(o) for o in obj)
    if isinstance(obj, dict):
        return sum(_bytes_of(o) for o in obj.values())
    return 0


def _node_bytes(gm: fx.GraphModule, example_inputs: Sequence[Any] | None) -> dict[str, int]:
    """Output bytes per node from existing metadata, or by propagating examples.

    Propagation runs in eval mode under no_grad so batch-norm running stats of
    the copy are not touched; only shapes are wanted.
    """
    have_meta = any(
        k in n.meta for n in gm.graph.nodes for k in ("tensor_meta", "val", "example_value")
    )
    if not have_meta and example_inputs is not None:
        flags = {m: m.training for m in gm.modules()}
        gm.eval()
        with torch.no_grad():
            ShapeProp(gm).propagate(*example_inputs)
        for m, f in flags.items():
            m.training = f
    out: dict[str, int] = {}
    for n in gm.graph.nodes:
        meta = n.meta.get("tensor_meta", n.meta.get("val", n.meta.get("example_value")))
        out[n.name] = _bytes_of(meta) if meta is not None else 0
    return out


def _inline_get_attrs(
    sub: fx.GraphModule, root: fx.GraphModule, targets: Mapping[str, str]
) -> None:
    """Turn placeholders that stand for get_attr nodes into get_attr nodes of ``sub``."""
    graph = sub.graph
    first = next(n for n in graph.nodes if n.op != "placeholder") if len(graph.nodes) else None
    for ph in [n for n in graph.nodes if n.op == "placeholder" and n.name in targets]:
        target = targets[ph.name]
        set_attr(sub, target, get_attr(root, target))
        with graph.inserting_before(first):
            ga = graph.get_attr(target)
        ph.replace_all_uses_with(ga)
        graph.erase_node(ph)
    out = graph.output_node()
    if not isinstance(out.args[0], tuple):
        out.args = ((out.args[0],),)  # always a tuple: the runtime indexes outputs
    graph.lint()
    sub.recompile()


def build_stages(
    gm: fx.GraphModule,
    stage_of: Mapping[str, int],
    stage_devices: Sequence[torch.device | str],
    *,
    example_inputs: Sequence[Any] | None = None,
    groups: Sequence[tuple[Sequence[torch.device | str], str]] | None = None,
    batch_stage: BatchStage | None = None,
) -> StagedProgram:
    """Split ``gm`` by ``stage_of`` into stages placed on ``stage_devices``.

    ``gm`` is not modified; parameters are deep-copied. ``example_inputs``
    (optional) are only used to size transfers when ``gm`` carries no shape
    metadata. ``groups[k] = (devices, split)`` (optional) runs stage ``k`` on a
    device group split by ``"channel"`` or ``"batch"``; its first device must be
    ``stage_devices[k]``; a batch split wraps the stage with ``batch_stage``
    (the runtime's ``BatchSplitStage``: codegen writes code, it does not run
    threads). Raises :class:`~crosscut.errors.CodegenError` naming
    the edge, node or parameter when the assignment cannot be honoured.
    """
    devices = [torch.device(d) for d in stage_devices]
    check_groups(groups, devices)
    if not devices:
        raise _fail("at least one stage device is needed", list(stage_devices), "pass ['cpu']")
    _check_assignment(gm, stage_of, len(devices))
    _check_mutation_ties(gm, stage_of)
    work = copy.deepcopy(gm)
    st, clones, aliases = _rewire(work, stage_of, groups)
    node_bytes = _node_bytes(work, example_inputs)
    origin = _state_origins(work)
    ga_targets = {n.name: str(n.target) for n in work.graph.nodes if n.op == "get_attr"}
    placeholders = [n.name for n in work.graph.nodes if n.op == "placeholder"]

    order_by_stage(work, st)  # stage calls in pipeline order (see codegen/stage_order.py)
    split = split_module(
        work, work, lambda n: st[n.name], keep_original_order=True, keep_original_node_name=True
    )
    stages, key_sources = _cut_stages(split, work, devices, st, origin, ga_targets)
    for stage in stages:
        stage.module.to(stage.device)
    shard_sources = apply_groups(stages, groups or [], origin, key_sources, batch_stage)

    out_node = work.graph.output_node()
    template = map_structure(
        lambda a: ValueRef(a.name) if isinstance(a, fx.Node) else a, out_node.args[0]
    )
    output_sources = {n.name: st.get(n.name, INPUT) for n in out_node.all_input_nodes}
    transfers = plan_transfers(
        [stage.inputs for stage in stages],
        output_sources,
        [str(d) for d in devices],
        node_bytes,
    )
    return StagedProgram(
        stages,
        placeholders,
        template,
        output_sources,
        transfers,
        node_bytes,
        key_sources,
        clones,
        shard_sources,
        aliases,
    )


def _rewire(
    work: fx.GraphModule,
    stage_of: Mapping[str, int],
    groups: Sequence[tuple[Sequence[torch.device | str], str]] | None,
) -> tuple[dict[str, int], list[str], dict[str, str]]:
    """Make ``work`` (a copy) safe to cut: in-place ops, state reads and fan-out rewired.

    Returns each compute node's stage (with the nodes the rewiring added), the
    inserted clones, and the aliases (new node -> the value it stands for).
    """
    st = {n.name: int(stage_of[n.name]) for n in work.graph.nodes if n.op not in _SKIP_OPS}
    clones = _protect_inplace(work, st)
    modules = dict(work.named_modules())
    mutators = [n for n in work.graph.nodes if n.op not in _SKIP_OPS and inplace_target(n, modules)]
    grouped = {k for k, (devs, _) in enumerate(groups or []) if len(devs) > 1}
    placed = {**{k: int(v) for k, v in stage_of.items()}, **st}  # get_attr nodes too
    aliases = share_state_reads(work, placed, mutators)  # one home per parameter
    st.update((a, placed[a]) for a in aliases)
    aliases |= separate_fanout(work, st, mutators, grouped)  # gradients summed in eager's order
    return st, clones, aliases


def _state_origins(work: fx.GraphModule) -> dict[int, list[str]]:
    """Every parameter and buffer tensor (by id) -> its original state_dict keys."""
    origin: dict[int, list[str]] = {}
    for key, t in [
        *work.named_parameters(remove_duplicate=False),
        *work.named_buffers(remove_duplicate=False),
    ]:
        origin.setdefault(id(t), []).append(key)
    return origin


def _cut_stages(
    split: fx.GraphModule,
    work: fx.GraphModule,
    devices: Sequence[torch.device],
    st: Mapping[str, int],
    origin: Mapping[int, list[str]],
    ga_targets: Mapping[str, str],
) -> tuple[list[Stage], dict[str, tuple[int, str]]]:
    """One :class:`Stage` per ``split_module`` submodule, and every original key's home.

    Refuses a parameter that two stages read (a tie the plan cut).
    """
    owners: dict[int, set[int]] = {}
    stages: list[Stage] = []
    key_sources: dict[str, tuple[int, str]] = {}
    for s, dev in enumerate(devices):
        sub = getattr(split, f"submod_{s}")
        assert isinstance(sub, fx.GraphModule)
        _inline_get_attrs(sub, work, ga_targets)
        param_keys: dict[str, list[str]] = {}
        for local, t in [
            *sub.named_parameters(remove_duplicate=False),
            *sub.named_buffers(remove_duplicate=False),
        ]:
            owners.setdefault(id(t), set()).add(s)
            keys = origin.get(id(t), [])
            param_keys[local] = keys
            for k in keys:
                key_sources.setdefault(k, (s, local))
        inputs = [(n.name, st.get(n.name, INPUT)) for n in sub.graph.nodes if n.op == "placeholder"]
        returned = sub.graph.output_node().args[0]
        assert isinstance(returned, tuple)
        outputs = [str(a.name) for a in returned if isinstance(a, fx.Node)]
        mutated = _mutated_inputs(sub, {v for v, _ in inputs})
        stages.append(Stage(s, dev, sub, inputs, outputs, param_keys, mutated, [dev]))
    for tid, where in owners.items():
        if len(where) > 1:
            raise _fail(
                f"parameter {origin.get(tid, ['<constant>'])} is tied (shared) across stages "
                f"{sorted(where)}; one tensor cannot live on two stages and stay tied",
                {"keys": origin.get(tid), "stages": sorted(where)},
                "assign every node that uses the shared parameter to the same stage",
            )
    return stages, key_sources


def _mutated_inputs(sub: fx.GraphModule, names: set[str]) -> set[str]:
    """The inputs of stage ``sub`` that it writes in place, directly or through a view."""
    sub_mods = dict(sub.named_modules())
    mutated = {
        m.name
        for n in sub.graph.nodes
        if n.op not in _SKIP_OPS
        and (m := inplace_target(n, sub_mods)) is not None
        and m.op == "placeholder"
    }
    # ... and inputs written through a view (alias.py)
    mutated |= {b for n in sub.graph.nodes for b in n.meta.get(MUTATES, []) if b in names}
    return mutated
