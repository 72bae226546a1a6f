"""`async-april` command line.

    async-april train CONFIG [section.key=value ...]   run training (embedded Ray or the surrounding cluster)
    async-april check CONFIG [section.key=value ...]   validate a config and print the resolved YAML
    async-april build-model [--cache-dir D] [--seed S] build the tiny built-in model
    async-april plot RUN_DIR                           plot a run's metrics.jsonl to PNG
"""

from __future__ import annotations

import sys

from async_april.config import ConfigError


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    cmd, rest = argv[0], argv[1:]
    try:
        if cmd == "train":
            from async_april.train import main as train_main

            if not rest:
                raise ConfigError("usage: async-april train CONFIG [section.key=value ...]")
            train_main(rest)
        elif cmd == "check":
            import yaml

            from async_april.config import load_config

            cfg = load_config(rest[0] if rest else None, rest[1:])
            print(yaml.safe_dump(cfg.to_yaml_dict(), sort_keys=False))
        elif cmd == "build-model":
            from async_april.models.tiny import main as build_main

            build_main(rest)
        elif cmd == "plot":
            from async_april.plot import main as plot_main

            plot_main(rest)
        else:
            print(f"unknown command {cmd!r}\n{__doc__}", file=sys.stderr)
            return 2
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
