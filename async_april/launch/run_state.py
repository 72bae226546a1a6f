"""The controller's own state between steps, saved in every checkpoint: the step, the bad-step and
restart counters, the auto-tuner's memory, where the last checkpoint is; and the tuner's decision
applied to the store."""

from __future__ import annotations

import time
from pathlib import Path

from async_april.config import Config
from async_april.rollout.auto_staleness import OffPolicyTuner, StepSignals, TunerState, wait_share
from async_april.run.console import say
from async_april.run.tracking import Tracker


class RunState:
    """The controller's own state: step, cumulative counters, where the last checkpoint is."""

    def __init__(self, cfg: Config, model_shape: dict, step: int = 0, bad_steps: int = 0,
                 checkpoint: Path | None = None, tuner: TunerState = TunerState()):
        self.cfg, self.model_shape, self.step, self.bad_steps = cfg, model_shape, step, bad_steps
        self.tuner = tuner
        """`auto` settings: what the tuner remembers (async_april/rollout/auto_staleness.py; the settings are the store's)."""
        self.last_checkpoint = checkpoint
        self.saved_step = step if checkpoint is not None else -1
        self.restarts = 0
        """Times this run rebuilt itself from a checkpoint (run.max_restarts)."""
        self.evaluator = None
        """The run's Evaluator, if it evaluates: its schedule counters are saved with the controller state."""

    @classmethod
    def restore(cls, ck, store, learner, cfg: Config, model_shape: dict) -> "RunState":
        """Learner (model, optimizer, scheduler, RNG, version) and store from checkpoint `ck`."""
        import ray

        from async_april.run.checkpoints import config_hash

        if ck.manifest.config_hash != config_hash(cfg):
            say(f"warning: the config differs from the one {ck.path} was saved with (settings other than run.*/logging.*)")
        learner.load_checkpoint(str(ck.learner_dir))
        ray.get(store.call.remote("load_state_dict", ck.store_state()))
        c = ck.controller_state()
        return cls(cfg, model_shape, int(c["step"]), int(c["train/bad_steps"]), checkpoint=ck.path, tuner=TunerState.from_dict(c.get("async/tuner", {"window": c.get("async/raise_window", [])})))

    def metrics(self, pool, version: int) -> dict[str, float]:
        return {"train/step": self.step, "train/policy_version": version, "train/bad_steps": self.bad_steps,
                **pool.metrics(), "run/restarts": self.restarts}

    def tune(self, tuner: OffPolicyTuner, metrics: dict[str, float], store) -> dict[str, float]:
        """One decision of the auto-tuner (async_april/rollout/auto_staleness.py) from this step's metrics; a
        changed setting goes to the store's admission at once. Returns `async/<knob>` (now in force)
        and `async/<knob>_change` for each tuned knob."""
        import ray

        now = {k.name: metrics[f"async/{k.name}"] for k in tuner.knobs}
        signals = StepSignals.from_metrics(metrics)
        judged = tuner.judged(self.tuner.window, signals)  # for the console line: the wait the decision saw
        new, self.tuner, decision = tuner.decide(now, self.tuner, signals)
        if (warning := tuner.warning(self.tuner)) is not None:
            say(warning)
        out = {}
        for name, value in new.items():
            if value != now[name]:
                setter = "set_max_staleness" if name == "eta" else "set_over_provision"
                ray.get(store.call.remote(setter, int(value) if name == "eta" else value))
                say(f"auto: {decision} {name} {now[name]:g} -> {value:g} (mismatch/ess {metrics.get('mismatch/ess', float('nan')):.3f}, "
                    f"mismatch/k3 {metrics.get('mismatch/k3', float('nan')):.2e}, waited {wait_share(judged):.0%} of the last {len(judged)} step(s))")
            out[f"async/{name}"], out[f"async/{name}_change"] = value, value - now[name]
        return out

    def save(self, store, learner, pool, tracker: Tracker) -> Path:
        import ray

        from async_april.run.checkpoints import CheckpointManager, config_hash

        t0 = time.perf_counter()
        ck = self.cfg.checkpoint
        controller = {"step": self.step, "policy_version": learner.version, "train/bad_steps": self.bad_steps,
                      "rollout/actor_restarts": pool.restarts,
                      "time/elapsed_s": round(tracker.elapsed_s, 3), "async/tuner": self.tuner.to_dict(),
                      "metrics_row": tracker.last_row,  # put back on resume if the crash tore it from metrics.jsonl
                      **(self.evaluator.schedule.state() if self.evaluator is not None else {})}
        path = CheckpointManager(self.cfg.run_dir, ck.keep, ck.verify).save(
            self.step, learner.version, learner, ray.get(store.call.remote("state_dict")), controller,
            tracker.wandb_run_id, config_hash(self.cfg), self.model_shape)
        say(f"checkpoint {path.name} ({time.perf_counter() - t0:.2f}s)")
        self.last_checkpoint, self.saved_step = path, self.step
        return path
