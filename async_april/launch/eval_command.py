"""`async-april eval CONFIG CHECKPOINT [k=v ...] [--out FILE]`: evaluate a saved policy, without training.

    CONFIG       the run's YAML config (its `eval` section says what to evaluate, `reward` how to
                 score, `data` which prompts are training prompts and so left out of the held-out sets)
    CHECKPOINT   a Hugging Face model directory (has config.json), or a run checkpoint / run directory
                 (exported to a temporary Hugging Face directory first, as `async-april export` does)

Runs the same `EvalActor` as evaluation during training, in this process (no Ray, full CPU priority),
on the engine `rollout.engine` names, and prints one `eval/<name>/<metric> value` line per number;
`--out FILE` also writes them as JSON. Bad input is one `error:` line and exit status 2.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from pathlib import Path

from async_april.errors import UserError


def evaluate_checkpoint(cfg, checkpoint: str | Path) -> dict[str, float]:
    """Metrics of CHECKPOINT on `cfg.eval.datasets` (see the module docstring)."""
    from async_april.data import load_prompts
    from async_april.evaluation import load_eval_sets, summarize
    from async_april.launch.export import export_checkpoint, open_checkpoint, run_config_of
    from async_april.rewards import get_reward_fn
    from async_april.launch.resolve import load_tokenizer

    if not cfg.eval.datasets:
        raise UserError("eval.datasets is empty: nothing to evaluate; add a held-out set to the config's `eval` section "
                        "(docs/evaluation.md) or override eval.datasets")
    for name in cfg.reward.functions:
        get_reward_fn(name)
    src = Path(checkpoint).expanduser().absolute()
    with tempfile.TemporaryDirectory(prefix="async-april-eval-") as tmp:
        if (src / "config.json").is_file():
            model_path, version = src, 0
        else:
            ck = open_checkpoint(src)
            version = ck.version
            # A LoRA run's checkpoint holds adapters: the engine needs them merged into the base.
            model_path = export_checkpoint(src, Path(tmp) / "hf", "float32", merge=run_config_of(ck).learner.lora.enabled)
        tokenizer = load_tokenizer(model_path, str(checkpoint))
        sets = load_eval_sets(cfg, tokenizer, load_prompts(cfg, tokenizer))
        results = asyncio.run(_run(cfg, str(model_path), sets, version))
    out: dict[str, float] = {}
    for r in results:
        out.update(summarize(r, cfg.eval.k, cfg.eval.correct_threshold))
    return out


async def _run(cfg, model_path: str, sets, version: int):
    from actors.evaluation import EvalActor

    actor = EvalActor(cfg, model_path, sets, nice=0, version=version)
    await actor.start()
    try:
        return await actor.evaluate(None, version)
    finally:
        await actor.stop()
        await actor.engine.shutdown()


def main(argv: list[str] | None = None) -> int:
    from async_april.config import OVERRIDES_HELP
    from async_april.config import load_config

    ap = argparse.ArgumentParser(prog="async-april eval", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", metavar="CONFIG", help="YAML config with an `eval` section, e.g. configs/tiny_cpu.yaml")
    ap.add_argument("checkpoint", metavar="CHECKPOINT", help="Hugging Face model directory, run checkpoint or run directory")
    ap.add_argument("overrides", metavar="KEY=VALUE", nargs="*", help=OVERRIDES_HELP)
    ap.add_argument("--out", type=Path, default=None, help="also write the metrics to this JSON file")
    a = ap.parse_args(argv)
    metrics = evaluate_checkpoint(load_config(a.config, a.overrides), a.checkpoint)
    for k, v in metrics.items():
        print(f"{k} {v:.4f}")
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(metrics, indent=1))
    return 0
