"""One error path: every kind of bad input ends in exit status 2 and one `error: ...` line naming
the file, key or row and the fix -- no traceback, and before Ray or any actor starts.

The cases run the real CLI entry point `async_april.cli.main` in this process (what
`python -m async_april` and the `async-april` script call; `test_the_entry_points_behave_alike`
runs a few of them as real subprocesses too), with `ray.init` patched to fail the test if
anything got as far as starting Ray. `train` and `check` share the resolver, so each case
runs through `train` (the costlier promise: nothing starts) and the `check` cases through
`check`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from async_april.launch import cli
from async_april.run.checkpoints import CheckpointManager
from async_april.models.tiny import ensure_tiny_model

REPO = Path(__file__).resolve().parent.parent
TINY = str(REPO / "configs" / "tiny_cpu.yaml")


class FakeLearner:
    def save_checkpoint(self, path):
        Path(path).mkdir()
        (Path(path) / "learner.json").write_text("{}")


def write(path: Path, text: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text) if isinstance(text, bytes) else path.write_text(text)
    return path


def jsonl(path: Path, rows: list) -> Path:
    return write(path, "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))


def model_without_tokenizer(t: Path) -> Path:
    d = t / "notok"
    d.mkdir()
    for name in ("config.json", "model.safetensors"):  # a model the engines could load, but no tokenizer
        shutil.copy(ensure_tiny_model() / name, d / name)
    return d


def checkpoint_of_another_model(t: Path) -> Path:
    mgr = CheckpointManager(t / "other")
    shape = {"model_type": "qwen2", "vocab_size": 151936, "hidden_size": 896, "num_hidden_layers": 24,  # Qwen2.5-0.5B
             "num_attention_heads": 14, "num_key_value_heads": 2, "intermediate_size": 4864, "tie_word_embeddings": True}
    return mgr.save(3, 3, FakeLearner(), {}, {"step": 3}, None, "h", shape)


def only_a_corrupt_checkpoint(t: Path) -> Path:
    mgr = CheckpointManager(t / "corrupt")
    path = mgr.save(1, 1, FakeLearner(), {}, {"step": 1}, None, "h", {})
    write(path / "manifest.json", '{"format": 2, "step": "one"')
    return path


def tampered_checkpoint(t: Path, edit, name: str = "store.json") -> Path:
    """A checkpoint of the tiny model with a real store state (a partial and finished samples), whose
    `name` (store.json or controller.json) `edit` changed, the manifest's size and sha256 updated to match
    as whoever edited it would: only reading the state back can tell."""
    import hashlib

    from async_april.run.checkpoints import model_shape
    from tests.test_store import abort, finish, make_store

    st = make_store()
    work = st.lease("a", 4, 0)
    st.push("a", [abort(work[0]), finish(work[2]), finish(work[3])])
    controller = {"step": 3, "policy_version": 3, "train/bad_steps": 0, "rollout/actor_restarts": 0, "time/elapsed_s": 1.0}
    path = CheckpointManager(t / "other").save(3, 3, FakeLearner(), st.state_dict(), controller, None, "h",
                                              model_shape(ensure_tiny_model()))
    doc = json.loads((path / name).read_text())
    write(path / name, json.dumps(edit(doc)))
    manifest = json.loads((path / "manifest.json").read_text())
    raw = (path / name).read_bytes()
    manifest["files"][name] = {"bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}
    write(path / "manifest.json", json.dumps(manifest))
    return path


def first_sample(doc: dict) -> dict:
    """The encoded tree's first dataclass object (a Sample of the partial buffer)."""
    return next(iter(doc["tree"]["partials"].values()))


def crafted(doc: dict, **change) -> dict:
    first_sample(doc).update(change)
    return doc


def used_run_dir(t: Path) -> Path:
    jsonl(t / "used" / "metrics.jsonl", [{"train/step": 1}])
    return t / "used"


def reward_module(t: Path, name: str, body: str) -> str:
    """`{'name:fn': 1}` for a reward module written into this test's import path."""
    write(t / "rewards_pkg" / f"{name}.py", body)
    return "reward.functions={'" + name + ":fn': 1}"


def with_preset(t: Path, preset: str) -> list[str]:
    write(t / "p.yaml", preset)
    return [str(write(t / "c.yaml", "defaults: [p.yaml]\n"))]


def data(t: Path, name: str, content: str | bytes) -> str:
    return f"data.source={write(t / name, content)}"


# (id, argv made from the test's tmp dir, what the one error line must say). "CFG" stands for the tiny config.
CASES = [
    # --- YAML and config
    ("yaml-syntax", lambda t: [str(write(t / "c.yaml", "run:\n  steps: [1, 2\n"))], r"c\.yaml'?: line 3, column 1: YAML syntax error"),
    ("yaml-empty", lambda t: [str(write(t / "c.yaml", ""))], r"c\.yaml' is empty; give at least one section"),
    ("yaml-not-a-mapping", lambda t: [str(write(t / "c.yaml", "- run\n- model\n"))], r"must hold a mapping of sections .* got a list"),
    ("yaml-not-utf8", lambda t: [str(write(t / "c.yaml", b"run:\n  name: \xff\n"))], r"c\.yaml' is not UTF-8 text"),
    ("config-missing", lambda t: [str(t / "nope.yaml")], r"config file '.*nope\.yaml' does not exist"),
    ("config-is-a-directory", lambda t: [str(t)], r"does not exist \(it is a directory\)"),
    ("preset-holds-a-list", lambda t: with_preset(t, "- a\n"), r"defaults entry 'p\.yaml' '.*p\.yaml' must hold a mapping"),
    ("preset-missing", lambda t: [str(write(t / "c.yaml", "defaults: [presets/nope.yaml]\n"))], r"defaults entry 'presets/nope\.yaml' not found"),
    ("preset-yaml-syntax", lambda t: with_preset(t, "a: [\n"), r"p\.yaml'?: line 2, column 1: YAML syntax error"),
    ("defaults-not-a-list", lambda t: [str(write(t / "c.yaml", "defaults: {a: 1}\n"))], r"`defaults` must be a list of YAML file paths"),
    ("unknown-key", lambda t: ["CFG", "rollout.n_sampels=8"], r"rollout\.n_sampels: unknown key"),
    ("value-out-of-range", lambda t: ["CFG", "rollout.n_samples=0"], r"rollout\.n_samples: Input should be greater than or equal to 1 \(got 0\)"),
    ("value-wrong-type", lambda t: ["CFG", "learner.lr=fast"], r"learner\.lr: Input should be a valid number"),
    ("override-without-equals", lambda t: ["CFG", "rollout.n_samples"], r"override 'rollout\.n_samples' is not of the form section\.key=value"),
    ("override-bad-yaml", lambda t: ["CFG", "run.name=[a"], r"override 'run\.name=\[a': the value is not valid YAML"),
    ("overwrite-and-resume", lambda t: ["CFG", "run.overwrite=true", "run.resume=auto"], r"set only one of them"),
    ("reward-timeout-without-workers", lambda t: ["CFG", "reward.timeout_s=5"], r"reward\.timeout_s needs reward\.num_workers >= 1"),
    ("sglang-moved-key", lambda t: ["CFG", "rollout.retries=3"], r"rollout\.retries has moved: set rollout\.sglang\.retries instead"),
    ("sglang-original-logprob", lambda t: ["CFG", "ENV:SGLANG_RETURN_ORIGINAL_LOGPROB=1", "rollout.engine=sglang", "rollout.temperature=0.7"],
     r"SGLANG_RETURN_ORIGINAL_LOGPROB=1 makes SGLang report logprobs before temperature scaling.*unset SGLANG_RETURN_ORIGINAL_LOGPROB"),
    # --- model
    ("model-missing", lambda t: ["CFG", "model.path=/nonexistent/model"], r"model\.path '/nonexistent/model' does not exist"),
    ("model-not-builtin", lambda t: ["CFG", "model.path=builtin:nope"], r"model\.path 'builtin:nope' is not a built-in model"),
    ("model-without-config", lambda t: ["CFG", f"model.path={t}"], r"has no config\.json"),
    ("model-hub-id-not-cached-offline", lambda t: ["CFG", f"ENV:HF_HUB_CACHE={t}/hub", "ENV:HF_HUB_OFFLINE=1", "model.path=Qwen/Qwen3-4B"],
     r"model\.path 'Qwen/Qwen3-4B' is not in the Hugging Face cache and HF_HUB_OFFLINE is set; fetch it .*`hf download Qwen/Qwen3-4B`"),
    ("model-without-tokenizer", lambda t: ["CFG", f"model.path={model_without_tokenizer(t)}"], r"no usable tokenizer in .*notok"),
    # --- checkpoints to resume
    ("resume-missing", lambda t: ["CFG", "run.resume=/nonexistent/step_00000001"], r"run\.resume='/nonexistent/step_00000001': no such checkpoint"),
    ("resume-without-checkpoints", lambda t: ["CFG", f"run.resume={t}"], r"no valid checkpoint under .*checkpoints; give a directory"),
    ("resume-only-corrupt", lambda t: ["CFG", f"run.resume={only_a_corrupt_checkpoint(t)}"], r"manifest\.json is not valid JSON.*no older valid checkpoint"),
    ("resume-another-model", lambda t: ["CFG", f"run.resume={checkpoint_of_another_model(t)}"],
     r"was saved for another model than model\.path \(vocab_size 151936 vs 19, hidden_size 896 vs 128.*resume with the model it was trained from"),
    # a state async-april never writes, its manifest made to match: one line naming the file, not a traceback after Ray started
    ("resume-crafted-class", lambda t: ["CFG", f"run.resume={tampered_checkpoint(t, lambda d: crafted(d, **{'$dc': 'os:system'}))}"],
     r"other/checkpoints/step_00000003/store\.json: state names dataclass 'os:system', which is not in .*ALLOWED_DATACLASSES; async-april never writes that"),
    ("resume-crafted-field", lambda t: ["CFG", f"run.resume={tampered_checkpoint(t, lambda d: (first_sample(d)['fields'].update(extend=1), d)[1])}"],
     r"store\.json: state gives async_april\.rollout\.trajectory:Sample fields it does not have: 'extend'"),
    ("resume-malformed-tag", lambda t: ["CFG", f"run.resume={tampered_checkpoint(t, lambda d: {**d, 'tree': {**d['tree'], 'version': {'$np': 'no-such-dtype', 'v': 1}}})}"],
     r"store\.json: not a state this code wrote \(TypeError"),
    ("resume-store-entry-unknown", lambda t: ["CFG", f"run.resume={tampered_checkpoint(t, lambda d: {**d, 'tree': {**d['tree'], 'dataset': []}})}"],
     r"store\.json: the store state holds entries a store does not have: dataset"),
    ("resume-store-entry-wrong-type", lambda t: ["CFG", f"run.resume={tampered_checkpoint(t, lambda d: {**d, 'tree': {**d['tree'], 'cursor': 'ten'}})}"],
     r"store\.json: the store state's 'cursor' is a str, not a int"),
    ("resume-store-accounting", lambda t: ["CFG", f"run.resume={tampered_checkpoint(t, lambda d: {**d, 'tree': {**d['tree'], 'cursor': 40}})}"],
     r"store\.json: rollout accounting broken: .*missing \[2, 3"),
    ("resume-controller-counts", lambda t: ["CFG", f"run.resume={tampered_checkpoint(t, lambda c: {**c, 'step': 'three'}, 'controller.json')}"],
     r"controller\.json lacks integer counts >= 0 for step; async-april never writes that"),
    # --- data
    ("data-missing", lambda t: ["CFG", "data.source=/nonexistent/d.jsonl"], r"data\.source '/nonexistent/d\.jsonl' does not exist"),
    ("data-unsupported-type", lambda t: ["CFG", data(t, "d.csv", "prompt\n1=\n")], r"unsupported file type '\.csv'"),
    ("data-bad-jsonl-row", lambda t: ["CFG", f"data.source={jsonl(t / 'd.jsonl', [{'prompt': '12='}, '{oops'])}"],
     r"d\.jsonl: line 2: malformed JSON .*set data\.on_bad_row=skip"),
    ("data-row-not-an-object", lambda t: ["CFG", f"data.source={jsonl(t / 'd.jsonl', ['[1, 2]'])}"], r"line 1: a row must be a JSON object, got list"),
    ("data-wrong-column", lambda t: ["CFG", f"data.source={jsonl(t / 'd.jsonl', [{'question': '12='}])}"],
     r"line 1: no 'prompt' column \(set data\.prompt_key\); columns: \['question'\]"),
    ("data-not-utf8", lambda t: ["CFG", data(t, "d.jsonl", b'{"prompt": "1\xff="}\n')], r"line 1: not UTF-8 text"),
    ("data-all-prompts-too-long", lambda t: ["CFG", "data.max_prompt_len=2"],
     r"no usable prompt at all \(4096 over data\.max_prompt_len=2.*set data\.on_long_prompt=truncate"),
    ("data-empty-file", lambda t: ["CFG", data(t, "d.jsonl", "")], r"no usable prompt at all \(0 over"),
    ("data-corrupt-parquet", lambda t: ["CFG", data(t, "d.parquet", b"PAR1 this is not parquet")], r"is not a readable parquet file"),
    # --- rewards
    ("reward-unknown-name", lambda t: ["CFG", "reward.functions={nope: 1}"], r"reward 'nope' is not a registered name"),
    ("reward-module-missing", lambda t: ["CFG", "reward.functions={'no_such_module_xyz:fn': 1}"], r"cannot import module no_such_module_xyz"),
    ("reward-function-missing", lambda t: ["CFG", "reward.functions={'tests.fault_rewards:nope': 1}"],
     r"module tests\.fault_rewards has no attribute nope; check the function name"),
    ("reward-module-raises", lambda t: ["CFG", reward_module(t, "broken_rwd", "1 / 0")], r"importing module broken_rwd raised ZeroDivisionError"),
    ("reward-wrong-signature", lambda t: ["CFG", reward_module(t, "narrow_rwd", "def fn(prompt, response):\n    return 0.0\n")],
     r"cannot be called as fn\(prompt=\.\.\., response=\.\.\., answer=\.\.\., \*\*extra\)"),
    ("reward-not-callable", lambda t: ["CFG", "reward.functions={'async_april.rewards.reverse:EOS_TEXTS': 1}"], r"is a tuple, not a function"),
    # --- run directory
    ("run-dir-is-a-file", lambda t: ["CFG", f"run.dir={write(t / 'f', 'x')}"], r"run\.dir .*/f is a file, not a directory"),
    ("run-dir-not-writable", lambda t: ["CFG", "run.dir=/proc/async-april-test/run"], r"run\.dir /proc/async-april-test/run is not writable"),
    ("run-dir-used", lambda t: ["CFG", f"run.dir={used_run_dir(t)}"],
     r"already holds a run \(metrics\.jsonl has 1 row\); nothing was changed\. Continue it with run\.resume=auto.*run\.name.*run\.overwrite=true"),
    ("run-dir-holds-other-files", lambda t: ["CFG", f"run.dir={write(t / 'mine' / 'notes.txt', 'x').parent}"], r"is not empty \(files no run writes: notes\.txt\); nothing was changed"),
    ("run-dir-relative-under-ray-job", lambda t: ["CFG", "run.dir=runs/x", "ENV:RAY_JOB_CONFIG_JSON_ENV_VAR={}"],
     r"run\.dir='runs/x' is relative, and under `ray job submit` it would land in Ray's temporary copy"),
]

PLOT_CASES = [
    ("plot-missing-dir", lambda t: [str(t / "nope")], r"is not a directory; give a run directory"),
    ("plot-not-a-run-dir", lambda t: [str(t)], r"holds no metrics\.jsonl: not a run directory"),
    ("plot-malformed-line", lambda t: [str(jsonl(t / "metrics.jsonl", [{"train/step": 1}, "{bad", {"train/step": 2}]).parent)],
     r"metrics\.jsonl: line 2 is not JSON"),
    ("plot-not-metrics", lambda t: [str(jsonl(t / "metrics.jsonl", [{"loss": 1}]).parent)], r"line 1 has no train/step"),
    ("plot-empty-metrics", lambda t: [str(write(t / "metrics.jsonl", "").parent)], r"has no rows yet"),
]


@pytest.fixture
def no_ray(monkeypatch):
    """Starting Ray fails the test: every bad input must be refused before that."""
    import ray

    def refuse(*a, **k):
        raise AssertionError("Ray was started before the bad input was refused")

    monkeypatch.setattr(ray, "init", refuse)


def run_cli(argv: list[str], capsys, monkeypatch, tmp_path: Path) -> tuple[int, str, str]:
    args = []
    for a in argv:
        if a.startswith("ENV:"):
            k, _, v = a[4:].partition("=")
            monkeypatch.setenv(k, v)
        else:
            args.append(TINY if a == "CFG" else a)
    if len(args) >= 2 and args[1] == TINY and not any(a.startswith("run.dir=") for a in args[2:]):
        args.insert(2, f"run.dir={tmp_path}/run")
    monkeypatch.syspath_prepend(str(tmp_path / "rewards_pkg"))
    rc = cli.main(args)
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_error_line(rc: int, err: str, pattern: str) -> None:
    assert rc == 2, err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, err
    import re

    assert re.search(pattern, errors[0]), errors[0]


@pytest.mark.parametrize("case, argv, pattern", CASES, ids=[c[0] for c in CASES])
def test_bad_input_exits_2_with_one_line_before_ray(case, argv, pattern, tmp_path, capsys, monkeypatch, no_ray):
    made = argv(tmp_path)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    rc, _, err = run_cli(["train", *made], capsys, monkeypatch, tmp_path)
    assert_one_error_line(rc, err, pattern)
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before, "a refused run changed files"
    assert not (tmp_path / "run").exists(), "the run directory was created for a run that never started"


CHECK_CASES = ["yaml-syntax", "model-missing", "resume-missing", "data-missing", "data-wrong-column",
               "reward-unknown-name", "reward-function-missing", "run-dir-used", "resume-another-model", "resume-crafted-class"]


@pytest.mark.parametrize("case", CHECK_CASES)
def test_check_resolves_what_train_resolves(case, tmp_path, capsys, monkeypatch, no_ray):
    _, argv, pattern = next(c for c in CASES if c[0] == case)
    rc, _, err = run_cli(["check", *argv(tmp_path)], capsys, monkeypatch, tmp_path)
    assert_one_error_line(rc, err, pattern)


@pytest.mark.parametrize("case, argv, pattern", PLOT_CASES, ids=[c[0] for c in PLOT_CASES])
def test_plot_bad_input_exits_2_with_one_line(case, argv, pattern, tmp_path, capsys, monkeypatch):
    rc, _, err = run_cli(["plot", *argv(tmp_path)], capsys, monkeypatch, tmp_path)
    assert_one_error_line(rc, err, pattern)


def test_plot_skips_a_cut_short_last_line_with_a_warning(tmp_path, capsys):
    """What a killed run leaves: the last line half-written. The plot is made from the rows before it."""
    write(tmp_path / "metrics.jsonl", json.dumps({"train/step": 1, "rollout/reward_mean": 0.5}) + "\n"
          + json.dumps({"train/step": 2, "rollout/reward_mean": 0.6}) + "\n" + '{"train/step": 3, "rollout/rew')
    assert cli.main(["plot", str(tmp_path)]) == 0
    _, err = capsys.readouterr()
    assert "line 3 is cut short" in err and "Traceback" not in err
    assert (tmp_path / "metrics.png").stat().st_size > 0


def test_check_prints_what_it_resolved(tmp_path, capsys, monkeypatch, no_ray):
    rc, out, err = run_cli(["check", "CFG"], capsys, monkeypatch, tmp_path)
    assert rc == 0, err
    assert f"dir: {tmp_path}/run" in out  # the absolute run dir, in the resolved config
    for what in (f"run dir {tmp_path}/run (new)", "model ", "hidden 128, 4 layers", "data builtin:reverse: 64 prompts",
                 "rewards reverse_match x1", "resume: no"):
        assert what in err, what
    assert not (tmp_path / "run").exists(), "check wrote the run directory"


def test_help_per_subcommand_and_version(capsys):
    for cmd, want in (("train", "CONFIG"), ("check", "resolve a config"), ("plot", "RUN_DIR"), ("build-model", "--cache-dir")):
        with pytest.raises(SystemExit) as e:
            cli.main([cmd, "--help"])
        out = capsys.readouterr().out
        assert e.value.code == 0 and f"async-april {cmd}" in out and want in out, out
        assert "does not exist" not in out
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"async-april {cli.version()}"
    for argv, want in ((["nope"], "invalid choice: 'nope'"), (["train"], "the following arguments are required: CONFIG"),
                       (["check", TINY, "--bogus"], "unrecognized arguments: --bogus")):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == 2 and want in capsys.readouterr().err


def test_the_entry_points_behave_alike(tmp_path):
    """`python -m async_april`, `python -m async_april.train` and the `async-april` script are the same
    path as `cli.main` above: exit 2, one error line, no traceback, no Ray."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    script = Path(sys.executable).with_name("async-april")
    runs = [
        ([sys.executable, "-m", "async_april", "train", TINY, f"run.dir={tmp_path}/a", "model.path=/nonexistent/model"],
         r"model\.path '/nonexistent/model' does not exist"),
        ([sys.executable, "-m", "async_april.train", str(write(tmp_path / "c.yaml", "run: [")), ], r"YAML syntax error"),
    ]
    if script.exists():
        runs.append(([str(script), "check", TINY, "rollout.n_samples=0"], r"rollout\.n_samples"))
    for argv, pattern in runs:
        proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
        assert_one_error_line(proc.returncode, proc.stderr, pattern)
        assert "Started a local Ray instance" not in proc.stderr + proc.stdout
    assert not (tmp_path / "a").exists()
    if script.exists():
        proc = subprocess.run([str(script), "--version"], env=env, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0 and proc.stdout.startswith("async-april ")


def test_check_lists_every_problem_it_finds_and_train_stops_at_the_first(tmp_path, capsys, monkeypatch, no_ray):
    """A recipe (logging.wandb=online) without a W&B key and with its hub model not cached: `check` names
    both, one `error:` line each, says which checks it skipped because they need the model, and exits 2
    (before, it stopped at the key and never said the model was missing). `train` stops at the first."""
    recipe = str(REPO / "configs" / "recipes" / "qwen3-4b_dapo_1gpu_async.yaml")
    for var in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "RAY_ADDRESS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    rc, _, err = run_cli(["check", recipe, f"run.dir={tmp_path}/run"], capsys, monkeypatch, tmp_path)
    assert rc == 2 and "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 2, err
    assert errors[0].startswith("error: logging.wandb=online needs a W&B API key")
    assert errors[1].startswith("error: model.path 'Qwen/Qwen3-4B' is not in the Hugging Face cache")
    skipped = next(line for line in err.splitlines() if "not checked, since what they need failed" in line)
    for what in ("model files", "tokenizer", "data", "memory plan"):
        assert what in skipped, skipped
    assert err.splitlines()[-1] == errors[-1]  # the problems come last
    rc, _, err = run_cli(["train", recipe, f"run.dir={tmp_path}/run"], capsys, monkeypatch, tmp_path)
    assert_one_error_line(rc, err, r"logging\.wandb=online needs a W&B API key")
