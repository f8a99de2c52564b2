"""Weights as the field publishes them: every published checkpoint layout (made here from pimm's own
models under the published names), the key-map presets, hf:// from a pre-filled Hugging Face cache
offline (never the network), and `pimm export --layout published` read back by name."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO, attempts, launch, launch_args, pimm_in_process, run_pimm, weights
from safetensors.torch import save_file

from pimm.checkpoint.layout import CheckpointError
from pimm.checkpoint.weights import KEY_MAP_PRESETS, check_pretrained_fits
from pimm.cli import main
from pimm.config import validate
from pimm.models import build_model

# the published segmentor (DefaultSegmentorV2 + PT-v3m2) at a tiny width: encoder-decoder, and encoder only
# with the up-cast head (the lin recipe's shape)
BACKBONE = dict(type="PT-v3m2", in_channels=4, order=("z", "z-trans"), stride=(2,), enc_depths=(1, 1),
                enc_channels=(16, 32), enc_num_head=(2, 2), enc_patch_size=(16, 16), dec_depths=(1,),
                dec_channels=(16,), dec_num_head=(2,), dec_patch_size=(16,), enable_flash=False)
SEGMENTOR = dict(type="DefaultSegmentorV2", num_classes=5, backbone_out_channels=16, backbone=BACKBONE)
ENCODER_ONLY = dict(SEGMENTOR, backbone_out_channels=48, backbone=dict(BACKBONE, enc_mode=True))
TINY_MODEL = dict(type="PointSegNet", in_channels=4, num_classes=5, channels=16, grid_sizes=[4, 16])  # tiny_semseg


def state_of(model_cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return build_model(model_cfg).state_dict()


def published_trainer_payload(state: dict) -> dict:
    """What the published CheckpointSaver writes (DeepLearnPhysics/pimm pimm/engines/hooks/misc.py): the DDP
    model's state_dict beside the optimizer, the OneCycleLR scheduler, and the best metric (a numpy float)."""
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.002)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.002, total_steps=10)
    return {"epoch": 4, "iter": 400, "state_dict": {"module." + k: v for k, v in state.items()},
            "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "scaler": None,
            "best_metric_value": np.float64(0.71)}


def write_layout(layout: str, state: dict, root: Path) -> Path:
    """`state` saved in one published layout under `root`; returns the path to give pretrained.path."""
    root.mkdir(parents=True)
    if layout == "pointcept":
        torch.save({"epoch": 3, "state_dict": {"module." + k: v for k, v in state.items()}}, root / "w.pth")
    elif layout == "trainer":
        torch.save(published_trainer_payload(state), root / "model_best.pth")
        return root / "model_best.pth"
    elif layout == "model.state_dict":
        torch.save({"model": {"state_dict": state}, "meta": {"epoch": 3}}, root / "w.pth")
    elif layout == "plain":
        torch.save(state, root / "w.pth")
    elif layout == "hf-safetensors":  # a Hugging Face export: model.safetensors + config.json
        save_file({k: v.contiguous() for k, v in state.items()}, root / "model.safetensors")
        (root / "config.json").write_text(json.dumps({"model": SEGMENTOR}))
        return root
    elif layout == "hf-pth":  # a Hugging Face repository of a .pth and config.json
        torch.save({"state_dict": {"module." + k: v for k, v in state.items()}}, root / "panda-semantic.pth")
        (root / "config.json").write_text("{}")
        return root
    return root / "w.pth"


def assert_loaded_exactly(match, state: dict) -> None:
    assert match.complete, match.summary()
    assert match.loaded.keys() == state.keys()
    for key, value in state.items():
        assert torch.equal(match.loaded[key], value), key


@pytest.mark.parametrize("key_map", [[], "pointcept"])
@pytest.mark.parametrize("layout", ["pointcept", "trainer", "model.state_dict", "plain", "hf-safetensors", "hf-pth"])
def test_every_published_layout_loads_by_name(tmp_path, layout, key_map):
    state = state_of(SEGMENTOR)
    path = write_layout(layout, state, tmp_path / layout)
    match = check_pretrained_fits(path, SEGMENTOR, {"key_map": key_map})
    assert_loaded_exactly(match, state)
    assert f"loaded {len(state)} of {len(state)}, skipped 0, missing 0, unexpected 0, shape-mismatched 0" in \
        match.summary()


def sonata_pretraining_payload(seed: int = 1) -> tuple[dict, dict]:
    """(the file, the student backbone's tensors under backbone.*): Sonata-v1m1's DDP state_dict as its
    pretraining saves it (student and teacher, each a PT-v3m2 encoder with a mask token and two heads)."""
    student = {k: v for k, v in state_of(dict(ENCODER_ONLY, backbone=dict(ENCODER_ONLY["backbone"], mask_token=True)),
                                         seed).items() if k.startswith("backbone.")}
    teacher = {k: v + 1 for k, v in student.items()}  # an EMA of the student: other values
    heads = {f"{head}.{name}": torch.randn(shape) for head in ("mask_head", "unmask_head")
             for name, shape in (("mlp.0.weight", (8, 48)), ("mlp.2.weight", (4, 8)),
                                 ("prototype.parametrizations.weight.original0", (6, 1)),
                                 ("prototype.parametrizations.weight.original1", (6, 4)))}
    state = {}
    for who, backbone in (("student", student), ("teacher", teacher)):
        state.update({f"module.{who}.{k}": v for k, v in backbone.items()})
        state.update({f"module.{who}.{k}": v for k, v in heads.items()})
    return {"epoch": 100, "state_dict": state}, student


def test_sonata_pretraining_loads_the_student_backbone_and_reports_the_rest(tmp_path):
    payload, student = sonata_pretraining_payload()
    path = tmp_path / "sonata.pth"
    torch.save(payload, path)

    match = check_pretrained_fits(path, ENCODER_ONLY, {"key_map": "sonata", "strict": False})
    backbone = {k: v for k, v in student.items() if k != "backbone.embedding.mask_token"}
    assert match.loaded.keys() == backbone.keys()
    for key, value in backbone.items():
        assert torch.equal(match.loaded[key], value), key  # the student's, not the teacher's
    assert match.missing == ["seg_head.weight", "seg_head.bias"] and not match.unexpected
    groups = ["backbone.embedding.mask_token", "student.mask_head.*", "student.unmask_head.*", "teacher.backbone.*",
              "teacher.mask_head.*", "teacher.unmask_head.*"]
    left_out = 1 + 8 + len(student) + 8  # the mask token, the student's heads, the teacher's backbone and heads
    assert match.facts()["left_out_groups"] == groups and match.facts()["left_out"] == left_out
    assert f"left out by key_map='sonata' {left_out} ({', '.join(groups)})" in match.summary()

    # a model that has the mask token (pretraining further) takes it too
    with_token = dict(ENCODER_ONLY, backbone=dict(ENCODER_ONLY["backbone"], mask_token=True))
    match = check_pretrained_fits(path, with_token, {"key_map": "sonata", "strict": False})
    assert torch.equal(match.loaded["backbone.embedding.mask_token"], student["backbone.embedding.mask_token"])

    with pytest.raises(CheckpointError, match=r"2 missing keys \(seg_head.weight, seg_head.bias\).*strict=false"):
        check_pretrained_fits(path, ENCODER_ONLY, {"key_map": "sonata"})
    for key_map in ([], "pointcept"):  # the names the file has say what to do
        with pytest.raises(CheckpointError, match="Sonata pretraining checkpoint .* pretrained.key_map='sonata'"):
            check_pretrained_fits(path, ENCODER_ONLY, {"key_map": key_map, "strict": False})


def test_a_bare_backbone_file_says_which_prefix_fits(tmp_path):
    state = state_of(SEGMENTOR)
    path = tmp_path / "backbone.pth"
    torch.save({k.removeprefix("backbone."): v for k, v in state.items() if k.startswith("backbone.")}, path)
    with pytest.raises(CheckpointError, match=rf"{len(state) - 2} of the file's names match the model with backbone\. "
                       r"prefix "
                       r"\(embedding.stem.linear.weight -> backbone.embedding.stem.linear.weight\): set "
                       r"pretrained.key_map=\[\['', 'backbone.'\]\]"):
        check_pretrained_fits(path, SEGMENTOR, {"strict": False, "key_map": [["seg_head.", "head."]]})
    match = check_pretrained_fits(path, SEGMENTOR, {"strict": False, "key_map": [["", "backbone."]]})
    assert len(match.loaded) == len(state) - 2 and match.missing == ["seg_head.weight", "seg_head.bias"]


def test_a_file_without_weights_says_what_it_holds(tmp_path):
    path = tmp_path / "optimizer_only.pth"
    payload = published_trainer_payload({})
    del payload["state_dict"]
    torch.save(payload, path)
    with pytest.raises(CheckpointError) as refused:
        check_pretrained_fits(path, SEGMENTOR)
    text = str(refused.value)
    assert "not a state_dict of tensors" in text and "key 'epoch' holds int" in text
    assert "top-level keys: 'epoch' (int), 'iter' (int), 'optimizer' (dict), 'scheduler' (dict)" in text
    assert "under 'state_dict', 'model' or 'model' -> 'state_dict'" in text


def test_the_presets_are_the_ones_the_config_check_accepts(tmp_path, tiny_data):
    assert tuple(KEY_MAP_PRESETS) == validate.KEY_MAP_PRESETS
    res = pimm_in_process(launch_args(tmp_path, tiny_data, 1, "pretrained.key_map=sonta", name="preset"))
    assert res.returncode == 2
    assert "pretrained.key_map must be a preset (pointcept, sonata) or a list of [old_prefix, new_prefix]" in res.stderr
    assert "did you mean 'sonata'?" in res.stderr


# -- hf:// through a Hugging Face cache filled here (the layout huggingface_hub writes), offline --

COMMITS = {"main": "1" * 40, "v1": "2" * 40}


def fill_hub_cache(hf_home: Path, repo_id: str, files_by_ref: dict[str, dict[str, bytes]]) -> None:
    """HF_HOME/hub/models--owner--name/{blobs/<sha256>, refs/<ref>, snapshots/<commit>/<file> -> blob}."""
    repo = hf_home / "hub" / f"models--{repo_id.replace('/', '--')}"
    for ref, files in files_by_ref.items():
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(COMMITS[ref])
        snapshot = repo / "snapshots" / COMMITS[ref]
        snapshot.mkdir(parents=True)
        for name, content in files.items():
            blob = repo / "blobs" / hashlib.sha256(content).hexdigest()
            blob.parent.mkdir(exist_ok=True)
            blob.write_bytes(content)
            (snapshot / name).symlink_to(Path("..", "..", "blobs", blob.name))


def file_bytes(tmp_path: Path, obj, name: str) -> bytes:
    path = tmp_path / name
    if name.endswith(".safetensors"):
        save_file({k: v.contiguous() for k, v in obj.items()}, path)
    else:
        torch.save(obj, path)
    return path.read_bytes()


@pytest.fixture
def offline_hub(tmp_path, monkeypatch) -> Path:
    """HF_HOME in tmp_path with HF_HUB_OFFLINE=1 for this test and the processes it starts."""
    hf_home = tmp_path / "hf"
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(hf_home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return hf_home


def check_in_a_new_process(paths: list[str], model_cfg: dict, pretrained: dict) -> list[dict]:
    """check_pretrained_fits of each path in a Python process started with this test's environment (huggingface_hub
    reads HF_HOME and HF_HUB_OFFLINE when it is imported): its facts, or its CheckpointError's message."""
    script = textwrap.dedent("""
        import json, sys
        from pimm.checkpoint.layout import CheckpointError
        from pimm.checkpoint.weights import check_pretrained_fits
        paths, model_cfg, pretrained = json.loads(sys.argv[1])
        out = []
        for path in paths:
            try:
                match = check_pretrained_fits(path, model_cfg, pretrained)
                out.append({"facts": match.facts(), "sums": {k: float(v.sum()) for k, v in match.loaded.items()}})
            except CheckpointError as exc:
                out.append({"error": str(exc)})
        print(json.dumps(out))
    """)
    res = subprocess.run([sys.executable, "-c", script, json.dumps([paths, model_cfg, pretrained])], cwd=REPO,
                         capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.splitlines()[-1])


def test_hf_weights_come_from_the_cache_offline(tmp_path, offline_hub):
    exported, sonata = state_of(SEGMENTOR, seed=3), sonata_pretraining_payload(seed=4)
    fill_hub_cache(offline_hub, "physics/panda-semantic", {
        "main": {"model.safetensors": file_bytes(tmp_path, exported, "m.safetensors"), "config.json": b"{}"},
        "v1": {"panda-semantic.pth": file_bytes(tmp_path, {"state_dict": {"module." + k: v + 2 for k, v in
                                                                          exported.items()}}, "p.pth")},
    })
    fill_hub_cache(offline_hub, "physics/panda-base", {
        "main": {"sonata.pth": file_bytes(tmp_path, sonata[0], "s.pth"), "config.json": b"{}"}})
    sums = {k: float(v.sum()) for k, v in exported.items()}

    found = check_in_a_new_process(
        ["hf://physics/panda-semantic", "hf://physics/panda-semantic@v1", f"hf://physics/panda-semantic@{'2' * 40}",
         "hf://physics/panda-semantic@v1/panda-semantic.pth", "hf://physics/not-downloaded",
         "hf://physics/panda-semantic/missing.pth", "hf://physics"], SEGMENTOR, {"key_map": "pointcept"})
    snapshots = offline_hub / "hub" / "models--physics--panda-semantic" / "snapshots"
    main_facts = found[0]["facts"]
    assert main_facts["loaded"] == len(exported) and found[0]["sums"] == sums
    assert main_facts["source"] == "hf://physics/panda-semantic"
    assert main_facts["path"] == str(snapshots / COMMITS["main"] / "model.safetensors")
    plus_two = {k: float((v + 2).sum()) for k, v in exported.items()}
    for result in found[1:4]:  # the ref, its commit, and the file by name
        assert result["facts"]["loaded"] == len(exported) and result["sums"] == plus_two, result
        assert result["facts"]["path"] == str(snapshots / COMMITS["v1"] / "panda-semantic.pth")
    not_cached, no_file, not_hf = (r["error"] for r in found[4:])
    assert "hf://physics/not-downloaded is not in the Hugging Face cache" in not_cached
    assert str(offline_hub / "hub") in not_cached and "HF_HUB_OFFLINE=1" in not_cached
    assert "`hf download physics/not-downloaded --revision main`" in not_cached
    assert "hf://physics/panda-semantic/missing.pth is not in the Hugging Face cache" in no_file
    assert "is not a Hugging Face address; write it as hf://owner/name" in not_hf

    base = check_in_a_new_process(["hf://physics/panda-base"], ENCODER_ONLY, {"key_map": "sonata", "strict": False})
    assert base[0]["facts"]["loaded"] == len(sonata[1]) - 1 and base[0]["facts"]["left_out"] == 17 + len(sonata[1])
    assert base[0]["sums"] == {k: float(v.sum()) for k, v in sonata[1].items() if k != "backbone.embedding.mask_token"}


def test_the_ranks_read_hf_weights_from_the_cache_and_never_download(tmp_path, offline_hub, monkeypatch):
    """load_pretrained (in a rank) with the Hub not disabled: what `pimm launch` cached loads, what it did not
    is refused at once (nothing is asked of the network: huggingface_hub's local_files_only)."""
    state = state_of(TINY_MODEL, seed=6)
    fill_hub_cache(offline_hub, "physics/tiny", {"main": {"tiny.pth": file_bytes(tmp_path, state, "t.pth")}})
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # were anything asked of a Hub, it would fail here
    script = textwrap.dedent("""
        import json, sys
        from pimm.checkpoint.layout import CheckpointError
        from pimm.checkpoint.weights import load_pretrained, model_entries
        model_cfg = json.loads(sys.argv[1])
        match = load_pretrained("hf://physics/tiny", model_entries(model_cfg), model_cfg, {})
        print(json.dumps({k: float(v.sum()) for k, v in match.loaded.items()}))
        try:
            load_pretrained("hf://physics/elsewhere@v2", model_entries(model_cfg), model_cfg, {})
        except CheckpointError as exc:
            print(exc)
    """)
    res = subprocess.run([sys.executable, "-c", script, json.dumps(TINY_MODEL)], cwd=REPO, capture_output=True,
                         text=True, timeout=300, check=False)
    assert res.returncode == 0, res.stderr
    loaded, refused = res.stdout.splitlines()[-2:]
    assert json.loads(loaded) == {k: float(v.sum()) for k, v in state.items()}
    assert "hf://physics/elsewhere@v2 is not in the Hugging Face cache" in refused
    assert "the ranks read hf:// weights from the cache that `pimm launch` filled before they started" in refused
    assert "`hf download physics/elsewhere --revision v2`" in refused


@pytest.fixture
def hf_run(tmp_path, tiny_data, offline_hub) -> tuple[Path, dict]:
    """A 1-step, lr=0 run of the tiny config warm-started from hf:// weights (Pointcept layout) in the cache."""
    source = state_of(TINY_MODEL, seed=5)
    fill_hub_cache(offline_hub, "physics/tiny", {"main": {
        "tiny.pth": file_bytes(tmp_path, {"state_dict": {"module." + k: v for k, v in source.items()}}, "t.pth"),
        "config.json": b"{}"}})
    res, run_dir = launch(tmp_path, tiny_data, 1, "max_steps=1", "optimizer.lr=0", "pretrained.path=hf://physics/tiny",
                          "pretrained.key_map=pointcept", name="from_hub")
    assert res.returncode == 0, res.stderr
    assert "pimm: warm start from weights hf://physics/tiny -> " in res.stdout
    assert "loaded 24 of 24, skipped 0, missing 0, unexpected 0, shape-mismatched 0" in res.stdout
    return run_dir, source


def test_a_run_warm_starts_from_hf_and_exports_in_the_published_layout(tmp_path, hf_run, tiny_data, capsys):
    run_dir, source = hf_run
    facts = attempts(run_dir)[-1]["pretrained"]
    assert (facts["source"], facts["key_map"], facts["loaded"]) == ("hf://physics/tiny", "pointcept", 24)
    trained = weights(run_dir)
    for key, value in trained.items():
        assert torch.equal(value, source[key]), key  # lr=0: the step changed nothing

    out = tmp_path / "published"
    code = main(["export", "--run-dir", str(run_dir), "--layout", "published", str(out)])
    assert code == 0, capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.pth"]
    config = json.loads((out / "config.json").read_text())
    assert config["layout"] == "published" and config["model"]["type"] == "PointSegNet"

    # as the published trainer and tester read it: torch.load, checkpoint["state_dict"], "module." + name
    checkpoint = torch.load(out / "model.pth", weights_only=True)
    assert list(checkpoint) == ["state_dict"]
    assert sorted(checkpoint["state_dict"]) == sorted("module." + k for k in trained)
    model = build_model(config["model"])
    model.load_state_dict({k.removeprefix("module."): v for k, v in checkpoint["state_dict"].items()}, strict=True)
    # and back into pimm by name
    for given in (out, out / "model.pth"):
        assert_loaded_exactly(check_pretrained_fits(given, config["model"], {"key_map": "pointcept"}), trained)
    # pimm predict takes the published-layout export as it takes pimm's
    res = run_pimm(["predict", "--weights", str(out), "--data", str(tiny_data["val"]), "--out",
                    str(tmp_path / "p.h5")], cwd=REPO)
    assert res.returncode == 0, res.stdout + res.stderr
    assert (tmp_path / "p.h5").is_file()


def test_sharded_safetensors_load_as_one_state_dict(tmp_path):
    """Hugging Face's sharded weights (model.safetensors.index.json + model-0000N-of-0000M.safetensors):
    the directory loads by name; a missing shard or a name no shard holds is refused saying so."""
    from pimm.checkpoint.weights import load_weight_file

    source = state_of(TINY_MODEL, seed=3)
    names = sorted(source)
    halves = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for shard, keys in halves.items():
        save_file({k: source[k].contiguous() for k in keys}, tmp_path / shard)
    index = {"metadata": {}, "weight_map": {k: shard for shard, keys in halves.items() for k in keys}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "config.json").write_text("{}")
    loaded = load_weight_file(tmp_path)
    assert loaded.keys() == source.keys() and all(torch.equal(loaded[k], source[k]) for k in source)
    assert_loaded_exactly(check_pretrained_fits(tmp_path, TINY_MODEL), source)
    index["weight_map"]["extra.weight"] = "model-00002-of-00002.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="promises 1 tensor"):
        load_weight_file(tmp_path)
    (tmp_path / "model-00001-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="names the shard 'model-00001-of-00002.safetensors'"):
        load_weight_file(tmp_path)
