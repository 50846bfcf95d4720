"""Per-rank state under the original keys, per-rank checkpoints, and re-assembly.

Why per rank: no rank holds the whole model, and gathering it onto one rank
would need that rank to have room for all of it. Each rank writes
``rank{r:05d}.pt`` with its tensors under the ORIGINAL model's ``state_dict``
keys (via ``StagedProgram.key_sources``) and its optimizer's state. A member
of a channel-split group holds pieces of some tensors; it writes them as
shards (key → member, cat dim, piece), and :func:`assemble_parts`
concatenates the members' pieces back into the original tensor, so neither
a save nor a load ever gathers a tensor onto one rank. Every file is written
to a temporary name and renamed (atomic on POSIX); after a barrier, rank 0
writes ``manifest.json`` last, so a directory with a manifest is complete and
a crash mid-save never leaves a checkpoint that looks whole.
:func:`assemble_checkpoint` reads replica 0's files and returns one
``state_dict`` a plain ``model.load_state_dict`` takes.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from crosscut.errors import DistributedError, InputError
from crosscut.runtime.contract import dtype_of_to, refuse_placement, share_of
from crosscut.runtime.dist.world import RankLayout

__all__ = [
    "MANIFEST",
    "RankState",
    "Shard",
    "assemble_checkpoint",
    "assemble_parts",
    "load_rank",
    "rank_file",
    "save_rank",
]

MANIFEST = "manifest.json"

Shard = tuple[int, int | None, torch.Tensor]
"""One member's piece of a channel-sharded tensor: (member, cat dim or None, piece)."""


class RankState:
    """This rank's tensors under the original keys (mixed into the distributed pipeline).

    Whole tensors (a stage's own, a batch group member's replicated copy) are
    listed under their original keys; a channel-split member's pieces are
    :data:`Shard` s (``shard_sources`` of ``codegen/grouped_stages.py``, cut to this
    member).
    """

    stage: nn.Module
    member: int
    _param_keys: dict[str, list[str]]  # local name -> original keys (whole tensors)
    _shard_sources: dict[str, tuple[int, list[str], int | None]]  # key -> (stage, names, dim)
    _orphans: dict[str, torch.Tensor]
    original_keys: list[str]  # the model's state_dict keys, in order
    device: torch.device
    replica: int
    stage_index: int
    rank_layout: RankLayout

    def _named_local(self) -> dict[str, torch.Tensor]:
        return {
            **dict(self.stage.named_parameters(remove_duplicate=False)),
            **dict(self.stage.named_buffers(remove_duplicate=False)),
        }

    def named_original_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """(original state_dict key, tensor) for the whole tensors this rank holds."""
        named = self._named_local()
        return [(key, named[local]) for local, keys in self._param_keys.items() for key in keys]

    def named_shards(self) -> list[tuple[str, int, int | None, torch.Tensor]]:
        """(original key, member, cat dim, piece) for this member's channel shards.

        The whole tensor is the members' pieces concatenated along ``dim`` in
        member order (``dim`` None: a replicated scalar, member 0's speaks).
        """
        named = self._named_local()
        return [
            (key, self.member, dim, named[names[self.member]])
            for key, (_s, names, dim) in self._shard_sources.items()
            if names[self.member] in named
        ]

    def local_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's whole tensors under the original keys, copied to CPU.

        Channel shards are in :meth:`local_shards`; each member of a batch
        group returns its own (identical) copy.
        """
        return {k: t.detach().to("cpu", copy=True) for k, t in self.named_original_tensors()}

    def local_grads(self) -> dict[str, torch.Tensor]:
        """Gradients of this rank's whole parameters under the original keys (CPU copies)."""
        return {
            k: t.grad.detach().to("cpu", copy=True)
            for k, t in self.named_original_tensors()
            if isinstance(t, nn.Parameter) and t.grad is not None
        }

    def local_shards(self) -> dict[str, Shard]:
        """This member's channel shards: original key -> (member, cat dim, CPU copy)."""
        return {
            k: (m, dim, t.detach().to("cpu", copy=True)) for k, m, dim, t in self.named_shards()
        }

    def local_shard_grads(self) -> dict[str, Shard]:
        """Gradients of this member's channel shards, like :meth:`local_shards`."""
        return {
            k: (m, dim, t.grad.detach().to("cpu", copy=True))
            for k, m, dim, t in self.named_shards()
            if isinstance(t, nn.Parameter) and t.grad is not None
        }

    def named_parameters(  # type: ignore[override]
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters under the model's names, in the model's order.

        As ``CompiledModule.named_parameters``: whole tensors under their
        original key, a channel-split member's pieces as ``KEY#shardM``. An
        optimizer built from ``parameters()`` on every rank indexes its state
        in the model's order.
        """
        seen: set[int] = set()
        for name, t in self._named_share():
            if not isinstance(t, nn.Parameter) or (remove_duplicate and id(t) in seen):
                continue
            seen.add(id(t))
            if recurse or "." not in name:
                yield prefix + name, t

    def state_dict(  # type: ignore[override]
        self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False
    ) -> dict[str, Any]:
        """This rank's share of the model's state_dict, under the model's keys and order.

        A channel-split member's pieces appear as ``KEY#shardM``;
        :func:`assemble_checkpoint` joins every rank's share into the model's.
        As ``nn.Module.state_dict``, values share storage with this rank's
        tensors (a write through one changes the stage);
        :meth:`local_state_dict` gives CPU copies.
        """
        out: dict[str, Any] = OrderedDict() if destination is None else destination
        for name, t in self._named_share():
            out[prefix + name] = t if keep_vars else t.detach()
        return out

    def load_state_dict(  # type: ignore[override]
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """Load a whole checkpoint of the model (or this rank's share): each rank takes its part."""
        whole = dict(self.named_original_tensors())
        shards = {key: (m, dim, t) for key, m, dim, t in self.named_shards()}
        known = set(self.original_keys)
        unexpected = [k for k in state_dict if k.split("#shard")[0] not in known]
        missing = [k for k in [*whole, *shards] if k not in state_dict]
        if strict and (missing or unexpected):
            raise InputError(
                "load_state_dict needs the model's keys (a whole checkpoint, or this rank's share)",
                value={"missing": missing[:10], "unexpected": unexpected[:10]},
                remedy="load a state_dict of the original model, or pass strict=False",
            )
        width = len(self.rank_layout.group_ranks(self.replica, self.stage_index))
        with torch.no_grad():
            for key, t in whole.items():
                if key in state_dict:
                    t.copy_(share_of(state_dict, key, t.shape, None).to(t.device))
            for key, (m, dim, t) in shards.items():
                if key in state_dict:
                    piece = None if dim is None else (dim, m, width)
                    t.copy_(share_of(state_dict, key, t.shape, piece).to(t.device))
        return nn.modules.module._IncompatibleKeys(missing, unexpected)

    def _named_share(self) -> list[tuple[str, torch.Tensor]]:
        whole = dict(self.named_original_tensors())
        shards = {key: (m, t) for key, m, _dim, t in self.named_shards()}
        out: list[tuple[str, torch.Tensor]] = []
        for key in self.original_keys:
            if key in whole:
                out.append((key, whole[key]))
            elif key in shards:
                out.append((f"{key}#shard{shards[key][0]}", shards[key][1]))
        return out

    def to(self, *args: Any, **kwargs: Any) -> Any:
        """A dtype change of this rank's stage; device moves are refused (runtime/contract.py)."""
        dtype = dtype_of_to(args, kwargs, [str(self.device)])
        if dtype is not None:
            self.stage.to(dtype)
        return self

    def cuda(self, device: Any = None) -> Any:
        raise refuse_placement(".cuda()", [str(self.device)])

    def cpu(self) -> Any:
        raise refuse_placement(".cpu()", [str(self.device)])

    def close(self) -> None:
        """Nothing to stop (the schedule runs on the caller's thread); for the shared contract."""

    def orphans(self) -> dict[str, torch.Tensor]:
        """Original keys the traced graph never reads (kept so checkpoints are complete)."""
        return dict(self._orphans)

    def save_checkpoint(self, directory: str, optimizer: Any = None, extra: Any = None) -> None:
        """Collective: every rank writes its state (and optimizer state) atomically."""
        save_rank(self, directory, optimizer, extra)

    def load_checkpoint(self, directory: str, optimizer: Any = None) -> Any:
        """Collective: restore this rank (and optimizer) from a checkpoint; returns ``extra``."""
        return load_rank(self, directory, optimizer)


def assemble_parts(
    parts: Iterable[Mapping[str, Any]], whole: str = "state", shards: str = "shards"
) -> dict[str, torch.Tensor]:
    """One dict under the original keys from per-rank parts (``layout`` + tensors).

    Whole tensors come from group leaders (member 0) of replica 0 — the
    other members of a batch group hold copies — and channel shards from
    every member of replica 0, concatenated in member order. ``whole`` and
    ``shards`` name the fields to read (``"grads"``/``"shard_grads"`` for
    gradients dumped the same way).
    """
    merged: dict[str, torch.Tensor] = {}
    pieces: dict[str, list[Shard]] = {}
    for part in parts:
        layout = part.get("layout", {})
        if int(layout.get("replica", 0)) != 0:
            continue
        if int(layout.get("member", 0)) == 0:
            merged.update(part.get(whole) or {})
        for key, shard in (part.get(shards) or {}).items():
            pieces.setdefault(key, []).append(shard)
    for key, got in pieces.items():
        got.sort(key=lambda p: p[0])
        members = [p[0] for p in got]
        if members != list(range(len(got))):
            raise DistributedError(
                f"the shards of {key!r} come from members {members}; every member of the "
                "group must have written its piece",
                value=key,
                remedy="the checkpoint is incomplete; save it again",
            )
        dim = got[0][1]
        merged[key] = got[0][2] if dim is None else torch.cat([p[2] for p in got], dim)
    return merged


def rank_file(directory: str | Path, rank: int) -> Path:
    """The file rank ``rank`` writes in ``directory``."""
    return Path(directory) / f"rank{rank:05d}.pt"


def _atomic_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    torch.save(obj, tmp)
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _barrier(pipe: Any, what: str) -> None:
    """A barrier that names the ranks that did not arrive (gloo's monitored barrier)."""
    try:
        if dist.get_backend() == "gloo":
            dist.monitored_barrier(timeout=timedelta(seconds=pipe.timeout_s), wait_all_ranks=True)
        else:
            dist.barrier()
    except RuntimeError as exc:
        raise DistributedError(
            f"rank {pipe.rank} gave up waiting for the other ranks {what}: "
            f"{str(exc).splitlines()[0][:300]}",
            remedy="the ranks named above did not reach the checkpoint; check their logs",
        ) from exc


def save_rank(pipe: Any, directory: str | Path, optimizer: Any = None, extra: Any = None) -> Path:
    """Collective: write this rank's file, wait for all ranks, then rank 0 writes the manifest."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    layout = pipe.layout()
    payload = {
        "layout": layout,
        "state": pipe.local_state_dict(),
        "shards": pipe.local_shards(),
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "orphans": pipe.orphans() if pipe.rank == 0 else {},
        "extra": extra,
    }
    path = rank_file(out, pipe.rank)
    _atomic_save(payload, path)
    _barrier(pipe, "to finish writing the checkpoint")
    if pipe.rank == 0:
        manifest = {
            "plan_hash": pipe.plan_hash,
            "stages": pipe.num_stages,
            "group_widths": layout["group_widths"],
            "replicas": pipe.replicas,
            "world_size": pipe.world_size,
            "keys": list(pipe.original_keys),
            "files": [rank_file(out, r).name for r in range(pipe.world_size)],
        }
        tmp = out / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(manifest, indent=1) + "\n")
        os.replace(tmp, out / MANIFEST)
    _barrier(pipe, "for rank 0 to write the checkpoint manifest")
    return path


def _manifest(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise DistributedError(
            "a checkpoint directory needs its manifest.json (written last, when every rank saved)",
            value=str(path),
            remedy="the save did not finish; use an earlier checkpoint",
        )
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def _load(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise DistributedError(
            "a rank file named in the checkpoint manifest is missing",
            value=str(path),
            remedy="copy the whole checkpoint directory, not single files",
        )
    data: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=False)
    return data


def _per_replica(manifest: Mapping[str, Any]) -> int:
    """Ranks of one replica in a checkpoint (older manifests: one per stage)."""
    return int(sum(manifest.get("group_widths") or [1] * int(manifest["stages"])))


def load_rank(pipe: Any, directory: str | Path, optimizer: Any = None) -> Any:
    """Collective: restore this rank (replica 0's copy of its position) and optimizer."""
    manifest = _manifest(directory)
    widths = manifest.get("group_widths") or [1] * int(manifest["stages"])
    if manifest["plan_hash"] != pipe.plan_hash or list(widths) != list(pipe.rank_layout.widths):
        raise DistributedError(
            "a checkpoint resumes only under the plan that wrote it",
            value={"checkpoint": manifest["plan_hash"], "this run": pipe.plan_hash},
            remedy="resume with the same plan file, or load assemble_checkpoint(dir) into "
            "the model and compile again",
        )
    source = rank_file(directory, pipe.position)  # replica 0 of this position
    own = rank_file(directory, pipe.rank)
    data = _load(source)
    wanted: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {
        k: (t, data["state"].get(k)) for k, t in pipe.named_original_tensors()
    }
    shards = data.get("shards") or {}
    for key, _m, _dim, t in pipe.named_shards():
        wanted[key] = (t, shards[key][2] if key in shards else None)
    with torch.no_grad():
        for key, (t, saved) in wanted.items():
            if saved is None:
                raise DistributedError(
                    f"checkpoint file {source.name} lacks {key!r}",
                    remedy="the checkpoint was written by another plan",
                )
            t.copy_(saved.to(t.device))
    if optimizer is not None:
        opt_data = _load(own) if own.is_file() and manifest["replicas"] == pipe.replicas else data
        if opt_data["optimizer"] is None:
            raise DistributedError(
                "the checkpoint holds no optimizer state",
                value=str(directory),
                remedy="pass optimizer= to save_checkpoint, or load without one",
            )
        optimizer.load_state_dict(opt_data["optimizer"])
    _barrier(pipe, "to finish loading the checkpoint")
    return data["extra"]


def assemble_checkpoint(directory: str | Path) -> dict[str, torch.Tensor]:
    """One state_dict with the original model's keys, in its order, from replica 0's files."""
    manifest = _manifest(directory)
    parts = [_load(rank_file(directory, r)) for r in range(_per_replica(manifest))]
    merged = assemble_parts(parts)
    for part in parts:
        merged.update(part.get("orphans") or {})
    missing = [k for k in manifest["keys"] if k not in merged]
    if missing:
        raise DistributedError(
            "the assembled checkpoint lacks keys of the original model",
            value=missing[:10],
            remedy="the checkpoint is incomplete; save it again",
        )
    return {k: merged[k] for k in manifest["keys"]}
