"""Ulysses sequence parallelism: SP=2 equals SP=1 in logprobs, loss and gradients; bad layouts are refused.

Real torch.distributed on gloo: 2 processes started with torch.multiprocessing.
Each runs (a) the logprob + loss maths in float64 on a ragged right-padded
micro-batch, against the plain sdpa model in the same process (1e-10 on the
loss, 1e-8 relative on the gradients summed over the sp group), and (b) a full
`LearnerWorker` step at world size 2 with sequence_parallel=2 (FSDP2 over both
ranks), compared with a world-size-1 worker in the test process.
"""

from __future__ import annotations

import copy
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from async_april.config import config_from_dict
from learners import sequence_parallel as seqpar
from learners.logprobs import collate, response_logprobs
from learners.sequence_parallel import check_sequence_parallel
from tests.test_learner import free_port, local_worker, make_batch, make_cfg

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

TEMPERATURE = 0.9
SP_CFG = {"max_tokens_per_microbatch": 64, "algorithm": {"loss": "gspo", "aggregation": "seq_mean_token_mean"}}
"""GSPO's sequence ratio and the per-sequence mean need each row's logprobs whole: the gather makes them so."""


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    from async_april.models import build_random_tiny_model

    out = tmp_path_factory.mktemp("tiny") / "model"
    return str(build_random_tiny_model(out, seed=0, hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                                       num_attention_heads=4, num_key_value_heads=2))


def ragged_micro_batch(vocab: int):
    """Right-padded rows of uneven length (odd longest: padding to a multiple of sp), a 1-token response,
    a 1-token prompt, and a row whose response crosses the slice boundary."""
    rng = np.random.default_rng(3)
    shapes = [(1, 12), (4, 1), (7, 9), (2, 5)]  # (prompt, response); longest row 19
    ids = [rng.integers(1, vocab, p + r).astype(np.int64) for p, r in shapes]
    blp = [rng.normal(-2.0, 0.3, r).astype(np.float32) for _, r in shapes]
    return collate(ids, np.array([p for p, _ in shapes]), blp, rng.normal(size=len(shapes)).astype(np.float32))


def _loss(logprobs, mb, settings):
    from async_april.algorithms.losses import policy_loss

    n = float(mb.num_response_tokens)
    behavior = mb.behavior_logprobs.double()
    return policy_loss(logprobs, behavior, mb.advantages.double(), mb.response_mask.double(), settings, n,
                       float(mb.input_ids.shape[0]), batch_tokens=n)[0]


def _maths_check(rank: int, model_path: str) -> None:
    """float64: the same model, plain sdpa vs Ulysses over the 2 ranks of the default group."""
    from transformers import AutoModelForCausalLM

    from async_april.algorithms.losses import LossSettings

    cfg = make_cfg(**SP_CFG)
    settings = LossSettings.from_config(cfg.algorithm, cfg.rollout.max_new_tokens)
    plain = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float64, attn_implementation="sdpa")
    ulysses = copy.deepcopy(plain)
    sp = seqpar.setup(ulysses, 2, 2, "cpu")
    assert (sp.rank, sp.size, sp.dp_rank, sp.dp_size) == (rank, 2, 0, 1)
    mb = ragged_micro_batch(plain.config.vocab_size)

    ref_lp, ref_ent = response_logprobs(plain, mb, TEMPERATURE, with_entropy=True)
    ref_loss = _loss(ref_lp, mb, settings)
    ref_loss.backward()
    lp, ent = seqpar.sp_response_logprobs(ulysses, mb, TEMPERATURE, sp, with_entropy=True)
    loss = _loss(lp, mb, settings)
    loss.backward()

    torch.testing.assert_close(lp, ref_lp, atol=1e-12, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=1e-12, rtol=0)
    assert abs(float(loss) - float(ref_loss)) < 1e-10
    ref_grads = dict(plain.named_parameters())
    worst = 0.0
    for name, p in ulysses.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g)  # each rank holds the partial gradient of its slice's computation
        want = ref_grads[name].grad
        worst = max(worst, float((g - want).abs().max() / want.abs().max().clamp(min=1e-30)))
    assert worst < 1e-8, worst
    # Each rank alone holds only part of it: the test would see a missing all-to-all backward.
    assert any(float((p.grad - ref_grads[n].grad).abs().max()) > 1e-6 for n, p in ulysses.named_parameters())


def _child(rank: int, port: int, model_path: str, out_dir: str) -> None:
    from learners.worker import LearnerWorker

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    _maths_check(rank, model_path)
    # The worker reuses the default group: FSDP2 over both ranks, which are one sp group.
    w = LearnerWorker(make_cfg(world_size=2, sequence_parallel=2, **SP_CFG), model_path, rank, 2)
    metrics = w.train_step(make_batch(model_path, seed=10))
    sd = w.full_state_dict()
    if rank == 0:
        torch.save({"metrics": metrics, "sd": sd}, os.path.join(out_dir, "sp2.pt"))
    w.shutdown()


def test_sp2_equals_sp1_in_logprobs_loss_and_gradients(model_path, tmp_path):
    mp.spawn(_child, args=(free_port(), model_path, str(tmp_path)), nprocs=2, join=True)
    got = torch.load(tmp_path / "sp2.pt", weights_only=False)
    with local_worker(make_cfg(**SP_CFG), model_path) as w:
        want = w.train_step(make_batch(model_path, seed=10))
        sd = w.full_state_dict()
    m = got["metrics"]
    for key in ("loss/total", "loss/policy", "train/grad_norm", "loss/entropy"):
        assert m[key] == pytest.approx(want[key], abs=1e-5), key
    assert m["loss/tokens"] == want["loss/tokens"]  # counted once per sp group
    for name, value in sd.items():
        torch.testing.assert_close(got["sd"][name], value, atol=1e-5, rtol=0, msg=lambda s, n=name: f"{n}: {s}")


def test_bad_layouts_are_clear_errors(model_path):
    from transformers import AutoModelForCausalLM

    with pytest.raises(ValueError, match=r"must divide learner.world_size=3.*multiple of 2"):
        config_from_dict({"learner": {"world_size": 3, "sequence_parallel": 2}})
    with pytest.raises(ValueError, match=r"num_attention_heads=4.*divisor of 4"):
        check_sequence_parallel(3, 3, num_heads=4, num_kv_heads=2)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    # 4 query heads but 2 KV heads: sp=4 is refused at model load, before any process group is touched.
    with pytest.raises(ValueError, match=r"num_key_value_heads=2.*divisor of 2"):
        seqpar.setup(model, 4, 4, "cpu")
    assert seqpar.setup(model, 4, 1, "cpu") is None  # sp=1 leaves the model alone
    assert model.config._attn_implementation == "sdpa"
