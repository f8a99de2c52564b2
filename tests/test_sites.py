"""Site profiles for `pimm submit`: loading with `_base_`, validation, and the sbatch lines they render."""

from __future__ import annotations

from pathlib import Path

import pytest

from pimm.errors import LaunchError
from pimm.launch.sites import Container, known_sites, load_site, parse_slurm_time

PACKAGED = ["apptainer", "local", "local-slurm", "nersc", "nersc-shifter", "s3df", "slurm"]
ACCOUNTS = {"nersc": "m1234_g", "nersc-shifter": "m1234_g", "s3df": "neutrino:ml"}
OUT = "exp/demo/run/slurm_logs/slurm-%j.out"


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_every_packaged_profile_loads():
    assert known_sites() == PACKAGED
    for name in PACKAGED:
        site = load_site(name, {"account": ACCOUNTS.get(name)})
        assert site.name == name
        assert site.source.name == f"{name}.yaml" and site.source.is_file()
        assert site.signal_delay_s < site.time_s
        if site.scheduler == "slurm":
            assert site.sbatch_directives("job", OUT)[0] == "#SBATCH --job-name=job"


def test_local_is_no_slurm_and_has_no_sbatch_script():
    site = load_site("local")
    assert (site.scheduler, site.nnodes, site.nproc_per_node, site.cpus_per_proc) == ("none", 1, 1, 1)
    assert not site.uses_gpus and site.container is None and site.python is None
    with pytest.raises(LaunchError, match="pimm launch"):
        site.sbatch_directives("job", OUT)


def test_inheritance_merges_environment_and_replaces_setup(tmp_path):
    shifter = load_site("nersc-shifter", {"account": "m1234_g"})
    # from nersc: constraint, GPUs, qos, environment; its own: container, no module load
    assert (shifter.constraint, shifter.nproc_per_node, shifter.qos) == ("gpu", 4, "regular")
    assert shifter.environment == {"NCCL_NET_GDR_LEVEL": "PHB"}
    assert shifter.setup == ()
    assert load_site("nersc", {"account": "m1234_g"}).setup == ("module load pytorch",)

    child = write(tmp_path / "child.yaml", "_base_: nersc\naccount: m99_g\nenvironment:\n  OMP_NUM_THREADS: 8\n"
                  "  NCCL_NET_GDR_LEVEL: null\nsetup: [module load cudatoolkit]\n")
    site = load_site(str(child))
    assert site.environment == {"OMP_NUM_THREADS": "8"}  # merged; null drops the parent's variable
    assert site.setup == ("module load cudatoolkit",)
    assert site.preamble() == ["module load cudatoolkit", "export OMP_NUM_THREADS=8"]


def test_container_mapping_merges(tmp_path):
    child = write(tmp_path / "mine.yaml", "_base_: apptainer\ncontainer:\n  image: /images/pimm.sif\n"
                  "  binds: [/scratch]\n")
    assert load_site(str(child)).container == Container("apptainer", "/images/pimm.sif", ("/scratch",), ())
    assert load_site(str(child), {"container": None}).container.image == "/images/pimm.sif"  # None: ignored


def test_overrides_apply_last(tmp_path):
    mine = write(tmp_path / "mine.yaml", "_base_: slurm\nnnodes: 4\npartition: gpu\ntime: '02:00:00'\n")
    site = load_site(str(mine), {"nnodes": 8, "partition": None, "time": "30", "environment": {"A": "b c"}})
    assert (site.nnodes, site.partition, site.time, site.time_s) == (8, "gpu", "30", 1800)
    assert site.preamble() == ["export A='b c'"]


def test_user_profile_path_with_base_slurm(tmp_path):
    mine = write(tmp_path / "cluster.yml", "_base_: slurm\npartition: gpu-a100\naccount: proj7\n"
                 "nproc_per_node: 2\ntime: 10:00\nsbatch_options: [--exclusive]\n")
    site = load_site(str(mine))
    assert site.name == "cluster" and site.source == mine.resolve()
    assert site.time_s == 600  # 10:00 is ten minutes, not YAML 1.1's base-60 integer 600
    assert site.sbatch_directives("demo", OUT) == [
        "#SBATCH --job-name=demo",
        "#SBATCH --nodes=1",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --cpus-per-task=2",
        "#SBATCH --gres=gpu:2",
        "#SBATCH --time=10:00",
        "#SBATCH --account=proj7",
        "#SBATCH --partition=gpu-a100",
        f"#SBATCH --output={OUT}",
        "#SBATCH --signal=USR1@120",
        "#SBATCH --exclusive",
    ]


def test_base_path_relative_to_the_file(tmp_path):
    (tmp_path / "profiles").mkdir()
    write(tmp_path / "profiles" / "group.yaml", "_base_: slurm\npartition: shared\n")
    mine = write(tmp_path / "mine.yaml", "_base_: profiles/group.yaml\nqos: high\n")
    site = load_site(str(mine))
    assert (site.partition, site.qos, site.scheduler) == ("shared", "high", "slurm")


def test_gres_site_directives():
    site = load_site("s3df", {"account": "neutrino:ml", "nnodes": 2, "nproc_per_node": 4, "cpus_per_proc": 8,
                              "mem": "0", "time": "2-00:00:00"})
    assert site.sbatch_directives("my job", OUT) == [
        "#SBATCH --job-name='my job'",
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --cpus-per-task=32",
        "#SBATCH --gres=gpu:4",
        "#SBATCH --time=2-00:00:00",
        "#SBATCH --mem=0",
        "#SBATCH --account=neutrino:ml",
        "#SBATCH --partition=ampere",
        f"#SBATCH --output={OUT}",
        "#SBATCH --signal=USR1@120",
    ]
    assert site.wrap(["python", "-m", "x"]) == ["python", "-m", "x"]


def test_gpus_per_node_site_directives():
    site = load_site("nersc", {"account": "m1234_g", "nnodes": 4, "time": "06:00:00"})
    assert site.sbatch_directives("pimm-demo", OUT) == [
        "#SBATCH --job-name=pimm-demo",
        "#SBATCH --nodes=4",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --cpus-per-task=128",
        "#SBATCH --gpus-per-node=4",
        "#SBATCH --time=06:00:00",
        "#SBATCH --account=m1234_g",
        "#SBATCH --qos=regular",
        "#SBATCH --constraint=gpu",
        f"#SBATCH --output={OUT}",
        "#SBATCH --signal=USR1@120",
    ]
    assert site.preamble() == ["module load pytorch", "export NCCL_NET_GDR_LEVEL=PHB"]


def test_apptainer_site_directives_and_wrap():
    site = load_site("apptainer", {"container": {"binds": ["/scratch", "/data:/data"], "options": ["--cleanenv"]},
                                   "gres_name": "gpu:a100"})
    assert site.sbatch_directives("demo", OUT) == [
        "#SBATCH --job-name=demo",
        "#SBATCH --nodes=1",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --cpus-per-task=1",
        "#SBATCH --gres=gpu:a100:1",
        "#SBATCH --time=01:00:00",
        f"#SBATCH --output={OUT}",
        "#SBATCH --signal=USR1@120",
    ]
    assert site.python == "python3"
    assert site.wrap(["python3", "-m", "pimm"]) == [
        "apptainer", "exec", "--nv", "--bind", "/scratch,/data:/data", "--cleanenv", "pimm.sif",
        "python3", "-m", "pimm",
    ]
    cpu = load_site("apptainer", {"gpu_directive": "none", "container": {"runtime": "singularity"}})
    assert cpu.wrap(["python3"]) == ["singularity", "exec", "pimm.sif", "python3"]


def test_shifter_site_directives_and_wrap():
    site = load_site("nersc-shifter", {"account": "m1234_g", "container": {"options": ["--module=gpu,nccl-plugin"]}})
    assert site.sbatch_directives("demo", OUT) == [
        "#SBATCH --job-name=demo",
        "#SBATCH --nodes=1",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --cpus-per-task=128",
        "#SBATCH --gpus-per-node=4",
        "#SBATCH --time=01:00:00",
        "#SBATCH --account=m1234_g",
        "#SBATCH --qos=regular",
        "#SBATCH --constraint=gpu",
        f"#SBATCH --output={OUT}",
        "#SBATCH --signal=USR1@120",
        "#SBATCH --image=nersc/pytorch:24.06.01",
    ]
    assert site.wrap(["python3", "-m", "pimm"]) == ["shifter", "--module=gpu,nccl-plugin", "python3", "-m", "pimm"]


def test_local_slurm_profile():
    site = load_site("local-slurm")
    assert (site.partition, site.nnodes, site.nproc_per_node, site.time_s, site.signal_delay_s) == (
        "debug", 2, 2, 600, 30)
    assert not site.uses_gpus and site.environment == {"OMP_NUM_THREADS": "1"}
    assert not any("gres" in line or "gpus" in line for line in site.sbatch_directives("t", OUT))


@pytest.mark.parametrize(("text", "seconds"), [
    ("30", 1800), ("1", 60), ("30:15", 1815), ("01:00:00", 3600), ("48:00:00", 172800), ("0:0:1", 1),
    ("2-0", 172800), ("1-12", 129600), ("1-00:30", 88200), ("1-02:03:04", 93784), ("0-00:00:10", 10),
])
def test_parse_slurm_time(text, seconds):
    assert parse_slurm_time(text) == seconds


@pytest.mark.parametrize("text", ["", "0", "00:00:00", "-5", "1h", "1:2:3:4", "1-2-3", "abc", "1.5", "1-", ":30",
                                  "UNLIMITED"])
def test_parse_slurm_time_rejects(text):
    with pytest.raises(LaunchError, match=r"M, M:S, H:M:S, D-H, D-H:M or D-H:M:S") as e:
        parse_slurm_time(text)
    assert repr(text) in str(e.value)


def test_unknown_site_lists_known_ones():
    with pytest.raises(LaunchError) as e:
        load_site("nersk")
    msg = str(e.value)
    assert "'nersk'" in msg and "did you mean 'nersc'" in msg and ", ".join(PACKAGED) in msg and "path" in msg


def test_unknown_key_suggests(tmp_path):
    mine = write(tmp_path / "mine.yaml", "_base_: slurm\nacount: m1\n")
    with pytest.raises(LaunchError, match=r"unknown field .*mine\.yaml.*'acount' \(did you mean 'account'\?\)"):
        load_site(str(mine))
    bad = write(tmp_path / "bad.yaml", "_base_: apptainer\ncontainer: {imag: x.sif}\n")
    with pytest.raises(LaunchError, match=r"'imag' \(did you mean 'image'\?\)"):
        load_site(str(bad))
    with pytest.raises(LaunchError, match=r"unknown site override: 'partiton' \(did you mean 'partition'\?\)"):
        load_site("slurm", {"partiton": "gpu"})
    with pytest.raises(LaunchError, match=r"container field in the site overrides: 'bind' \(did you mean 'binds'\?\)"):
        load_site("apptainer", {"container": {"bind": ["/a"]}})


def test_base_cycle_is_named(tmp_path):
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    write(a, "_base_: b.yaml\n")
    write(b, "_base_: ./a.yaml\n")
    with pytest.raises(LaunchError, match="cycle") as e:
        load_site(str(a))
    assert f"{a} -> {b} -> {a}" in str(e.value)


def test_missing_required_account():
    with pytest.raises(LaunchError, match=r"site 'nersc' needs an account: pass --resources.account NAME"):
        load_site("nersc")
    with pytest.raises(LaunchError, match=r"site 's3df' needs an account"):
        load_site("s3df", {"account": None})


def test_account_suffix():
    msg = r"account 'm1234' does not end in '_g'.*use e.g. --resources.account m1234_g$"
    with pytest.raises(LaunchError, match=msg):
        load_site("nersc", {"account": "m1234"})


def test_invalid_time(tmp_path):
    mine = write(tmp_path / "mine.yaml", "_base_: slurm\ntime: 1 hour\n")
    with pytest.raises(LaunchError, match=r"site 'mine': time limit '1 hour' is not a Slurm time.*mine\.yaml"):
        load_site(str(mine))


def test_signal_delay_must_be_inside_the_time_limit():
    with pytest.raises(LaunchError, match=r"signal_delay_s 120 is not smaller than the time limit 2 \(120 s\)"):
        load_site("slurm", {"time": "2"})
    assert load_site("slurm", {"time": "2", "signal_delay_s": 60}).time_s == 120


def test_bad_values():
    with pytest.raises(LaunchError, match=r"gpu_directive must be one of gres, gpus-per-node, none, got 'gpus'"):
        load_site("slurm", {"gpu_directive": "gpus"})
    with pytest.raises(LaunchError, match=r"scheduler must be one of slurm, none, got 'pbs'"):
        load_site("slurm", {"scheduler": "pbs"})
    with pytest.raises(LaunchError, match=r"nproc_per_node must be an integer >= 1, got 0"):
        load_site("slurm", {"nproc_per_node": 0})
    with pytest.raises(LaunchError, match=r"signal_delay_s must be an integer >= 0, got -1"):
        load_site("slurm", {"signal_delay_s": -1})
    with pytest.raises(LaunchError, match=r"mem must be a size such as 64G"):
        load_site("slurm", {"mem": "lots"})
    with pytest.raises(LaunchError, match=r"container.binds is for apptainer and singularity, not shifter"):
        load_site("nersc-shifter", {"account": "m1_g", "container": {"binds": ["/a"]}})
    with pytest.raises(LaunchError, match=r"container.runtime must be one of apptainer, singularity, shifter"):
        load_site("apptainer", {"container": {"runtime": "docker"}})
    assert load_site("slurm", {"nnodes": "3"}).nnodes == 3  # a flag's string value


def test_container_without_image(tmp_path):
    mine = write(tmp_path / "mine.yaml", "_base_: slurm\ncontainer:\n  runtime: apptainer\n")
    with pytest.raises(LaunchError, match=r"site 'mine': the apptainer container has no image"):
        load_site(str(mine))


def test_unreadable_or_not_a_mapping(tmp_path):
    listed = write(tmp_path / "list.yaml", "- _base_: slurm\n")
    with pytest.raises(LaunchError, match=r"list\.yaml' holds a list, not a mapping"):
        load_site(str(listed))
    broken = write(tmp_path / "broken.yaml", "_base_: [slurm\n")
    with pytest.raises(LaunchError, match=r"broken\.yaml' is not valid YAML"):
        load_site(str(broken))
    with pytest.raises(LaunchError, match=r"missing\.yaml' does not exist"):
        load_site(str(tmp_path / "missing.yaml"))
    folder = tmp_path / "dir.yaml"
    folder.mkdir()
    with pytest.raises(LaunchError, match=r"dir\.yaml' does not exist \(or is not a file\)"):
        load_site(str(folder))
