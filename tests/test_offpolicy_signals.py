"""Off-policy signals per step (async_april/algorithms/metrics.py `trajectory_staleness`): per trajectory the
versions that sampled it and its oldest token's lag, the step's worst case, and the lag histograms, in
metrics.jsonl and as W&B histograms (logged offline here).

The batch is built by hand with known versions: at policy version 7,
    row a  tokens from v7 only                        spans 1, oldest lag 0
    row b  v5, v5, v6 (resumed once across an update)  spans 2, oldest lag 2
    row c  v4 | environment tokens | v6, v7            spans 3, oldest lag 3 (the env tokens count nowhere)
    row d  v6, v6                                     spans 1, oldest lag 1
Token lags 0: 3 (a: 2, c: 1), 1: 4 (b: 1, c: 1, d: 2), 2: 2 (b), 3: 1 (c).
"""

from __future__ import annotations

import numpy as np
import pytest

from async_april.algorithms.metrics import trajectory_staleness
from async_april.config import load_config
from async_april.rollout.trajectory import Group, Sample

POLICY = 7
WANT = {
    "rollout/versions_spanned_mean": (1 + 2 + 3 + 1) / 4, "rollout/versions_spanned_max": 3,
    "rollout/multi_version_frac": 0.5, "staleness/oldest_lag_mean": (0 + 2 + 3 + 1) / 4,
    "staleness/token_lag_hist": [3, 4, 2, 1], "staleness/oldest_lag_hist": [1, 1, 1, 1],
}  # fmt: skip


def hand_built_groups() -> list[Group]:
    def sample(i: int, segments) -> Sample:
        s = Sample(prompt_index=i // 2, sample_index=i % 2, prompt_ids=np.array([1, 2, 3]))
        for seg in segments:
            if seg == "env":
                s.observe(np.array([9, 9, 9]))
            else:
                s.extend(np.full(len(seg), 4), np.full(len(seg), -0.5, np.float32), np.array(seg), "length")
        s.reward = float(i)
        return s

    a, b = sample(0, [[7, 7]]), sample(1, [[5, 5], [6]])
    c, d = sample(2, [[4], "env", [6, 7]]), sample(3, [[6, 6]])
    return [Group(0, [a, b]), Group(1, [c, d])]


def test_trajectory_staleness_on_a_hand_built_batch():
    from async_april.rollout.batch import build_train_batch

    batch = build_train_batch(hand_built_groups(), np.zeros(4, np.float32), POLICY)
    assert trajectory_staleness(batch.model_versions(), POLICY) == WANT  # exact: quarters
    # With the environment tokens counted, row c's would add three tokens at lag 3: they must not.
    assert trajectory_staleness(batch.versions, POLICY)["staleness/token_lag_hist"] == [3, 4, 2, 4]
    none = trajectory_staleness([np.zeros(0, np.int64)], POLICY)
    assert none["rollout/versions_spanned_max"] == 0 and none["staleness/token_lag_hist"] == []


def test_every_step_row_has_them_next_to_the_worst_case():
    from async_april.launch.step_metrics import make_batch

    cfg = load_config(None, [])
    _, m = make_batch(hand_built_groups(), cfg, POLICY)
    assert {k: m[k] for k in WANT} == WANT
    assert m["staleness/max"] == 3 and m["staleness/mean"] == pytest.approx((0 * 3 + 1 * 4 + 2 * 2 + 3 * 1) / 10)


def test_wandb_gets_the_lag_histograms(tmp_path, monkeypatch):
    """Logged offline (W&B's own record file, read back by tests/wandb_records.py): one bin per lag,
    centred on it, holding that lag's count; the numbers beside it as before."""
    from async_april.run.tracking import Tracker
    from tests.wandb_records import read_offline_run

    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.delenv("WANDB_MODE", raising=False)
    cfg = load_config(None, [f"run.dir={tmp_path}/run", "logging.wandb=offline", "logging.console_every=100"])
    cfg.run_dir.mkdir(parents=True)
    t = Tracker(cfg, cfg.run_dir)
    t.log({"train/step": 1, "staleness/max": 3, **WANT})
    t.close()
    run = read_offline_run(next((cfg.run_dir / "wandb").glob("offline-run-*")))
    row = run.rows[0]  # W&B records a histogram as nested keys: <key>/_type, /values, /bins
    assert row["staleness/token_lag_hist/_type"] == "histogram" and row["staleness/token_lag_hist/values"] == [3, 4, 2, 1]
    assert row["staleness/token_lag_hist/bins"] == [-0.5, 0.5, 1.5, 2.5, 3.5]
    assert row["staleness/oldest_lag_hist/values"] == [1, 1, 1, 1]
    assert row["rollout/versions_spanned_max"] == 3 and row["staleness/max"] == 3
