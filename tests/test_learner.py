"""FSDP2 learner: rank equivalence, micro-batch accumulation, resume, bad steps, HF export.

Tiny random Qwen2 (hidden 64, 2 layers), fp32, gloo on CPU. Single-rank
workers run in this process (no Ray); multi-rank ones as a LearnerGroup of
Ray actors in a cluster started (and stopped) by this module only. Over 400 lines: its helpers
(make_cfg, make_batch, local_worker) are the learner's test kit, which test_lora.py and
test_sequence_parallel.py import; the tests beside them use them most.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import socket
from pathlib import Path
import sys

import numpy as np
import pytest
import torch

from async_april.rollout.batch import TrainBatch
from async_april.config import Config, config_from_dict
from learners.logprobs import collate, response_logprobs, token_logprobs
from learners.update import pack_micro_batches
from learners.worker import LearnerWorker

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

TEMPERATURE = 0.9
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    from async_april.models import build_random_tiny_model

    out = tmp_path_factory.mktemp("tiny") / "model"
    return str(build_random_tiny_model(out, seed=0, hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                                       num_attention_heads=4, num_key_value_heads=2))


def make_cfg(algorithm: dict | None = None, **learner) -> Config:
    base = {"lr": 1e-3, "weight_decay": 0.01, "warmup_steps": 2, "grad_clip": 1.0}
    base.update(learner)
    return config_from_dict({"learner": base, "rollout": {"temperature": TEMPERATURE}, "run": {"seed": 7},
                             "algorithm": algorithm or {}})


TWO_RANK = dict(max_tokens_per_microbatch=64, mini_batches=2, algorithm={"correction": "decoupled"})
"""The two-rank runs: several micro-batches per rank in each of 2 mini-batches, proximal forward included."""


def make_batch(model_path: str, seed: int, n: int = 8, nan_advantages: bool = False) -> TrainBatch:
    """Random rows; behaviour logprobs = initial-model logprobs + small noise; random advantages."""
    from transformers import AutoModelForCausalLM

    rng = np.random.default_rng(seed)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    vocab = model.config.vocab_size
    ids, plens, resp = [], [], []
    for _ in range(n):
        p, r = int(rng.integers(2, 7)), int(rng.integers(1, 12))
        ids.append(rng.integers(1, vocab, p + r).astype(np.int64))
        plens.append(p)
        resp.append(np.zeros(r, np.float32))
    plens = np.array(plens, np.int64)
    with torch.no_grad():
        mb = collate(ids, plens, resp, np.zeros(n, np.float32))
        lp = response_logprobs(model, mb, TEMPERATURE).numpy()
    blp = [(lp[i, : len(resp[i])] + rng.normal(0, 0.05, len(resp[i]))).astype(np.float32) for i in range(n)]
    adv = rng.normal(size=n).astype(np.float32)
    if nan_advantages:
        adv[0] = np.nan
    return TrainBatch(ids, plens, blp, [np.zeros(len(b), np.int64) for b in blp], adv, policy_version=0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def local_worker(cfg: Config, model_path: str):
    """A world-size-1 LearnerWorker in this process (its own gloo group, destroyed after)."""
    w = LearnerWorker(cfg, model_path, 0, 1, "127.0.0.1", free_port())
    try:
        yield w
    finally:
        w.shutdown()


def assert_close_dicts(a: dict, b: dict, atol: float) -> None:
    assert set(a) == set(b)
    for k in a:
        if isinstance(a[k], dict):
            assert_close_dicts(a[k], b[k], atol)
        elif isinstance(a[k], torch.Tensor):
            torch.testing.assert_close(a[k].float(), b[k].float(), atol=atol, rtol=0, msg=lambda m: f"{k}: {m}")
        elif isinstance(a[k], (list, tuple)):
            assert len(a[k]) == len(b[k])
            for x, y in zip(a[k], b[k]):
                assert_close_dicts(x, y, atol) if isinstance(x, dict) else None
        else:
            assert a[k] == pytest.approx(b[k], abs=atol), k


# ----------------------------------------------------------------------------- pure helpers


def test_token_logprobs_is_tempered_log_softmax():
    logits = torch.randn(3, 5, 11)
    targets = torch.randint(0, 11, (3, 5))
    want = torch.log_softmax(logits / 0.7, -1).gather(-1, targets[..., None])[..., 0]
    torch.testing.assert_close(token_logprobs(logits, targets, 0.7), want)


def test_pack_micro_batches_respects_budget():
    lengths = np.array([5, 9, 3, 30, 7, 7, 2])
    groups = pack_micro_batches(lengths, 16)
    assert sorted(i for g in groups for i in g) == list(range(7))
    for g in groups:
        assert len(g) == 1 or len(g) * lengths[g].max() <= 16  # the 30-token row goes alone


# ----------------------------------------------------------------------------- single process


def test_microbatch_accumulation_equivalence(model_path):
    batch = make_batch(model_path, seed=1)
    lengths = np.array([len(x) for x in batch.input_ids])
    budget = next(b for b in range(16, 1000) if len(pack_micro_batches(lengths, b)) == 4)
    results = []
    for tokens in (100_000, budget):
        with local_worker(make_cfg(max_tokens_per_microbatch=tokens), model_path) as w:
            m = w.train_step(batch)
            results.append((m, w.full_state_dict()))
    (m1, sd1), (m4, sd4) = results
    assert m1["train/micro_batches"] == 1 and m4["train/micro_batches"] == 4
    assert m4["loss/total"] == pytest.approx(m1["loss/total"], abs=1e-5)
    assert m4["loss/policy"] == pytest.approx(m1["loss/policy"], abs=1e-5)
    assert m4["train/grad_norm"] == pytest.approx(m1["train/grad_norm"], abs=1e-5)
    assert m4["is/weight_max"] == pytest.approx(m1["is/weight_max"], abs=1e-6)
    assert_close_dicts(sd1, sd4, atol=1e-5)


def test_nan_loss_skips_step_then_stops(model_path):
    good, bad = make_batch(model_path, seed=2), make_batch(model_path, seed=2, nan_advantages=True)
    with local_worker(make_cfg(max_bad_steps=2), model_path) as w:
        w.train_step(good)
        before = w.full_state_dict()
        m = w.train_step(bad)
        assert m["train/bad_step"] == 1.0 and m["train/consecutive_bad_steps"] == 1.0
        assert m["train/policy_version"] == 1.0 and w.version == 1
        for k, v in w.full_state_dict().items():
            assert torch.equal(v, before[k]), k
        m = w.train_step(good)  # a good step resets the counter
        assert m["train/bad_step"] == 0.0 and m["train/consecutive_bad_steps"] == 0.0 and w.version == 2
        w.train_step(bad)
        with pytest.raises(RuntimeError, match="2 consecutive learner steps.*max_bad_steps=2"):
            w.train_step(bad)


def all_bad(batch: TrainBatch) -> TrainBatch:
    """`batch` with every advantage NaN: each of its mini-batches has a non-finite loss."""
    batch.advantages = np.full_like(batch.advantages, np.nan)
    return batch


def test_max_bad_steps_counts_rollout_batches_not_optimizer_steps(model_path):
    """Regression (issue 26.6): learner.max_bad_steps counted skipped optimizer steps, so with
    learner.mini_batches >= max_bad_steps one non-finite rollout batch stopped the run instead of being
    skipped. A batch counts once (bad when none of its optimizer steps could be taken), a batch with
    at least one step taken resets the count."""
    good = make_batch(model_path, seed=2)
    with local_worker(make_cfg(max_bad_steps=2, mini_batches=2), model_path) as w:
        w.train_step(good)
        m = w.train_step(all_bad(make_batch(model_path, seed=2)))  # two skipped optimizer steps, one bad batch
        assert (m["train/bad_step"], m["train/consecutive_bad_steps"], m["train/optimizer_steps"], w.version) == (1.0, 1.0, 0.0, 1)
        m = w.train_step(make_batch(model_path, seed=2, nan_advantages=True))  # one mini-batch of two is bad
        assert (m["train/bad_step"], m["train/consecutive_bad_steps"], m["train/optimizer_steps"], w.version) == (0.0, 0.0, 1.0, 2)
        w.train_step(all_bad(make_batch(model_path, seed=2)))
        with pytest.raises(RuntimeError, match="2 consecutive learner steps.*max_bad_steps=2, counted per rollout batch"):
            w.train_step(all_bad(make_batch(model_path, seed=2)))


def test_the_lr_schedule_counts_rollout_batches_as_its_docs_say(model_path):
    """Regression (issue 26.7): the schedule steps once per rollout batch (as run.steps counts, and as
    verl and AReaL step theirs) while the learner.warmup_steps docstring, docs/configuration.md and
    make_lr_scheduler said optimizer steps. With two mini-batches per batch, warm-up over 2 steps
    reaches lr at the third batch, every mini-batch of a batch trains at that batch's lr, and a
    skipped batch does not advance the schedule; the docs say the same."""
    from async_april.config import LearnerConfig
    from learners.optim import make_lr_scheduler

    good = make_batch(model_path, seed=3)
    with local_worker(make_cfg(mini_batches=2, warmup_steps=2, lr=1e-3), model_path) as w:
        lrs = [w.train_step(b)["train/lr"] for b in (good, all_bad(make_batch(model_path, seed=3)), good, good)]
        assert w.scheduler.last_epoch == 3 and w.version == 3
    assert lrs == pytest.approx([0.0, 5e-4, 5e-4, 1e-3], abs=1e-12)  # constant_with_warmup: lr * step / warmup_steps
    config_md = next(line for line in (REPO / "docs/configuration.md").read_text().splitlines() if "`learner.warmup_steps`" in line)
    for doc in (LearnerConfig.model_fields["warmup_steps"].description, make_lr_scheduler.__doc__, config_md):
        assert "rollout batch" in " ".join(doc.split()), doc


def stale_batch(model_path: str, seed: int, n: int = 8) -> TrainBatch:
    """`make_batch`'s rows, with behaviour logprobs from an older policy (the weights perturbed):
    what a batch generated a few versions ago looks like to the learner."""
    from transformers import AutoModelForCausalLM

    batch = make_batch(model_path, seed, n)
    old = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in old.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=g))
        lp = response_logprobs(old, collate(batch.input_ids, batch.prompt_lens, batch.behavior_logprobs, batch.advantages),
                               TEMPERATURE).numpy()
    batch.behavior_logprobs = [lp[i, : len(b)].astype(np.float32) for i, b in enumerate(batch.behavior_logprobs)]
    return batch


def plain_loop(model_path: str, cfg: Config, batch: TrainBatch) -> tuple[dict, list[float]]:
    """Reference for decoupled PPO with mini-batches, written out plainly: no FSDP, no micro-batches.
    Proximal = the initial model's logprobs; then one AdamW step per consecutive part of the rows,
    each normalised by its own tokens. Returns the final weights and each step's clip fraction."""
    from transformers import AutoModelForCausalLM

    from async_april.algorithms.losses import LossSettings, policy_loss

    lc = cfg.learner
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).train()
    opt = torch.optim.AdamW(model.parameters(), lr=lc.lr, betas=lc.betas, weight_decay=lc.weight_decay, eps=1e-8)
    settings = LossSettings.from_config(cfg.algorithm, cfg.rollout.max_new_tokens)
    rows = lambda idx: collate([batch.input_ids[i] for i in idx], batch.prompt_lens[idx],  # noqa: E731
                               [batch.behavior_logprobs[i] for i in idx], batch.advantages[idx])
    with torch.no_grad():
        proximal = response_logprobs(model, rows(np.arange(len(batch))), TEMPERATURE)
    clip_fracs = []
    for idx in np.array_split(np.arange(len(batch)), lc.mini_batches):
        mb = rows(idx)
        logprobs = response_logprobs(model, mb, TEMPERATURE)
        loss, metrics = policy_loss(logprobs, mb.behavior_logprobs, mb.advantages, mb.response_mask, settings,
                                    mb.num_response_tokens, len(idx),
                                    proximal_logprobs=proximal[idx, : logprobs.shape[1]])
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), lc.grad_clip)
        opt.step()
        clip_fracs.append(float(metrics["loss/clip_frac"]))
    return model.state_dict(), clip_fracs


def test_mini_batches_with_decoupled_correction_match_a_plain_loop(model_path):
    """4 mini-batches, decoupled correction, a stale batch: the proximal policy is the pre-update one,
    so u = pi_theta / pi_prox is exactly 1 in the first update and leaves it in later ones, where the
    clip acts (clip_frac > 0). The four updates, micro-batched, equal the plain loop's."""
    batch = stale_batch(model_path, seed=5)
    lengths = np.array([len(x) for x in batch.input_ids])
    budget = max(16, int(lengths.max()))  # about a row each: several micro-batches per mini-batch
    cfg = make_cfg(lr=3e-2, warmup_steps=0, mini_batches=4, max_tokens_per_microbatch=budget,
                   algorithm={"correction": "decoupled", "weight_bound": "truncate"})
    with local_worker(cfg, model_path) as w:
        m = w.train_step(batch)
        sd = w.full_state_dict()
    ref_sd, ref_clip = plain_loop(model_path, cfg, batch)
    assert m["train/mini_batches"] == 4 and m["train/optimizer_steps"] == 4 and m["train/policy_version"] == 1
    assert m["train/micro_batches"] > 1
    assert ref_clip[0] == 0.0 and max(ref_clip[1:]) > 0, ref_clip
    assert m["loss/clip_frac"] > 0 and m["loss/clip_frac"] == pytest.approx(np.mean(ref_clip), abs=1e-6)
    assert 0 < m["loss/entropy"] < np.log(32)
    assert m["is/weight_mean"] != pytest.approx(1.0, abs=1e-3)  # the batch is stale: w = pi_prox / pi_behav moves
    # The key bias has an exactly-zero gradient (softmax ignores a constant per query), so AdamW turns
    # rounding noise into lr-sized steps there in both runs: compared everywhere else, to 0.3% of a step.
    noise_driven = [k for k in sd if k.endswith("k_proj.bias")]
    assert_close_dicts({k: v for k, v in sd.items() if k not in noise_driven},
                       {k: v for k, v in ref_sd.items() if k not in noise_driven}, atol=1e-4)


def test_rejected_tokens_out_of_the_normaliser_and_mismatch_metrics_match_a_plain_loop(model_path):
    """Rejection by token k3 against pi_prox with rejected tokens out of the normaliser, one mini-batch
    split into micro-batches: the learner counts the kept tokens before the step (a no-grad forward)
    and its update equals one plain AdamW step on the whole batch normalised by those counts. The
    step's mismatch metrics (KL k1 and the token shares by lag) equal the values computed by hand."""
    from transformers import AutoModelForCausalLM

    from async_april.algorithms.losses import LossSettings, policy_loss

    batch = stale_batch(model_path, seed=6)
    batch.policy_version = 2
    batch.versions = [np.full(len(b), i % 3, np.int64) for i, b in enumerate(batch.behavior_logprobs)]  # lags 2, 1, 0
    lengths = np.array([len(x) for x in batch.input_ids])
    algorithm = {"rejection": {"divergence": "k3", "high": 0.002, "keep_in_normalizer": False}}
    cfg = make_cfg(lr=3e-2, warmup_steps=0, max_tokens_per_microbatch=max(16, int(lengths.max())), algorithm=algorithm)
    cfg.async_.max_staleness = 2
    with local_worker(cfg, model_path) as w:
        m = w.train_step(batch)
        sd = w.full_state_dict()
    assert m["train/micro_batches"] > 1

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2, betas=cfg.learner.betas, weight_decay=0.01, eps=1e-8)
    mb = collate(batch.input_ids, batch.prompt_lens, batch.behavior_logprobs, batch.advantages)
    logprobs = response_logprobs(model, mb, TEMPERATURE)
    mask = mb.response_mask.bool()
    d = (logprobs.detach() - mb.behavior_logprobs).double()
    kept = mask & ((torch.exp(d) - d - 1.0) <= 0.002)
    assert 0 < int(kept.sum()) < int(mask.sum())  # some rejected, some kept
    settings = LossSettings.from_config(cfg.algorithm, cfg.rollout.max_new_tokens)
    loss, _ = policy_loss(logprobs, mb.behavior_logprobs, mb.advantages, mb.response_mask, settings,
                          float(kept.sum()), float(kept.any(-1).sum()), proximal_logprobs=logprobs.detach())
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.learner.grad_clip)
    opt.step()
    assert m["loss/total"] == pytest.approx(float(loss.detach()), abs=1e-6)
    assert m["is/rejected_frac"] == pytest.approx(1 - float(kept.sum()) / float(mask.sum()), abs=1e-6)
    # As in the mini-batch test above; AdamW's first step is lr * g / (|g| + eps), so an element whose
    # gradient is ~eps moves by a rounding-dependent fraction of lr: compared to 1% of a step.
    noise_driven = [k for k in sd if k.endswith("k_proj.bias")]
    assert_close_dicts({k: v for k, v in sd.items() if k not in noise_driven},
                       {k: v for k, v in model.state_dict().items() if k not in noise_driven}, atol=3e-4)

    assert m["mismatch/k1"] == pytest.approx(float(-d[mask].mean()), abs=1e-6)
    lag_rows = np.array([i % 3 for i in range(len(batch))])
    tokens = np.array([len(b) for b in batch.behavior_logprobs])
    for lag in (0, 1, 2):
        rows = lag_rows == 2 - lag
        assert m[f"mismatch/token_frac_lag{lag}"] == pytest.approx(tokens[rows].sum() / tokens.sum(), abs=1e-6)
        assert m[f"mismatch/k1_lag{lag}"] == pytest.approx(float(-d[torch.from_numpy(rows)][mask[torch.from_numpy(rows)]].mean()), abs=1e-5)
    assert 0 < m["mismatch/ess"] <= 1 and 0 < m["mismatch/ess_lag0"] <= 1


def test_export_hf_roundtrip(model_path, tmp_path):
    from transformers import AutoModelForCausalLM

    with local_worker(make_cfg(), model_path) as w:
        w.train_step(make_batch(model_path, seed=3))
        sd = w.full_state_dict()
        out = w.export_hf(str(tmp_path / "hf"))
    assert os.path.isfile(os.path.join(out, "tokenizer.json"))
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    assert set(loaded) == set(sd)
    assert all(torch.equal(loaded[k], sd[k]) for k in sd)


def test_decoupled_kl_and_activation_checkpointing_paths(model_path):
    """Decoupled correction (proximal = pre-update policy) with a KL reference; AC changes nothing."""
    batch = make_batch(model_path, seed=4)
    algo = {"correction": "decoupled", "kl_coef": 0.1}
    results = []
    for ac in (False, True):
        cfg = make_cfg(activation_checkpointing=ac)
        cfg = cfg.model_copy(update={"algorithm": cfg.algorithm.model_copy(update=algo)})
        with local_worker(cfg, model_path) as w:
            results.append((w.train_step(batch), w.full_state_dict()))
    (m, sd), (m_ac, sd_ac) = results
    assert m["train/bad_step"] == 0.0 and "loss/kl" in m
    assert m["loss/kl"] == pytest.approx(0.0, abs=1e-6)  # reference == initial policy at step 1
    assert m["loss/total"] == pytest.approx(m_ac["loss/total"], abs=1e-6)
    assert_close_dicts(sd, sd_ac, atol=1e-6)


def test_optimizer_offload_trains_exactly_as_without(model_path):
    """learner.offload_optimizer (FSDP2 CPUOffloadPolicy): the same losses, weights and AdamW state after two
    steps. On CPU the shards already live on the host, so this pins that the policy changes no arithmetic
    and that the optimizer still finds and updates every parameter (docs/learner.md, Memory plan)."""
    batches = [make_batch(model_path, seed=s) for s in (5, 6)]
    results = []
    for offload in (False, True):
        with local_worker(make_cfg(offload_optimizer=offload), model_path) as w:
            from torch.distributed.fsdp import CPUOffloadPolicy

            policies = {type(m._get_fsdp_state()._fsdp_param_group.offload_policy) for m in w.model.modules()
                        if hasattr(m, "_get_fsdp_state") and m._get_fsdp_state()._fsdp_param_group is not None}
            assert (policies == {CPUOffloadPolicy}) == offload
            losses = [w.train_step(b)["loss/total"] for b in batches]
            results.append((losses, w.full_state_dict(), w.full_optimizer_state_dict()))
    (l0, sd0, osd0), (l1, sd1, osd1) = results
    assert l0 == l1
    assert_close_dicts(sd0, sd1, atol=0.0)
    assert_close_dicts(osd0, osd1, atol=0.0)
    assert any(not torch.equal(v, sd0[k]) for k, v in make_initial_state(model_path).items())  # it did train


def make_initial_state(model_path: str) -> dict:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).state_dict()


def test_flash_attention_without_package_is_a_clear_error(monkeypatch):
    import importlib.util

    from learners import parallelize

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(RuntimeError, match="flash-attn package"):
        parallelize.resolve_attn_implementation("flash_attention_2")
    assert parallelize.resolve_attn_implementation("sdpa") == "sdpa"


def test_flash_attn_4_namespace_is_not_flash_attention_2(tmp_path, monkeypatch):
    """Issue 26 item 15: flash-attn-4 (pulled in by sglang 0.5.23) installs flash_attn/cute/ and no
    flash_attn/__init__.py; find_spec("flash_attn") found that namespace, so FA2 passed the check without
    being installed and the hint sent users to the [gpu] extra, which does not provide it. Layouts as the
    wheels install them (flash_attn_4-4.0.0b36; flash-attn 2.x: flash_attn/__init__.py + flash_attn_2_cuda)."""
    from learners import parallelize

    fa4 = tmp_path / "fa4"
    (fa4 / "flash_attn" / "cute").mkdir(parents=True)
    (fa4 / "flash_attn" / "cute" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(fa4))
    with pytest.raises(RuntimeError, match="flash-attn-4, which sglang 0.5.23 pulls in, is not FA2"):
        parallelize.resolve_attn_implementation("flash_attention_2")
    assert "pip install flash-attn --no-build-isolation" in parallelize.FLASH_ATTN_HINT
    assert "async-april[gpu]" not in parallelize.FLASH_ATTN_HINT

    fa2 = tmp_path / "fa2"
    (fa2 / "flash_attn").mkdir(parents=True)
    (fa2 / "flash_attn" / "__init__.py").write_text("__version__ = '2.8.3'\n")
    (fa2 / "flash_attn_2_cuda.py").write_text("")  # the extension module's name (a .so in the real wheel)
    monkeypatch.syspath_prepend(str(fa2))
    for mod in ("flash_attn", "flash_attn_2_cuda"):
        monkeypatch.delitem(sys.modules, mod, raising=False)
    importlib.invalidate_caches()
    assert parallelize.resolve_attn_implementation("flash_attention_2") == "flash_attention_2"


# ----------------------------------------------------------------------------- Ray, 2 ranks


@pytest.fixture(scope="module")
def two_rank_run(ray_cluster, model_path, tmp_path_factory):
    """4 steps at world size 2, with a checkpoint after step 2 (saving changes nothing)."""
    from learners.group import LearnerGroup

    batches = [make_batch(model_path, seed=10 + i) for i in range(4)]
    ckpt = str(tmp_path_factory.mktemp("ckpt") / "step2")
    group = LearnerGroup(make_cfg(world_size=2, **TWO_RANK), model_path)
    try:
        metrics = [group.train_step(batches[0])]
        sd1 = group.full_state_dict()
        metrics.append(group.train_step(batches[1]))
        group.save_checkpoint(ckpt)
        metrics += [group.train_step(b) for b in batches[2:]]
        result = dict(batches=batches, ckpt=ckpt, metrics=metrics, sd1=sd1,
                      sd4=group.full_state_dict(), osd4=group.full_optimizer_state_dict(), version=group.version)
    finally:
        group.shutdown()
    return result


def test_two_ranks_match_one_rank(two_rank_run, model_path):
    with local_worker(make_cfg(**TWO_RANK), model_path) as w:
        m = w.train_step(two_rank_run["batches"][0])
        sd = w.full_state_dict()
    m2 = two_rank_run["metrics"][0]
    assert m2["loss/total"] == pytest.approx(m["loss/total"], abs=1e-5)
    assert m2["loss/policy"] == pytest.approx(m["loss/policy"], abs=1e-5)
    assert m2["train/grad_norm"] == pytest.approx(m["train/grad_norm"], abs=1e-5)
    assert m2["loss/tokens"] == m["loss/tokens"] == two_rank_run["batches"][0].num_response_tokens
    assert_close_dicts(sd, two_rank_run["sd1"], atol=1e-5)


def test_resume_in_new_actors_matches_straight_run(two_rank_run, model_path):
    from learners.group import LearnerGroup

    group = LearnerGroup(make_cfg(world_size=2, **TWO_RANK), model_path)
    try:
        assert group.load_checkpoint(two_rank_run["ckpt"]) == {"step": 2, "version": 2}
        metrics = [group.train_step(b) for b in two_rank_run["batches"][2:]]
        sd, osd = group.full_state_dict(), group.full_optimizer_state_dict()
        assert group.version == two_rank_run["version"] == 4
    finally:
        group.shutdown()
    for a, b in zip(metrics, two_rank_run["metrics"][2:]):
        assert a["loss/total"] == pytest.approx(b["loss/total"], abs=1e-6)
        assert a["train/lr"] == b["train/lr"]
    assert_close_dicts(sd, two_rank_run["sd4"], atol=1e-6)
    assert_close_dicts(osd["state"], two_rank_run["osd4"]["state"], atol=1e-6)


def test_two_rank_checkpoint_loads_at_one_rank_without_pickle(two_rank_run, model_path, no_pickle):
    """The checkpoint saved by two ranks holds no pickle and reshards: one rank in this process loads
    it with every way of unpickling patched to fail, and its next steps match the two-rank run's."""
    from pathlib import Path

    files = sorted(p.name for p in Path(two_rank_run["ckpt"]).iterdir())
    assert files == ["learner.json", "rank_00000.json", "rank_00000.safetensors", "rank_00001.json", "rank_00001.safetensors"]
    with local_worker(make_cfg(**TWO_RANK), model_path) as w:
        assert w.load_checkpoint(two_rank_run["ckpt"]) == {"step": 2, "version": 2}
        metrics = [w.train_step(b) for b in two_rank_run["batches"][2:]]
        sd, osd = w.full_state_dict(), w.full_optimizer_state_dict()
    for a, b in zip(metrics, two_rank_run["metrics"][2:]):
        assert a["loss/total"] == pytest.approx(b["loss/total"], abs=1e-5)
        assert a["train/lr"] == b["train/lr"]
    assert_close_dicts(sd, two_rank_run["sd4"], atol=1e-5)
    assert_close_dicts(osd["state"], two_rank_run["osd4"]["state"], atol=1e-5)
