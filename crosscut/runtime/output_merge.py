"""How the outputs of ``M`` micro-batches become the output of one call.

A pipeline runs the model on micro-batches, so each output exists ``M``
times and must be merged into what the model returns on the whole batch.
Concatenation on the batch dimension is right for batch-major outputs
(logits, per-sample losses, feature maps) and wrong for everything else: the
sum of squares of the logits, a mean loss, a count of samples. Before this
module the executor concatenated what it could and silently returned the first
micro-batch's value for the rest (a model returning ``(logits,
logits.pow(2).sum())`` gave 225.7 instead of 475.1 with two micro-batches).

So every output leaf is merged by an explicit rule:

* the default, for a leaf that is batch-major in the traced graph (a tensor
  with ``dim >= 1`` whose first dimension is the traced micro-batch): ``"cat"``
  on dim 0;
* a rule given by the caller (``crosscut.compile(..., output_merge=...)``),
  at the leaf's path or at a sub-structure above it:

  - ``"cat"``: ``torch.cat`` on dim 0 (tensors with ``dim >= 1``);
  - ``"sum"``: the micro-batches' values added in micro-batch order (tensors
    or Python numbers): a ``.sum()`` over the batch, a count of samples;
  - ``"mean"``: that sum divided by ``M``: a mean over the batch, such as a
    ``reduction="mean"`` loss (micro-batches are equal, so this is the
    batch mean);
  - ``"same"``: every micro-batch must give an equal value (a constant, a
    statistic of the weights), which is returned; unequal values raise;
  - a callable taking the list of the ``M`` values (each a leaf, or the
    sub-structure at the rule's path, tensors on the output device) and
    returning the merged one.

* a literal constant of the output structure (``None``, a string) is returned
  as it is.

A leaf that is not batch-major and has no rule is refused when the module is
compiled (:func:`check_outputs`, from the shapes the trace recorded at the
micro-batch size), with an :class:`~crosscut.errors.InputError` naming its
path and the remedy — never merged by a guess. Where the graph carries no
shapes, the same rule is checked on the values at run time. One ambiguity
remains: a tensor that is not per-sample but whose first dimension happens to
equal the micro-batch (a ``[4, k]`` statistic with 4-sample micro-batches)
looks batch-major at one traced size; give such an output a rule.

``output_merge`` is spelt like ``torch.distributed.pipelining``'s
``output_merge_spec`` in spirit (a rule per output, concatenation on dim 0 by
default), but addressed by path rather than by a structure mirroring the
output: a mapping from a path to a rule. A path joins the keys from the
output's root with ``"."``: tuple and list positions (``"1"``, or the int
``1``), dict keys (``"loss"``), namedtuple fields (``"aux"``); nested,
``"1.count"``. The empty path ``""`` is the whole output, and a bare rule
(``output_merge="sum"``) means ``{"": rule}``.

With one micro-batch nothing is merged (the single output is returned as it
is, rules unused). ``train_step`` merges nothing either: it calls ``loss_fn``
on each micro-batch's outputs, so there a non-batch output is that
micro-batch's value (a ``.sum()`` over the micro-batch, not the batch).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree

from crosscut.errors import InputError, RuntimeError_
from crosscut.ir.program import ValueRef

__all__ = ["RULES", "OutputMerge", "check_outputs", "gather", "normalize_merge"]

RULES = ("cat", "sum", "mean", "same")
Rule = str | Callable[[list[Any]], Any]
_VALUE = object()  # template marker: below a traced value, the structure is the value's own
_REMEDY = (
    "give it a rule: crosscut.compile(..., output_merge={{{path!r}: 'sum'}}) (or 'mean', "
    "'same', a callable over the list of micro-batch values), or use microbatches=1"
)


def normalize_merge(spec: Any) -> dict[str, Rule]:
    """``output_merge`` as ``{path: rule}``, checked once (InputError for a bad rule)."""
    if spec is None:
        return {}
    if isinstance(spec, str) or callable(spec):
        spec = {"": spec}
    if not isinstance(spec, Mapping):
        raise InputError(
            "output_merge must be a rule or a mapping from output path to rule",
            value=type(spec).__name__,
            remedy="e.g. output_merge={1: 'sum'} or {'loss': 'mean'}; rules: "
            f"{list(RULES)} or a callable over the list of micro-batch values",
        )
    out: dict[str, Rule] = {}
    for key, rule in spec.items():
        if not isinstance(key, (str, int)) or isinstance(key, bool):
            raise InputError(
                "output_merge paths are strings ('1.count') or tuple positions (1)",
                value=repr(key),
                remedy="join the keys from the output's root with '.'",
            )
        path = str(key)
        if not (callable(rule) or rule in RULES):
            raise InputError(
                f"output_merge rule for {_name(path)} must be one of {list(RULES)} or a callable",
                value=repr(rule),
                remedy="'sum' for a sum over the batch, 'mean' for a mean, 'same' for a "
                "constant, or a function of the list of micro-batch values",
            )
        out[path] = rule
    paths = sorted(out)
    for a in paths:
        for b in paths:
            if a != b and (a == "" or b.startswith(a + ".")):
                raise InputError(
                    "output_merge rules must not overlap (one path inside another)",
                    value=[a, b],
                    remedy=f"keep one of them: a rule at {_name(a)} covers everything below it",
                )
    return out


def _name(path: str) -> str:
    return "the whole output" if path == "" else f"output {path!r}"


def _join(path: str, key: Any) -> str:
    return str(key) if path == "" else f"{path}.{key}"


def _children(obj: Any) -> list[tuple[Any, Any]] | None:
    """(key, child) of a tuple / namedtuple / list / dict; None for a leaf."""
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return list(zip(obj._fields, obj))
    if isinstance(obj, (tuple, list)):
        return list(enumerate(obj))
    if isinstance(obj, dict):
        return list(obj.items())
    return None


def _rebuild(like: Any, items: list[Any]) -> Any:
    if isinstance(like, tuple) and hasattr(like, "_fields"):
        return type(like)(*items)
    if isinstance(like, (tuple, list)):
        return type(like)(items)
    return dict(zip(like.keys(), items))


# ---- compile time: the traced shapes ---------------------------------------------------
def _micro_batch(gm: fx.GraphModule) -> int | None:
    for n in gm.graph.nodes:
        val = n.meta.get("val") if n.op == "placeholder" else None
        if isinstance(val, torch.Tensor) and val.dim() > 0:
            return int(val.shape[0])
    return None


def _describe(val: Any) -> str:
    if isinstance(val, torch.Tensor):
        return f"a tensor of shape {list(val.shape)}"
    return f"a Python {type(val).__name__}"


def check_outputs(
    gm: fx.GraphModule, spec: Any, microbatches: int, *, strict_paths: bool = True
) -> dict[str, Rule]:
    """Refuse, at compile time, an output ``M`` micro-batches cannot be merged into.

    Reads the shapes the trace recorded (``node.meta["val"]``, at the
    micro-batch size): a leaf is batch-major when it is a tensor with ``dim >=
    1`` whose first dimension is the micro-batch. Every other leaf needs a
    rule when ``microbatches > 1``; a rule must suit its leaves (``"cat"`` a
    tensor with a dimension, ``"sum"``/``"mean"`` a tensor or number).
    ``strict_paths``: a rule's path must exist in this graph's output (off
    for a second graph of the same model, whose outputs may differ by mode).
    Returns the normalised rules.
    """
    rules = normalize_merge(spec)
    micro = _micro_batch(gm)
    paths: set[str] = set()
    missing: list[str] = []
    missing_paths: list[str] = []
    unfit: list[str] = []

    def visit(path: str, obj: Any, traced: bool, rule: Rule | None) -> None:
        paths.add(path)
        rule = rules.get(path, rule)
        if isinstance(obj, fx.Node):
            if "val" not in obj.meta:
                return  # no shapes recorded: the run-time check stands in
            obj, traced = obj.meta["val"], True
        kids = _children(obj)
        if kids is not None:
            for key, child in kids:
                visit(_join(path, key), child, traced, rule)
            return
        if not traced or obj is None:
            return  # a literal constant of the output (or a None value): returned as it is
        if rule is None:
            batched = isinstance(obj, torch.Tensor) and obj.dim() > 0 and obj.shape[0] == micro
            if not batched and microbatches > 1 and micro is not None:
                missing.append(f"{_name(path)}: {_describe(obj)}")
                missing_paths.append(path)
        elif rule == "cat" and not (isinstance(obj, torch.Tensor) and obj.dim() > 0):
            unfit.append(f"'cat' on {_name(path)}: {_describe(obj)}")
        elif rule in ("sum", "mean") and not isinstance(obj, (torch.Tensor, int, float)):
            unfit.append(f"{rule!r} on {_name(path)}: {_describe(obj)}")

    visit("", gm.graph.output_node().args[0], False, None)
    unknown = sorted(p for p in rules if p not in paths)
    if strict_paths and unknown:
        raise InputError(
            "output_merge names paths the model's output does not have",
            value={"unknown": unknown, "paths": sorted(paths)[:12]},
            remedy="join the keys from the output's root with '.' (tuple positions, dict keys, "
            "namedtuple fields)",
        )
    if unfit:
        raise InputError(
            "an output_merge rule does not suit its output",
            value=unfit[:6],
            remedy="'cat' needs a tensor with a batch dimension; 'sum'/'mean' a tensor or "
            "number; use 'same' or a callable for anything else",
        )
    if missing:
        raise InputError(
            f"with {microbatches} micro-batches every output needs a merge rule, and "
            f"{len(missing)} output(s) have no batch dimension (dim 0 = the micro-batch, "
            f"{micro}), so concatenating their micro-batch values would be wrong",
            value=missing[:6],
            remedy=_REMEDY.format(path=missing_paths[0]),
        )
    return rules


# ---- run time --------------------------------------------------------------------------
class OutputMerge:
    """The merge of one program's micro-batch outputs (see the module docstring)."""

    def __init__(self, template: Any = _VALUE, spec: Any = None) -> None:
        """``template``: the output structure with :class:`ValueRef` leaves (a program's
        ``output_template``); literal leaves are constants. ``spec``: ``output_merge``."""
        self.template = template
        self.rules = normalize_merge(spec)

    def merge(
        self,
        outputs: Sequence[Any],
        device: torch.device,
        sizes: Sequence[int | None] | None = None,
    ) -> Any:
        """One output from the micro-batches' ``outputs`` (each of ``sizes[m]`` samples)."""
        if len(outputs) == 1:
            return outputs[0]
        return self._merge("", self.template, list(outputs), device, sizes, None)

    def _merge(
        self,
        path: str,
        template: Any,
        values: list[Any],
        device: torch.device,
        sizes: Sequence[int | None] | None,
        inherited: str | None,
    ) -> Any:
        rule = self.rules.get(path, inherited)
        if isinstance(template, ValueRef):
            template = _VALUE
        if callable(rule):  # a callable merges the whole value at its path
            return rule([_to(v, device) for v in values])
        kids = _children(values[0])
        if kids is not None:
            sub = _children(template) if template is not _VALUE else None
            items = []
            for i, (key, _) in enumerate(kids):
                child_values = [_children(v)[i][1] for v in values]  # type: ignore[index]
                child_template = sub[i][1] if sub is not None else _VALUE
                items.append(
                    self._merge(_join(path, key), child_template, child_values, device, sizes, rule)
                )
            return _rebuild(values[0], items)
        if template is not _VALUE or values[0] is None:
            return values[0]  # a literal constant of the output structure
        if rule is None:
            return _default(path, values, device, sizes)
        return _apply(rule, path, [_to(v, device) for v in values])


def _to(value: Any, device: torch.device) -> Any:
    return pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, value)


def _default(
    path: str, values: list[Any], device: torch.device, sizes: Sequence[int | None] | None
) -> Any:
    """Concatenation on dim 0, for values that are batch-major in every micro-batch."""
    for m, v in enumerate(values):
        rows = sizes[m] if sizes is not None else None
        ok = isinstance(v, torch.Tensor) and v.dim() > 0 and rows in (None, v.shape[0])
        if not ok:
            got = (
                _describe(v)
                if not isinstance(v, torch.Tensor) or v.dim() == 0
                else (f"{v.shape[0]} rows for a micro-batch of {rows} samples")
            )
            raise RuntimeError_(
                f"{_name(path)} has no batch dimension in micro-batch {m} ({got}), so the "
                "micro-batches' values cannot be concatenated",
                value=path,
                remedy=_REMEDY.format(path=path),
            )
    return torch.cat([v.to(device) for v in values], 0)


def _apply(rule: str, path: str, values: list[Any]) -> Any:
    """A named rule on one leaf's micro-batch values (already on the output device)."""
    tensors = all(isinstance(v, torch.Tensor) for v in values)
    numbers = all(isinstance(v, (int, float)) for v in values)
    fits = {
        "cat": tensors and all(v.dim() > 0 for v in values),
        "sum": tensors or numbers,
        "mean": tensors or numbers,
    }
    if not fits.get(rule, True):
        raise RuntimeError_(
            f"the rule {rule!r} of {_name(path)} does not suit its values",
            value=_describe(values[0]),
            remedy="'cat' needs a tensor with a batch dimension; 'sum'/'mean' a tensor or "
            "number; use 'same' or a callable for anything else",
        )
    if rule == "cat":
        return torch.cat(values, 0)
    if rule in ("sum", "mean"):
        total = values[0]
        for v in values[1:]:
            total = total + v
        return total / len(values) if rule == "mean" else total
    first = values[0]  # "same"
    for m, v in enumerate(values[1:], start=1):
        same = torch.equal(first, v) if isinstance(first, torch.Tensor) else bool(first == v)
        if not same:
            raise RuntimeError_(
                f"{_name(path)} has the rule 'same' but micro-batch {m} gave another value "
                "than micro-batch 0",
                value={"0": repr(first)[:60], str(m): repr(v)[:60]},
                remedy="use 'sum', 'mean' or a callable for a value that depends on the batch",
            )
    return first


def gather(outputs: Sequence[Any], device: torch.device) -> Any:
    """Concatenate per-micro-batch outputs along dim 0 on ``device`` (no rules, strict)."""
    return OutputMerge().merge(outputs, device)
