"""Per-rank checkpoints of a distributed pipeline, and re-assembly into one state_dict.

Why per rank: no rank holds the whole model, and gathering it onto one rank
would need that rank to have room for all of it. Each rank writes
``rank{r:05d}.pt`` with its stage's tensors under the ORIGINAL model's
``state_dict`` keys (via ``StagedProgram.key_sources``) and its optimizer's
state. Every file is written to a temporary name and renamed (atomic on
POSIX); after a barrier, rank 0 writes ``manifest.json`` last, so a directory
with a manifest is complete and a crash mid-save never leaves a checkpoint
that looks whole. :func:`assemble_checkpoint` reads replica 0's file of every
stage and returns one ``state_dict`` a plain ``model.load_state_dict`` takes.
"""

from __future__ import annotations

import json
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from crosscut.errors import DistributedError

__all__ = ["MANIFEST", "assemble_checkpoint", "load_rank", "rank_file", "save_rank"]

MANIFEST = "manifest.json"


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
    state = pipe.local_state_dict()
    payload = {
        "layout": layout,
        "state": state,
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


def load_rank(pipe: Any, directory: str | Path, optimizer: Any = None) -> Any:
    """Collective: restore this rank's stage (replica 0's copy) and optimizer; return extra."""
    manifest = _manifest(directory)
    if manifest["plan_hash"] != pipe.plan_hash or manifest["stages"] != pipe.num_stages:
        raise DistributedError(
            "a checkpoint resumes only under the plan that wrote it",
            value={"checkpoint": manifest["plan_hash"], "this run": pipe.plan_hash},
            remedy="resume with the same plan file, or load assemble_checkpoint(dir) into "
            "the model and compile again",
        )
    source = rank_file(directory, pipe.stage_index)  # replica 0 of this stage
    own = rank_file(directory, pipe.rank)
    data = _load(source)
    named = dict(pipe.named_original_tensors())
    with torch.no_grad():
        for key, t in named.items():
            if key not in data["state"]:
                raise DistributedError(
                    f"checkpoint file {source.name} lacks {key!r}",
                    remedy="the checkpoint was written by another plan",
                )
            t.copy_(data["state"][key].to(t.device))
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
    merged: dict[str, torch.Tensor] = {}
    for stage in range(int(manifest["stages"])):
        data = _load(rank_file(directory, stage))
        merged.update(data["state"])
        merged.update(data.get("orphans") or {})
    missing = [k for k in manifest["keys"] if k not in merged]
    if missing:
        raise DistributedError(
            "the assembled checkpoint lacks keys of the original model",
            value=missing[:10],
            remedy="the checkpoint is incomplete; save it again",
        )
    return {k: merged[k] for k in manifest["keys"]}
