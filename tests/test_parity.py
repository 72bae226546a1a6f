"""Parity mode (`model.parity`, async_april/parity/): engine and learner logprobs equal bit for bit.

The sync preset's loop, in this process: a TorchEngine samples a batch with the learner's current
weights (every token lag 0), the FSDP2 learner (world size 1, gloo) recomputes each token's logprob and
takes a step, and the new weights go back to the engine through the learner's bucket export; three
times. In parity mode every behaviour logprob equals the learner's recomputed one exactly (so every
ratio is exactly 1 and mismatch/k1, k3 at lag 0 are exactly 0.0), in float32 and bfloat16, with packed
and padded micro-batches (the engine's requests in flight: up to 8 at once, left-padded, admitted in
blocks), full fine-tuning and LoRA (adapter and merged sync). Without it the same loop does not match.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from async_april.rollout.batch import TrainBatch
from async_april.config import config_from_dict
from async_april.parity import kernels
from tests.test_learner import local_worker

TEMPERATURE = 0.9
STEPS = 3


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    from async_april.models import build_random_tiny_model

    out = tmp_path_factory.mktemp("tiny") / "model"
    return str(build_random_tiny_model(out, seed=0, hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                                       num_attention_heads=4, num_key_value_heads=2))


def parity_cfg(parity: bool, dtype: str, packing: bool, lora: str | None, **extra):
    learner = {"lr": 2e-2, "packing": packing, "max_tokens_per_microbatch": 96, **extra}
    if lora:
        learner["lora"] = {"enabled": True, "rank": 8, "alpha": 16.0, "sync": lora}
    return config_from_dict({
        "model": {"parity": parity, "dtype": dtype},
        "learner": learner, "rollout": {"temperature": TEMPERATURE, "engine": "torch", "concurrency": 8}, "run": {"seed": 3},
        "async": {"max_staleness": 0},
    })  # fmt: skip


def sync_loop(cfg, model_path: str, steps: int = STEPS, worker=None):
    """(per step: behaviour logprobs, the learner's recomputed ones, train metrics) of the sync loop.
    `worker`: a context manager giving the learner rank (default: a world-size-1 worker here)."""
    from actors.engine import GenerateRequest, SamplingParams
    from actors.engines import make_engine

    rng = np.random.default_rng(11)
    out = []
    with worker or local_worker(cfg, model_path) as w:

        async def run():
            eng = make_engine(cfg, model_path, device="cpu", eos_token_ids=(), num_threads=1)
            await eng.start()
            try:
                for step in range(steps):
                    reqs = [GenerateRequest(f"s{step}r{i}#", rng.integers(3, 15, int(rng.integers(2, 9))).tolist(),
                                            SamplingParams(max_new_tokens=int(rng.integers(3, 20)), seed=100 * step + i,
                                                           temperature=TEMPERATURE)) for i in range(12)]
                    res = await asyncio.gather(*(eng.generate(r) for r in reqs))
                    batch = TrainBatch(
                        [np.concatenate([r.input_ids, x.output_ids]).astype(np.int64) for r, x in zip(reqs, res)],
                        np.array([len(r.input_ids) for r in reqs], np.int64), [x.logprobs for x in res],
                        [x.versions for x in res], rng.normal(size=len(reqs)).astype(np.float32), w.version)
                    mb = w._collate(batch)
                    with torch.no_grad():
                        lp = w._logprobs(w.model, mb, TEMPERATURE)
                    mask = mb.response_mask.bool()
                    out.append((mb.behavior_logprobs[mask], lp.float()[mask], w.train_step(batch)))
                    buckets = list(w.iter_weight_buckets(bucket_mb=0.05))  # a collective: every rank calls it
                    if w.world_size > 1:  # only rank 0 gets the buckets; every rank's engine takes them
                        import torch.distributed as dist

                        shared = [buckets]
                        dist.broadcast_object_list(shared, src=0)
                        buckets = shared[0]
                    await eng.update_weights(iter(buckets), w.version)
            finally:
                await eng.shutdown()

        asyncio.run(run())
    return out


CASES = [("float32", True, None), ("float32", False, None), ("bfloat16", True, None), ("bfloat16", False, None),
         ("float32", True, "adapter"), ("float32", True, "merged"), ("bfloat16", True, "adapter"),
         ("bfloat16", False, "merged")]


@pytest.mark.parametrize("dtype,packing,lora", CASES)
def test_parity_makes_behaviour_and_learner_logprobs_equal_bit_for_bit(model_path, dtype, packing, lora):
    steps = sync_loop(parity_cfg(True, dtype, packing, lora), model_path)
    for i, (behaviour, learner, m) in enumerate(steps):
        assert torch.equal(behaviour, learner), (i, (behaviour - learner).abs().max())
        assert m["mismatch/k1"] == 0.0 and m["mismatch/k3"] == 0.0, (i, m["mismatch/k1"], m["mismatch/k3"])
        assert m["mismatch/k1_lag0"] == 0.0 and m["mismatch/k3_lag0"] == 0.0 and m["mismatch/token_frac_lag0"] == 1.0
        assert m["mismatch/ess"] == 1.0 and m["is/weight_mean"] == 1.0
    assert steps[-1][2]["train/policy_version"] == STEPS  # the weights moved: later steps sampled new policies
    assert not torch.equal(steps[0][0][:20], steps[-1][0][:20])


def test_without_parity_the_same_loop_does_not_match(model_path):
    """The control: the stock kernels (a GEMM blocked by shape, SDPA, libm tails) give the same tokens
    different last bits in the engine's decode steps and the learner's forward."""
    steps = sync_loop(parity_cfg(False, "float32", True, None), model_path, steps=1)
    behaviour, learner, m = steps[0]
    assert not torch.equal(behaviour, learner)
    assert 0.0 < (behaviour - learner).abs().max() < 1e-4 and m["mismatch/k3_lag0"] < 1e-8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_give_a_row_the_same_bits_in_any_batch(dtype):
    """Row i of each kernel's output does not depend on the rows around it (batch size, offset), nor a
    query's attention on padding after its keys or zeros before them."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(70, 64, generator=g).to(dtype), torch.randn(96, 64, generator=g).to(dtype)
    full = kernels.linear(x, w, None, dtype)
    norm = kernels.rms_norm(x, w[0], 1e-6, dtype)
    z = torch.randn(70, 19, generator=g)
    lsm = kernels.log_softmax(z)
    for start, n in [(0, 1), (5, 3), (33, 37), (69, 1)]:
        rows = slice(start, start + n)
        assert torch.equal(kernels.linear(x[rows], w, None, dtype), full[rows])
        assert torch.equal(kernels.rms_norm(x[rows], w[0], 1e-6, dtype), norm[rows])
        assert torch.equal(kernels.log_softmax(z[rows]), lsm[rows])
    h, d, t = 4, 16, 23
    q, k, v = (torch.randn(1, h, t, d, generator=g).to(dtype) for _ in range(3))
    whole = kernels.attention(q, k, v, None, 0.25)
    pad = torch.zeros(1, h, 3, d, dtype=dtype)
    for i in range(t):  # one decode step at a time, left-padded like the engine's batch
        keys, vals = torch.cat([pad, k[:, :, : i + 1]], 2), torch.cat([pad, v[:, :, : i + 1]], 2)
        mask = torch.arange(i + 4)[None] >= 3
        assert torch.equal(kernels.attention(q[:, :, i : i + 1], keys, vals, mask, 0.25)[0, 0], whole[0, i])
    right = kernels.attention(*(torch.cat([a, torch.randn(1, h, 5, d, generator=g).to(dtype)], 2) for a in (q, k, v)),
                              torch.arange(t + 5)[None] < t, 0.25)
    assert torch.equal(right[0, :t], whole[0])
    packed = kernels.attention(*(torch.cat([a, a[:, :, :9]], 2) for a in (q, k, v)), None, 0.25, segments=[t, 9])
    assert torch.equal(packed[0, :t], whole[0]) and torch.equal(packed[0, t:], whole[0, :9])


def _sp_child(rank: int, port: int, model_path: str, out_dir: str) -> None:
    """One of 2 ranks (one sp group): each runs the same engine (same seeds: the same batches) and the
    learner's collectives; rank 0 saves what it saw."""
    import contextlib
    import os

    import torch.distributed as dist

    from learners.worker import LearnerWorker

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    cfg = parity_cfg(True, "float32", False, None, world_size=2, sequence_parallel=2)

    @contextlib.contextmanager
    def worker():
        w = LearnerWorker(cfg, model_path, rank, 2)
        try:
            yield w
        finally:
            w.shutdown()

    steps = sync_loop(cfg, model_path, steps=2, worker=worker())
    if rank == 0:
        torch.save(steps, os.path.join(out_dir, "sp2.pt"))


def test_parity_holds_with_sequence_parallel_2(model_path, tmp_path):
    """learner.sequence_parallel=2: each rank computes half of every row's positions and, after Ulysses'
    all-to-all, the attention of half of the heads over the whole row; the logprobs still equal the
    engine's decode-step ones bit for bit."""
    import torch.multiprocessing as mp

    from tests.test_learner import free_port

    mp.spawn(_sp_child, args=(free_port(), model_path, str(tmp_path)), nprocs=2, join=True)
    steps = torch.load(tmp_path / "sp2.pt", weights_only=False)
    assert len(steps) == 2
    for behaviour, learner, m in steps:
        assert torch.equal(behaviour, learner), (behaviour - learner).abs().max()
        assert m["mismatch/k1_lag0"] == 0.0 and m["mismatch/k3_lag0"] == 0.0 and m["mismatch/k1"] == 0.0


def test_parity_refuses_what_it_cannot_match():
    with pytest.raises(ValueError, match=r"model.parity needs rollout.engine=torch \(or sglang\): the simulated engine"):
        config_from_dict({"model": {"parity": True}, "rollout": {"engine": "simulated"}})
    with pytest.raises(ValueError, match="set rollout.sglang.deterministic=true"):
        config_from_dict({"model": {"parity": True}, "rollout": {"engine": "sglang", "sglang": {"deterministic": False}}})
    with pytest.raises(ValueError, match="set learner.compile=false"):
        config_from_dict({"model": {"parity": True}, "learner": {"compile": True}})
    with pytest.raises(ValueError, match="--rl-on-policy-target, which async-april sets itself"):
        config_from_dict({"rollout": {"engine": "sglang", "sglang": {"extra_args": ["--rl-on-policy-target", "fsdp"]}}})
    # The server would refuse it at start (sglang 0.5.23 srt/arg_groups/overrides.py): refused before any launch.
    with pytest.raises(ValueError, match="--attention-backend torch_native, which SGLang refuses with deterministic inference"):
        config_from_dict({"rollout": {"engine": "sglang", "sglang": {"extra_args": ["--attention-backend=torch_native"]}}})
    config_from_dict({"rollout": {"engine": "sglang", "sglang": {"extra_args": ["--attention-backend", "fa3"]}}})
    config_from_dict({"rollout": {"engine": "sglang", "sglang": {"deterministic": False, "extra_args": ["--attention-backend", "torch_native"]}}})


def test_parity_on_sglang_launches_its_on_policy_kernels_as_the_real_server_takes_them(model_path):
    """Item 2: SGLang cannot be bit-equal to this learner (its kernels are its own: docs/engines.md), so
    parity there means SGLang's deterministic inference plus its trainer-matching kernels
    (`--rl-on-policy-target fsdp`), and the lag-0 mismatch figures measuring numerics alone. The launch
    command carries both flags; the STAND-IN server (tests/sglang_standin.py) parses them with 0.5.23's
    rules: `fsdp` is the only target (argparse exits 2 otherwise), the target turns deterministic inference
    on, an attention backend outside the deterministic ones stops it at start with the real ValueError;
    an attached server without the target is refused by the client with one line."""
    from actors.engines import make_engine
    from actors.engines.sglang_server import check_server_info
    from actors.engines.sglang_wire import SGLangError
    from tests.sglang_standin import parse_args, server_from_command

    cfg = config_from_dict({"model": {"parity": True}, "rollout": {"engine": "sglang"}})
    cmd = make_engine(cfg, model_path, device="cpu", eos_token_ids=()).launch_command(30001)
    assert cmd[cmd.index("--rl-on-policy-target") + 1] == "fsdp" and "--enable-deterministic-inference" in cmd
    plain = make_engine(config_from_dict({"rollout": {"engine": "sglang"}}), model_path, device="cpu",
                        eos_token_ids=()).launch_command(30001)
    assert "--rl-on-policy-target" not in plain

    without_flag = [a for a in cmd if a != "--enable-deterministic-inference"]
    srv = server_from_command(without_flag)  # the target alone turns deterministic inference on
    assert srv.deterministic and srv.rl_on_policy_target == "fsdp"
    with pytest.raises(ValueError, match=r"only \['ascend', 'fa3', 'fa4', 'flashinfer', 'intel_xpu', 'triton'\] attention "
                                         r"backends are supported for deterministic inference, but you explicitly specified 'torch_native'"):
        server_from_command(cmd + ["--attention-backend", "torch_native"])
    with pytest.raises(SystemExit):
        parse_args(["--model-path", model_path, "--rl-on-policy-target", "megatron"])

    info = {"port": 30001, "tp_size": 1, "enable_deterministic_inference": True, "rl_on_policy_target": None}
    with pytest.raises(SGLangError, match="model.parity needs 'fsdp'.*restart it with --rl-on-policy-target fsdp"):
        check_server_info(info, "http://h:1", port=None, tp_size=1, deterministic=True, rl_on_policy_target="fsdp")
    check_server_info({**info, "rl_on_policy_target": "fsdp"}, "http://h:1", port=None, tp_size=1, deterministic=True,
                      rl_on_policy_target="fsdp")
    check_server_info(info, "http://h:1", port=None, tp_size=1, deterministic=True)  # without parity: no demand
