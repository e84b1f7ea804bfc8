"""The failure record's JSON form, what summary.json, events.jsonl and metrics.jsonl hold: for each kind of recovery,
the keys a reader of the run folder finds (those of dtk before the record was a dataclass), and a record read back
from it is the same record."""
from __future__ import annotations

import json

import pytest
import torch.distributed as dist

from dtk.resilience import protocol as keys
from dtk.resilience.failures import (CheckpointRestart, FailureRecord, describe_failure, finalize_failures,
                                     lost_during_recovery)
from dtk.resilience.recovery import InPlaceFigures

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

NAMED = ["rank", "exit", "attempt", "generation", "detected_at", "step", "committed", "fault_time", "fault",
         "fault_spec"]
IN_PLACE = ["resumed_at_step", "steps_lost", "rebuilt_from", "rebuild_s", "rolled_forward", "source_rank", "lost_ranks", "survivors",
            "survivor_engines_kept", "replacements", "rounds", "released_at", "notice_s", "plan_at", "plan_s",
            "regrouped_at", "repaired_at", "repair_bytes", "promote_s", "regroup_s", "recovery_s"]


def killed(rank: int = 1) -> FailureRecord:
    fired = {"kind": "kill", "at_step": 6, "time": 100.0, "id": "f0"}
    return describe_failure(rank=rank, code=-9, t_detect=100.1, attempt=0, generation=0, committed=6, fired=fired,
                            lost_node=None, node_loss=None, hung_at=None)


def in_place_figures() -> InPlaceFigures:
    return InPlaceFigures(step=6, resumed_at_step=6, steps_lost=0, rebuilt_from="peer (rank 0)", rebuild_s=0.0,
                          source_rank=0, lost_ranks=[1], survivors=[0], survivor_engines_kept=True,
                          replacements=[{"rank": 1, "generation": 1, "replacement": "shadow", "shadow": 0}],
                          rounds=1, released_at=100.2, notice_s=0.1, plan_at=100.3, plan_s=0.2, regrouped_at=100.4,
                          repaired_at=100.5, repair_bytes=10, promote_s=0.1, regroup_s=0.1, recovery_s=0.5)


def finalized(tmp_path, records: list[FailureRecord], *, restart_attempt: int | None = None) -> list[dict]:
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0, "time": t}) + "\n"
                                                    for s, t in [(5, 99.0), (6, 101.0), (7, 102.0)]))
    store = dist.HashStore()
    if restart_attempt is not None:  # what the restarted ranks write as they start
        timeline = {"start_step": 3, "main_at": 100.4, "imported_at": 100.5, "group_at": 100.6, "engine_at": 100.7,
                    "loaded_at": 100.8}
        for r in range(2):
            keys.attempt_store(store, restart_attempt).set(keys.started(r), json.dumps(timeline))
    finalize_failures(records, run_dir=tmp_path, store=store, world=2)
    return [f.to_dict() for f in records]


def test_each_kind_of_recovery_writes_the_keys_the_run_folder_always_had(tmp_path):
    in_place, restarted, stopped = killed(), killed(), killed()
    in_place.recovered_in_place(in_place_figures())
    restarted.restarted(CheckpointRestart(stopped_at=100.3, restart_attempt=1, checkpoint_step=3))
    for name in "abc":
        (tmp_path / name).mkdir()
    [a] = finalized(tmp_path / "a", [in_place])
    [b] = finalized(tmp_path / "b", [restarted], restart_attempt=1)
    [c] = finalized(tmp_path / "c", [stopped])
    assert list(a) == NAMED + IN_PLACE + ["detect_s", "downtime_s", "breakdown_s"]
    assert list(b) == NAMED + ["recovery", "stopped_at", "restart_attempt", "checkpoint_step", "detect_s",
                               "downtime_s", "steps_lost", "breakdown_s"]
    assert list(c) == NAMED + ["detect_s", "downtime_s"]
    assert "recovery" not in a and b["recovery"] == "checkpoint restart"
    assert (a["steps_lost"], b["steps_lost"], a["downtime_s"]) == (0, 3, pytest.approx(1.0))
    assert list(a["breakdown_s"]) == ["detect", "release", "plan", "regroup", "state_transfer", "redo"]
    assert list(b["breakdown_s"]) == ["detect", "stop", "process_start", "import", "group_init", "engine_build",
                                      "checkpoint_load", "replay"]
    for log in ("events.jsonl", "metrics.jsonl"):  # the failure's lines there: the same keys and values
        lines = [json.loads(line) for line in (tmp_path / "b" / log).read_text().splitlines()]
        assert [{k: v for k, v in e.items() if k not in ("event", "time")} for e in lines if "event" in e] == [b]


def test_a_record_read_back_from_its_json_form_is_the_same_record(tmp_path):
    first, second = killed(1), killed(2)
    lost = lost_during_recovery(3, like=first, attempt=0, generation=1, t_detect=100.4)
    for f in (first, second, lost):
        f.recovered_in_place(in_place_figures())
    restarted = killed(0)
    restarted.restarted(CheckpointRestart(stopped_at=100.3, restart_attempt=1, checkpoint_step=3))
    records = [first, second, lost, restarted, killed(0)]
    written = finalized(tmp_path, records, restart_attempt=1)
    back = [FailureRecord.from_dict(json.loads(json.dumps(f))) for f in written]
    assert back == records
    assert [f.recovery for f in back] == ["in place"] * 3 + ["checkpoint restart", "none (stopped)"]
    assert lost.to_dict()["fault"] == "failed during recovery" and "fault_spec" not in lost.to_dict()
