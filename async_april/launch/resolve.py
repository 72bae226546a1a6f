"""The one place that resolves a config against the world, shared by `check` and `train`.

    resolve(cfg) -> Resolved
      run dir      absolute (relative under `ray job submit` is an error), a directory we can
                   write, not already used by another run unless run.resume / run.overwrite say so
      resume       run.resume -> a verified checkpoint (or a fresh start for `auto` without one)
      tracking     logging.wandb=online has an API key to use (W&B would otherwise fail after Ray started)
      rewards      every name in reward.functions imported (this runs the user's module)
      env          rollout.env imported and built once with rollout.agent.env_args (multi-turn)
      model        model.path -> a local directory (built for builtin:, a hub ID via the Hugging Face
                   cache: async_april/models/hub.py) whose config.json and weight headers open as the
                   engines will open them (async_april/weights/files.py), its tokenizer,
                   and a checkpoint being resumed must be of this model's shape (LoRA: of this
                   very base, by the sha256 of its weights)
      engine       SGLang: this environment must not make its logprobs pre-temperature
      data         data.source read, columns mapped, prompts templated and tokenised (`check`: the
                   first rows only), and every reward callable with this dataset's extra columns
      eval         each eval.datasets entry read the same way, training prompts left out
      resume state the checkpoint's controller.json and store state read back into a store of this
                   config, its accounting checked (a crafted or edited state: one CheckpointError)

`check_gpu_resources` compares the GPUs a config asks for with a cluster's: `check` calls it when
a Ray address is given (with the per-node layout fit of async_april/launch/layout.py),
`train` once Ray is up, before any actor starts.

Everything here runs on the driver before Ray or any actor starts, cheapest checks
first; every failure is a UserError (async_april/errors.py) naming the key, file
or row and the fix. `train` stops at the first; `check` runs each check through a
collecting `Checks` and lists every problem, one line each, skipping (and naming)
only the checks that need one that failed. Nothing is written: `train` then
prepares the run directory (async_april/run/directory.py) and starts the run with what
this returns.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from async_april.run import directory as rundir
from async_april.run.checkpoints import (NOT_WRITTEN_BY_US, Checkpoint, CheckpointError, check_model_fits, model_shape,
                                       resolve_resume)
from async_april.config import Config
from async_april.data import PromptDataset, load_prompts
from async_april.errors import ModelError, UserError, UserErrors, one_line
from async_april.run.tracking import check_wandb_key
from async_april.weights.files import check_model_dir
from async_april.evaluation import EvalSet, load_eval_sets
from async_april.rewards import RewardFn, check_reward_signature, get_reward_fn

CHECK_ROWS = 64
"""Rows `async-april check` reads, maps and tokenises (`train` reads them all)."""


@dataclass
class Resolved:
    cfg: Config
    """The config with run.dir (and a run.resume path) made absolute: what every actor sees."""
    run_dir: rundir.RunDirState
    resume: Checkpoint | None
    model_path: Path
    model_shape: dict[str, Any]
    tokenizer: Any
    dataset: PromptDataset
    rewards: dict[str, RewardFn] = field(default_factory=dict)
    eval_sets: list[EvalSet] = field(default_factory=list)

    imported: list[str] = field(default_factory=list)
    """User modules the config named that were imported here (their import-time code ran)."""

    def describe(self) -> list[str]:
        """What was resolved, one line each (printed by `check` and at the start of `train`)."""
        d, ck = self.dataset, self.resume
        kept = f"{len(d)} prompts" + (f" ({d.rejected_long} too long, {d.bad_rows} malformed skipped)"
                                     if d.rejected_long or d.bad_rows else "")
        m = self.model_shape
        shape = f"{m.get('model_type')}, hidden {m.get('hidden_size')}, {m.get('num_hidden_layers')} layers, vocab {m.get('vocab_size')}"
        from async_april.models.paths import hub_pin

        pin = hub_pin(self.cfg.model.path, self.model_path)
        return [
            f"run dir {self.run_dir.path} ({'continuing it' if self.run_dir.used else 'new'})",
            f"model {self.model_path} ({shape})" + (f"; {pin[0]} pinned to commit {pin[1]}: every node loads exactly "
                                                    "it, from its own Hugging Face cache" if pin else ""),
            f"data {self.cfg.data.source}: {kept}",
            "rewards " + ", ".join(f"{n} x{w:g}" for n, w in self.cfg.reward.functions.items()),
            f"resume from {ck.path} (step {ck.step}, policy version {ck.version})" if ck else
            ("resume: no checkpoint yet, starting from step 0" if self.cfg.run.resume else "resume: no (fresh start)"),
        ] + [f"imported {m} (its import-time code ran here, and runs in every actor that uses it)" for m in self.imported
             ] + [f"eval {s.name}: {len(s.rows)} held-out prompts" + (f" ({s.in_training} also in the training data left out)"
                                                                 if s.in_training else "") for s in self.eval_sets]


class Checks:
    """The checks of one resolution, and what to do with a problem: `train` stops at the first (the
    UserError is raised as it comes); `check` (`collect=True`) runs every check it can, records each
    problem, and `finish()` raises them together (errors.UserErrors: one `error:` line each).

    A check names the checks it needs (`needs=`): when one of them failed or was skipped, it is
    skipped too, and `finish()` says so (no model means no tokenizer, so no data to read), since its
    verdict would mean nothing. Results are kept by name (`results`) for later checks to use.

        checks.run("model revision", pin_revision, cfg, needs=("model",))    # joins like any other
    """

    def __init__(self, collect: bool = False) -> None:
        self.collect = collect
        self.problems: list[str] = []
        self.skipped: list[str] = []
        self.results: dict[str, Any] = {}
        self.failed: set[str] = set()
        """Checks that raised or were skipped (what their dependents need)."""

    def run(self, name: str, fn, *args, needs: tuple[str, ...] = (), **kwargs) -> Any:
        """`fn(*args, **kwargs)`, or None when it raised a UserError (collecting) or a check it needs failed."""
        if any(n in self.failed for n in needs):
            self.failed.add(name)
            self.skipped.append(name)
            return None
        try:
            value = fn(*args, **kwargs)
        except UserError as e:
            if not self.collect:
                raise
            self.failed.add(name)
            self.problems.append(one_line(str(e)))
            return None
        self.results[name] = value
        return value

    def finish(self) -> None:
        """Raise every problem recorded, one per line; nothing when there was none."""
        if self.problems:
            notes = [f"not checked, since what they need failed: {', '.join(self.skipped)}"] if self.skipped else []
            raise UserErrors(self.problems, notes)


def resolve(cfg: Config, sample_rows: int | None = None, checks: Checks | None = None) -> Resolved | None:
    """Check `cfg` against the world (see the module docstring); `sample_rows` limits the data read.
    Without `checks` the first problem raises; with collecting `checks` (`async-april check`) each one is
    recorded there, and None is returned when there was any."""
    c = checks if checks is not None else Checks()
    cfg = cfg.model_copy(deep=True)
    run_dir = c.run("run dir", rundir.absolute_run_dir, cfg)
    if run_dir is not None:
        cfg.run.dir = str(run_dir)
    state = c.run("run dir state", rundir.inspect_run_dir, run_dir, needs=("run dir",))
    resume = c.run("resume", resolve_resume, cfg, run_dir, needs=("run dir",))
    if resume is not None and cfg.run.resume != "auto":
        cfg.run.resume = str(resume.path)
    c.run("run dir reuse", rundir.check_reuse, state, cfg, needs=("run dir state", "resume"))
    c.run("engine environment", check_engine_environment, cfg)
    c.run("W&B key", check_wandb_key, cfg)
    rewards = {name: fn for name in cfg.reward.functions if (fn := c.run(f"reward {name}", get_reward_fn, name)) is not None}
    imported = [f"{n.partition(':')[0]} (reward.functions)" for n in cfg.reward.functions if ":" in n]
    model_path = c.run("model", local_model_path, cfg)
    shape = c.run("model files", lambda: model_shape(check_model_dir(model_path, cfg.model.path)), needs=("model",))
    if resume is not None:
        c.run("resume model", check_model_fits, resume, shape, needs=("model files",))
        c.run("resume LoRA", check_lora_resume, cfg, resume, model_path, needs=("model",))
    tokenizer = c.run("tokenizer", load_tokenizer, model_path, cfg.model.path, needs=("model files",))  # reads config.json
    dataset = c.run("data", lambda: load_prompts(cfg, tokenizer, limit=sample_rows), needs=("tokenizer",))
    if resume is not None:
        c.run("resume state", check_resume_state, cfg, dataset, resume, needs=("data", "resume model"))
    for name, fn in rewards.items():
        c.run(f"reward {name} on the data", lambda n=name, f=fn: check_reward_signature(n, f, dataset.rows[0].extra),
              needs=("data",))
    eval_sets = c.run("eval sets", lambda: load_eval_sets(cfg, tokenizer, dataset, limit=sample_rows), needs=("data",))
    if cfg.rollout.env is not None:  # imports the user's module and builds one instance with env_args
        from actors.agents.env import make_env

        c.run("rollout.env", lambda: make_env(cfg.rollout.env, tokenizer, cfg.rollout.agent.env_args), needs=("tokenizer",))
        if not cfg.rollout.env.startswith("builtin:"):
            imported.append(f"{cfg.rollout.env.partition(':')[0]} (rollout.env)")
    if c.failed:
        return None
    return Resolved(cfg, state, resume, model_path, shape, tokenizer, dataset, rewards, eval_sets, imported)


def local_model_path(cfg: Config) -> Path:
    """model.path as an absolute local directory (built, or found in the hub cache); ModelError if it is none."""
    from async_april.models.paths import resolve_model_path

    try:
        return Path(resolve_model_path(cfg.model.path, cfg.model.cache_dir)).absolute()
    except (OSError, ValueError) as e:
        raise ModelError(str(e) if str(e).startswith("model.path") else f"model.path {cfg.model.path!r}: {e}") from None


def check_resume_state(cfg: Config, dataset: PromptDataset, ck: Checkpoint) -> None:
    """The resumed checkpoint's controller and store state read back as the restore will read them, into a
    store of this config whose accounting must hold: CheckpointError naming the file otherwise, before
    anything is written or started (a crafted state would else end in a traceback after Ray started)."""
    from async_april.rollout.store import RolloutStore

    ck.check_controller_state()
    state = ck.store_state()
    try:
        store = RolloutStore(cfg, dataset)
        store.load_state_dict(state)
        store.check_accounting()
    except (ValueError, TypeError, KeyError, AttributeError, AssertionError) as e:
        raise CheckpointError(f"run.resume: {ck.path / 'store.json'}: {one_line(str(e), 300)}; {NOT_WRITTEN_BY_US}") from None


def check_lora_resume(cfg: Config, resume: Checkpoint, model_path: Path) -> None:
    """A LoRA checkpoint holds adapters for one base model: resume it only with learner.lora on and that
    base at model.path (its weights' sha256 is in learner.json); a full checkpoint only with LoRA off."""
    from learners import lora

    saved = lora.json_meta(resume.learner_dir).get(lora.BASE_HASH_KEY)
    if cfg.learner.lora.enabled:
        lora.check_base(saved, model_path, f"run.resume: {resume.path}")
    elif saved is not None:
        raise UserError(f"run.resume: {resume.path} holds LoRA adapters (learner.lora.enabled was true); "
                        "resume it with learner.lora.enabled=true and the same learner.lora settings")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")
"""One of these must be in a model directory: transformers 5 otherwise builds an empty tokenizer without a word."""


def load_tokenizer(model_path: Path, spec: str):
    from transformers import AutoTokenizer

    hint = "a model directory needs its tokenizer files (tokenizer.json, or vocab files)"
    if not any((model_path / f).is_file() for f in TOKENIZER_FILES):
        raise ModelError(f"model.path {spec!r}: no usable tokenizer in {model_path} (none of {', '.join(TOKENIZER_FILES)}); {hint}")
    try:
        tok = AutoTokenizer.from_pretrained(str(model_path))
    except (OSError, ValueError, TypeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelError(f"model.path {spec!r}: no usable tokenizer in {model_path} ({first}); {hint}") from None
    return tok


def check_engine_environment(cfg: Config) -> None:
    """An SGLang server launched from here inherits this environment: refuse one that would make its
    logprobs those of the wrong distribution (actors/engines/sglang_engine.py)."""
    if cfg.rollout.engine != "sglang":
        return
    from actors.engines.sglang_engine import original_logprob_env_error

    why = original_logprob_env_error(cfg.rollout.temperature)
    if why is not None:
        raise EngineEnvError(why)


class EngineEnvError(UserError, ValueError):
    """The environment would make an engine report the wrong logprobs."""


def gpus_needed(cfg: Config) -> float:
    """GPUs Ray must reserve: every generation actor's share plus every learner rank's on CUDA."""
    r, lc = cfg.rollout, cfg.learner
    return r.num_actors * r.gpus_per_actor + (lc.world_size * lc.gpus_per_rank if lc.device == "cuda" else 0.0)


def check_gpu_resources(cfg: Config, cluster_gpus: float) -> None:
    """UserError when the cluster has fewer GPUs than the config reserves (Ray would wait forever)."""
    need = gpus_needed(cfg)
    if need > cluster_gpus + 1e-9:
        r, lc = cfg.rollout, cfg.learner
        raise ResourceError(
            f"the config reserves {need:g} GPUs (rollout.num_actors={r.num_actors} x rollout.gpus_per_actor="
            f"{r.gpus_per_actor:g} + learner.world_size={lc.world_size} x learner.gpus_per_rank={lc.gpus_per_rank:g}) "
            f"but the Ray cluster has {cluster_gpus:g}; lower them or add GPUs")


class ResourceError(UserError, ValueError):
    """The config asks for more of a resource than the cluster has."""


def cluster_layout_if_reachable(cfg: Config):
    """The config's layout fitted to the live nodes of the Ray cluster named by run.ray_address or
    RAY_ADDRESS (async_april/launch/layout.py), or None when none is named."""
    import os

    address = cfg.run.ray_address or os.environ.get("RAY_ADDRESS")
    if not address:
        return None
    probe_ray_address(cfg)
    import ray

    from async_april.launch.layout import fit_layout, live_nodes

    started = not ray.is_initialized()
    if started:
        ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    try:
        return fit_layout(cfg, live_nodes(), ray.get_runtime_context().get_node_id()), float(ray.cluster_resources().get("GPU", 0.0))
    finally:
        if started:
            ray.shutdown()


def check_cluster(cfg: Config) -> None:
    """`check`'s resources step: against the Ray cluster run.ray_address / RAY_ADDRESS names (if any), the
    GPUs reserved and the per-node layout fit, printed; ResourceError when they do not fit."""
    from async_april.run.console import say

    live = cluster_layout_if_reachable(cfg)
    if live is None:
        say(f"resources: {gpus_needed(cfg):g} GPUs reserved; no Ray cluster named (run.ray_address, RAY_ADDRESS), not checked")
        return
    layout, gpus = live
    for line in layout.lines():
        say(line)
    check_gpu_resources(cfg, gpus)
    if layout.problems:
        raise ResourceError("the layout does not fit the cluster: " + "; ".join(layout.problems) +
                            "; add nodes, lower learner.world_size / rollout.num_actors, or change placement.*")
    say(f"resources: {gpus_needed(cfg):g} GPUs reserved of the cluster's {gpus:g}; the layout fits")


RAY_CONNECT_TIMEOUT_S = 10.0
"""How long joining a named Ray cluster may take to answer at all (ray.init itself retries for minutes)."""


class ClusterError(UserError, ConnectionError):
    """The Ray cluster the config or environment names does not answer."""


def probe_ray_address(cfg: Config) -> None:
    """ClusterError when the `host:port` (or `ray://host:port`) in run.ray_address / RAY_ADDRESS accepts no
    TCP connection within RAY_CONNECT_TIMEOUT_S: said at once instead of ray.init's minutes of retries.
    `auto` and `local` are Ray's own lookups and are left to it."""
    import os
    import socket

    key = "run.ray_address" if cfg.run.ray_address else "RAY_ADDRESS"
    address = cfg.run.ray_address or os.environ.get("RAY_ADDRESS") or ""
    hostport = address.removeprefix("ray://").split("/", 1)[0]
    if address in ("auto", "local") or ":" not in hostport:
        return
    host, _, port = hostport.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=RAY_CONNECT_TIMEOUT_S).close()
    except (OSError, ValueError) as e:
        why = "timed out" if isinstance(e, TimeoutError) else (getattr(e, "strerror", None) or str(e))
        raise ClusterError(f"{key}={address!r}: no Ray cluster answers at {hostport} ({why}, waited at most "
                           f"{RAY_CONNECT_TIMEOUT_S:g} s); start it (`ray start --head`), fix the address, or unset "
                           f"{key} to run on an embedded cluster") from None

