"""Splitting a benchmark over jobs (``--shard K/N``, a Slurm job array) and joining the parts.

Shard K of N holds the selected samples (after ``--where`` and ``--limit``) at positions
K-1, K-1+N, K-1+2N, ... of annotation order: a deterministic 1/N that needs nothing but the
annotation file, so every job of an array picks its part alone. A shard's output is an ordinary
evaluation output whose settings also hold ``shard`` ("K/N") and ``selection`` (the data
directory, ``where`` and ``limit``): :func:`merge_shards` checks that the shards' settings agree
on everything else, recomputes each shard's samples from the annotation, names the shards and
samples that are missing, and writes one output in annotation order, scored as one run.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from apbv.eval.data import TASK_NAMES, load_samples
from apbv.eval.settings import read_settings, write_settings

T = TypeVar("T")

SHOWN = 10
"""How many missing sample ids a refused merge names."""


@dataclass(frozen=True)
class Shard:
    """Part ``index`` (1-based) of ``count``."""

    index: int
    count: int

    def __post_init__(self) -> None:
        if not 1 <= self.count or not 1 <= self.index <= self.count:
            raise ValueError(f"shard K/N needs 1 <= K <= N, got {self.index}/{self.count}")

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"

    def take(self, items: Sequence[T]) -> list[T]:
        """This shard's items: positions index-1, index-1+count, ... of ``items``."""
        return list(items[self.index - 1::self.count])


def parse_shard(text: str | None, env: Mapping[str, str] = os.environ) -> Shard | None:
    """The shard of ``--shard K/N``, else of a Slurm job array (``SLURM_ARRAY_TASK_ID`` is
    K-1 with ``SLURM_ARRAY_TASK_MIN`` 0, or K with 1; ``SLURM_ARRAY_TASK_COUNT`` is N), else
    None (the whole selection). Raises ValueError for a malformed value."""
    if text is not None:
        parts = text.split("/")
        if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
            raise ValueError(f"--shard must be K/N with integers 1 <= K <= N, e.g. 2/8; "
                             f"got {text!r}")
        return Shard(int(parts[0]), int(parts[1]))
    if "SLURM_ARRAY_TASK_ID" not in env or "SLURM_ARRAY_TASK_COUNT" not in env:
        return None
    try:
        task, count = int(env["SLURM_ARRAY_TASK_ID"]), int(env["SLURM_ARRAY_TASK_COUNT"])
        first = int(env.get("SLURM_ARRAY_TASK_MIN", "0"))
    except ValueError:
        raise ValueError(f"SLURM_ARRAY_TASK_ID, _MIN and _COUNT must be integers, got "
                         f"{env.get('SLURM_ARRAY_TASK_ID')!r}, "
                         f"{env.get('SLURM_ARRAY_TASK_MIN')!r}, "
                         f"{env.get('SLURM_ARRAY_TASK_COUNT')!r}") from None
    if first not in (0, 1):
        raise ValueError(f"a job array for apbv eval must be numbered 0-(N-1) or 1-N (--array); "
                         f"SLURM_ARRAY_TASK_MIN is {first}")
    return Shard(task - first + 1, count)


def shard_settings(shard: Shard, data_dir: str, where: Sequence[tuple[str, str]],
                   limit: int | None) -> dict[str, Any]:
    """The settings entries a shard's output adds (what :func:`merge_shards` needs to
    recompute its samples)."""
    return {"shard": str(shard),
            "selection": {"data_dir": os.path.abspath(data_dir),
                          "where": [list(w) for w in where], "limit": limit}}


def _read_shard(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    from apbv.eval.store import ResultLog

    if not path.is_file():
        raise ValueError(f"no shard output {path}")
    settings = read_settings(path)
    if settings is None or "shard" not in settings:
        raise ValueError(f"{path} is no shard output of apbv eval (its settings file "
                         f"names no shard; run with --shard K/N)")
    rows, note = ResultLog(path).read_rows("id")
    if note:
        raise ValueError(f"{path} ends in a half-written line; resume that shard first")
    return settings, rows


def merge_shards(out: str | os.PathLike[str], paths: Sequence[str | os.PathLike[str]],
                 ) -> tuple[dict[str, Any], list[dict[str, Any]], int]:
    """Join the shard outputs ``paths`` into ``out`` (JSONL, in annotation order, with its
    settings file: the shards' without ``shard``). Returns (settings, rows, total: the
    selected samples before ``limit``).

    Raises ValueError, writing nothing, for: a file that is no shard output, shards of
    different settings (naming the entries that differ), one shard given twice, missing
    shards (named K/N) or shards missing samples (named by id), or rows of samples no shard
    holds.
    """
    if not paths:
        raise ValueError("name the shard outputs to merge")
    read = [(Path(p), *_read_shard(Path(p))) for p in paths]
    first_path, first, _ = read[0]
    common = {k: v for k, v in first.items() if k != "shard"}
    for path, settings, _ in read[1:]:
        other = {k: v for k, v in settings.items() if k != "shard"}
        differ = sorted(k for k in set(common) | set(other) if common.get(k) != other.get(k))
        if differ:
            raise ValueError(f"{path} and {first_path} were run with other settings "
                             f"({', '.join(differ)} differ); only shards of one run merge")
    count = int(str(first["shard"]).split("/")[1])
    by_index: dict[int, tuple[Path, list[dict[str, Any]]]] = {}
    for path, settings, rows in read:
        index, n = (int(x) for x in str(settings["shard"]).split("/"))
        if n != count:
            raise ValueError(f"{path} is shard {settings['shard']}, {first_path} shard "
                             f"{first['shard']}: only shards of one split merge")
        if index in by_index:
            raise ValueError(f"shard {index}/{count} given twice: {by_index[index][0]} and "
                             f"{path}")
        by_index[index] = (path, rows)
    selection = common["selection"]
    samples = load_samples(common["bench"], selection["data_dir"], common["annotation"],
                           tuple(tuple(w) for w in selection["where"]))
    total = len(samples)
    if selection["limit"] is not None:
        samples = samples[:selection["limit"]]
    problems = [f"shard {k}/{count} is missing"
                for k in range(1, count + 1) if k not in by_index]
    rows_by_id: dict[str, dict[str, Any]] = {}
    for index, (path, rows) in sorted(by_index.items()):
        expected = [s.id for s in Shard(index, count).take(samples)]
        have = {r["id"] for r in rows}
        absent = [i for i in expected if i not in have]
        if absent:
            shown = ", ".join(absent[:SHOWN]) + (f" and {len(absent) - SHOWN} more"
                                                 if len(absent) > SHOWN else "")
            problems.append(f"shard {index}/{count} ({path}) lacks {len(absent)} of its "
                            f"{len(expected)} samples: {shown}")
        stray = sorted(have - set(expected))
        if stray:
            problems.append(f"{path} holds rows of samples outside shard {index}/{count}: "
                            f"{', '.join(stray[:SHOWN])}")
        rows_by_id.update({r["id"]: r for r in rows})
    if problems:
        raise ValueError("cannot merge: " + "; ".join(problems))
    if any(r.get("task") != TASK_NAMES[common["bench"]] for r in rows_by_id.values()):
        raise ValueError(f"the shards hold rows of another task than {common['bench']}")
    merged = [rows_by_id[s.id] for s in samples]
    from apbv.eval.store import ResultLog

    if Path(out).resolve() in {p.resolve() for p, _, _ in read}:
        raise ValueError(f"--out {out} is one of the shards; name a new file")
    ResultLog(Path(out)).rewrite(merged)
    write_settings(out, common)
    return common, merged, total
