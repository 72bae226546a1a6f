"""Bad input, second round (issue 31): one parametrised test per class of input that used to end in a
traceback, a hang, a flood of output or a silent wrong result. Each case names the example from the
issue or a case of its own in the same class; every one failed on the code before the fix.

The cases run the real CLI entry point (`cli.main`) with `ray.init` patched to fail (the `no_ray`
fixture of tests/test_bad_input.py), and assert exit 2, one `error:` line of bounded length naming
the key, file or row, and, for `train`, that nothing was written. Faults found after start-up
(durability, the run lock, checkpoints from elsewhere, secrets) are in tests/test_fault_classes.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
from pathlib import Path

import pytest

from async_april.models.tiny import ensure_tiny_model
from tests.test_bad_input import FakeLearner, jsonl, no_ray, run_cli, write  # noqa: F401 - no_ray is a fixture

ONE_LINE_MAX = 1007
"""`error: ` and at most 1000 characters (async_april/errors.py MAX_LINE), whatever the input quotes."""


def assert_bounded_error(rc: int, err: str, pattern: str) -> str:
    assert rc == 2, err[-2000:]
    assert "Traceback" not in err, err[-2000:]
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, err[-2000:]
    assert len(lines[0]) <= ONE_LINE_MAX, f"an error line of {len(lines[0])} characters"
    assert re.search(pattern, lines[0]), lines[0]
    return lines[0]


def check_case(argv: list[str], pattern: str, tmp_path: Path, capsys, monkeypatch, command: str = "train") -> str:
    """`command` on `argv` exits 2 with one bounded line matching `pattern`; a refused `train` changed no file."""
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    rc, _, err = run_cli([command, *argv], capsys, monkeypatch, tmp_path)
    line = assert_bounded_error(rc, err, pattern)
    if command == "train":
        assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before, "a refused run changed files"
        assert not (tmp_path / "run").exists(), "the run directory was created for a run that never started"
    return line


# ------------------------------------------------------------------ recursion and explosion

def alias_bomb(levels: int, width: int = 10) -> str:
    """`a0: &a0 [x, x, ...]`, `a1: &a1 [*a0, *a0, ...]`, ...: width**levels values from a few hundred bytes."""
    lines = [f"a0: &a0 [{', '.join(['x'] * width)}]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * width)}]" for i in range(1, levels)]
    return "\n".join(lines) + f"\nrun: {{name: *a{levels - 1}}}\n"


def data_row(t: Path, line: str) -> str:
    """`data.source=` a JSONL file holding `line` (written as is: JSON escapes stay escapes)."""
    return f"data.source={write(t / 's.jsonl', line + chr(10))}"


def deep_manifest_checkpoint(t: Path) -> str:
    from async_april.run.checkpoints import CheckpointManager

    path = CheckpointManager(t / "deep").save(1, 1, FakeLearner(), {}, {"step": 1}, None, "h", {})
    write(path / "manifest.json", '{"format": 2, "step": ' + "[" * 50_000 + "]" * 50_000 + "}")
    return f"run.resume={path}"


RECURSION = [
    ("defaults-cycle", lambda t: [write(t / "b.yaml", "defaults: [a.yaml]\n") and str(write(t / "a.yaml", "defaults: [b.yaml]\n"))],
     r"defaults entry 'a\.yaml' in '.*b\.yaml' includes a file that includes it back \(a\.yaml -> b\.yaml -> a\.yaml\)"),
    ("self-include", lambda t: [str(write(t / "s.yaml", "defaults: [s.yaml]\n"))], r"includes it back \(s\.yaml -> s\.yaml\)"),
    ("cycle-through-a-subdirectory", lambda t: [write(t / "p" / "q.yaml", "defaults: [../c.yaml]\n") and str(write(t / "c.yaml", "defaults: [p/q.yaml]\n"))],
     r"includes it back \(c\.yaml -> q\.yaml -> c\.yaml\)"),
    ("deep-yaml-config", lambda t: [str(write(t / "d.yaml", "run:\n  name: " + "[" * 5000 + "]" * 5000 + "\n"))],
     r"d\.yaml': line 2: nested more than 100 levels deep"),
    ("deep-yaml-mapping", lambda t: [str(write(t / "d.yaml", "".join("  " * i + f"k{i}:\n" for i in range(300)) + "  " * 300 + "v\n"))],
     r"nested more than 100 levels deep"),
    ("deep-override", lambda t: ["CFG", "run.name=" + "[" * 3000 + "]" * 3000], r"override '.*: line 1: nested more than 100 levels deep"),
    ("alias-bomb", lambda t: [str(write(t / "bomb.yaml", alias_bomb(6)))], r"bomb\.yaml': line \d+: its aliases expand to more than 100000 values"),
    ("alias-bomb-in-override", lambda t: ["CFG", "run.name=" + alias_bomb(6).replace("\n", ", ").replace("run: {name: *a5}, ", "z: *a5")
                                          .join(["{", "}"])], r"aliases expand to more than 100000 values"),
    ("big-value-under-the-alias-limit", lambda t: [str(write(t / "big.yaml", alias_bomb(4)))],
     r"run\.name: Input should be a valid string \(got \[\[\["),
    ("duplicated-top-level-key", lambda t: [str(write(t / "dup.yaml", "run: {steps: 7}\nrollout: {n_samples: 2}\nrun: {name: x}\n"))],
     r"dup\.yaml': line 3: key 'run' appears twice \(first on line 1\); keep one of them"),
    ("duplicated-key-in-a-section", lambda t: [str(write(t / "dup.yaml", "rollout:\n  n_samples: 2\n  n_samples: 4\n"))],
     r"line 3: key 'n_samples' appears twice \(first on line 2\)"),
    ("deep-data-row", lambda t: ["CFG", data_row(t, '{"prompt": "1=", "x": ' + "[" * 100_000 + "]" * 100_000 + "}")],
     r"s\.jsonl: line 1: malformed JSON \(nested more than 100 levels deep\)\. Fix the row, or set data\.on_bad_row=skip"),
    ("deep-manifest", lambda t: ["CFG", deep_manifest_checkpoint(t)],
     r"manifest\.json is not valid JSON \(nested more than 100 levels deep\); and no older valid checkpoint next to it"),
]


@pytest.mark.parametrize("case, argv, pattern", RECURSION, ids=[c[0] for c in RECURSION])
def test_structures_that_recurse_or_explode_exit_2_with_a_bounded_line(case, argv, pattern, tmp_path, capsys, monkeypatch, no_ray):
    check_case(argv(tmp_path), pattern, tmp_path, capsys, monkeypatch)


def test_a_deep_metrics_line_is_refused_by_plot_in_one_bounded_line(tmp_path, capsys, monkeypatch):
    jsonl(tmp_path / "metrics.jsonl", ['{"train/step": ' + "[" * 100_000 + "]" * 100_000 + "}", {"train/step": 2}])
    check_case([str(tmp_path)], r"metrics\.jsonl: line 1 is not JSON \(nested more than 100 levels deep\)", tmp_path,
               capsys, monkeypatch, command="plot")


# ------------------------------------------------------------------ values the schema admitted

VALUES = [
    ("betas-above-one", ["learner.betas=[2, 0.5]"], r"learner\.betas\.0: Input should be less than 1 \(got 2\)"),
    ("beta2-equal-to-one", ["learner.betas=[0.9, 1.0]"], r"learner\.betas\.1: Input should be less than 1 \(got 1\.0\)"),
    ("beta-negative", ["learner.betas=[-0.1, 0.99]"], r"learner\.betas\.0: Input should be greater than or equal to 0"),
    ("weight-decay-inf", ["learner.weight_decay=.inf"], r"learner\.weight_decay: Input should be a finite number \(got inf\)"),
    ("weight-decay-nan", ["learner.weight_decay=.nan"], r"learner\.weight_decay: Input should be a finite number \(got nan\)"),
    ("lr-times-weight-decay-over-one", ["learner.lr=0.5", "learner.weight_decay=4"],
     r"learner\.lr x learner\.weight_decay = 2 must be below 1 \(AdamW multiplies the weights by 1 - lr x weight_decay"),
    ("reward-weight-nan", ["reward.functions={reverse_match: .nan}"], r"reward\.functions\.reverse_match: Input should be a finite number \(got nan\)"),
    ("reward-weight-inf", ["reward.functions={reverse_match: -.inf}"], r"reward\.functions\.reverse_match: Input should be a finite number"),
    ("grad-clip-inf", ["learner.grad_clip=.inf"], r"learner\.grad_clip: Input should be a finite number \(got inf\)"),
    ("temperature-nan", ["rollout.temperature=.nan"], r"rollout\.temperature: Input should be a finite number \(got nan\)"),
    ("adv-eps-inf", ["algorithm.adv_eps=.inf"], r"algorithm\.adv_eps: Input should be a finite number"),
]


@pytest.mark.parametrize("case, over, pattern", VALUES, ids=[c[0] for c in VALUES])
def test_values_that_break_training_are_refused_naming_the_key(case, over, pattern, tmp_path, capsys, monkeypatch, no_ray):
    check_case(["CFG", *over], pattern, tmp_path, capsys, monkeypatch)


# ------------------------------------------------------------------ model and text the engines open

def tiny_copy(t: Path, name: str, mutate) -> str:
    d = t / name
    shutil.copytree(ensure_tiny_model(), d)
    mutate(d)
    return f"model.path={d}"


def _config(d: Path, **changes) -> None:
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


def _shard(d: Path, missing: bool, second: str = "model-00002-of-00002.safetensors") -> None:
    """Two shards as the hub cache lays them out: symlinks into a blobs/ directory next to the snapshot."""
    blobs = d.parent / f"{d.name}-blobs"
    blobs.mkdir()
    (d / "model.safetensors").rename(blobs / "1")
    (d / "model-00001-of-00002.safetensors").symlink_to(blobs / "1")
    if not missing:
        (d / second).symlink_to(blobs / "1")
    weight_map = {"a": "model-00001-of-00002.safetensors", "b": second}
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _truncate(p: Path) -> None:
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])


MODEL_TEXT = [
    ("model-without-weights", lambda t: tiny_copy(t, "nowt", lambda d: (d / "model.safetensors").unlink()),
     r"model\.path '.*nowt': .*nowt has no weights \(none of model\.safetensors, .*\); copy the model's weight files there"),
    ("corrupt-model-safetensors", lambda t: tiny_copy(t, "bad", lambda d: (d / "model.safetensors").write_bytes(os.urandom(64))),
     r"model\.safetensors: header length \d+ does not fit the file's 64 bytes \(corrupt\); re-download or re-export"),
    ("truncated-model-safetensors", lambda t: tiny_copy(t, "cut", lambda d: _truncate(d / "model.safetensors")),
     r"model\.safetensors: tensor '.*' lies outside the file's \d+ data bytes \(corrupt\)"),
    ("index-naming-a-missing-shard", lambda t: tiny_copy(t, "shards", lambda d: _shard(d, missing=True)),
     r"shard model-00002-of-00002\.safetensors named by model\.safetensors\.index\.json is missing"),
    ("index-naming-a-path-elsewhere", lambda t: tiny_copy(t, "far", lambda d: _shard(d, missing=True, second="../far-blobs/1")),
     r"model\.safetensors\.index\.json names a shard that is not a file name in the model directory"),
    ("config-json-a-list", lambda t: tiny_copy(t, "cl", lambda d: (d / "config.json").write_text("[1, 2]")),
     r"cl/config\.json holds a list, not a JSON object"),
    ("config-json-model-type-null", lambda t: tiny_copy(t, "mtn", lambda d: _config(d, model_type=None)),
     r"mtn/config\.json has model_type None; transformers picks the model class by it"),
    ("config-json-not-json", lambda t: tiny_copy(t, "nj", lambda d: (d / "config.json").write_text("{oops")),
     r"nj/config\.json is not readable JSON"),
    ("prompt-with-a-lone-surrogate", lambda t: data_row(t, r'{"prompt": "12\ud800="}'),
     r"s\.jsonl: line 1: column 'prompt' holds a lone surrogate \(U\+D800 at character 2\), which is not Unicode text"),
    ("answer-with-a-lone-surrogate", lambda t: data_row(t, r'{"prompt": "12=", "answer": "\udfff"}'),
     r"column 'answer' holds a lone surrogate \(U\+DFFF"),
    ("chat-message-with-a-lone-surrogate", lambda t: data_row(t, r'{"prompt": [{"role": "user", "content": "\ud83d"}]}'),
     r"column 'prompt' holds a lone surrogate \(U\+D83D"),
]


@pytest.mark.parametrize("case, over, pattern", MODEL_TEXT, ids=[c[0] for c in MODEL_TEXT])
def test_check_opens_model_and_text_the_way_the_engines_will(case, over, pattern, tmp_path, capsys, monkeypatch, no_ray):
    check_case(["CFG", over(tmp_path)], pattern, tmp_path, capsys, monkeypatch, command="check")


def test_a_sharded_model_with_every_shard_present_resolves(tmp_path, capsys, monkeypatch, no_ray):
    """The other side of `index-naming-a-missing-shard`: the check accepts a complete sharded model whose
    shards are symlinks into blobs/, as in the Hugging Face cache."""
    from async_april.weights.files import check_model_dir

    d = Path(tiny_copy(tmp_path, "ok", lambda d: _shard(d, missing=False)).partition("=")[2])
    assert check_model_dir(d, str(d))["model_type"] == json.loads((ensure_tiny_model() / "config.json").read_text())["model_type"]


# ------------------------------------------------------------------ code the config names

EXITS = {"exit0": "import sys\nsys.exit(0)\n", "exit3": "import sys\nsys.exit(3)\n", "exit-msg": "raise SystemExit('bye')\n"}


def code_module(t: Path, name: str, body: str) -> str:
    write(t / "rewards_pkg" / f"{name}.py", body + "def fn(prompt, response, answer, **extra):\n    return 0.0\n"
          "class Env:\n    pass\n")
    return name


CODE = [
    ("reward-sys-exit-0-at-import", lambda t: f"reward.functions={{'{code_module(t, 'ex0', EXITS['exit0'])}:fn': 1}}",
     r"reward 'ex0:fn': importing module ex0 called sys\.exit\(0\); a module named in the config must not exit"),
    ("reward-sys-exit-3-at-import", lambda t: f"reward.functions={{'{code_module(t, 'ex3', EXITS['exit3'])}:fn': 1}}",
     r"importing module ex3 called sys\.exit\(3\)"),
    ("reward-raise-systemexit-at-import", lambda t: f"reward.functions={{'{code_module(t, 'exm', EXITS['exit-msg'])}:fn': 1}}",
     r"importing module exm called sys\.exit\('bye'\)"),
    ("env-sys-exit-at-import", lambda t: f"rollout.env={code_module(t, 'envx', EXITS['exit0'])}:Env",
     r"rollout\.env 'envx:Env': importing module envx called sys\.exit\(0\)"),
]


@pytest.mark.parametrize("case, over, pattern", CODE, ids=[c[0] for c in CODE])
def test_code_the_config_names_that_exits_is_contained_like_code_that_raises(case, over, pattern, tmp_path, capsys,
                                                                           monkeypatch, no_ray):
    check_case(["CFG", over(tmp_path)], pattern, tmp_path, capsys, monkeypatch)


# ------------------------------------------------------------------ things that hung or crashed

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def a_checkpoint(t: Path) -> Path:
    from async_april.run.checkpoints import CheckpointManager

    return CheckpointManager(t / "r").save(1, 1, FakeLearner(), {}, {"step": 1}, None, "h", {})


HANGS = [
    ("unreachable-ray-address", "check", lambda t: ["CFG", f"ENV:RAY_ADDRESS=127.0.0.1:{free_port()}"],
     r"RAY_ADDRESS='127\.0\.0\.1:\d+': no Ray cluster answers at 127\.0\.0\.1:\d+ \(Connection refused, waited at most 10 s\)"),
    ("unreachable-run-ray-address", "check", lambda t: ["CFG", f"run.ray_address=ray://127.0.0.1:{free_port()}"],
     r"run\.ray_address='ray://127\.0\.0\.1:\d+': no Ray cluster answers .*unset run\.ray_address"),
    ("wandb-online-without-a-key", "train", lambda t: ["CFG", "logging.wandb=online", "ENV:WANDB_API_KEY=", f"ENV:HOME={t}",
                                                       f"ENV:NETRC={t}/no-netrc"],
     r"logging\.wandb=online needs a W&B API key for api\.wandb\.ai: set WANDB_API_KEY or run `wandb login`, or set logging\.wandb=offline"),
    ("disk-dir-without-the-disk-transport", "train", lambda t: ["CFG", f"weight_sync.disk_dir={t}/w"],
     r"weight_sync\.disk_dir is only used by weight_sync\.transport=disk \(this config has object_store\)"),
    ("export-under-a-file", "export", lambda t: [str(a_checkpoint(t)), str(write(t / "afile", "x") / "out")],
     r"OUT_DIR '.*afile/out' lies under .*afile, which is a file, not a directory"),
    ("plot-out-without-png", "plot", lambda t: [str(jsonl(t / "metrics.jsonl", [{"train/step": 1}]).parent), "--out", str(t / "plot.txt")],
     r"--out '.*plot\.txt': give a file name ending in \.png, or an existing directory"),
]


@pytest.mark.parametrize("case, command, argv, pattern", HANGS, ids=[c[0] for c in HANGS])
def test_what_hung_or_crashed_says_why_in_one_line(case, command, argv, pattern, tmp_path, capsys, monkeypatch, no_ray):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    check_case(argv(tmp_path), pattern, tmp_path, capsys, monkeypatch, command=command)


def test_plot_out_dir_writes_metrics_png_in_it_and_prints_that_path(tmp_path, capsys):
    from async_april.launch import cli

    jsonl(tmp_path / "metrics.jsonl", [{"train/step": 1, "rollout/reward_mean": 0.1}, {"train/step": 2, "rollout/reward_mean": 0.3}])
    out = tmp_path / "plots"
    out.mkdir()
    assert cli.main(["plot", str(tmp_path), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out / "metrics.png")
    assert (out / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and not (tmp_path / "plots.png").exists()


def test_weight_sync_disk_dir_is_the_directory_the_disk_transport_uses(tmp_path):
    from async_april.config import load_config
    from learners.weight_sync import WeightSyncer

    cfg = load_config(None, [f"run.dir={tmp_path}/run", "weight_sync.transport=disk", f"weight_sync.disk_dir={tmp_path}/shared"])
    assert WeightSyncer.from_config(cfg).disk_dir == tmp_path / "shared"
    cfg = load_config(None, [f"run.dir={tmp_path}/run", "weight_sync.transport=disk"])
    assert WeightSyncer.from_config(cfg).disk_dir == tmp_path / "run" / "weights"  # the default, as documented


# ------------------------------------------------------------------ security, on the command line

def home_like(t: Path) -> Path:
    write(t / "home" / "notes.txt", "mine")
    write(t / "home" / ".bashrc", "export X=1")
    return t / "home"


def run_dir_with_a_stranger(t: Path) -> Path:
    jsonl(t / "old" / "metrics.jsonl", [{"train/step": 1}])
    write(t / "old" / "thesis.tex", "mine")
    return t / "old"


SECURITY_CLI = [
    ("overwrite-a-home-directory", lambda t: ["CFG", f"run.dir={home_like(t)}", "run.overwrite=true"],
     r"run\.overwrite=true only replaces a run directory, and run\.dir .*home is not one \(it holds files no run writes: "
     r"\.bashrc, notes\.txt\); nothing was moved"),
    ("overwrite-a-run-dir-holding-other-files", lambda t: ["CFG", f"run.dir={run_dir_with_a_stranger(t)}", "run.overwrite=true"],
     r"only replaces a run directory, and run\.dir .*old is not one \(it holds files no run writes: thesis\.tex\)"),
]


@pytest.mark.parametrize("case, argv, pattern", SECURITY_CLI, ids=[c[0] for c in SECURITY_CLI])
def test_run_overwrite_only_ever_moves_a_run_directory(case, argv, pattern, tmp_path, capsys, monkeypatch, no_ray):
    check_case(argv(tmp_path), pattern, tmp_path, capsys, monkeypatch)
    assert not list(tmp_path.glob("*.old-*")), "something was moved aside"


def test_check_says_which_user_modules_it_imported(tmp_path, capsys, monkeypatch, no_ray):
    """`check` starts no Ray and no actor but does import the reward module the config names: it says so."""
    name = code_module(tmp_path, "said_rwd", "")
    rc, _, err = run_cli(["check", "CFG", f"reward.functions={{'{name}:fn': 1}}"], capsys, monkeypatch, tmp_path)
    assert rc == 0, err
    assert "imported said_rwd (reward.functions) (its import-time code ran here, and runs in every actor that uses it)" in err
