"""Shards across jobs and rank-group dealing, in one process with the scripted engine of
test_eval_loop.py: shards 1/3, 2/3, 3/3 then ``apbv eval merge`` equal one run (rows and
scores); a missing shard, a shard short of samples and mixed settings are refused by name;
``--shard`` and Slurm's array variables parse to the same part; :func:`deal` balances."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from apbv.__main__ import main
from apbv.distributed import group_ranks
from apbv.eval.groups import deal
from apbv.eval.harness import run_eval
from apbv.eval.shards import Shard, merge_shards, parse_shard
from tests.unit.test_eval_loop import CFG, _spec, _strip, scripted_engine, vnbench_fixture


@pytest.fixture(scope="module")
def vnb(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return vnbench_fixture(tmp_path_factory.mktemp("vnb"))


def _run(root: Path, out: Path, **kw) -> dict:
    results = run_eval(_spec(root, out, **kw), CFG, lambda: scripted_engine(root))
    assert results is not None
    return results


def _scores(path: Path) -> dict:
    doc = json.loads(path.read_text())
    return {"results": doc["results"], "apbv": doc["apbv"], "n": doc["n-samples"]}


def test_three_shards_merged_equal_one_run(vnb: Path, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    whole = tmp_path / "whole.jsonl"
    _run(vnb, whole)
    parts = [tmp_path / f"part{k}.jsonl" for k in (1, 2, 3)]
    for k, part in enumerate(parts, 1):
        _run(vnb, part, shard=Shard(k, 3))
        assert len(part.read_text().splitlines()) == len(range(k - 1, 12, 3))
    merged = tmp_path / "merged.jsonl"
    assert main(["eval", "merge", "--out", str(merged), *map(str, parts)]) == 0
    assert _strip(merged) == _strip(whole)
    assert _scores(merged.with_name("merged_results.json")) == \
        _scores(whole.with_name("whole_results.json"))
    assert "merged 3 shard(s), 12 samples" in capsys.readouterr().out


def test_a_missing_shard_or_sample_and_mixed_settings_are_refused(vnb: Path,
                                                                  tmp_path: Path) -> None:
    parts = [tmp_path / f"part{k}.jsonl" for k in (1, 2, 3)]
    for k, part in enumerate(parts, 1):
        _run(vnb, part, shard=Shard(k, 3))
    out = tmp_path / "merged.jsonl"
    with pytest.raises(ValueError, match=r"shard 2/3 is missing"):
        merge_shards(out, [parts[0], parts[2]])
    lines = parts[1].read_text().splitlines()
    short = tmp_path / "short.jsonl"
    short.write_text("\n".join(lines[1:]) + "\n")
    short.with_name("short_settings.json").write_text(
        parts[1].with_name("part2_settings.json").read_text())
    first = json.loads(lines[0])["id"]
    with pytest.raises(ValueError, match=rf"shard 2/3 \({short}\) lacks 1 of its 4 samples: "
                                         rf"{first}$"):
        merge_shards(out, [parts[0], short, parts[2]])
    other = tmp_path / "other.jsonl"
    _run(vnb, other, shard=Shard(2, 3), max_new_tokens=3)
    with pytest.raises(ValueError, match=r"other settings \(max_new_tokens differ\)"):
        merge_shards(out, [parts[0], other, parts[2]])
    with pytest.raises(ValueError, match="given twice"):
        merge_shards(out, [parts[0], parts[0], parts[2]])
    with pytest.raises(ValueError, match="no shard output"):
        merge_shards(out, [tmp_path / "nothing.jsonl"])
    assert not out.exists()


def test_shard_from_the_flag_or_a_slurm_array() -> None:
    assert parse_shard("2/3", {}) == Shard(2, 3)
    assert parse_shard(None, {}) is None
    array = {"SLURM_ARRAY_TASK_ID": "1", "SLURM_ARRAY_TASK_COUNT": "3"}
    assert parse_shard(None, array) == Shard(2, 3)  # --array=0-2
    assert parse_shard(None, {**array, "SLURM_ARRAY_TASK_MIN": "1"}) == Shard(1, 3)
    assert parse_shard("3/3", array) == Shard(3, 3)  # the flag wins
    for bad in ("0/3", "4/3", "1-3", "a/b", "1/0"):
        with pytest.raises(ValueError, match="shard|K/N"):
            parse_shard(bad, {})
    with pytest.raises(ValueError, match="numbered 0-\\(N-1\\) or 1-N"):
        parse_shard(None, {**array, "SLURM_ARRAY_TASK_MIN": "5"})
    assert Shard(2, 3).take(list(range(8))) == [1, 4, 7]


def test_deal_balances_and_groups_must_divide_the_world() -> None:
    rng = random.Random(0)
    costs = [rng.uniform(1, 100) for _ in range(41)]
    for groups in (1, 2, 3, 4):
        dealt = deal(costs, groups)
        assert sorted(i for d in dealt for i in d) == list(range(41))
        assert max(map(len, dealt)) - min(map(len, dealt)) <= 1
        loads = [sum(costs[i] for i in d) for d in dealt]
        # each round's costliest sample goes to the least loaded group: the spread stays
        # within the costliest sample
        assert max(loads) - min(loads) <= max(costs), (groups, loads)
        for d in dealt if groups > 1 else ():  # longest first within each group
            assert [costs[i] for i in d] == sorted((costs[i] for i in d), reverse=True)
    assert deal(costs, 1) == [list(range(41))]  # one group: annotation order
    assert group_ranks(8, 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(ValueError, match="groups=3 does not divide the world of 8"):
        group_ranks(8, 3)
