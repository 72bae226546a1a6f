"""SimulatedLearner: stands in for `LearnerGroup` where no model is trained.

Used with the simulated engine for capacity planning and scheduling
benchmarks: a step takes `a + b * tokens` simulated seconds (scaled to real
time by `time_scale`, like the engine) and bumps the policy version; weight
export is empty, so engines only record the new version. It never touches a
model, so its only use is measuring how the rollout side behaves around a
learner of a given speed. Its policy never moves, so it reports the mismatch of
identical policies (`mismatch/ess` 1, `mismatch/k3` 0), which is what lets
`async.max_staleness: auto` raise eta around it.
"""

from __future__ import annotations

import time

from async_april.rollout.batch import TrainBatch


class SimulatedLearner:
    def __init__(self, step_s: float = 20.0, s_per_token: float = 0.0, time_scale: float = 0.01):
        self.step_s, self.s_per_token, self.time_scale = step_s, s_per_token, time_scale
        self._version = 0
        self.last_export_bytes = 0

    @property
    def version(self) -> int:
        return self._version

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        sim_s = self.step_s + self.s_per_token * batch.num_response_tokens
        time.sleep(sim_s * self.time_scale)
        self._version += 1
        # No policy moves here, so behaviour and current policy agree: an IS effective sample size of 1 and
        # a KL of 0 (what `async.max_staleness: auto` reads; without them it would never raise eta).
        return {"train/policy_version": self._version, "train/bad_step": 0, "loss/policy": 0.0, "timing_s/simulated_train": sim_s,
                "mismatch/ess": 1.0, "mismatch/k3": 0.0}

    def weight_buckets(self, bucket_mb: float) -> list:
        return []

    def raise_if_lost(self) -> None:
        """In this process: it cannot be lost without the driver (learners/group.py has the real check)."""

    def shutdown(self) -> None:
        pass

    def save_checkpoint(self, path: str) -> None:
        import json
        from pathlib import Path

        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "learner.json").write_text(json.dumps({"version": self._version}))

    def load_checkpoint(self, path: str) -> dict[str, int]:
        import json
        from pathlib import Path

        self._version = json.loads((Path(path) / "learner.json").read_text())["version"]
        return {"version": self._version}
