"""The learner's memory plan (async_april/planning/memory.py, `async-april check`): its figure against a real
learner step's measured peak, the refusal of a recipe that cannot fit, the recipes against their GPUs,
and learner.offload_optimizer (FSDP2 CPUOffloadPolicy) training exactly as without it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from async_april.config import load_config
from async_april.launch.memory_check import plan_inputs
from async_april.planning.memory import ModelDims, PlanInputs, plan, refusal

REPO = Path(__file__).resolve().parent.parent
RECIPES = sorted(p for p in (REPO / "configs" / "recipes").glob("*.yaml"))
QWEN3_4B = ModelDims.from_hf_config(  # Qwen/Qwen3-4B config.json; parameters as transformers counts them
    {"model_type": "qwen3", "hidden_size": 2560, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
     "head_dim": 128, "intermediate_size": 9728, "vocab_size": 151936, "tie_word_embeddings": True}, 4_022_468_096)
QWEN25_MATH_1_5B = ModelDims.from_hf_config(  # Qwen/Qwen2.5-Math-1.5B config.json
    {"model_type": "qwen2", "hidden_size": 1536, "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
     "intermediate_size": 8960, "vocab_size": 151936, "tie_word_embeddings": True}, 1_543_714_304)
QWEN3_4B_LORA_PER_RANK = 2_064_384
"""LoRA parameters per unit of rank on every linear layer of Qwen3-4B: 36 layers x (in + out) summed over
q, k, v, o, gate, up, down (learners/lora.py parameter_counts gives 33,030,144 at rank 16)."""


def env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from async_april.models import build_random_tiny_model

    return build_random_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0, max_position_embeddings=4096)


def test_plan_is_within_20_percent_of_a_real_learner_steps_peak(tiny):
    """tests/memory_probe.py trains a 1-rank CPU learner (32 rows x 128 tokens per micro-batch) and samples its
    RSS; with glibc's mmap threshold fixed, freed tensors leave the RSS, so the peak over the built worker's
    RSS, plus the weights it already held, is what the plan counts (weights, grads, AdamW, activations, logits)."""
    tokens, row = 4096, 128
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "memory_probe.py"), str(tiny), str(tokens), str(row), "0", "0"],
                          env={**env(), "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"},
                          capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = json.loads(proc.stdout.strip().splitlines()[-1])
    measured = (m["peak"] - m["init"] + 4 * m["params"]) / 1e9
    dims = ModelDims.from_hf_config(json.loads((tiny / "config.json").read_text()), m["params"])
    planned = plan(dims, PlanInputs(microbatch_tokens=tokens, longest_row=row, on_gpu=False)).total_gb
    assert planned > 0.2  # activations dominate: the comparison tests the activation model
    assert abs(planned - measured) <= 0.2 * measured, f"plan {planned:.3f} GB, measured {measured:.3f} GB"


@pytest.mark.parametrize("dtype, c", [("float32", 4), ("bfloat16", 2)])
def test_the_head_backward_holds_what_the_plan_counts(dtype, c):
    """tests/memory_probe.py `head`: the chunked head's backward alone at vocab 32,768 x hidden 512 (one [V, H] fp32
    tensor is 67 MB), peak RSS (VmHWM) over the RSS before it. It holds the weight's gradient (c bytes x V x H,
    the plan's root gradient), the plan's `head grad` row (nothing in fp32; the fp32 accumulator and one
    VOCAB_SLICE product in bf16) and its `logits` row (8 bytes x chunk x V). Before issue 38 each chunk added a
    [V, H] product and its fp32 copy: 8.7 and 10.5 bytes x V x H measured, against the 5.0 and 7.5 counted."""
    from async_april.planning.memory import head_grad_bytes

    vocab, hidden, positions, chunk = 32768, 512, 256, 64
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "memory_probe.py"), "head", str(vocab), str(hidden),
                           str(positions), str(chunk), dtype],
                          env={**env(), "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"},
                          capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = json.loads(proc.stdout.strip().splitlines()[-1])
    measured = m["peak"] - m["before"]
    held = c * vocab * hidden + head_grad_bytes(vocab, hidden, c)  # the gradient returned, and what the plan adds
    counted = held + 8 * chunk * vocab + 4 * positions * hidden  # + the logits row's chunk and grad_h
    # At least the returned gradient and (bf16) the fp32 accumulator it is cast from must have been resident
    # at once; the one-slice product may be freed before the cast (6.15 measured against 6.5 held in bf16).
    must = c * vocab * hidden + (4 * vocab * hidden if c < 4 else 0)
    assert 0.95 * must <= measured <= 1.1 * counted, f"{measured / (vocab * hidden):.2f} bytes x V x H measured, " \
                                                     f"{counted / (vocab * hidden):.2f} counted"


FRAGMENTS = """
import sys, torch
from async_april.config import config_from_dict
from learners.worker import LearnerWorker
from tests.memory_probe import rss
w = LearnerWorker(config_from_dict({"learner": {"device": "cpu"}}), sys.argv[1], master_port=int(sys.argv[2]))
big = torch.ones(1 << 20); del big  # a freed 4 MB block: glibc's default would now serve 2 MB ones from its heap
kept, temps, before = [], [], rss()
for _ in range(40):  # as a forward pass: temporaries freed between tensors kept for backward
    temps.append(torch.ones(1 << 19))
    kept.append(torch.ones(1 << 15))
del temps
print((rss() - before) / 1e6)
w.shutdown()
"""


def test_a_cpu_learner_rank_returns_freed_activations_to_the_os(tiny):
    """learners/host_allocator.py: after a LearnerWorker is built on CPU, 40 freed 2 MB temporaries between
    kept 128 KB tensors leave the RSS. With glibc's default dynamic mmap threshold 89 MB of them stayed
    resident: the fragmentation that cost Ulysses SP=2 a third of its peak (docs/benchmarks.md)."""
    from tests.test_learner import free_port

    proc = subprocess.run([sys.executable, "-c", FRAGMENTS, str(tiny), str(free_port())], env=env(), capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    resident_mb = float(proc.stdout.strip().splitlines()[-1])
    assert resident_mb < 20, f"{resident_mb:.0f} MB of freed 2 MB temporaries stayed resident (80 MB were allocated)"


def test_cli_refuses_a_learner_that_cannot_fit_and_names_the_keys(tiny, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "async_april", "check", str(REPO / "configs" / "tiny_cpu.yaml"),
                           f"model.path={tiny}", "learner.gpu_memory_gb=0.01", "learner.max_tokens_per_microbatch=4096",
                           f"run.dir={tmp_path}/run"],
                          cwd=REPO, env=env(), capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    err = proc.stderr
    assert "learner rank memory" in err and "activations" in err  # the table is printed before the refusal
    line = err.strip().splitlines()[-1]
    assert line.startswith("error: the learner needs") and "of the 0.01 GB GPU" in line
    assert "learner.activation_checkpointing=true" in line and "learner.max_tokens_per_microbatch=" in line


def recipe_dims(cfg) -> ModelDims:
    dims = QWEN3_4B if cfg.model.path == "Qwen/Qwen3-4B" else QWEN25_MATH_1_5B
    if cfg.learner.lora.enabled:
        assert dims is QWEN3_4B
        lora = cfg.learner.lora.rank * QWEN3_4B_LORA_PER_RANK
        dims = replace(dims, params=dims.params + lora, trainable=lora)
    return dims


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_every_recipe_fits_the_gpu_its_header_names(path):
    """Each recipe's header names its GPU (`# GPU: 80 GB ...`); the plan with the real model's numbers fits it."""
    header = path.read_text().splitlines()[1]
    assert header.startswith("# GPU: ") and " GB" in header, f"{path.name}: second line must name the GPU's memory"
    gb = float(header.removeprefix("# GPU: ").split(" GB")[0])
    cfg = load_config(path)
    inputs = plan_inputs(cfg)
    assert inputs.gpu_memory_gb in (None, gb)  # a recipe that sets learner.gpu_memory_gb says the same
    assert refusal(recipe_dims(cfg), replace(inputs, gpu_memory_gb=gb)) is None


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.stem)
def test_cpu_configs_are_planned_but_not_refused(path):
    """The CPU configs name no GPU: `check` prints their plan and refuses nothing (docs/learner.md, Memory plan)."""
    cfg = load_config(path)
    inputs = plan_inputs(cfg)
    assert not inputs.on_gpu and inputs.gpu_memory_gb is None and inputs.sglang_engines == 0
    dims = ModelDims.from_hf_config({"hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
                                     "intermediate_size": 512, "vocab_size": 19}, 1_053_696)
    assert plan(dims, inputs).budget_gb is None and refusal(dims, inputs) is None


def test_qwen3_4b_1gpu_recipe_fits_an_80gb_gpu_with_sglang():
    """Issue 26 item 16: fp32 weights, grads and AdamW (~64 GB) beside SGLang on one 80 GB GPU did not fit."""
    cfg = load_config(REPO / "configs" / "recipes" / "qwen3-4b_dapo_1gpu_async.yaml")
    inputs = plan_inputs(cfg)
    assert inputs.sglang_engines == 1 and inputs.gpu_memory_gb == 80
    assert refusal(QWEN3_4B, inputs) is None
    p = plan(QWEN3_4B, inputs)
    assert p.host_gb == pytest.approx(16 * QWEN3_4B.params / 1e9)  # fp32 master + grads + AdamW on the host
    # The same settings without offload do not fit, and the refusal names the key that fixes it.
    message = refusal(QWEN3_4B, replace(inputs, offload_optimizer=False))
    assert message is not None and "learner.offload_optimizer=true" in message


def test_the_plans_logits_chunk_is_the_learners():
    """The plan charges the chunked head's [chunk, vocab] block: the same chunk the learner uses."""
    from async_april.planning import memory as memory_plan
    from learners import chunked_logprobs

    assert memory_plan.CHUNK_POSITIONS == chunked_logprobs.CHUNK_POSITIONS
    assert memory_plan.VOCAB_SLICE == chunked_logprobs.VOCAB_SLICE
    assert plan_inputs(load_config(REPO / "configs" / "tiny_cpu.yaml")).logits_path == "chunked"


def test_sglang_engines_on_the_learners_gpu_start_before_the_learner(tmp_path):
    """SGLang takes `mem_fraction_static` of the memory free when it starts (sglang 0.5.23
    srt/mem_cache/kv_cache_configurator.py), so an engine that shares the learner's GPU must start
    first. One (declared) GPU shared half and half by the learner rank and one SGLang engine (the
    stand-in server, `tests.sglang_standin`, launched by the real engine client): by the time the
    controller builds the learner, the engine has started; with the learner on a GPU of its own the
    learner comes first (the engines then load while its ranks initialise)."""
    import ray

    from async_april.launch.controller import train

    class LearnerBuilt(Exception):
        pass

    def engines_up_when_the_learner_is_built(cfg, model_path):
        from ray._private.state import state  # the GCS's actor table, through this driver's connection

        seen.append(sum(a["State"] == "ALIVE" and a["ActorClassName"].endswith("GenerationActor")
                        for a in state.actor_table(None).values()))
        raise LearnerBuilt  # what the test needed; the controller stops the engines on its way out

    repo = Path(__file__).resolve().parent.parent
    assert not ray.is_initialized()
    ray.init(address="local", num_cpus=4, num_gpus=1, include_dashboard=False, logging_level="WARNING",
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(repo)}})
    try:
        for name, split in [("shared", ["learner.gpus_per_rank=0.5", "rollout.gpus_per_actor=0.5"]),
                            ("own", ["learner.gpus_per_rank=1", "rollout.gpus_per_actor=0"])]:
            seen: list[int] = []
            cfg = load_config(repo / "configs/tiny_cpu.yaml", [
                f"run.dir={tmp_path}/{name}", "rollout.engine=sglang", "rollout.sglang.launch_module=tests.sglang_standin",
                "rollout.sglang.startup_timeout_s=120", "rollout.num_actors=1", "learner.device=cpu", "run.pin_cpus=false",
                "logging.wandb=disabled", "run.steps=1", *split])
            with pytest.raises(LearnerBuilt):
                train(cfg, learner_factory=engines_up_when_the_learner_is_built)
            assert seen == ([1] if name == "shared" else [0]), (name, seen)
    finally:
        ray.shutdown()
