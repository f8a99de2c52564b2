"""Site profiles for `pimm submit`: what a cluster needs in an sbatch script (account, partition,
GPU directive, modules, container) kept in small YAML files under `pimm/launch/sites/`.

A profile names its parent with `_base_` (a packaged profile's name, or a path relative to the
file); a file without `_base_` inherits from `local.yaml`, which holds every default. Mappings
(`environment`, `container`) merge key by key, a `null` value removing the parent's key; lists and
scalars replace. Command-line overrides apply last, then the whole profile is validated once.

Runs on a login node before anything starts: no torch here.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pimm.errors import LaunchError

SITES_DIR = Path(__file__).with_name("sites")
ROOT_SITE = "local"

SCHEDULERS = ("slurm", "none")
GPU_DIRECTIVES = ("gres", "gpus-per-node", "none")
RUNTIMES = ("apptainer", "singularity", "shifter")
BINDING_RUNTIMES = ("apptainer", "singularity")  # shifter mounts with --volume: pass it in options

INT_FIELDS = ("nnodes", "nproc_per_node", "cpus_per_proc", "signal_delay_s")
OPTIONAL_STR_FIELDS = ("mem", "account", "account_suffix", "partition", "qos", "constraint", "python")
LIST_FIELDS = ("setup", "required", "sbatch_options")
FIELDS = (
    "_base_", "scheduler", *INT_FIELDS, "time", *OPTIONAL_STR_FIELDS, "gpu_directive", "gres_name",
    "environment", "container", *LIST_FIELDS,
)
MERGED_FIELDS = ("environment", "container")
CONTAINER_FIELDS = ("runtime", "image", "binds", "options")

TIME_FORMATS = "M, M:S, H:M:S, D-H, D-H:M or D-H:M:S (e.g. 30, 01:30:00, 2-00:00:00)"
_TIME_RE = re.compile(r"(?:(?P<days>\d+)-(?P<dh>\d+)(?::(?P<dm>\d+)(?::(?P<ds>\d+))?)?"
                      r"|(?P<a>\d+)(?::(?P<b>\d+)(?::(?P<c>\d+))?)?)")
_MEM_RE = re.compile(r"\d+[KMGT]?", re.IGNORECASE)
_ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class _Loader(yaml.SafeLoader):
    """SafeLoader without YAML 1.1's base-60 numbers, so `time: 10:00` stays the string sbatch reads
    (the stock loader makes it the integer 600)."""


_INT_TAG, _FLOAT_TAG = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
_Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in (_INT_TAG, _FLOAT_TAG)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    _INT_TAG, re.compile(r"^(?:[-+]?0b[0-1_]+|[-+]?0[0-7_]+|[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+)$"),
    list("-+0123456789"))
_Loader.add_implicit_resolver(
    _FLOAT_TAG, re.compile(r"^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+][0-9]+)?|\.[0-9_]+(?:[eE][-+][0-9]+)?"
                           r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
    list("-+0123456789."))


@dataclass(frozen=True)
class Container:
    """The image a job runs in; `runtime` is apptainer, singularity or shifter."""

    runtime: str
    image: str
    binds: tuple[str, ...] = ()
    options: tuple[str, ...] = ()


@dataclass(frozen=True)
class Site:
    """A validated site profile: every field set, every value checked."""

    name: str
    source: Path
    scheduler: str
    nnodes: int
    nproc_per_node: int
    cpus_per_proc: int
    time: str
    time_s: int
    mem: str | None
    account: str | None
    partition: str | None
    qos: str | None
    constraint: str | None
    gpu_directive: str
    gres_name: str
    signal_delay_s: int
    environment: dict[str, str] = field(default_factory=dict)
    setup: tuple[str, ...] = ()
    container: Container | None = None
    python: str | None = None
    sbatch_options: tuple[str, ...] = ()

    @property
    def uses_gpus(self) -> bool:
        return self.gpu_directive != "none"

    def sbatch_directives(self, job_name: str, output: str) -> list[str]:
        """The `#SBATCH` lines: one launcher task per node (torchrun starts the per-GPU processes),
        then GPUs, limits, accounting, the log path and the checkpoint signal; values shell-quoted."""
        if self.scheduler != "slurm":
            raise LaunchError(f"site {self.name!r} has scheduler {self.scheduler!r}, so it has no sbatch script: "
                              "run it with `pimm launch`, or pick a Slurm site (--site slurm, or your own profile)")
        q = shlex.quote
        lines = [
            f"--job-name={q(job_name)}",
            f"--nodes={self.nnodes}",
            "--ntasks-per-node=1",
            f"--cpus-per-task={self.cpus_per_proc * self.nproc_per_node}",
        ]
        if self.gpu_directive == "gres":
            lines.append(f"--gres={q(self.gres_name)}:{self.nproc_per_node}")
        elif self.gpu_directive == "gpus-per-node":
            lines.append(f"--gpus-per-node={self.nproc_per_node}")
        lines.append(f"--time={q(self.time)}")
        for name in ("mem", "account", "partition", "qos", "constraint"):
            value = getattr(self, name)
            if value is not None:
                lines.append(f"--{name}={q(value)}")
        lines += [f"--output={q(output)}", f"--signal=USR1@{self.signal_delay_s}"]
        if self.container is not None and self.container.runtime == "shifter":
            lines.append(f"--image={q(self.container.image)}")
        lines += [q(option) for option in self.sbatch_options]
        return [f"#SBATCH {line}" for line in lines]

    def script_values(self) -> list[tuple[str, str]]:
        """(field, text) of every value of the profile that a batch script may carry."""
        out: list[tuple[str, str]] = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Container):
                value = (value.runtime, value.image, *value.binds, *value.options)
            elif isinstance(value, dict):
                value = tuple(f"{k}={v}" for k, v in value.items())
            out += [(f.name, str(v)) for v in (value if isinstance(value, tuple) else (value,))
                    if isinstance(v, str | Path)]
        return out

    def preamble(self) -> list[str]:
        """Shell lines run on each node before training: the setup lines as written, then exports."""
        return [*self.setup, *(f"export {key}={shlex.quote(value)}" for key, value in self.environment.items())]

    def wrap(self, argv: list[str]) -> list[str]:
        """The command as a compute node runs it: inside the site's container when it has one."""
        c = self.container
        if c is None:
            return list(argv)
        if c.runtime == "shifter":
            return ["shifter", *c.options, *argv]  # the image comes from `#SBATCH --image`
        wrapped = [c.runtime, "exec"]
        if self.uses_gpus:
            wrapped.append("--nv")
        if c.binds:
            wrapped += ["--bind", ",".join(c.binds)]
        return [*wrapped, *c.options, c.image, *argv]


def control_characters(text: str) -> str:
    """The control characters in `text` (below 0x20, and DEL), each as its Python escape ('\\n\\t'); '' when none."""
    return "".join(sorted({repr(c)[1:-1] for c in text if ord(c) < 0x20 or ord(c) == 0x7F}))


def check_one_line(value: str, what: str) -> str:
    """`value` when it holds no control character; LaunchError naming `what` otherwise. In a batch
    script a newline starts a new line: a new #SBATCH directive or a shell command nobody asked for."""
    found = control_characters(value)
    if found:
        raise LaunchError(f"{what} {value!r:.100} holds control character(s) {found}; a value written into a batch "
                          "script must be one line of printable text: remove them")
    return value


def known_sites() -> list[str]:
    """Names of the packaged profiles (`pimm/launch/sites/*.yaml`), sorted."""
    return sorted(p.stem for p in SITES_DIR.glob("*.yaml"))


def parse_slurm_time(text: str) -> int:
    """A Slurm time limit in seconds; accepts what sbatch accepts: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S."""
    match = _TIME_RE.fullmatch(str(text).strip())
    if match is None:
        raise LaunchError(f"time limit {text!r} is not a Slurm time: use {TIME_FORMATS}")
    g = {k: int(v) for k, v in match.groupdict().items() if v is not None}
    if "days" in g:
        seconds = g["days"] * 86400 + g["dh"] * 3600 + g.get("dm", 0) * 60 + g.get("ds", 0)
    elif "c" in g:
        seconds = g["a"] * 3600 + g["b"] * 60 + g["c"]
    else:
        seconds = g["a"] * 60 + g.get("b", 0)
    if seconds <= 0:
        raise LaunchError(f"time limit {text!r} is zero: give a positive limit in {TIME_FORMATS}")
    return seconds


def flag_for(name: str) -> str:
    """The `pimm submit` flag that overrides a profile field (`nproc_per_node` -> --resources.nproc-per-node)."""
    return "--resources." + name.replace("_", "-")


def load_site(name_or_path: str, overrides: dict | None = None) -> Site:
    """A packaged profile by name, or the user's own YAML (a path: contains '/' or ends in .yaml/.yml),
    with its `_base_` chain merged, `overrides` (field -> value; None ignored) applied last, validated."""
    source = _locate(str(name_or_path))
    name = source.stem
    merged, origin = _resolve(source, [])
    for key, value in (overrides or {}).items():
        if value is None:
            continue
        _check_known(key, FIELDS[1:], "site override", "overrides name profile fields, listed in "
                     "pimm/launch/sites/local.yaml")
        if key == "container":
            _check_container_keys(value, "the site overrides")
        merged[key] = _merge_value(key, merged.get(key), value)
        origin[key] = flag_for(key)
    return _validate(name, source, merged, origin)


def _locate(name_or_path: str) -> Path:
    if "/" in name_or_path or name_or_path.endswith((".yaml", ".yml")):
        path = Path(name_or_path).expanduser()
        if not path.is_file():
            raise LaunchError(f"site profile {str(path)!r} does not exist (or is not a file): check the path, "
                              f"or name a packaged site: {', '.join(known_sites())}")
        return path.resolve()
    if name_or_path not in known_sites():
        close = difflib.get_close_matches(name_or_path, known_sites(), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise LaunchError(f"unknown site {name_or_path!r}{hint}; known sites: {', '.join(known_sites())}. "
                          "A path to your own profile works too (e.g. --site ./mycluster.yaml with `_base_: slurm`)")
    return (SITES_DIR / f"{name_or_path}.yaml").resolve()


def _read(path: Path) -> dict:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise LaunchError(f"cannot read site profile {str(path)!r}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise LaunchError(f"site profile {str(path)!r} is not a text file (byte {e.object[e.start]:#04x} at offset "
                          f"{e.start} is not UTF-8); give a YAML profile such as pimm/launch/sites/slurm.yaml"
                          ) from None
    try:
        data = yaml.load(text, Loader=_Loader)  # a SafeLoader: plain data only
    except yaml.YAMLError as e:
        raise LaunchError(f"site profile {str(path)!r} is not valid YAML: {' '.join(str(e).split())}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise LaunchError(f"site profile {str(path)!r} holds a {type(data).__name__}, not a mapping of "
                          "`field: value` lines: write it like pimm/launch/sites/slurm.yaml")
    for key in data:
        _check_known(key, FIELDS, f"field in site profile {str(path)!r}",
                     "see pimm/launch/sites/local.yaml for every field")
    _check_container_keys(data.get("container"), f"site profile {str(path)!r}")
    return data


def _check_container_keys(container: Any, where: str) -> None:
    for key in container if isinstance(container, dict) else ():
        _check_known(key, CONTAINER_FIELDS, f"container field in {where}",
                     f"a container has {', '.join(CONTAINER_FIELDS)}")


def _check_known(key: Any, known: tuple[str, ...], what: str, advice: str) -> None:
    if key in known:
        return
    close = difflib.get_close_matches(str(key), known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise LaunchError(f"unknown {what}: {key!r}{hint}; {advice}")


def _resolve(path: Path, chain: list[Path]) -> tuple[dict, dict[str, str]]:
    """The profile at `path` merged over its `_base_` chain; also which file set each field."""
    if path in chain:
        cycle = " -> ".join(str(p) for p in [*chain[chain.index(path):], path])
        raise LaunchError(f"site profiles inherit in a cycle: {cycle}; remove one of these `_base_` lines")
    data = _read(path)
    base = data.pop("_base_", None)
    root = (SITES_DIR / f"{ROOT_SITE}.yaml").resolve()
    if base is None and path != root:
        base = ROOT_SITE
    if base is None:
        merged, origin = {}, {}
    else:
        if not isinstance(base, str) or not base:
            raise LaunchError(f"`_base_` in site profile {str(path)!r} must be a site name or a path, got {base!r}")
        if "/" in base or base.endswith((".yaml", ".yml")):
            base_path = (path.parent / Path(base).expanduser()).resolve()
            if not base_path.is_file():
                raise LaunchError(f"`_base_: {base}` in site profile {str(path)!r} names {str(base_path)!r}, "
                                  "which does not exist: paths are relative to the file that names them")
        else:
            try:
                base_path = _locate(base)
            except LaunchError as e:
                raise LaunchError(f"`_base_` in site profile {str(path)!r}: {e}") from None
        merged, origin = _resolve(base_path, [*chain, path])
    for key, value in data.items():
        merged[key] = _merge_value(key, merged.get(key), value)
        origin[key] = str(path)
    return merged, origin


def _merge_value(key: str, old: Any, new: Any) -> Any:
    """Mappings in MERGED_FIELDS merge (a null value drops the key); everything else replaces."""
    if key not in MERGED_FIELDS or not isinstance(old, dict) or not isinstance(new, dict):
        return new
    out = dict(old)
    for k, v in new.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = v
    return out


def _validate(name: str, source: Path, raw: dict, origin: dict[str, str]) -> Site:
    def fail(key: str, problem: str, advice: str = "") -> LaunchError:
        where = f" (from {origin[key]})" if key in origin else ""
        return LaunchError(f"site {name!r}: {problem}{where}" + (f"; {advice}" if advice else ""))

    for key in ("scheduler", *INT_FIELDS, "time", "gpu_directive", "gres_name"):
        if raw.get(key) is None:
            raise fail(key, f"{key} is not set", f"set it in the profile or pass {flag_for(key)}")

    def choice(key: str, allowed: tuple[str, ...], value: Any = None, label: str | None = None) -> str:
        value = raw[key] if value is None else value
        if value not in allowed:
            raise fail(key, f"{label or key} must be one of {', '.join(allowed)}, got {value!r}")
        return value

    def integer(key: str, minimum: int) -> int:
        value = raw[key]
        if isinstance(value, str) and value.strip().isdigit():
            value = int(value)
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise fail(key, f"{key} must be an integer >= {minimum}, got {raw[key]!r}")
        return value

    def text(key: str) -> str | None:
        value = raw.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, str | int):
            raise fail(key, f"{key} must be a string, got {value!r}")
        value = str(value).strip()
        if not value:
            raise fail(key, f"{key} is empty", "remove the line, or set it to null")
        return value

    def lines(key: str, value: Any = None, where: str | None = None) -> tuple[str, ...]:
        value = raw.get(key) if where is None else value
        if value is None:
            return ()
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise fail(key, f"{where or key} must be a list of strings, got {value!r}",
                       "write one item per line, each starting with '- '")
        return tuple(value)

    scheduler = choice("scheduler", SCHEDULERS)
    nnodes, nproc, cpus = integer("nnodes", 1), integer("nproc_per_node", 1), integer("cpus_per_proc", 1)
    signal_delay_s = integer("signal_delay_s", 0)
    gpu_directive = choice("gpu_directive", GPU_DIRECTIVES)
    time = text("time")
    try:
        time_s = parse_slurm_time(time)
    except LaunchError as e:
        raise fail("time", str(e)) from None
    if signal_delay_s >= time_s:
        raise fail("signal_delay_s", f"signal_delay_s {signal_delay_s} is not smaller than the time limit "
                   f"{time} ({time_s} s), so the checkpoint signal would come as the job starts",
                   f"give a longer time ({flag_for('time')}) or a shorter delay ({flag_for('signal_delay_s')})")
    strings = {key: text(key) for key in OPTIONAL_STR_FIELDS}
    if strings["mem"] is not None and not _MEM_RE.fullmatch(strings["mem"]):
        raise fail("mem", f"mem must be a size such as 64G, 500M or 0 (all of the node's memory), "
                   f"got {strings['mem']!r}")

    environment = raw.get("environment") or {}
    if not isinstance(environment, dict):
        raise fail("environment", f"environment must be a mapping of NAME: value, got {environment!r}")
    env: dict[str, str] = {}
    for key, value in environment.items():
        if not isinstance(key, str) or not _ENV_NAME_RE.fullmatch(key):
            raise fail("environment", f"environment variable name {key!r} is not a shell name (letters, digits, _)")
        if isinstance(value, bool) or not isinstance(value, str | int | float):
            raise fail("environment", f"environment {key} must be a string, got {value!r}",
                       "quote it in the YAML (e.g. \"1\")")
        env[key] = str(value)

    container = None
    spec = raw.get("container")
    if spec is not None:
        if not isinstance(spec, dict):
            raise fail("container", f"container must be a mapping with {', '.join(CONTAINER_FIELDS)}, got {spec!r}")
        runtime = choice("container", RUNTIMES, spec.get("runtime") or "(not set)", "container.runtime")
        image = spec.get("image")
        if not isinstance(image, str) or not image.strip():
            raise fail("container", f"the {runtime} container has no image (got {image!r})",
                       "set container.image to the image the compute nodes run (a .sif path, or name:tag for shifter)")
        binds = lines("container", spec.get("binds"), "container.binds")
        if binds and runtime not in BINDING_RUNTIMES:
            raise fail("container", f"container.binds is for {' and '.join(BINDING_RUNTIMES)}, not {runtime}",
                       "for shifter put --volume=HOST:CONTAINER in container.options")
        options = lines("container", spec.get("options"), "container.options")
        container = Container(runtime=runtime, image=image.strip(), binds=binds, options=options)

    sbatch_options = lines("sbatch_options")
    for option in sbatch_options:
        if not option.startswith("-"):
            raise fail("sbatch_options", f"sbatch option {option!r} does not start with '-'",
                       "write it as on the sbatch command line, e.g. --exclusive")

    values = {**raw, **strings, "scheduler": scheduler, "nnodes": nnodes, "nproc_per_node": nproc,
              "cpus_per_proc": cpus, "time": time, "signal_delay_s": signal_delay_s, "environment": env,
              "container": container}
    for key in lines("required"):
        _check_known(key, FIELDS[1:], f"field in `required` of site {name!r}",
                     "list profile fields, e.g. [account]")
        if values.get(key) in (None, "", (), [], {}):
            required_by = f" (required in {origin['required']})" if "required" in origin else ""
            raise LaunchError(f"site {name!r} needs {_article(key)} {key}: pass {flag_for(key)} "
                              f"{'NAME' if key == 'account' else 'VALUE'}{required_by}")
    suffix = strings["account_suffix"]
    account = strings["account"]
    if suffix and account and not account.endswith(suffix):
        raise fail("account", f"account {account!r} does not end in {suffix!r}, as this site's accounts for "
                   "these jobs must", f"use e.g. {flag_for('account')} {account}{suffix}")

    site = Site(
        name=name, source=source, scheduler=scheduler, nnodes=nnodes, nproc_per_node=nproc, cpus_per_proc=cpus,
        time=time, time_s=time_s, mem=strings["mem"], account=account, partition=strings["partition"],
        qos=strings["qos"], constraint=strings["constraint"], gpu_directive=gpu_directive,
        gres_name=text("gres_name"), signal_delay_s=signal_delay_s, environment=env, setup=lines("setup"),
        container=container, python=strings["python"], sbatch_options=sbatch_options,
    )
    for key, value in site.script_values():
        try:
            check_one_line(value, key)
        except LaunchError as e:
            raise fail(key, str(e)) from None
    return site


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"
