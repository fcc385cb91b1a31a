"""The decision log is durable (fsync before `append` returns) and fails loudly when unwritable."""

import json
import os

import pytest
from dist_quant.coordinator.decision_log import DecisionLog, DecisionLogError


def test_append_fsyncs_the_record_before_returning(tmp_path, monkeypatch):
    log = DecisionLog(tmp_path / "d.jsonl")
    seen_at_fsync = []
    real_fsync = os.fsync

    def spy(fd):
        # What a crash right after this fsync would leave on disk.
        seen_at_fsync.append((tmp_path / "d.jsonl").read_text())
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", spy)
    log.append({"event": "decision", "switch_id": 1, "commit": True})
    # First fsync is the file (holding the record), the second the new file's directory entry.
    assert len(seen_at_fsync) == 2
    assert json.loads(seen_at_fsync[0])["switch_id"] == 1


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_a_full_disk_raises_decision_log_error():
    with pytest.raises(DecisionLogError, match="not writable"):
        DecisionLog("/dev/full").append({"event": "open", "switch_id": 1})


def test_a_log_under_a_regular_file_raises_decision_log_error(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(DecisionLogError, match="not writable"):
        DecisionLog(tmp_path / "file" / "d.jsonl").append({"event": "open", "switch_id": 1})


def test_records_skip_a_torn_last_line(tmp_path):
    path = tmp_path / "d.jsonl"
    log = DecisionLog(path)
    log.append({"event": "open", "switch_id": 4})
    with open(path, "a") as f:
        f.write('{"event": "decision", "swi')  # crash mid-write
    assert [r["switch_id"] for r in log.records()] == [4]
    assert log.last_switch_id() == 4


def test_recovery_closes_an_open_switch_as_aborted_and_keeps_decided_ones(tmp_path):
    log = DecisionLog(tmp_path / "d.jsonl")
    log.append({"event": "open", "switch_id": 1})
    log.append({"event": "decision", "switch_id": 1, "commit": True, "step": 5})
    log.append({"event": "open", "switch_id": 2})
    assert log.recover_open_switch() == 2
    last = log.records()[-1]
    assert (last["event"], last["switch_id"], last["commit"]) == ("decision", 2, False)
    assert log.recover_open_switch() is None  # nothing left open
    assert log.last_switch_id() == 2
