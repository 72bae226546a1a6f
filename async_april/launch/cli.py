"""`async-april` command line.

    async-april train CONFIG [section.key=value ...]   run training (embedded Ray or the surrounding cluster)
    async-april check CONFIG [section.key=value ...]   resolve a config against the world (memory plan included), print it; starts no Ray or
                                                       actor, but imports the reward/env modules the config names
    async-april build-model [--cache-dir D] [--seed S] build the tiny built-in model
    async-april eval CONFIG CHECKPOINT [k=v ...]       evaluate a checkpoint or HF directory on eval.datasets
    async-april export CHECKPOINT OUT_DIR [--merge]    write a Hugging Face directory from a run checkpoint (LoRA: adapters, or merged)
    async-april plot RUN_DIR [--out FILE]              plot a run's metrics.jsonl (training and eval reward) to PNG
    async-april plan CONFIG [--lengths HIST.json] [--gpus N] ...   capacity planner: simulated throughput, utilisation and
                                                       staleness of sync / APRIL / async settings and GPU splits, and the best
    async-april --version

One error path: bad input of any kind (config, YAML, data, model, reward,
checkpoint, run directory, plot input) is a UserError (async_april/errors.py),
printed as one line `error: ...` with exit status 2 and no traceback. `check` lists
every problem it finds, one such line each (async_april/launch/resolve.py `Checks`);
`train` stops at the first. A run
stopped by SIGINT/SIGTERM exits 130/143 after saying where its checkpoint is.
"""

from __future__ import annotations

import argparse
import logging
import sys

from async_april.config import OVERRIDES_HELP
from async_april.errors import UserError, one_line


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as package_version

    try:
        return package_version("async-april")
    except PackageNotFoundError:
        return "unknown (not installed; pip install -e .)"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="async-april", description="Asynchronous RL post-training for LLMs.",
                                 epilog="`async-april COMMAND --help` describes each command.")
    ap.add_argument("--version", action="version", version=f"async-april {version()}")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, text in (("train", "run training: resolves the config (as `check` does), then starts Ray and the actors"),
                       ("check", "resolve a config against the world -- run dir, model, tokenizer, data (first rows), "
                                 "rewards, resume target, the learner's memory plan per rank -- and print it, or list every problem "
                                 "found, one line each (refusing a learner that cannot fit its GPU); starts no Ray and no actor, but imports the "
                                 "reward and environment modules the config names, so their import-time code runs")):
        p = sub.add_parser(name, help=text, description=text)
        p.add_argument("config", metavar="CONFIG", help="YAML config file, e.g. configs/tiny_cpu.yaml")
        p.add_argument("overrides", metavar="KEY=VALUE", nargs="*", help=OVERRIDES_HELP)
    # These parse their own options (their --help too).
    sub.add_parser("build-model", help="build (or find) the tiny built-in model", add_help=False)
    sub.add_parser("eval", help="evaluate a run checkpoint or a Hugging Face directory on the config's eval.datasets, "
                                "without training", add_help=False)
    sub.add_parser("export", help="write a Hugging Face model directory from a run checkpoint", add_help=False)
    sub.add_parser("plot", help="plot a run's metrics.jsonl (reward and eval reward, length, throughput, staleness) to PNG",
                   add_help=False)
    sub.add_parser("plan", help="capacity planner: simulate sync, APRIL and async at several eta, over-provisioning and "
                                "rollout:learner GPU splits, print throughput, utilisation and staleness, recommend the best",
                   add_help=False)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = build_parser()
    args, rest = ap.parse_known_args(argv)
    if rest and args.command in ("train", "check"):
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    logging.basicConfig(level=logging.WARNING, format="[async-april] %(levelname)s %(name)s: %(message)s")
    try:
        return _run(args, rest)
    except UserError as e:  # one line per problem (`check` lists all it found: errors.UserErrors)
        for note in getattr(e, "notes", ()):
            print(f"[async-april] {one_line(note)}", file=sys.stderr)
        for problem in getattr(e, "problems", [str(e)]):
            print(f"error: {one_line(problem)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted (no checkpoint saved)", file=sys.stderr)
        return 130


def _run(args: argparse.Namespace, rest: list[str]) -> int:
    from async_april.run.stopping import Interrupted

    if args.command == "build-model":
        from async_april.models.tiny import main as build_main

        return build_main(rest)
    if args.command == "eval":
        from async_april.launch.eval_command import main as eval_main

        return eval_main(rest)
    if args.command == "export":
        from async_april.launch.export import main as export_main

        return export_main(rest)
    if args.command == "plan":
        from async_april.launch.plan_command import main as plan_main

        return plan_main(rest)
    if args.command == "plot":
        from async_april.run.plot import main as plot_main

        plot_main(rest)
        return 0
    from async_april.config import load_config

    cfg = load_config(args.config, args.overrides)
    if args.command == "check":
        import yaml

        from async_april.run.console import say
        from async_april.launch.memory_check import show_and_check_memory
        from async_april.launch.resolve import CHECK_ROWS, Checks, check_cluster, resolve

        checks = Checks(collect=True)  # every independent problem, one line each (train stops at the first)
        r = resolve(cfg, sample_rows=CHECK_ROWS, checks=checks)
        for line in r.describe() if r is not None else ():
            say(line)
        checks.run("memory plan", lambda: show_and_check_memory(cfg, checks.results["model"]), needs=("model files",))
        checks.run("resources", check_cluster, cfg)
        checks.finish()
        print(yaml.safe_dump(r.cfg.to_yaml_dict(), sort_keys=False))
        say(f"ok: {args.config} resolves (data: first {CHECK_ROWS} rows checked)")
        return 0
    from async_april.launch.controller import train

    try:
        train(cfg)
    except Interrupted as e:
        print(f"[async-april] {e}", file=sys.stderr, flush=True)
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
