"""GPU recipes (configs/recipes): each validates, names resources consistent with the node
layout in its `# resources:` header, and carries the paper settings; plus the GPU check
script's CPU smoke mode (and, on a GPU, its tiny CUDA mode)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from async_april.config import load_config
from async_april.rewards import REGISTRY

REPO = Path(__file__).resolve().parent.parent
RECIPES = sorted((REPO / "configs" / "recipes").rglob("*.yaml"))
MODE_FILES = [p for p in RECIPES if p.parent.name == "recipes"]
HEADER = re.compile(r"^# resources: nodes=(\d+) gpus_per_node=(\d+) colocate=(true|false) model_context=(\d+)\s*$")


def resources(path: Path) -> dict:
    first = path.read_text().splitlines()[0]
    m = HEADER.match(first)
    assert m, f"{path.name}: first line must be '# resources: nodes=N gpus_per_node=G colocate=true|false model_context=T'"
    return {"nodes": int(m[1]), "gpus": int(m[2]), "colocate": m[3] == "true", "context": int(m[4])}


def test_there_are_recipes_for_both_models_layouts_and_modes():
    names = {p.stem for p in MODE_FILES}
    for model in ("qwen2.5-math-1.5b_deepscaler", "qwen3-4b_dapo"):
        for layout in ("8gpu", "1gpu"):
            for mode in ("sync", "april", "async"):
                assert f"{model}_{layout}_{mode}" in names


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: str(p.relative_to(REPO / "configs" / "recipes")))
def test_recipe_is_consistent_with_its_node_layout(path):
    cfg = load_config(path)
    res = resources(path)
    r, lc = cfg.rollout, cfg.learner
    gpus = res["nodes"] * res["gpus"]
    reserved = r.num_actors * r.gpus_per_actor + lc.world_size * lc.gpus_per_rank
    assert 0 < reserved <= gpus, f"Ray would reserve {reserved} GPUs on a {gpus}-GPU layout"
    assert r.gpus_per_actor > 0, "an SGLang engine needs a GPU share"
    if res["colocate"]:  # engines and learner ranks share GPUs
        assert r.gpus_per_actor < 1 and lc.gpus_per_rank < 1
        assert cfg.weight_sync.transport == "object_store", "NCCL cannot put two ranks on one GPU"
    else:
        assert r.gpus_per_actor >= 1 and lc.gpus_per_rank == 1
        assert cfg.weight_sync.transport in ("nccl", "object_store")
    assert f"{res['gpus']}gpu" in path.stem
    assert cfg.model.dtype == "bfloat16" and lc.device == "cuda" and r.engine == "sglang"
    assert cfg.data.max_prompt_len + r.max_new_tokens <= res["context"]
    assert cfg.data.source.startswith("hf:")
    assert all(name in REGISTRY for name in cfg.reward.functions) and cfg.reward.num_workers > 0
    # APRIL / CoPRIS settings
    assert (cfg.algorithm.clip_low, cfg.algorithm.clip_high) == (0.2, 0.28)
    assert lc.lr == (1e-5 if lc.lora.enabled else 1e-6) and r.n_samples == 8  # LoRA: 10x, its usual ratio
    assert r.batch_groups == (32 if res["gpus"] == 8 else r.batch_groups)
    assert r.max_new_tokens >= 3072


@pytest.mark.parametrize("path", MODE_FILES, ids=lambda p: p.stem)
def test_mode_recipes_take_the_preset_settings(path):
    """Modes are settings: every key of configs/presets/<mode>.yaml holds in the resolved recipe."""
    import yaml

    cfg = load_config(path).to_yaml_dict()
    mode = path.stem.rsplit("_", 1)[1]
    preset = yaml.safe_load((REPO / "configs" / "presets" / f"{mode}.yaml").read_text())
    for section, values in preset.items():
        for key, value in values.items():
            assert cfg[section][key] == value, f"{path.name}: {section}.{key} is {cfg[section][key]!r}, preset {mode} says {value!r}"
    assert cfg["run"]["name"].endswith(mode)


# ----------------------------------------------------------------------------- gpu_check


def run_gpu_check(tmp_path: Path, *args: str, timeout: int) -> dict:
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_check.py"), *args, "--out", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)  # fmt: skip
    assert out.is_file(), proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert proc.returncode == 0 and result["ok"], json.dumps(result, indent=1)[-3000:]
    assert "rollout tokens/s" in proc.stdout and "weight sync" in proc.stdout
    return result


def test_gpu_check_cpu_smoke(tmp_path):
    """The script's logic on CPU with a tiny model: every phase runs and reports."""
    r = run_gpu_check(tmp_path, "--cpu", "--tiny", timeout=120)
    assert r["rollout"]["generated_tokens"] == r["args"]["requests"] * r["args"]["new_tokens"]  # EOS ignored
    assert r["rollout"]["rollout_tokens_per_s"] > 0 and r["learner"]["learner_tokens_per_s"] > 0
    assert r["learner"]["finite"] and len(r["learner"]["loss"]) == 2
    assert r["weight_sync"]["weights_match"] and r["weight_sync"]["engine_version"] == 2  # CPU path, then device path
    assert r["environment"]["has_pydantic"]


@pytest.mark.gpu
def test_gpu_check_tiny_on_cuda(tmp_path):
    """NCCL (world size 1), bf16 engine and learner, MFU reported, weights loaded into the engine."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    r = run_gpu_check(tmp_path, "--tiny", timeout=300)
    assert "mfu" in r["learner"] or "H" not in r["environment"]["gpu"]
    assert r["weight_sync"]["weights_match"]


# ----------------------------------------------------------------------------- `async-april check` on every recipe

HUB_COMMIT = "0123456789abcdef0123456789abcdef01234567"
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
SUBSTITUTE_ROWS = {  # the recipes' columns: DeepScaleR (problem, answer), DAPO-Math-17k (chat prompt, reward_model)
    "deepscaler": [{"problem": f"What is {i} + {i}?", "answer": str(2 * i), "solution": "..."} for i in range(80)],
    "dapo": [{"prompt": [{"role": "user", "content": f"Compute {i} * 3."}], "data_source": "math_dapo",
              "reward_model": {"ground_truth": str(3 * i), "style": "rule-lighteval/MATH_v2"}} for i in range(80)],
}


@pytest.fixture(scope="module")
def substitutes(tmp_path_factory):
    """A tiny model in the Hugging Face hub cache layout under each recipe's model ID
    (models--org--name/refs/main + snapshots/<commit>/), with a chat template as the real ones
    have, and each recipe's dataset as a local file with the same columns."""
    import shutil

    from tests.sglang_standin import make_test_model_dir

    root = tmp_path_factory.mktemp("recipe-substitutes")
    model = make_test_model_dir(root / "tiny")
    tok_cfg = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**tok_cfg, "chat_template": CHAT_TEMPLATE}))
    ids = {load_config(p).model.path for p in MODE_FILES}
    for repo in ids:
        cached = root / "hub" / ("models--" + repo.replace("/", "--"))
        shutil.copytree(model, cached / "snapshots" / HUB_COMMIT)
        (cached / "refs").mkdir()
        (cached / "refs" / "main").write_text(HUB_COMMIT)
    data = {}
    for name, rows in SUBSTITUTE_ROWS.items():
        data[name] = root / f"{name}.jsonl"
        data[name].write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root, data, ids


@pytest.mark.parametrize("path", MODE_FILES, ids=lambda p: p.stem)
def test_recipe_passes_async_april_check(path, substitutes, monkeypatch, capsys, tmp_path):
    """`async-april check RECIPE` offline: the recipe's hub model ID resolves through the cache,
    its data columns map and tokenise, its rewards import; only data.source and run.dir are
    overridden (no dataset hub here). Resources are checked where RAY_ADDRESS names a cluster."""
    from async_april.launch.cli import main

    root, data, ids = substitutes
    monkeypatch.setenv("HF_HUB_CACHE", str(root / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    # The recipes log to W&B online: `check` refuses that without a key, as the cluster's job would fail.
    monkeypatch.setenv("WANDB_API_KEY", "fake-key-the-cluster-provides")
    source = data["dapo" if "dapo" in path.stem else "deepscaler"]
    rc = main(["check", str(path), f"data.source={source}", f"run.dir={tmp_path}/${{name}}"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    model_line = next(line for line in err.splitlines() if "] model " in line)
    assert f"snapshots/{HUB_COMMIT}" in model_line
    assert f"data {source}: 64 prompts" in err  # check reads the first 64 rows; none rejected
    cfg = load_config(path)
    assert ("learner: LoRA" in err) == cfg.learner.lora.enabled and "weights + grads + AdamW" in err
    assert "learner rank memory" in err and "logits" in err  # the memory plan (tests/test_memory_plan.py)
    assert f"resources: {cfg.rollout.num_actors * cfg.rollout.gpus_per_actor + cfg.learner.world_size * cfg.learner.gpus_per_rank:g} GPUs reserved" in err


def test_check_refuses_a_config_asking_for_more_gpus_than_the_cluster_has():
    from async_april.launch.resolve import ResourceError, check_gpu_resources, gpus_needed

    cfg = load_config(REPO / "configs/recipes/qwen3-4b_dapo_8gpu_april.yaml")
    assert gpus_needed(cfg) == 8
    check_gpu_resources(cfg, 8.0)
    with pytest.raises(ResourceError, match=r"reserves 8 GPUs .* the Ray cluster has 4"):
        check_gpu_resources(cfg, 4.0)
