"""Config: every file in configs/ validates; bad input fails early, naming the key."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from async_april.config import ConfigError, load_config, save_config
from async_april.config_docs import main as docs_main

REPO = Path(__file__).resolve().parent.parent
CONFIG_FILES = sorted(p for p in (REPO / "configs").rglob("*.yaml"))


def test_there_are_configs():
    assert any(p.name == "tiny_cpu.yaml" for p in CONFIG_FILES)


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_config_file_validates(path):
    cfg = load_config(path)
    assert cfg.rollout.n_samples >= 1


def test_overrides_are_typed():
    cfg = load_config(REPO / "configs/tiny_cpu.yaml", ["rollout.n_samples=4", "learner.lr=3e-4", "async.max_staleness=5"])
    assert cfg.rollout.n_samples == 4 and cfg.learner.lr == 3e-4 and cfg.async_.max_staleness == 5


def test_presets_set_the_modes():
    sync = load_config(REPO / "configs/presets/sync.yaml")
    april = load_config(REPO / "configs/presets/april.yaml")
    asyn = load_config(REPO / "configs/presets/async.yaml")
    assert sync.async_.max_staleness == 0 and sync.rollout.over_provision == 1.0
    assert april.rollout.over_provision > 1 and april.rollout.early_stop
    assert asyn.async_.max_staleness >= 1 and asyn.rollout.on_weight_update == "interrupt"


@pytest.mark.parametrize(
    "override, named",
    [
        ("rollout.n_sampels=8", "rollout.n_sampels"),
        ("rollout.batch_groups=-2", "rollout.batch_groups"),
        ("learner.lr=fast", "learner.lr"),
        ("algorithm.correction=magic", "algorithm.correction"),
        ("nosection.x=1", "nosection"),
        ("learner.mini_batches=4000", "learner.mini_batches"),
    ],
)
def test_bad_values_name_the_key_and_value(override, named):
    with pytest.raises(ConfigError) as e:
        load_config(REPO / "configs/tiny_cpu.yaml", [override])
    msg = str(e.value)
    assert named in msg
    assert override.split("=", 1)[1] in msg


def test_top_p_with_correction_is_rejected():
    with pytest.raises(ConfigError, match="top_p"):
        load_config(None, ["rollout.top_p=0.9"])
    load_config(None, ["rollout.top_p=0.9", "algorithm.weight_bound=none"])


def test_missing_file_is_clear():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("configs/nope.yaml")


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(REPO / "configs/tiny_cpu.yaml", ["run.steps=3"])
    out = save_config(cfg, tmp_path)
    again = load_config(out)
    assert again == cfg
    assert "async" in yaml.safe_load(out.read_text())


def test_config_module_imports_without_torch_or_ray():
    code = "import sys, async_april.config; assert 'torch' not in sys.modules and 'ray' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_configuration_docs_are_up_to_date():
    assert docs_main(["--check"]) == 0, "run: python -m async_april.config_docs"


def test_lora_keys_without_the_switch_are_refused(tmp_path):
    """learner.lora.rank=8 alone used to train every weight silently. Refused on both paths (override and
    YAML) in one line naming both keys; `enabled: true` or an explicit `enabled: false` (a LoRA config
    switched off) is fine, and a saved config (every key written) loads back."""
    with pytest.raises(ConfigError) as e:
        load_config(REPO / "configs/tiny_cpu.yaml", ["learner.lora.rank=8"])
    assert "learner.lora.rank is set without learner.lora.enabled=true" in str(e.value) and "\n" not in str(e.value)
    half = tmp_path / "half.yaml"
    half.write_text(f"defaults: [{REPO}/configs/tiny_cpu.yaml]\nlearner:\n  lora: {{rank: 8, alpha: 16}}\n")
    with pytest.raises(ConfigError, match=r"learner.lora.alpha, learner.lora.rank are set without learner.lora.enabled=true"):
        load_config(half)
    assert load_config(half, ["learner.lora.enabled=true"]).learner.lora.rank == 8
    off = load_config(REPO / "configs/tiny_cpu_lora.yaml", ["learner.lora.enabled=false"])
    assert not off.learner.lora.enabled and load_config(save_config(off, tmp_path / "run")) == off
