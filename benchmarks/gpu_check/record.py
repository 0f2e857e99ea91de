"""One stage's record: ``OUT/<stage>.json``, rewritten after every case (a stage stopped by its budget
keeps what it finished).

A case is ``passed``, ``failed`` or ``skipped``; a skip says what kind it is, because the kinds
weigh differently in the verdict (:mod:`.verdict`):

* ``unavailable``: a kernel the case needs is missing here (package, CUDA extension, device); the
  case names the missing kernels. It fails the check unless each is allowed or not applicable.
* ``refused``: the kernel is here but cannot do these inputs (a feature upstream lacks, e.g. fp32
  in fla's Gated DeltaProduct); the reason is upstream's.
* ``not applicable``: a CUDA C++ kernel on a dry run (no device to run it; nothing to interpret).
* ``not covered``: something the check does not measure, with the reason.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

STATUSES = ("passed", "failed", "skipped")
SKIP_KINDS = ("unavailable", "refused", "not applicable", "not covered")


class Skip(Exception):
    """A case that cannot run here: ``kind`` (one of :data:`SKIP_KINDS`) and the reason; ``missing``
    names the kernels an ``unavailable`` case lacked (empty: every kernel the case declares)."""

    def __init__(self, reason: str, kind: str = "refused", missing=()):
        if kind not in SKIP_KINDS:
            raise ValueError(f"Skip kind must be one of {SKIP_KINDS}, got {kind!r}")
        super().__init__(reason)
        self.kind, self.missing = kind, tuple(missing)


class Recorder:
    """Collects one stage's cases and rewrites ``OUT/<stage>.json`` after each."""

    def __init__(self, out: Path, stage: str, context: dict):
        self.path = Path(out) / f"{stage}.json"
        self.data = {"stage": stage, "context": context, "cases": []}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._write()

    def _write(self):
        self.path.write_text(json.dumps(self.data, indent=1, default=str) + "\n")

    def add(self, name: str, status: str, detail: str = "", figures: dict | None = None, seconds: float = 0.0,
            *, kernels=(), skip: str | None = None, missing=()):
        """One case. ``kernels``: the kernels of :data:`ssm_pack.support.requirements.KERNELS` it exercises;
        ``skip``: the kind of a skipped case; ``missing``: the kernels an ``unavailable`` one lacked."""
        assert status in STATUSES, status
        assert (status == "skipped") == (skip is not None), (status, skip)
        assert skip is None or skip in SKIP_KINDS, skip
        missing = list(missing) or (list(kernels) if skip == "unavailable" else [])
        self.data["cases"].append({"name": name, "status": status, "detail": detail, "figures": figures or {},
                                   "seconds": round(seconds, 3), "kernels": list(kernels), "skip": skip,
                                   "missing": missing})
        self._write()
        print(f"{status:7s} {name}  {detail}", flush=True)

    def run(self, name: str, case, *args, kernels=()) -> None:
        """Run ``case(*args)`` -> ``(detail, figures, ok)``; a :class:`Skip` or an exception is recorded too."""
        start = time.perf_counter()
        skip, missing = None, ()
        try:
            detail, figures, ok = case(*args)
            status = "passed" if ok else "failed"
        except Skip as why:
            detail, figures, status, skip, missing = f"skipped: {why}", {}, "skipped", why.kind, why.missing
        except Exception as err:  # noqa: BLE001 - a case's error is its result; the next case still runs
            detail, figures, status = f"{type(err).__name__}: {err}", {}, "failed"
        self.add(name, status, detail, figures, time.perf_counter() - start, kernels=kernels, skip=skip,
                 missing=missing)

    def exit_code(self) -> int:
        return 1 if any(c["status"] == "failed" for c in self.data["cases"]) else 0


def read(out: Path, stage: str) -> dict | None:
    """``OUT/<stage>.json`` as written by :class:`Recorder`, or ``None`` when the stage wrote none."""
    path = Path(out) / f"{stage}.json"
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        return None


class Case:
    """One case of a measuring stage: ``function(*args)`` -> ``(detail, figures, ok)``, and the kernels
    of :data:`ssm_pack.support.requirements.KERNELS` it exercises (empty: none in particular)."""

    __slots__ = ("name", "function", "args", "kernels")

    def __init__(self, name: str, function, args=(), kernels=()):
        self.name, self.function, self.args, self.kernels = name, function, tuple(args), tuple(kernels)

    def __repr__(self):
        return f"Case({self.name!r}, kernels={self.kernels})"
