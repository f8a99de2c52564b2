"""Find, load, merge, dump and hash Python config files (mmengine/Pointcept style).

A config is a ``.py`` file of plain assignments. ``_base_`` names parent files that are
loaded first and deep-merged under the file's own values. The resolved config is a
nested dict of plain data only (dict, list, tuple, str, int, float, bool, None).
"""

from __future__ import annotations

import ast
import builtins
import difflib
import hashlib
import json
import keyword
import math
import os
import pprint
import types
from pathlib import Path
from typing import Any

from pimm.errors import ConfigError
from pimm.files import write_atomic

BASE_KEY = "_base_"
DELETE_KEY = "_delete_"
_SCALARS = (str, int, float, bool, type(None))
_HEADER = "# resolved by pimm; do not edit\n"


# ----------------------------------------------------------------------------- names


def list_configs(root: Path) -> list[str]:
    """Config names under ``root``: relative posix paths without ``.py``, sorted.

    Skips ``_base_/`` and any file or folder whose name starts with ``_``.
    """
    root = Path(root)
    if not root.is_dir():
        return []
    names = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root)
        # private parts (_base_, __pycache__, _helpers.py) are building blocks, not runnable configs
        if any(part.startswith("_") for part in rel.parts):
            continue
        if p.is_file():
            names.append(rel.with_suffix("").as_posix())
    return sorted(names)


def resolve_config_path(name_or_path: str, search_roots: list[Path]) -> Path:
    """Turn a config name (``tests/tiny_semseg``) or file path into an existing ``.py`` path.

    An existing file path (with or without ``.py``) wins; otherwise the name is looked up
    as ``<root>/<name>.py`` in each root in order. Raises ConfigError when nothing matches, or
    when it names a folder (the message lists the configs in it).
    """
    given = str(name_or_path)
    for candidate in (Path(given), Path(given + ".py")):
        if candidate.is_file():
            return candidate.resolve()

    name = given.removesuffix(".py")
    for folder in (*(Path(root) / name for root in search_roots), Path(given)):
        if folder.is_dir():
            raise _is_a_folder(given, folder, search_roots)
    tried = []
    for root in search_roots:
        candidate = Path(root) / f"{name}.py"
        tried.append(str(candidate))
        if candidate.is_file():
            return candidate.resolve()

    known = sorted({n for root in search_roots for n in list_configs(Path(root))})
    msg = f"config {given!r} not found; looked in: {', '.join(tried) or '(no search roots)'}"
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    if not close:
        # a bare file name ("tiny_semseg") should still find "tests/tiny_semseg"
        close = [n for n in known if n.rsplit("/", 1)[-1] == name.rsplit("/", 1)[-1]][:1]
    if close:
        msg += f"; did you mean {close[0]!r}?"
    msg += " Run `pimm ls` to list the available configs."
    raise ConfigError(msg)


def _is_a_folder(given: str, folder: Path, search_roots: list[Path]) -> ConfigError:
    """ConfigError for a folder given as a config, listing the configs in it as --train.config takes them."""
    root = next((Path(r).resolve() for r in search_roots if folder.resolve().is_relative_to(Path(r).resolve())), None)
    if root is not None:  # config names, as `pimm ls` lists them
        prefix = folder.resolve().relative_to(root).as_posix()
        names = [n for n in list_configs(root) if prefix == "." or n.startswith(prefix + "/")]
    else:  # paths of the .py files directly in it
        names = sorted(p.as_posix() for p in folder.glob("*.py") if p.is_file() and not p.name.startswith("_"))
    where = f"{given!r} is a directory" + (f" ({folder})" if folder.as_posix() != given.rstrip("/") else "")
    if not names:
        return ConfigError(f"config {where} with no runnable config in it (configs are .py files outside _base_/); "
                           "pass a config name or a .py file. Run `pimm ls` to list the available configs.")
    shown = ", ".join(names[:20]) + (f" (and {len(names) - 20} more)" if len(names) > 20 else "")
    return ConfigError(f"config {where}, not a config file. Pass one of the configs in it: {shown}. For example: "
                       f"--train.config {names[0]}")

# ----------------------------------------------------------------------------- plain data


def check_plain_data(value: Any, where: str, file: str | None = None) -> Any:
    """Return ``value`` as plain data (dict subclasses become dict) or raise ConfigError."""
    if type(value) in _SCALARS:
        return value
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if type(k) not in _SCALARS:
                raise ConfigError(
                    f"config key {k!r} in {where!r} has type {type(k).__name__}"
                    f"{' in ' + file if file else ''}; dict keys must be str, int, float, bool or None"
                )
            out[k] = check_plain_data(v, f"{where}.{k}", file)
        return out
    if type(value) is list:
        return [check_plain_data(v, f"{where}[{i}]", file) for i, v in enumerate(value)]
    if type(value) is tuple:
        return tuple(check_plain_data(v, f"{where}[{i}]", file) for i, v in enumerate(value))
    raise ConfigError(
        f"config value {where!r}{' in ' + file if file else ''} is a {type(value).__name__} "
        f"({value!r:.80}); configs may hold only dict, list, tuple, str, int, float, bool and None. "
        "Convert it (e.g. float(x), str(path)) or give the name a leading underscore to keep it private."
    )


def _is_code(value: Any) -> bool:
    """True for modules, functions and classes: helpers a config may define but not export."""
    return isinstance(value, types.ModuleType) or callable(value)


def flatten_keys(cfg: dict) -> list[str]:
    """All dotted key paths of a nested dict, intermediate dict keys included (preorder)."""
    out: list[str] = []

    def walk(node: dict, prefix: str) -> None:
        for k, v in node.items():
            path = f"{prefix}{k}"
            out.append(path)
            if isinstance(v, dict):
                walk(v, path + ".")

    walk(cfg, "")
    return out


# ----------------------------------------------------------------------------- merge


def _strip_delete(value: Any) -> Any:
    """Copy of ``value`` with every ``_delete_`` marker removed from nested dicts."""
    if isinstance(value, dict):
        return {k: _strip_delete(v) for k, v in value.items() if k != DELETE_KEY}
    if isinstance(value, list):
        return [_strip_delete(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_strip_delete(v) for v in value)
    return value


def merge_configs(base: dict, child: dict) -> dict:
    """Deep-merge ``child`` over ``base`` into a new dict (inputs are not modified).

    Dicts merge key by key; any other value replaces. A child dict with ``_delete_=True``
    replaces the base dict instead of merging into it.
    """
    out = {k: _strip_delete(v) for k, v in base.items()}
    for k, v in child.items():
        if k == DELETE_KEY:
            continue
        if isinstance(v, dict) and isinstance(out.get(k), dict) and not v.get(DELETE_KEY, False):
            out[k] = merge_configs(out[k], v)
        else:
            out[k] = _strip_delete(v)
    return out


# ----------------------------------------------------------------------------- load


def _line_text(source: str, lineno: int | None) -> str:
    lines = source.splitlines()
    if lineno and 1 <= lineno <= len(lines):
        return lines[lineno - 1].strip()
    return ""


def _exec_file(path: Path, filename: str) -> dict:
    """Execute one config file in a fresh namespace and return that namespace."""
    try:
        source = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read config {filename}: {e}; check the path and that it is a UTF-8 text file") from e
    try:
        # the real filename makes tracebacks and line numbers point at the config
        code = compile(source, filename, "exec", dont_inherit=True)
    except SyntaxError as e:
        text = (e.text or _line_text(source, e.lineno)).strip()
        raise ConfigError(
            f"config syntax error in {filename}, line {e.lineno}: {e.msg}"
            + (f"\n    {text}" if text else "")
        ) from None
    namespace: dict[str, Any] = {"__file__": filename, "__name__": "__pimm_config__", "__builtins__": builtins}
    try:
        exec(code, namespace)  # noqa: S102 - configs are Python files by design
    except Exception as e:
        # report the deepest frame that belongs to this config file, not pimm internals
        lineno = None
        tb = e.__traceback__
        while tb is not None:
            if tb.tb_frame.f_code.co_filename == filename:
                lineno = tb.tb_lineno
            tb = tb.tb_next
        text = _line_text(source, lineno)
        raise ConfigError(
            f"error while executing config {filename}, line {lineno}: {type(e).__name__}: {e}"
            + (f"\n    {text}" if text else "")
            + "\nFix the config file; it must run as plain Python."
        ) from e
    return namespace


def _base_list(raw: Any, filename: str) -> list[str]:
    if isinstance(raw, str):
        return [raw]
    if isinstance(raw, (list, tuple)) and all(isinstance(b, str) for b in raw):
        return list(raw)
    raise ConfigError(
        f"_base_ in {filename} is {raw!r}; it must be a path string or a list of path strings "
        "relative to the config file, e.g. _base_ = ['../_base_/default_runtime.py']"
    )


def _load(path: Path, stack: list[Path]) -> dict:
    filename = os.path.normpath(str(path))
    real = Path(filename).resolve()
    if real in stack:
        chain = " -> ".join(str(p) for p in [*stack[stack.index(real):], real])
        raise ConfigError(f"cyclic _base_ chain: {chain}; remove one of these _base_ references")
    namespace = _exec_file(Path(filename), filename)

    own = {}
    for k, v in namespace.items():
        if k.startswith("_") or _is_code(v):
            continue
        own[k] = check_plain_data(v, k, filename)

    merged: dict = {}
    if BASE_KEY in namespace:
        for rel in _base_list(namespace[BASE_KEY], filename):
            base_path = Path(filename).parent / rel
            with_py = base_path.with_name(base_path.name + ".py")
            if not base_path.is_file() and not rel.endswith(".py") and with_py.is_file():
                base_path = with_py
            if not base_path.is_file():
                raise ConfigError(
                    f"base config {rel!r} referenced by {filename} not found "
                    f"(looked for {os.path.normpath(str(base_path))}); fix the _base_ path, "
                    "which is relative to the referencing file"
                )
            merged = merge_configs(merged, _load(base_path, [*stack, real]))
    return merge_configs(merged, own)


def load_config(path: Path) -> dict:
    """Execute a config file (and its ``_base_`` chain) and return the resolved plain-data dict."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} not found; pass an existing .py file or a config name")
    return _load(path, [])


# ----------------------------------------------------------------------------- dump / hash


class _ExactPrinter(pprint.PrettyPrinter):
    """PrettyPrinter whose output evaluates back to the same value (inf/nan floats included)."""

    def format(self, obj: Any, context: dict, maxlevels: int, level: int) -> tuple[str, bool, bool]:
        if type(obj) is float and not math.isfinite(obj):
            # repr gives 'inf'/'nan', which are not Python literals
            text = "float('nan')" if math.isnan(obj) else ("float('inf')" if obj > 0 else "-float('inf')")
            return text, True, False
        return super().format(obj, context, maxlevels, level)


def dump_config(cfg: dict, path: Path) -> None:
    """Write ``cfg`` as a Python file of plain assignments that ``load_config`` reads back equal.

    The write is atomic (temporary file in the same folder, then ``os.replace``).
    """
    if not isinstance(cfg, dict):
        raise ConfigError(f"cannot dump config: expected a dict, got {type(cfg).__name__}")
    parts = []
    for key in sorted(cfg):
        if not isinstance(key, str) or not key.isidentifier() or keyword.iskeyword(key) or key.startswith("_"):
            raise ConfigError(
                f"cannot dump config: top-level key {key!r} is not a public Python name; "
                "top-level keys must be identifiers that do not start with '_'"
            )
        value = check_plain_data(cfg[key], key)
        prefix = f"{key} = "
        printer = _ExactPrinter(width=max(40, 88 - len(prefix)), sort_dicts=True)
        # pprint never breaks inside a string literal, so indenting continuation lines is safe
        body = printer.pformat(value).replace("\n", "\n" + " " * len(prefix))
        parts.append(f"\n{prefix}{body}\n")
    text = "".join([_HEADER, f"# config hash: {config_hash(cfg)}\n", *parts])

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, text)  # readers see the old file or the new one, never half of one


# ----------------------------------------------------------------------------- read a run's config


_NON_FINITE = {"nan": math.nan, "inf": math.inf}  # float('nan'), float('inf'): how dump_config writes them


class _NonFinite(ast.NodeTransformer):
    """Replace exactly `float('nan')` and `float('inf')` (the forms dump_config writes) by their
    value, so ast.literal_eval reads them; any other call stays and is refused."""

    def visit_Call(self, node: ast.Call) -> ast.AST:
        func, args = node.func, node.args
        if (isinstance(func, ast.Name) and func.id == "float" and not node.keywords and len(args) == 1
                and isinstance(args[0], ast.Constant) and args[0].value in _NON_FINITE):
            return ast.copy_location(ast.Constant(_NON_FINITE[args[0].value]), node)
        return node


def read_run_config(path: Path) -> dict:
    """The resolved config of a run (its config.py, as ``dump_config`` wrote it) read as data: each
    top-level statement must be ``NAME = <literal>``; nothing in the file is executed. ConfigError,
    naming the file and line, for anything else (a file someone appended code to is refused)."""
    path = Path(path)
    try:
        source = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read the run's config {path}: {e}; it should be the config.py pimm wrote "
                          "into the run directory") from None

    def refuse(lineno: int | None, problem: str) -> ConfigError:
        text = _line_text(source, lineno)
        return ConfigError(f"{path}, line {lineno}: pimm reads a run's config.py as data; it holds code: {problem}"
                           + (f" ({text:.80})" if text else "")
                           + "; restore the config.py pimm wrote (plain NAME = value lines) or start a new run")

    try:
        tree = ast.parse(source, filename=str(path))
    except SyntaxError as e:
        raise refuse(e.lineno, f"a syntax error ({e.msg})") from None
    except (ValueError, RecursionError, MemoryError) as e:  # a NUL byte; nesting too deep for the parser
        raise refuse(None, f"not Python source ({type(e).__name__}: {str(e):.80})") from None
    cfg: dict = {}
    for statement in tree.body:
        target = statement.targets[0] if isinstance(statement, ast.Assign) and len(statement.targets) == 1 else None
        if not isinstance(target, ast.Name):
            raise refuse(statement.lineno, "a statement that is not an assignment NAME = <value>")
        try:
            value = ast.literal_eval(_NonFinite().visit(statement.value))
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            raise refuse(statement.lineno, f"the value of {target.id} is an expression, not a literal") from None
        if target.id.startswith("_"):
            raise refuse(statement.lineno, f"{target.id} is a private name, which dump_config never writes")
        try:
            cfg[target.id] = check_plain_data(value, target.id)
        except ConfigError as e:  # a set, bytes or complex number: literals, but not config values
            raise refuse(statement.lineno, str(e).split(";")[0]) from None
    return cfg


def _canonical(value: Any) -> Any:
    if isinstance(value, dict):
        # json keys must be strings; encode non-str keys the way json itself would
        return {k if isinstance(k, str) else json.dumps(k): _canonical(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    return value


def config_hash(cfg: dict) -> str:
    """sha256 hex digest of the canonical JSON form of ``cfg`` (sorted keys, tuples as lists)."""
    if not isinstance(cfg, dict):
        raise ConfigError(f"cannot hash config: expected a dict, got {type(cfg).__name__}")
    for k, v in cfg.items():
        check_plain_data(v, str(k))
    text = json.dumps(_canonical(cfg), sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()
