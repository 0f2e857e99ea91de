"""Sharded training checkpoints: complete or absent, the newest ``keep`` kept.

    <directory>/step-00000012/
        .metadata, __0_0.distcp, ...   model and optimizer (torch.distributed.checkpoint), sharded
        scheduler.pt, extra.pt         rank 0: the LR scheduler; plain values the same on every rank
        rank-00000.pt, ...             one per rank: its stream, carried states, RNG states
        COMPLETE                       written last: JSON {format, step, world, files: {name: bytes}}

The model and the optimizer go through ``get_state_dict`` / ``set_state_dict`` and DCP, so one
checkpoint loads at any world size: saved from FSDP2 (``fully_shard``, DTensor parameters) it
loads into a plain module and the reverse, every rank reading the pieces it holds.

A save writes into ``step-N.partial/``, waits for every rank (a barrier when a process group is
initialised), renames the folder to ``step-N/`` and only then writes ``COMPLETE``, listing every
file with its size. :meth:`Checkpointer.latest` returns only folders whose ``COMPLETE`` is valid
and whose files all exist with the listed sizes, so a crash at any point of a save leaves nothing
a resume would read; the next save removes the leftovers and all but the newest ``keep``.

Per-rank files at another world size: :meth:`Checkpointer.load` returns this rank's dict when the
checkpoint was saved at the current world size, otherwise ``{"by_rank": {rank: dict}}`` with every
saved rank's dict (every rank reads every file), so the training loop can re-deal the stream
shards by their index. The per-rank and ``extra`` files are pickles (``torch.save``): load only
checkpoints you wrote.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import warnings
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

FORMAT = 1
MARKER = "COMPLETE"
_STEP = re.compile(r"^step-(\d{8})$")
# Flat optimizer keys ("state.<fqn>.exp_avg"): the same at every world size, checked one by one.
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


@contextmanager
def _single_process_quiet():
    """DCP warns that it assumes one process when no group is initialised: here that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _step_name(step: int) -> str:
    return f"step-{step:08d}"


def _rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def _files(root: pathlib.Path) -> dict[str, int]:
    """Every file under ``root`` (relative POSIX path -> bytes), the marker left out."""
    out = {}
    for path in sorted(root.rglob("*")):
        if path.is_file() and path.name != MARKER:
            out[path.relative_to(root).as_posix()] = path.stat().st_size
    return out


def _write_marker(final: pathlib.Path, manifest: dict) -> None:
    """``COMPLETE``, written whole (a temporary file renamed) and flushed to disk."""
    tmp = final / (MARKER + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final / MARKER)


def _publish(partial: pathlib.Path, final: pathlib.Path, manifest: dict) -> None:
    """Rename the finished ``.partial`` folder to its step and mark it complete."""
    if final.exists():                    # the same step saved again: the old one goes, the new one replaces it
        stale = final.with_name(final.name + ".stale")
        shutil.rmtree(stale, ignore_errors=True)
        os.replace(final, stale)
    os.replace(partial, final)
    _write_marker(final, manifest)


def read_manifest(path: str | os.PathLike) -> dict:
    """The manifest of a complete checkpoint folder; ``ValueError`` naming the file and the fix for
    a folder that is not one, incomplete, of another format, or with a file missing or truncated."""
    path = pathlib.Path(path)
    if not path.is_dir():
        raise ValueError(f"checkpoint path {str(path)!r} is not a directory; pass a step-NNNNNNNN folder "
                         "(Checkpointer.latest() gives the newest complete one)")
    marker = path / MARKER
    if not marker.is_file():
        raise ValueError(f"{str(marker)!r} is missing: the checkpoint is incomplete (its save did not finish); "
                         "resume from a complete one (Checkpointer.latest())")
    try:
        manifest = json.loads(marker.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{str(marker)!r} is not a readable JSON manifest ({err}); resume from another checkpoint "
                         "(Checkpointer.latest())") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else manifest
        raise ValueError(f"{str(marker)!r} has checkpoint format {got!r} but this version reads format {FORMAT}; "
                         "load it with the ssm-pack version that wrote it")
    files, world = manifest.get("files"), manifest.get("world")
    if (not isinstance(files, dict) or isinstance(world, bool) or not isinstance(world, int) or world < 1
            or not isinstance(manifest.get("step"), int)):
        raise ValueError(f"{str(marker)!r} lacks step, world or files; resume from another checkpoint "
                         "(Checkpointer.latest())")
    for name, size in files.items():
        file = path / name
        have = file.stat().st_size if file.is_file() else None
        if have != size:
            what = "is missing" if have is None else f"has {have} bytes"
            raise ValueError(f"{str(file)!r} {what} but {MARKER} lists {size} bytes: the checkpoint is damaged; "
                             "resume from another checkpoint (Checkpointer.latest())")
    return manifest


def read_extra(path: str | os.PathLike) -> dict:
    """The ``extra`` dict of a complete checkpoint (step, config, counters), read without loading
    the model: a run checks that it may resume from it before touching its weights."""
    read_manifest(path)
    return torch.load(pathlib.Path(path) / "extra.pt", weights_only=True)


def _saved_keys(path: pathlib.Path) -> dict:
    """The checkpoint's DCP keys (``model.<fqn>``, ``optim.<key>``) and their metadata."""
    return dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata


_FIX = "build the model (pattern, sizes) and optimizer the checkpoint was saved with"


def _check_model_keys(path: pathlib.Path, saved: dict, model_sd: dict) -> None:
    """Refuse a model whose parameter names or shapes differ from the saved ones (a foreign one)."""
    saved_model = {k[len("model."):]: v for k, v in saved.items() if k.startswith("model.")}
    for key, value in model_sd.items():
        if key not in saved_model:
            raise ValueError(f"{str(path)!r} holds no model key {key!r}: it was saved from another model; {_FIX}")
        size = getattr(saved_model[key], "size", None)
        if isinstance(value, torch.Tensor) and size is not None and tuple(size) != tuple(value.shape):
            raise ValueError(f"{str(path)!r} holds {key!r} of shape {tuple(size)} but the model's is "
                             f"{tuple(value.shape)}; {_FIX}")
    for key in saved_model:
        if key not in model_sd:
            raise ValueError(f"{str(path)!r} holds model key {key!r} that the model lacks (unexpected); {_FIX}")


def _check_optim_keys(path: pathlib.Path, saved: dict, optim_sd: dict) -> None:
    """Refuse an optimizer whose entries differ from the saved ones (another kind, or state already touched)."""
    for key in optim_sd:
        if f"optim.{key}" not in saved:
            raise ValueError(f"{str(path)!r} holds no optimizer entry {key!r}: it was saved with another optimizer "
                             f"or model; {_FIX}")
    for key in saved:
        if key.startswith("optim.state.") and key[len("optim."):] not in optim_sd:   # a state DCP would skip
            raise ValueError(f"{str(path)!r} holds optimizer entry {key[len('optim.'):]!r} that the optimizer lacks; "
                             f"{_FIX}, and load into an optimizer that has not stepped (or one whose state is full)")


class Checkpointer:
    """Save and load sharded checkpoints under ``directory`` (``<out_dir>/checkpoints``).

    Args:
        directory: the folder holding the ``step-N`` folders.
        keep: complete checkpoints kept after a save (the newest), at least 1.
        rank / world: this process's rank and the world size (of ``group`` when one is initialised).
        group: the process group (``None``: the default one, when initialised).

    With no process group initialised the checkpointer runs one process (DCP without collectives).
    """

    def __init__(self, directory: str | os.PathLike, *, keep: int, rank: int = 0, world: int = 1, group=None):
        if not isinstance(directory, (str, os.PathLike)):
            raise TypeError(f"directory must be a path (str or os.PathLike), got {type(directory).__name__}")
        for name, value, low in (("keep", keep, 1), ("world", world, 1), ("rank", rank, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}"
                                 + ("; keep at least the checkpoint just saved (keep=1)" if name == "keep" else ""))
        if rank >= world:
            raise ValueError(f"rank must be in 0..{world - 1} (world={world}), got {rank}")
        if _distributed():
            have = (dist.get_rank(group), dist.get_world_size(group))
            if have != (rank, world):
                raise ValueError(f"rank={rank}, world={world} but the process group says rank {have[0]} of "
                                 f"{have[1]}; pass dist.get_rank() and dist.get_world_size()")
        elif world != 1:
            raise ValueError(f"world={world} needs an initialised process group (torch.distributed."
                             "init_process_group); without one pass world=1")
        self.directory = pathlib.Path(directory)
        self.keep, self.rank, self.world, self.group = keep, rank, world, group

    # ----------------------------------------------------------------- helpers
    def _barrier(self) -> None:
        if _distributed():
            dist.barrier(group=self.group)

    def _steps(self) -> list[tuple[int, pathlib.Path]]:
        """``(step, folder)`` of every ``step-N`` folder, complete or not, newest first."""
        if not self.directory.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.directory.iterdir() if p.is_dir() and (m := _STEP.match(p.name))]
        return sorted(found, reverse=True)

    def _complete(self, step: int, path: pathlib.Path) -> bool:
        try:
            return read_manifest(path)["step"] == step
        except ValueError:
            return False

    def latest(self) -> pathlib.Path | None:
        """The newest complete checkpoint folder, or ``None``."""
        for step, path in self._steps():
            if self._complete(step, path):
                return path
        return None

    def _prune(self) -> None:
        """Rank 0, after a save: all but the newest ``keep`` complete checkpoints, incomplete step
        folders and leftover ``.partial`` / ``.stale`` folders go."""
        kept = 0
        for step, path in self._steps():
            if self._complete(step, path) and kept < self.keep:
                kept += 1
            else:
                shutil.rmtree(path)
        for path in self.directory.iterdir():
            if path.is_dir() and path.name.endswith((".partial", ".stale")):
                shutil.rmtree(path)

    # ----------------------------------------------------------------- save / load
    def save(self, step: int, model, optimizer, *, scheduler=None, extra: dict | None = None,
             per_rank: dict | None = None) -> pathlib.Path:
        """Save a checkpoint (collective when a process group is initialised); returns its folder."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        for name, value in (("extra", extra), ("per_rank", per_rank)):
            if value is not None and not isinstance(value, dict):
                raise TypeError(f"{name} must be a dict or None, got {type(value).__name__}")
        model_sd, optim_sd = get_state_dict(model, optimizer, options=_OPTIONS)
        final = self.directory / _step_name(step)
        partial = final.with_name(final.name + ".partial")
        if self.rank == 0:
            self.directory.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir()
        self._barrier()
        with _single_process_quiet():
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=partial, process_group=self.group,
                     no_dist=not _distributed())
        torch.save(dict(per_rank or {}), partial / _rank_file(self.rank))
        if self.rank == 0:
            if scheduler is not None:
                torch.save(scheduler.state_dict(), partial / "scheduler.pt")
            torch.save(dict(extra or {}), partial / "extra.pt")
        self._barrier()                   # every rank has written its files
        if self.rank == 0:
            manifest = {"format": FORMAT, "step": step, "world": self.world, "files": _files(partial)}
            _publish(partial, final, manifest)
            self._prune()
        self._barrier()                   # nobody returns before the checkpoint is complete
        return final

    def load(self, path, model, optimizer, *, scheduler=None) -> tuple[dict, dict]:
        """Load ``path`` into ``model``, ``optimizer`` (and ``scheduler``) in place (collective when a
        process group is initialised); returns ``(extra, per_rank)`` (see the module docstring)."""
        path = pathlib.Path(path)
        manifest = read_manifest(path)
        if scheduler is not None and not (path / "scheduler.pt").is_file():
            raise ValueError(f"{str(path / 'scheduler.pt')!r} is missing: the checkpoint was saved without a "
                             "scheduler; load it with scheduler=None")
        saved = _saved_keys(path)
        _check_model_keys(path, saved, get_model_state_dict(model, options=_OPTIONS))
        model_sd, optim_sd = get_state_dict(model, optimizer, options=_OPTIONS)   # a fresh optimizer: its states made
        _check_optim_keys(path, saved, optim_sd)
        with _single_process_quiet():
            dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path, process_group=self.group,
                     no_dist=not _distributed())
        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd, options=_OPTIONS)
        if scheduler is not None:
            scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
        extra = torch.load(path / "extra.pt", weights_only=True)
        if manifest["world"] == self.world:
            per_rank = torch.load(path / _rank_file(self.rank), weights_only=True)
        else:
            per_rank = {"by_rank": {r: torch.load(path / _rank_file(r), weights_only=True)
                                    for r in range(manifest["world"])}}
        return extra, per_rank
