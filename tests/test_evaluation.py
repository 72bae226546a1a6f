"""Evaluation during training (async_april/evaluation.py, actors/evaluation.py), `async-april eval`
and `export`, and learner.lr_schedule.

Pure maths and schedules run without Ray; the version test runs a real EvalActor (torch engine, the
tiny model) in this process; one short real training run (embedded Ray, 4 steps, eval every 2) and its
resumption back the accounting, export, CLI and schedule tests."""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from async_april.config import ConfigError, config_from_dict, load_config
from async_april.evaluation import EvalSchedule, SetResult, pass_at_k, summarize

REPO = Path(__file__).resolve().parent.parent
SMALL = ["rollout.batch_groups=4", "rollout.n_samples=4", "rollout.max_new_tokens=16", "rollout.concurrency=16",
         "logging.wandb=disabled", "logging.console_every=100", "run.pin_cpus=false",
         "async.max_staleness=0", "rollout.over_provision=1", "rollout.on_weight_update=drain"]  # the sync preset
EVAL = {"datasets": [{"name": "heldout", "source": "builtin:reverse", "num_prompts": 16}], "every": 2, "samples": 2,
        "before_first_step": True, "at_end": True, "concurrency": 16, "nice": 0}


# ------------------------------------------------------------------------------------ pure


@pytest.mark.parametrize("n, c, k, expected", [
    (5, 0, 1, 0.0),
    (5, 2, 1, 2 / 5),
    (5, 2, 2, 1 - 3 / 10),        # 1 - C(3,2)/C(5,2)
    (4, 1, 2, 1 - 3 / 6),         # 1 - C(3,2)/C(4,2)
    (10, 3, 5, 1 - 21 / 252),     # 1 - C(7,5)/C(10,5)
    (3, 1, 3, 1.0),               # n - c < k: some draw of k always holds the correct one
    (5, 5, 3, 1.0),
])
def test_pass_at_k_is_the_unbiased_estimator(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)
    assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-12)


def test_summary_of_a_hand_table():
    # 3 prompts x 4 samples; correct = reward >= 1: counts 2, 0, 4.
    r = SetResult("t", 7, rewards=np.array([[1, 0, 1, 0.5], [0, 0, 0, 0], [1, 1, 1, 1]], float),
                  lengths=np.array([[3, 4, 5, 6], [10, 10, 10, 10], [1, 1, 1, 1]]),
                  truncated=np.array([[0, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]], bool), greedy_rewards=np.array([1, 0, 0.5]))
    m = summarize(r, k=2, threshold=1.0)
    assert m["eval/t/mean_reward"] == pytest.approx(6.5 / 12)
    assert m["eval/t/pass@1"] == pytest.approx((2 / 4 + 0 + 1) / 3)
    # pass@2 = mean(1 - C(2,2)/C(4,2), 0, 1) = (5/6 + 1) / 3 -- not 1 - (1 - pass@1)^2 per prompt (0.75 for the first)
    assert m["eval/t/pass@k"] == pytest.approx((5 / 6 + 1) / 3)
    assert m["eval/t/mean_length"] == pytest.approx(62 / 12)
    assert m["eval/t/truncation_rate"] == pytest.approx(4 / 12)
    assert m["eval/t/greedy_reward"] == pytest.approx(0.5) and m["eval/t/greedy_pass"] == pytest.approx(1 / 3)
    assert m["eval/t/version"] == 7 and m["eval/t/prompts"] == 3


def test_schedule_and_its_counters_survive_a_checkpoint():
    s = EvalSchedule(every=20, steps=50, at_end=True)
    assert [t for t in range(1, 51) if s.due(t)] == [20, 40, 50]
    assert s.any_due(0) and s.any_due(49) and not s.any_due(50)
    short = EvalSchedule(every=20, steps=19, at_end=False)  # the tests' short runs of the tiny config: no actor
    assert not short.any_due(0) and EvalSchedule(every=20, steps=40, at_end=False).any_due(20)
    s.requested, s.completed, s.skipped, s.last_version = 3, 1, 1, 40  # one still in flight when saved
    r = EvalSchedule(every=20, steps=60, at_end=True)
    r.restore(json.loads(json.dumps(s.state())))
    assert (r.requested, r.completed, r.skipped, r.last_version) == (3, 1, 2, 40)  # the lost one counts as skipped


def test_eval_config_errors_name_the_key():
    with pytest.raises(ConfigError, match=r"eval.pass_k \(5\) must be at most eval.samples \(4\)"):
        config_from_dict({"eval": {"samples": 4, "pass_k": 5}})
    with pytest.raises(ConfigError, match=r"eval.datasets: names must be unique"):
        config_from_dict({"eval": {"datasets": [{"name": "a"}, {"name": "a"}]}})
    with pytest.raises(ConfigError, match=r"eval.datasets.0.name"):
        config_from_dict({"eval": {"datasets": [{"source": "builtin:reverse"}]}})


@pytest.mark.parametrize("schedule, expected", [
    ("constant", [0.0, 0.5, 1, 1, 1, 1, 1, 1, 1, 1]),
    ("linear", [0.1, 0.55, 1, 0.8875, 0.775, 0.6625, 0.55, 0.4375, 0.325, 0.2125]),
    ("cosine", [0.1, 0.55] + [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * i / 8)) for i in range(8)]),
])
def test_lr_schedules_warm_up_and_decay_to_the_minimum(schedule, expected):
    from async_april.run import state_codec
    from learners.optim import make_lr_scheduler

    lc = config_from_dict({"learner": {"lr": 1.0, "lr_schedule": schedule, "warmup_steps": 2, "min_lr_ratio": 0.1}}).learner

    def fresh():
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        return opt, make_lr_scheduler(opt, lc, total_steps=10)

    opt, sched = fresh()
    lrs = []
    for _ in range(10):
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    assert lrs == pytest.approx(expected, abs=1e-9)
    assert sched.get_last_lr()[0] == pytest.approx(0.1 if schedule != "constant" else 1.0)  # stays at the minimum
    # Checkpointed as the learner does (state_codec, no pickle) and resumed mid-schedule: the same lrs follow.
    opt, sched = fresh()
    for _ in range(4):
        opt.step()
        sched.step()
    opt2, sched2 = fresh()
    sched2.load_state_dict(state_codec.decode(*_roundtrip(sched.state_dict())))
    assert sched2.get_last_lr()[0] == pytest.approx(expected[4])
    opt2.step()
    sched2.step()
    assert sched2.get_last_lr()[0] == pytest.approx(expected[5])


def _roundtrip(obj):
    from async_april.run import state_codec

    tree, arrays = state_codec.encode(obj)
    return json.loads(json.dumps(tree)), lambda tag: arrays[next(iter(tag.values()))]


# ------------------------------------------------------------------------------------ one version


@pytest.fixture(scope="module")
def tiny_model():
    from async_april.models.paths import resolve_model_path

    return resolve_model_path("builtin:tiny-reverse", "~/.cache/async_april")


def test_one_evaluation_uses_one_version_for_all_its_samples(tiny_model, tmp_path):
    """Two evaluations of different versions asked for at once on one actor: each sees only its own
    weights (version on every token), and each gives exactly what it gives alone."""
    from actors.evaluation import EvalActor
    from async_april.evaluation import load_eval_sets
    from async_april.launch.resolve import load_tokenizer
    from learners.weight_sync import DiskBucketWriter
    from transformers import AutoModelForCausalLM

    cfg = config_from_dict({"eval": {**EVAL, "concurrency": 8}, "rollout": {"max_new_tokens": 16}})
    sets = load_eval_sets(cfg, load_tokenizer(Path(tiny_model), "tiny"), None)
    base = AutoModelForCausalLM.from_pretrained(tiny_model).state_dict()
    payloads = {}
    for v, scale in ((1, 1.0), (2, 0.0)):  # version 2: every weight zeroed, a very different policy
        w = DiskBucketWriter(tmp_path / "w", v)
        w.add({k: t * scale for k, t in base.items() if k != "lm_head.weight"})
        payloads[v] = w.commit()

    async def run():
        actor = EvalActor(cfg, tiny_model, sets, nice=0)
        await actor.start()
        both = await asyncio.gather(actor.evaluate(payloads[1], 1), actor.evaluate(payloads[2], 2))
        alone = await actor.evaluate(payloads[1], 1)
        await actor.stop()
        await actor.engine.shutdown()
        return both, alone

    (v1, v2), alone = asyncio.run(run())
    assert v1[0].version == 1 and v2[0].version == 2
    assert np.array_equal(v1[0].rewards, alone[0].rewards) and np.array_equal(v1[0].lengths, alone[0].lengths)
    assert not np.array_equal(v1[0].lengths, v2[0].lengths)


class ExportedWeights:
    """What the Evaluator asks of a learner, from the tiny model's own weights: a policy version and the full
    weights as object-store buckets, exported as LearnerGroup.weight_buckets does (async_april/weights/buckets.py)."""

    def __init__(self, model_path, version: int):
        from transformers import AutoModelForCausalLM

        state = AutoModelForCausalLM.from_pretrained(model_path).state_dict()
        self.state = {k: t for k, t in state.items() if k != "lm_head.weight"}  # tied to the embedding
        self.version = version

    def weight_buckets(self, bucket_mb: float) -> list:
        import ray

        from async_april.weights.buckets import bucketize

        return [ray.put(b) for b in bucketize(self.state, bucket_mb)]


def test_a_failed_evaluation_is_counted_and_the_next_runs_on_a_new_eval_actor(ray_cluster, tiny_model):
    """Regression (issue 26.5): Evaluator.collect did a bare ray.get, so an eval actor that died mid-evaluation
    (the OOM killer), a raising reward or the version check raised into the run loop and ended training.
    The failure is logged as eval/<name>/failed and counted (and survives a checkpoint), the dead actor is
    dropped, and the next evaluation runs on a new one. ~9 s (16 s under heavy load): the new actor's
    process start is what is tested."""
    import ray

    from async_april.evaluation import load_eval_sets
    from async_april.launch.evaluator import Evaluator
    from async_april.launch.resolve import load_tokenizer

    one_set = [{"name": "heldout", "source": "builtin:reverse", "num_prompts": 4}]
    cfg = config_from_dict({"eval": {**EVAL, "datasets": one_set, "every": 1, "samples": 1, "greedy": False},
                            "rollout": {"max_new_tokens": 8}, "run": {"steps": 3}})
    sets = load_eval_sets(cfg, load_tokenizer(Path(tiny_model), "tiny"), None)
    ev = Evaluator.create(cfg, str(tiny_model), sets, step=0, controller_state=None)
    learner = ExportedWeights(tiny_model, version=1)
    try:
        ev.submit(learner)
        ray.kill(ev.actor)  # its process dies with the evaluation asked of it
        out = ev.collect(wait=True)
        assert out["eval/heldout/failed"] == 1.0 and "eval/heldout/mean_reward" not in out
        assert ev.actor is None and ev.schedule.state()["eval/failed"] == 1
        learner.version = 2
        ev.submit(learner)
        out = ev.collect(wait=True)
        assert "eval/heldout/failed" not in out and (out["eval/heldout/version"], out["eval/heldout/prompts"]) == (2.0, 4.0)
        assert (ev.schedule.requested, ev.schedule.completed, ev.schedule.failed, ev.schedule.skipped) == (2, 1, 1, 0)
        resumed = EvalSchedule(every=1, steps=3, at_end=False)
        resumed.restore(json.loads(json.dumps(ev.schedule.state())))
        assert (resumed.failed, resumed.skipped) == (1, 0)  # a failure is not counted again as skipped
    finally:
        ev.stop()


# ------------------------------------------------------------------------------------ real runs


def make_cfg(run_dir: Path, *overrides: str):
    cfg = load_config(REPO / "configs/tiny_cpu.yaml", [f"run.dir={run_dir}", *SMALL, *overrides])
    return cfg.model_copy(update={"eval": type(cfg.eval).model_validate(EVAL)})


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def trained(ray_cluster, tmp_path_factory):
    """2 steps, eval every 2 plus before the first and after the last step; then resumed to step 4."""
    from async_april.launch.controller import train

    run_dir = tmp_path_factory.mktemp("eval") / "run"
    seen: dict = {"prompts": [], "weights": None}

    def on_step(step, batch, learner):
        seen["prompts"] += [tuple(ids[:pl].tolist()) for ids, pl in zip(batch.input_ids, batch.prompt_lens)]
        if step == 4:
            seen["weights"] = learner.full_state_dict()

    train(make_cfg(run_dir, "run.steps=2"), on_step=on_step)
    first = rows(run_dir)
    train(make_cfg(run_dir, "run.steps=4", "run.resume=auto"), on_step=on_step)
    return run_dir, first, rows(run_dir)[2:], seen


def test_eval_samples_never_reach_the_learner(trained, tiny_model):
    from async_april.evaluation import load_eval_sets
    from async_april.launch.resolve import load_tokenizer

    run_dir, first, _, seen = trained
    cfg = make_cfg(run_dir)
    held_out = {tuple(r.prompt_ids.tolist()) for s in load_eval_sets(cfg, load_tokenizer(Path(tiny_model), "tiny"), None)
                for r in s.rows}
    assert len(held_out) == 16
    assert len(seen["prompts"]) == 4 * 4 * 4  # 4 steps x 4 groups x 4 samples: training samples only
    assert not held_out & set(seen["prompts"])
    assert first[-1]["eval/completed"] >= 1 and first[-1]["eval/heldout/prompts"] == 16
    # The store saw only training work: 16 trained groups, each a training prompt; the evaluations'
    # 16 x (3 + 1) responses per version never entered it (the run checks its accounting every step).
    from async_april.run import state_codec

    store = state_codec.load(run_dir / "checkpoints/step_00000004", "store")
    assert len(store["trained"]) == 16


def test_evaluations_are_at_one_version_each_and_the_resume_continues_the_schedule(trained):
    _, first, resumed, _ = trained
    evaluated = [r["eval/heldout/version"] for r in first if "eval/heldout/version" in r]
    assert set(evaluated) <= {0, 2} and evaluated[-1] == 2  # before the first step, then step 2 (due and the last)
    assert first[-1]["eval/requested"] == first[-1]["eval/completed"] + first[-1]["eval/skipped"] == 2
    # Resumed at step 2: no second "before the first step", the next due evaluation is step 4's.
    assert [r["train/step"] for r in resumed] == [3, 4]
    assert [r["eval/heldout/version"] for r in resumed if "eval/heldout/version" in r] == [4]
    assert resumed[-1]["eval/requested"] == first[-1]["eval/requested"] + 1
    assert resumed[-1]["eval/completed"] == first[-1]["eval/completed"] + 1
    for r in first + resumed:
        if "eval/heldout/mean_reward" in r:
            assert 0 <= r["eval/heldout/mean_reward"] <= 1 and 0 <= r["eval/heldout/pass@1"] <= r["eval/heldout/pass@k"] <= 1


def test_export_then_load_gives_the_learners_weights(trained, tmp_path):
    from transformers import AutoModelForCausalLM

    from async_april.launch.export import export_checkpoint

    run_dir, _, _, seen = trained
    out = export_checkpoint(run_dir / "checkpoints/step_00000004", tmp_path / "hf")
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    learner = seen["weights"]
    assert set(learner) <= set(loaded)
    for k, t in learner.items():
        assert torch.equal(loaded[k], t), k
    assert (out / "tokenizer.json").is_file()


def test_eval_command_reproduces_the_final_evaluation(trained):
    """`async-april eval` on the last checkpoint: the numbers the run logged for that version (same seeds)."""
    from async_april.launch.eval_command import evaluate_checkpoint

    run_dir, _, resumed, _ = trained
    got = evaluate_checkpoint(make_cfg(run_dir), run_dir)
    logged = resumed[-1]
    for key in ("mean_reward", "pass@1", "pass@k", "mean_length", "truncation_rate", "greedy_reward", "version"):
        assert got[f"eval/heldout/{key}"] == pytest.approx(logged[f"eval/heldout/{key}"], abs=1e-9), key


def test_plot_places_eval_reward_at_the_version_it_evaluated(trained, tmp_path):
    from async_april.run.plot import eval_curves, plot_run

    run_dir, first, resumed, _ = trained
    curves = eval_curves(first + resumed)
    assert [v for v, _ in curves["eval heldout mean"]] == sorted(
        r["eval/heldout/version"] for r in first + resumed if "eval/heldout/version" in r)
    assert "eval heldout greedy" in curves
    assert plot_run(run_dir, tmp_path / "m.png").stat().st_size > 0


@pytest.mark.parametrize("args, message", [
    (["eval", "configs/presets/sync.yaml", "."], "eval.datasets is empty: nothing to evaluate"),
    (["export", "/nonexistent/ckpt", "/tmp/out"], "CHECKPOINT '/nonexistent/ckpt' does not exist"),
    (["export", "configs", "/tmp/out"], "CHECKPOINT 'configs' is neither a run checkpoint"),
])
def test_eval_and_export_bad_input_is_one_line_exit_2(args, message):
    proc = subprocess.run([sys.executable, "-m", "async_april.launch.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith(f"error: {message}"), proc.stderr


def test_export_refuses_a_non_empty_out_dir_and_touches_nothing(trained, tmp_path):
    from async_april.launch import cli

    run_dir = trained[0]
    (tmp_path / "keep.txt").write_text("mine")
    assert cli.main(["export", str(run_dir), str(tmp_path)]) == 2
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]


def test_eval_and_export_have_help(capsys):
    from async_april.launch import cli

    for cmd, want in (("eval", "CHECKPOINT"), ("export", "OUT_DIR")):
        with pytest.raises(SystemExit) as e:
            cli.main([cmd, "--help"])
        out = capsys.readouterr().out
        assert e.value.code == 0 and f"async-april {cmd}" in out and want in out, out
