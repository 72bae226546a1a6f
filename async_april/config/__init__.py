"""Typed run configuration: one class per component, YAML as data only.

Every field carries a docstring (it becomes the field's description and the
text of docs/configuration.md) and bounds. `load_config` reads a YAML file,
applies dotted command-line overrides (`rollout.n_samples=8`) and validates
everything before any actor starts; a bad key or value raises `ConfigError`
naming the key, the value and what is allowed.

    base.py     Section (unknown keys are errors), ConfigError
    run.py      run, checkpoint, logging
    inputs.py   model, data, reward, eval (held-out sets)
    rollout.py  rollout (+ sglang, agent), async (staleness)
    learner.py  algorithm, learner, weight_sync
    placement.py  placement of each role's actors over a cluster's nodes
    root.py     Config: every section, and the checks that span sections
    loading.py  YAML files, `defaults:` presets, dotted overrides, config.yaml

This package imports neither torch nor Ray, so the CLI can reject a bad config
in well under a second.
"""

from async_april.config.base import ConfigError, Section
from async_april.config.inputs import DataConfig, EvalConfig, EvalDatasetConfig, ModelConfig, RewardConfig
from async_april.config.learner import AlgorithmConfig, LearnerConfig, LoraConfig, WeightSyncConfig
from async_april.config.loading import (
    OVERRIDES_HELP,
    apply_overrides,
    config_from_dict,
    load_config,
    parse_override,
    read_yaml,
    save_config,
)
from async_april.config.placement import PlacementConfig
from async_april.config.rollout import MOVED_ROLLOUT_KEYS, AgentConfig, AsyncConfig, RolloutConfig, SGLangConfig
from async_april.config.root import Config
from async_april.config.run import CheckpointConfig, LoggingConfig, RunConfig

__all__ = [
    "MOVED_ROLLOUT_KEYS", "OVERRIDES_HELP", "AgentConfig", "AlgorithmConfig", "AsyncConfig", "CheckpointConfig",
    "Config", "ConfigError", "DataConfig", "EvalConfig", "EvalDatasetConfig", "LearnerConfig", "LoggingConfig", "LoraConfig",
    "ModelConfig", "PlacementConfig", "RewardConfig", "RolloutConfig", "RunConfig", "SGLangConfig", "Section", "WeightSyncConfig",
    "apply_overrides", "config_from_dict", "load_config", "parse_override", "read_yaml", "save_config",
]
