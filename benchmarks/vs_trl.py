"""Wall time to a target reward: TRL's GRPOTrainer against this project's sync and async modes.

Same tiny model (builtin:tiny-reverse), task and reward (digit reversal,
`reverse_match`), group size (8), prompts per step (16), max tokens (48),
temperature (1), learning rate (constant 2e-4, AdamW betas 0.9/0.99, grad
clip 1), clip 0.2/0.28, token-mean loss, no KL, one update per batch. TRL
runs in this process on all cores (`use_cpu=True, bf16=False`, HF generate,
no vLLM); this project runs its embedded Ray with one thread per actor.
Needs the `bench` extra (`pip install -e '.[bench]'`).

    python benchmarks/vs_trl.py                    # seeds 1234 and 7, 200 steps each
    python benchmarks/vs_trl.py --seeds 1234 --steps 120 --target 0.55
    python benchmarks/vs_trl.py --reuse benchmarks/results/time_to_reward.json   # TRL only, ours from that run

Prints a table and writes benchmarks/results/vs_trl.json and vs_trl.png.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from common import RESULTS, final_reward, mode_config, reward_curve, run, time_to_target, trailing_curve, write_json

from async_april.run.plot import plot_curves
from async_april.run.tracking import progress


def run_trl(seed: int, steps: int, tmp: Path) -> tuple[list[tuple[float, float]], list[float]]:
    """TRL GRPOTrainer on the same task; returns the (wall s, trailing reward) curve and per-step rewards."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from async_april.models.paths import resolve_model_path
    from async_april.rewards.reverse import reverse_match
    from async_april.tasks.reverse import make_reverse_rows

    torch.set_num_threads(os.cpu_count() or 1)
    path = str(resolve_model_path("builtin:tiny-reverse"))
    tok = AutoTokenizer.from_pretrained(path)
    # TRL adds no BOS to text prompts; ours start with BOS, so put it in the text.
    rows = [{"prompt": tok.bos_token + r["prompt"], "answer": r["answer"]} for r in make_reverse_rows(4096, seed)]

    def reward(completions, answer, **_):
        return [reverse_match(prompt="", response=c, answer=a) for c, a in zip(completions, answer)]

    rewards: list[float] = []
    times: list[float] = []

    class Record(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                rewards.append(float(logs["reward"]))
                times.append(time.perf_counter() - self.t0)

    args = GRPOConfig(
        output_dir=str(tmp / f"trl-{seed}"), use_cpu=True, bf16=False, gradient_checkpointing=False, use_vllm=False,
        per_device_train_batch_size=128, gradient_accumulation_steps=1, num_generations=8,
        max_completion_length=48, temperature=1.0, learning_rate=2e-4, lr_scheduler_type="constant",
        adam_beta2=0.99, weight_decay=0.0, max_grad_norm=1.0, beta=0.0, epsilon=0.2, epsilon_high=0.28,
        loss_type="dapo", num_iterations=1, max_steps=steps, logging_steps=1, report_to=[], seed=seed,
        save_strategy="no", dataloader_num_workers=0, disable_tqdm=True,
    )
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), reward_funcs=reward, args=args,
        train_dataset=Dataset.from_list(rows), processing_class=tok, callbacks=[Record()],
    )
    trainer.train()
    return trailing_curve(times, rewards), rewards


def _reusable_runs(path: Path, seeds: list[int], steps: int) -> dict:
    """This project's runs from time_to_reward.py, keyed by (mode, seed); refuses a mismatch."""
    import json

    data = json.loads(path.read_text())
    found = {(r["mode"], r["seed"]): {"seed": r["seed"], "curve": [tuple(p) for p in r["curve"]], "final_reward": r["final_reward"]}
             for r in data["runs"] if r["label"] in ("sync", "async") and r.get("steps") == steps}
    missing = [(m, s) for s in seeds for m in ("sync", "async") if (m, s) not in found]
    if missing:
        raise SystemExit(f"{path} has no {missing} runs of {steps} steps; run without --reuse")
    return found


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1234, 7])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--target", type=float, default=0.55)
    ap.add_argument("--reuse", type=Path, default=None,
                    help="take this project's sync/async runs from a time_to_reward.json of the same session "
                         "(same seeds and steps) instead of running them again")
    a = ap.parse_args(argv)
    reused = _reusable_runs(a.reuse, a.seeds, a.steps) if a.reuse else None
    runs = []
    with tempfile.TemporaryDirectory(prefix="aa-trl-") as tmp:
        for seed in a.seeds:
            progress(f"TRL GRPOTrainer seed {seed}")
            curve, rewards = run_trl(seed, a.steps, Path(tmp))
            runs.append({"label": "TRL GRPOTrainer", "seed": seed, "curve": curve, "final_reward": final_reward(rewards)})
            for mode in ("sync", "async"):
                if reused is not None:
                    runs.append({**reused[(mode, seed)], "label": f"async-april {mode}"})
                    continue
                progress(f"async-april {mode} seed {seed}")
                rows = run(mode_config(mode, Path(tmp), [f"run.seed={seed}", f"run.steps={a.steps}"]))
                runs.append({"label": f"async-april {mode}", "seed": seed, "curve": reward_curve(rows),
                             "final_reward": final_reward([r["rollout/reward_mean"] for r in rows])})
    for r in runs:
        r["time_to_target_s"] = time_to_target(r["curve"], a.target)
        r["wall_s"] = r["curve"][-1][0]
    summary = []
    for label in dict.fromkeys(r["label"] for r in runs):
        rs = [r for r in runs if r["label"] == label]
        ttt = [r["time_to_target_s"] for r in rs]
        summary.append({"label": label, "reached": f"{sum(t is not None for t in ttt)}/{len(rs)}",
                        "time_to_target_s_median": statistics.median(ttt) if None not in ttt else None,
                        "final_reward_median": statistics.median(r["final_reward"] for r in rs),
                        "wall_s_median": statistics.median(r["wall_s"] for r in rs)})
    trl = summary[0]
    print(f"{'run':<22}{'time to ' + str(a.target):>14}{'reached':>9}{'x TRL':>8}{'final reward':>14}{'wall s':>9}")
    for s in summary:
        if trl["time_to_target_s_median"] and s["time_to_target_s_median"]:
            s["time_vs_trl"] = s["time_to_target_s_median"] / trl["time_to_target_s_median"]
        t = f"{s['time_to_target_s_median']:.0f}s" if s["time_to_target_s_median"] else "-"
        ratio = f"{s['time_vs_trl']:.2f}" if "time_vs_trl" in s else "-"
        print(f"{s['label']:<22}{t:>14}{s['reached']:>9}{ratio:>8}{s['final_reward_median']:>14.3f}{s['wall_s_median']:>9.0f}")
    png = plot_curves({f"{r['label']} s{r['seed']}": r["curve"] for r in runs}, RESULTS / "vs_trl.png",
                      xlabel="wall time (s)", ylabel="reward (trailing 10-step mean)", hline=a.target)
    print(f"wrote {write_json('vs_trl.json', {'target': a.target, 'summary': summary, 'runs': runs})} and {png}")


if __name__ == "__main__":
    main()
