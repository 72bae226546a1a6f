"""Run checkpoints on disk: pickle-free store state, manifest schema and fallback, fsync before
the rename, the pickle-free codec's limits. No Ray: checkpoints are written by CheckpointManager
with a stand-in learner (the real learner's files are tested in tests/test_learner.py and, from
a real run, in tests/test_faults.py)."""

from __future__ import annotations

import json
import logging
import os
from collections import Counter, deque
from pathlib import Path

import numpy as np
import pytest

from async_april.run import state_codec
from async_april.run.checkpoints import CheckpointManager, fsync_tree
from tests.test_store import abort, finish, make_store


class FakeLearner:
    """Writes what a learner checkpoint holds, as far as the run checkpoint can tell: files and learner.json."""

    def save_checkpoint(self, path):
        Path(path).mkdir()
        (Path(path) / "weights.bin").write_bytes(os.urandom(4096))
        (Path(path) / "learner.json").write_text("{}")


def save_steps(root: Path, steps, keep: int = 5, **kw) -> CheckpointManager:
    mgr = CheckpointManager(root, keep=keep, **kw)
    for step in steps:
        mgr.save(step, step, FakeLearner(), {"cursor": step}, {"step": step}, None, "h", {"hidden_size": 8})
    return mgr


def test_store_state_round_trips_without_pickle(tmp_path, no_pickle):
    st = make_store(**{"async.max_staleness": 2, "rollout.over_provision": 3})
    work = st.lease("a", 6, 0)
    st.push("a", [abort(work[0], version=0), finish(work[2]), finish(work[3])])  # a partial, a completed group
    st.set_version(1)
    st.counters.extra["samples_released"] += 2
    state = st.state_dict()
    state_codec.save(state, tmp_path, "store")
    assert not any(tmp_path.glob("*.pkl"))
    back = state_codec.load(tmp_path, "store")
    fresh = make_store(**{"async.max_staleness": 2, "rollout.over_provision": 3})
    fresh.load_state_dict(back)
    fresh.check_accounting()
    assert (fresh.cursor, fresh.version, fresh.trained, fresh.counters) == (st.cursor, st.version, st.trained, st.counters)
    assert isinstance(fresh.fresh, deque) and list(fresh.fresh) == list(state["fresh"])
    s, t = fresh.partials[work[0].uid], state["partials"][work[0].uid]
    for k in ("prompt_ids", "response_ids", "behavior_logprobs", "versions"):
        assert getattr(s, k).dtype == getattr(t, k).dtype and np.array_equal(getattr(s, k), getattr(t, k))
    assert [g.prompt_index for g in fresh.completed] == [g.prompt_index for g in st.completed]
    assert fresh.completed[0].samples[1].reward == st.completed[0].samples[1].reward
    assert set(fresh.open_groups) == set(st.open_groups)  # int keys survive JSON


def test_a_store_state_saved_before_the_core_moved_into_folders_still_loads(tmp_path):
    """Issue 39 moved trajectory.py and store.py into async_april/rollout/: a checkpoint written before names
    the old modules (async_april.trajectory:Sample, async_april.store:_Counters) and loads as before."""
    st = make_store(**{"rollout.over_provision": 3})
    work = st.lease("a", 6, 0)
    st.push("a", [abort(work[0], version=0), finish(work[2]), finish(work[3])])
    state_codec.save(st.state_dict(), tmp_path, "store")
    (doc,) = [p for p in tmp_path.iterdir() if p.suffix == ".json"]
    text = doc.read_text()
    assert "async_april.rollout.trajectory:Sample" in text and "async_april.rollout.store:_Counters" in text
    doc.write_text(text.replace("async_april.rollout.trajectory:", "async_april.trajectory:")
                   .replace("async_april.rollout.store:", "async_april.store:"))
    fresh = make_store(**{"rollout.over_provision": 3})
    fresh.load_state_dict(state_codec.load(tmp_path, "store"))
    fresh.check_accounting()
    assert (fresh.cursor, fresh.counters, set(fresh.partials)) == (st.cursor, st.counters, set(st.partials))
    assert type(fresh.partials[work[0].uid]).__module__ == "async_april.rollout.trajectory"


def test_codec_round_trips_plain_data_and_refuses_anything_else(tmp_path):
    obj = {"t": (1, 2.5, None), 3: [np.float32(0.5), float("nan")], "$k": Counter(a=2), "d": deque([(0, 1)])}
    state_codec.save(obj, tmp_path, "x")
    back = state_codec.load(tmp_path, "x")
    assert back["t"] == (1, 2.5, None) and back["$k"] == Counter(a=2) and back["d"] == deque([(0, 1)])
    assert type(back[3][0]) is np.float32 and np.isnan(back[3][1])
    with pytest.raises(TypeError, match="/bad: a builtins.object cannot be checkpointed"):
        state_codec.encode({"bad": object()})
    with pytest.raises(TypeError, match="numpy array of Python objects"):
        state_codec.encode({"a": np.array([{}], dtype=object)})
    doc = json.loads((tmp_path / "x.json").read_text())
    doc["tree"] = {"$dc": "os:system", "fields": {}}  # a state file cannot make the loader import code
    (tmp_path / "x.json").write_text(json.dumps(doc))
    with pytest.raises(state_codec.StateFormatError, match="not in state_codec.ALLOWED_DATACLASSES"):
        state_codec.load(tmp_path, "x")


def test_truncated_or_incomplete_checkpoint_is_detected(tmp_path, caplog):
    """A truncated file, a flipped byte and a missing manifest are each rejected, and the previous one is used."""
    mgr = save_steps(tmp_path, (1, 2, 3, 4), keep=3)
    assert [p.name for p in mgr.list()] == ["step_00000002", "step_00000003", "step_00000004"]  # keep=3
    (mgr.path_for(4) / "learner/weights.bin").write_bytes(b"short")  # truncated
    flipped = bytearray((mgr.path_for(3) / "learner/weights.bin").read_bytes())
    flipped[7] ^= 0xFF
    (mgr.path_for(3) / "learner/weights.bin").write_bytes(bytes(flipped))  # same size, corrupt
    with caplog.at_level(logging.WARNING):
        ck = mgr.latest_valid()
    assert ck.step == 2 and ck.store_state() == {"cursor": 2}
    msg = caplog.text
    assert "step_00000004" in msg and "truncated" in msg and "step_00000003" in msg and "sha256" in msg and "step_00000002" in msg
    (mgr.path_for(2) / "manifest.json").unlink()
    assert mgr.latest_valid() is None
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))


@pytest.mark.parametrize("corrupt, named", [
    ("{not json", "not valid JSON"),
    (lambda m: {**m, "step": "three"}, "step: Input should be a valid integer"),
    (lambda m: {**m, "files": {**m["files"], "store.json": {"bytes": "12"}}}, "files.store.json.bytes"),
    (lambda m: {**m, "files": []}, "files: Input should be a valid dictionary"),
    (lambda m: {k: v for k, v in m.items() if k != "policy_version"}, "policy_version: Field required"),
    (lambda m: {**m, "files": {}}, "files: Dictionary should have at least 1 item"),
    (lambda m: {**m, "files": {k: v for k, v in m["files"].items() if k != "store.safetensors"}},
     "does not list store.safetensors"),
    (lambda m: {**m, "format": 1}, "format 1 held a pickle"),
    (lambda m: [m["step"]], "<root>: Input should be a valid dictionary"),
], ids=["malformed-json", "wrong-type", "wrong-nested-type", "files-not-a-map", "missing-key", "empty-file-list",
        "required-file-unlisted", "old-pickle-format", "not-an-object"])
def test_malformed_or_empty_manifest_falls_back_to_the_previous_checkpoint(tmp_path, caplog, corrupt, named):
    mgr = save_steps(tmp_path, (1, 2))
    mf = mgr.path_for(2) / "manifest.json"
    mf.write_text(corrupt if isinstance(corrupt, str) else json.dumps(corrupt(json.loads(mf.read_text()))))
    with caplog.at_level(logging.WARNING):
        ck = mgr.latest_valid()
    assert ck is not None and ck.step == 1, "did not fall back to the previous checkpoint"
    assert "step_00000002" in caplog.text and named in caplog.text and "using" in caplog.text


def test_checkpoint_is_fsynced_before_the_rename(tmp_path, monkeypatch):
    """Every file and directory of the new checkpoint reaches the disk before it gets its final
    name, and the rename itself is made durable (the parent directory is fsynced after it)."""
    events = []
    real_fsync, real_rename = os.fsync, Path.rename
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))), real_fsync(fd))[1])
    monkeypatch.setattr(Path, "rename", lambda self, target: (events.append(("rename", str(self))), real_rename(self, target))[1])
    save_steps(tmp_path, (7,))
    final = tmp_path / "checkpoints" / "step_00000007"
    at = events.index(("rename", str(tmp_path / "checkpoints" / ".tmp-step_00000007")))
    synced = {Path(p) for kind, p in events[:at] if kind == "fsync"}
    tmp = tmp_path / "checkpoints" / ".tmp-step_00000007"
    want = {tmp / p.relative_to(final) for p in final.rglob("*")} | {tmp}
    assert want <= synced, f"not fsynced before the rename: {sorted(map(str, want - synced))}"
    assert ("fsync", str(tmp_path / "checkpoints")) in events[at:], "the rename itself was not fsynced"


def test_fsync_tree_covers_files_and_directories(tmp_path, monkeypatch):
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "f").write_text("x")
    seen = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (seen.append(os.readlink(f"/proc/self/fd/{fd}")), real(fd))[1])
    fsync_tree(tmp_path)
    assert set(seen) == {str(tmp_path), str(tmp_path / "a"), str(tmp_path / "a" / "b"), str(tmp_path / "a" / "b" / "f")}
