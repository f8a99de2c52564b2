"""The house's shape and the fixes that came with it (issue 25): imports that point down the
layers and never in a circle, deferred imports that say why, `pimm test` / `pimm predict` that read
one complete checkpoint while the run trains, the test after a longer training, a stop on the last
step, and the dry run's one `pimm launch` line that runs the same plan."""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import (
    REPO,
    attempts,
    copy_exp,
    kill_run,
    launch,
    pimm_in_process,
    run_pimm,
    start_launch,
    wait_for_run,
)

from pimm.checkpoint import choose
from pimm.checkpoint.choose import choose_weights, hold_weights, recorded_weights
from pimm.checkpoint.layout import BEST, BEST_RECORD, LAST, CheckpointError, read_manifest, sha256_file, write_manifest
from pimm.cli import build_parser
from pimm.data.predictions import open_predictions
from pimm.errors import EXIT_CHECKPOINTED, EXIT_SECOND_SIGNAL, PimmError
from pimm.launch.node import ending
from pimm.launch.preflight import prepare_launch

PACKAGE = REPO / "pimm"
# top to bottom: a module imports its own layer (in no circle) and the layers below it
LAYERS = (
    ("pimm.__main__", "pimm.docs_reference"),
    ("pimm.cli",),
    ("pimm.validate",),
    ("pimm.launch",),
    ("pimm.engine",),
    ("pimm.checkpoint", "pimm.tasks"),  # a task's meter sums its counts over the ranks (distributed.env)
    ("pimm.distributed",),
    ("pimm.models", "pimm.display"),
    ("pimm.data",),
    ("pimm",),  # the ground floor: config/, registry, provenance, signals, errors, names, json_io, files
)


def _module(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, list[tuple[str, int]]]:
    """module -> [(pimm module it imports, line)] for every import, at the top or inside a function."""
    modules = {_module(p): p for p in PACKAGE.rglob("*.py")}
    found: dict[str, list[tuple[str, int]]] = {}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("pimm"):
                targets = [f"{node.module}.{a.name}" for a in node.names]
                found.setdefault(name, []).extend(
                    (t if t in modules else node.module, node.lineno) for t in targets)
            elif isinstance(node, ast.Import):
                found.setdefault(name, []).extend((a.name, node.lineno) for a in node.names
                                                  if a.name.startswith("pimm"))
    return found


def _layer(module: str) -> int:
    for depth, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return depth
    raise AssertionError(f"{module} is on no layer of LAYERS")


def test_imports_point_down_the_layers_and_never_in_a_circle():
    imports = _imports()
    up = [f"{a}:{line} imports {b}" for a, edges in imports.items() for b, line in edges if _layer(b) < _layer(a)]
    assert not up, "imports that run up the layers (docs/contributing.md#layers):\n" + "\n".join(up)
    graph = {a: {b for b, _ in edges if b != a} for a, edges in imports.items()}
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(module: str, path: list[str]) -> list[str] | None:
        state[module] = 1
        for child in sorted(graph.get(module, ())):
            if state.get(child) == 1:
                return [*path[path.index(child):], child] if child in path else [module, child]
            if child not in state and (circle := visit(child, [*path, child])):
                return circle
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state:
            circle = visit(module, [module])
            assert circle is None, "modules that import each other: " + " -> ".join(circle)


def test_every_import_inside_a_function_says_why_it_is_deferred():
    """Imports stand at the top of a module; one inside a function keeps a heavy dependency (torch,
    h5py, matplotlib, an optional package) out of `pimm --help` or the launcher, and says so in a
    `# deferred: ...` comment on its line or above its block."""
    silent = []
    for path in sorted(PACKAGE.rglob("*.py")):
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and node.col_offset > 0:
                first = node.lineno - 1
                while first > 0 and lines[first - 1].strip().startswith(("from ", "import ")):
                    first -= 1
                said = lines[node.lineno - 1] + (lines[first - 1] if first > 0 else "")
                if "deferred" not in said:
                    silent.append(f"{path.relative_to(REPO)}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    assert not silent, "imports inside functions without a `# deferred: why` comment:\n" + "\n".join(silent)


def _in_a_fresh_interpreter(code: str) -> dict:
    """Run `code` (which sets the dict `result`) in a new Python process that counts the garbage collector's
    runs; returns `result` with the collector's state after it: frozen objects, enabled, generations collected."""
    program = ("import gc, json, sys\ncollected = []\n"
               "gc.callbacks.append(lambda phase, info: phase == 'start' and collected.append(info['generation']))\n"
               f"{code}\nprint('RESULT', json.dumps(dict(result, frozen=gc.get_freeze_count(), enabled=gc.isenabled(), "
               "generations=sorted(set(collected)))))")
    res = subprocess.run([sys.executable, "-c", program], check=False, capture_output=True, text=True, cwd=REPO,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "RANK": "0"})
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.split("RESULT", 1)[1])


def test_a_training_rank_does_not_import_scipy():
    """scipy.optimize and scipy.special cost each rank ~0.6 CPU-s at start; the trainer and the evaluation ranks
    import them only where the detector's matching or AMI run."""
    loaded = _in_a_fresh_interpreter(
        "import pimm.engine.trainer, pimm.engine.worker, pimm.engine.evaluation\n"
        "result = dict(scipy=sorted(m for m in sys.modules if m.split('.')[0] == 'scipy'))")
    assert loaded["scipy"] == [], f"a rank's imports load scipy: {loaded['scipy']}"


def test_ranks_and_torchrun_import_torch_with_the_collector_paused_then_frozen(tmp_path):
    """pimm.startup.paused_gc around the imports of a training rank (pimm.engine.worker), an evaluation rank
    (pimm.engine.eval_worker) and pimm's torchrun: no full collection runs while torch is imported, its
    objects are frozen after, and the collector is on again."""
    (tmp_path / "config.py").write_text("model = dict(type='NoSuchModel')\n")  # refused after the imports
    rank = _in_a_fresh_interpreter(
        "from pimm.engine import worker\n"
        f"result = dict(status=worker.main(['--run-dir', {str(tmp_path)!r}]), torch='torch' in sys.modules)")
    assert rank["status"] != 0 and rank["torch"], rank  # the bad config is refused after torch was imported
    evaluation = _in_a_fresh_interpreter(
        "from pimm.engine import eval_worker\n"
        f"result = dict(status=eval_worker.main(['--eval-dir', {str(tmp_path)!r}]), torch='torch' in sys.modules)")
    assert evaluation["status"] == 2 and evaluation["torch"], evaluation  # no eval.json: refused after the imports
    torchrun = _in_a_fresh_interpreter(
        "from pimm.launch import torchrun\ntry:\n    torchrun.main(['--help'])\nexcept SystemExit:\n    pass\n"
        "result = dict(torch='torch' in sys.modules)")
    for startup in (rank, evaluation, torchrun):
        assert startup["torch"] and startup["enabled"], startup
        assert startup["frozen"] > 100_000, f"torch's objects were not frozen after the start-up: {startup}"
        assert 2 not in startup["generations"], f"a full collection ran while a start-up imported torch: {startup}"


# -- one complete checkpoint, also while a training writes the run ---------------------------------


def _checkpoint(model_dir: Path, name: str, step: int, value: float) -> Path:
    """A complete checkpoint directory (weights.pth, trainer.dcp/, .complete) of weights `value`."""
    ckpt = model_dir / name
    (ckpt / "trainer.dcp").mkdir(parents=True)
    (ckpt / "trainer.dcp" / "__0_0.distcp").write_bytes(b"state")
    torch.save({"w": torch.full((4,), value)}, ckpt / "weights.pth")
    write_manifest(ckpt, step)
    return ckpt


def _held_value(path: Path) -> float:
    return float(torch.load(path, weights_only=True)["w"][0])


def test_weights_held_while_a_training_promotes_a_checkpoint_come_from_one_checkpoint(tmp_path, monkeypatch):
    """The race of issue 25 made deterministic: between reading `last`'s manifest (step 1) and taking
    its weights, the training promotes step 2. The weights, step and hash all come from step 2."""
    run = tmp_path / "run"
    model = run / "model"
    _checkpoint(model, LAST, 1, 1.0)
    take = choose._take
    calls = []

    def promote_then_take(source: Path, into: Path) -> None:
        if not calls:  # the trainer's promotion, as pimm.checkpoint.manager._promote does it
            os.replace(model / LAST, model / "step_00000001")
            os.replace(_checkpoint(model, ".tmp-step_00000002", 2, 2.0), model / LAST)
        calls.append(source)
        take(source, into)

    monkeypatch.setattr(choose, "_take", promote_then_take)
    held = hold_weights(run, LAST, tmp_path / "held.pth")
    assert len(calls) == 2  # taken again after the hash said it was another checkpoint's file
    assert (held.step, _held_value(held.path)) == (2, 2.0)
    assert held.sha256 == sha256_file(held.path) == read_manifest(model / LAST)["files"]["weights.pth"][1]
    # the held file stays what it is when the training deletes the checkpoint
    shutil.rmtree(model / LAST)
    assert _held_value(held.path) == 2.0 and sha256_file(held.path) == held.sha256


def test_best_weights_are_held_with_the_step_their_record_names(tmp_path, monkeypatch):
    """model_best.pth is replaced before model_best.json: a reader between the two renames sees the
    new weights with the old record; it waits for the record that names those weights."""
    model = tmp_path / "run" / "model"
    model.mkdir(parents=True)

    def best(step: int, value: float) -> None:
        torch.save({"w": torch.full((4,), value)}, model / BEST)
        (model / BEST_RECORD).write_text(json.dumps({"step": step, "sha256": sha256_file(model / BEST)}))

    best(167, 1.0)
    take, calls = choose._take, []

    def replace_weights_then_take(source: Path, into: Path) -> None:
        calls.append(source)
        if len(calls) == 1:  # the trainer has renamed the new weights into place, not yet the record
            torch.save({"w": torch.full((4,), 2.0)}, model / BEST)
        elif len(calls) == 2:
            (model / BEST_RECORD).write_text(json.dumps({"step": 168, "sha256": sha256_file(model / BEST)}))
        take(source, into)

    monkeypatch.setattr(choose, "_take", replace_weights_then_take)
    held = hold_weights(tmp_path / "run", "best", tmp_path / "held.pth")
    assert (held.step, _held_value(held.path)) == (168, 2.0) and len(calls) == 3
    assert recorded_weights(tmp_path / "run", "best")[1:] == (168, held.sha256)


def test_a_reader_between_the_two_renames_that_replace_last_waits_for_the_new_last(tmp_path, monkeypatch):
    """A training replaces `last` by two renames (last -> step_N, then staging -> last): a reader that
    looks in between finds no `last` and looks again (a fresh-clone CI run once failed here); a run
    that stopped between the two is told apart from one that is writing."""
    run = tmp_path / "run"
    model = run / "model"
    _checkpoint(model, LAST, 1, 1.0)
    os.replace(model / LAST, model / "step_00000001")  # the first rename has happened
    staging = _checkpoint(model, ".tmp-step_00000002", 2, 2.0)
    sleep, pauses = choose.time.sleep, []

    def second_rename_meanwhile(seconds: float) -> None:
        pauses.append(seconds)
        if len(pauses) == 2:
            os.replace(staging, model / LAST)
        sleep(seconds)

    monkeypatch.setattr(choose.time, "sleep", second_rename_meanwhile)
    held = hold_weights(run, LAST, tmp_path / "held.pth")
    assert (held.step, _held_value(held.path)) == (2, 2.0) and len(pauses) == 2
    # a training that died between the two renames: after the tries, the message says so
    os.replace(model / LAST, model / "step_00000002")
    monkeypatch.setattr(choose.time, "sleep", lambda seconds: None)
    with pytest.raises(PimmError, match=r"no checkpoint 'last' .*between the two renames.*step_2, step_1"):
        hold_weights(run, LAST, tmp_path / "held.pth")
    assert choose_weights(run, "step_2")[1] == 2  # a finished run's named checkpoint is read without waiting


def test_damaged_weights_of_a_checkpoint_that_stays_are_refused(tmp_path):
    model = tmp_path / "run" / "model"
    ckpt = _checkpoint(model, LAST, 3, 1.0)
    torch.save({"w": torch.zeros(4)}, ckpt / "weights.pth")  # not what the manifest records
    with pytest.raises(CheckpointError, match=r"corrupt checkpoint file .*weights.pth: its sha256 does not match"):
        hold_weights(tmp_path / "run", LAST, tmp_path / "held.pth")
    assert not (tmp_path / "held.pth").exists()


def test_test_and_predict_while_the_run_trains_read_one_complete_checkpoint(tmp_path, tiny_data):
    """Through the CLI, with a real run training meanwhile (a checkpoint after every step, kept, and
    a new best model every other step): `pimm test` of last and of best and `pimm predict` report a
    step whose own checkpoint holds exactly the weights they used."""
    exp = tmp_path / "exp"
    test_set = f"data.test={{type: LArTPCDataset, path: {tiny_data['val']}}}"
    proc = start_launch(exp, tiny_data, 1, "epochs=40", "checkpoint_every_n_steps=1", "checkpoint_keep_last=1000",
                        "eval_every_n_steps=2", "checkpoint_async=false", test_set, name="busy")
    run_dir = exp / "tests" / "busy"
    try:
        wait_for_run(proc, lambda: (run_dir / "model" / LAST / ".complete").exists()
                     and (run_dir / "model" / BEST_RECORD).exists(), timeout=240)
        last = run_pimm(["test", "--run-dir", str(run_dir), "--checkpoint", "last", "--out", str(tmp_path / "last")],
                        cwd=REPO)
        best = run_pimm(["test", "--run-dir", str(run_dir), "--out", str(tmp_path / "best")], cwd=REPO)
        predicted = run_pimm(["predict", "--weights", str(run_dir), "--checkpoint", "last", "--data",
                              str(tiny_data["val"]), "--out", str(tmp_path / "p.h5")], cwd=REPO)
        assert proc.poll() is None, "the run ended before the evaluations did: they did not run beside a training"
    finally:
        kill_run(proc)
    for res in (last, best, predicted):
        assert res.returncode == 0, res.stdout + res.stderr
    manifests = {m["step"]: m["files"]["weights.pth"][1] for m in
                 (read_manifest(d) for d in (run_dir / "model").iterdir() if (d / ".complete").exists())}
    metrics = json.loads((tmp_path / "last" / "test_metrics.json").read_text())
    assert metrics["weights_sha256"] == manifests[metrics["step"]]
    assert not (tmp_path / "last" / ".weights.pth").exists()  # the held file goes with the evaluation
    # the best model's test on the validation events gives the mIoU its own validation logged at that step
    tested = json.loads((tmp_path / "best" / "test_metrics.json").read_text())
    validations = {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
                   if r.get("kind") == "val"}
    assert tested["miou"] == validations[tested["step"]]["miou"]
    with open_predictions(tmp_path / "p.h5") as preds:
        assert preds.provenance["weights_sha256"] == manifests[preds.provenance["step"]]


# -- the test after a longer training ----------------------------------------------------------------


def test_a_finished_run_trained_longer_tests_again_beside_its_first_test(tmp_path, tiny_data, tested_run):
    """`--train.resume RUN -- max_steps=N` on a finished run whose config has data.test: exit 0, the
    first test stays in eval/test-best, the new best model's test lands in eval/test-best-step_<N>."""
    exp = copy_exp(tested_run.run_dir, tmp_path)
    run_dir = exp / "tests" / tested_run.run_dir.name
    first = (run_dir / "eval" / "test-best" / "test_metrics.json").read_text()
    res = run_pimm(["launch", "--train.resume", str(run_dir), "--", "max_steps=24"], cwd=REPO)
    assert res.returncode == 0, res.stdout + res.stderr
    step = json.loads((run_dir / "model" / BEST_RECORD).read_text())["step"]
    assert step > 4, "the longer training found no better model: this test needs one"
    again = run_dir / "eval" / f"test-best-step_{step}"
    assert json.loads((again / "test_metrics.json").read_text())["step"] == step
    assert f"--out {again}" in res.stdout and "pimm test: mIoU" in res.stdout
    assert (run_dir / "eval" / "test-best" / "test_metrics.json").read_text() == first


# -- a stop on the last step ------------------------------------------------------------------------


def test_a_stop_on_the_last_step_is_an_interrupted_run_whose_resume_completes_it(tmp_path, tiny_data):
    """The ranks agree to stop on the run's last step: the checkpoint of that step is written, the
    exit status is 75 and provenance says interrupted; the resume runs the end of the run (final
    validation, summary) and exits 0 with provenance completed."""
    res, run_dir = launch(tmp_path, tiny_data, 1, "max_steps=3", "debug.interrupt_at_step=3", name="edge")
    assert res.returncode == EXIT_CHECKPOINTED, res.stderr
    assert attempts(run_dir)[-1]["outcome"].startswith("interrupted")
    assert read_manifest(run_dir / "model" / LAST)["step"] == 3
    res, _ = launch(tmp_path, tiny_data, 1, "max_steps=3", name="edge", resume=True)
    assert res.returncode == 0, res.stderr
    assert attempts(run_dir)[-1]["outcome"] == "completed" and "training finished" in res.stdout
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "val"] == [3]
    assert json.loads((run_dir / "summary.json").read_text())["final_val"]["events"] == 12


@pytest.mark.parametrize("outcome, returncode, signal_name, killed, errors, expected", [
    # the ranks finished and wrote their final checkpoint; the stop signal came after their last
    # agreement and stopped torchrun itself (128 + SIGUSR1): completed, exit 0
    ("completed", 128 + signal.SIGUSR1, "SIGUSR1", False, {}, (0, False)),
    ("completed", 0, None, False, {}, (0, False)),
    ("interrupted by SIGUSR1", 128 + signal.SIGUSR1, "SIGUSR1", False, {}, (EXIT_CHECKPOINTED, True)),
    ("running", 128 + signal.SIGTERM, "SIGTERM", False, {}, (EXIT_CHECKPOINTED, True)),
    ("running", -signal.SIGKILL, "SIGTERM", True, {}, (EXIT_SECOND_SIGNAL, True)),
    ("failed", 1, None, False, {0: "boom"}, (1, False)),
])
def test_the_exit_status_agrees_with_the_recorded_outcome(outcome, returncode, signal_name, killed, errors, expected):
    stops = SimpleNamespace(signal_name=signal_name, killed=killed)
    assert ending(outcome, returncode, stops, errors, has_checkpoint=True) == expected


# -- the dry run's pimm line ------------------------------------------------------------------------


def _plan(argv: list[str]):
    """The LaunchPlan `pimm ARGV` makes (argv as the shell gives it, `--` and the overrides included)."""
    cut = argv.index("--") if "--" in argv else len(argv)
    args = build_parser().parse_args(argv[:cut])
    args.overrides = argv[cut + 1:]
    return prepare_launch(args)


@pytest.mark.parametrize("resume", [False, True])
def test_the_dry_run_prints_one_pimm_line_that_makes_the_same_plan(tmp_path, tiny_data, interrupted, resume):
    odd = "data.names=[\"sho wer\", \"it's\", michel, 'del$ta', low_energy]"  # spaces, quotes, a $
    if resume:
        argv = ["launch", "--train.resume", str(interrupted), "--dry-run", "--", odd]
    else:
        argv = ["launch", "--train.config", "tests/tiny_semseg", "--resources.nproc-per-node", "2", "--dry-run",
                "--paths.exp-root", str(tmp_path / "exp"), "--", f"data.train.path={tiny_data['train']}",
                f"data.val.path={tiny_data['val']}", "batch_size=8", odd]
    res = pimm_in_process(argv)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    line = lines[lines.index("to run this plan, paste this line (in this directory):") + 1].strip()
    printed = shlex.split(line)  # as a POSIX shell reads it
    assert printed[:2] == ["pimm", "launch"] and "--dry-run" not in printed
    # the run directory as the dry run named it: planning again here may fall in the next second of the clock
    shown = Path(next(text.strip().removeprefix("run directory: ") for text in lines
                      if text.strip().startswith("run directory: ")))
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(REPO)
        asked, again = dataclasses.replace(_plan(argv), run_dir=shown), _plan(printed[1:])
    assert again.torchrun_argv() == asked.torchrun_argv() and again.cfg == asked.cfg
    assert (again.run_dir, again.config_name, again.overrides, again.phases) == \
        (asked.run_dir, asked.config_name, asked.overrides, asked.phases)
    assert not (tmp_path / "exp").exists()
