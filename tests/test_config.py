"""Tests for pimm.config: loading with _base_, name resolution, overrides, dump and hash."""

from __future__ import annotations

import keyword
import math
import textwrap
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pimm.config import (
    apply_overrides,
    config_hash,
    dump_config,
    flatten_keys,
    list_configs,
    load_config,
    merge_configs,
    parse_overrides,
    resolve_config_path,
)
from pimm.errors import ConfigError


def write(root: Path, rel: str, text: str) -> Path:
    """Write a dedented config file under root and return its path."""
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(textwrap.dedent(text))
    return p


# ----------------------------------------------------------------------------- loading


def test_plain_load_keeps_only_public_data(tmp_path: Path) -> None:
    p = write(tmp_path, "c.py", """
        import os
        from pathlib import Path as _P

        def helper(x):
            return x * 2

        class Thing:
            pass

        _private = 3
        seed = helper(21)
        lr = 0.5
        name = "run"
        flag = True
        nothing = None
        shape = (1, 2)
        model = dict(type="Net", layers=[1, 2, dict(k=3)])
        """)
    cfg = load_config(p)
    assert cfg == {
        "seed": 42, "lr": 0.5, "name": "run", "flag": True, "nothing": None,
        "shape": (1, 2), "model": {"type": "Net", "layers": [1, 2, {"k": 3}]},
    }


def test_nested_non_data_value_is_an_error(tmp_path: Path) -> None:
    p = write(tmp_path, "c.py", """
        model = dict(act=print)
        """)
    with pytest.raises(ConfigError, match=r"model\.act.*builtin_function_or_method"):
        load_config(p)


def test_top_level_non_data_object_is_an_error(tmp_path: Path) -> None:
    p = write(tmp_path, "c.py", """
        from pathlib import Path
        root = Path("/data")
        """)
    with pytest.raises(ConfigError, match=r"'root'.*PosixPath|'root'.*WindowsPath"):
        load_config(p)


def test_base_inheritance_multi_level_and_order(tmp_path: Path) -> None:
    write(tmp_path, "_base_/runtime.py", """
        seed = 1
        epochs = 10
        log = dict(interval=10, dir="exp")
        """)
    write(tmp_path, "_base_/mid.py", """
        _base_ = "runtime.py"
        epochs = 20
        log = dict(interval=5)
        """)
    write(tmp_path, "_base_/other.py", """
        epochs = 30
        extra = "other"
        """)
    p = write(tmp_path, "exp/child.py", """
        _base_ = ["../_base_/mid.py", "../_base_/other.py"]
        seed = 7
        """)
    cfg = load_config(p)
    # later bases override earlier ones; the file's own values override all bases
    assert cfg == {"seed": 7, "epochs": 30, "log": {"interval": 5, "dir": "exp"}, "extra": "other"}


def test_base_order_reversed(tmp_path: Path) -> None:
    write(tmp_path, "a.py", "x = 'a'\n")
    write(tmp_path, "b.py", "x = 'b'\n")
    assert load_config(write(tmp_path, "c1.py", "_base_ = ['a.py', 'b.py']\n")) == {"x": "b"}
    assert load_config(write(tmp_path, "c2.py", "_base_ = ['b.py', 'a.py']\n")) == {"x": "a"}


def test_deep_merge_dicts_and_replace_non_dicts(tmp_path: Path) -> None:
    write(tmp_path, "base.py", """
        model = dict(type="Net", backbone=dict(depth=4, width=32), heads=[1, 2])
        data = dict(train=dict(max_len=64, split="train"))
        """)
    p = write(tmp_path, "c.py", """
        _base_ = "base.py"
        model = dict(backbone=dict(width=64), heads=[3])
        data = "replaced"
        """)
    assert load_config(p) == {
        "model": {"type": "Net", "backbone": {"depth": 4, "width": 64}, "heads": [3]},
        "data": "replaced",
    }


def test_delete_replaces_base_dict(tmp_path: Path) -> None:
    write(tmp_path, "base.py", """
        optimizer = dict(type="AdamW", lr=0.001, weight_decay=0.05)
        sched = dict(type="Cos", warm=dict(steps=10, ratio=0.1))
        """)
    p = write(tmp_path, "c.py", """
        _base_ = "base.py"
        optimizer = dict(_delete_=True, type="SGD", lr=0.1)
        sched = dict(warm=dict(_delete_=True, steps=5))
        new = dict(_delete_=True, a=1)
        """)
    assert load_config(p) == {
        "optimizer": {"type": "SGD", "lr": 0.1},
        "sched": {"type": "Cos", "warm": {"steps": 5}},
        "new": {"a": 1},
    }


def test_syntax_error_names_file_line_and_text(tmp_path: Path) -> None:
    p = write(tmp_path, "bad.py", "a = 1\nb = (2,\nc = 3 +\n")
    with pytest.raises(ConfigError) as ei:
        load_config(p)
    msg = str(ei.value)
    assert msg.startswith(f"config syntax error in {p}, line ")
    p2 = write(tmp_path, "bad2.py", "a = 1\nb = 2 2\n")
    with pytest.raises(ConfigError, match=r"bad2\.py, line 2: .*\n\s+b = 2 2"):
        load_config(p2)


def test_runtime_error_names_file_and_line(tmp_path: Path) -> None:
    p = write(tmp_path, "boom.py", "a = 1\n\nb = a / 0\n")
    with pytest.raises(ConfigError, match=r"boom\.py, line 3: ZeroDivisionError: division by zero\n\s+b = a / 0"):
        load_config(p)


def test_runtime_error_in_function_reports_deepest_line(tmp_path: Path) -> None:
    p = write(tmp_path, "boom.py", "def f():\n    return {}['missing']\n\nx = f()\n")
    with pytest.raises(ConfigError, match=r"line 2: KeyError: 'missing'"):
        load_config(p)


def test_runtime_error_in_base_names_the_base(tmp_path: Path) -> None:
    write(tmp_path, "_base_/b.py", "x = undefined_name\n")
    p = write(tmp_path, "c.py", "_base_ = '_base_/b.py'\n")
    with pytest.raises(ConfigError, match=r"_base_/b\.py, line 1: NameError"):
        load_config(p)


def test_missing_base_names_base_and_referrer(tmp_path: Path) -> None:
    p = write(tmp_path, "exp/c.py", "_base_ = ['../_base_/nope.py']\nx = 1\n")
    with pytest.raises(ConfigError) as ei:
        load_config(p)
    msg = str(ei.value)
    assert "../_base_/nope.py" in msg and str(p) in msg


def test_bad_base_type(tmp_path: Path) -> None:
    p = write(tmp_path, "c.py", "_base_ = 3\n")
    with pytest.raises(ConfigError, match="_base_ in .* is 3"):
        load_config(p)


def test_cyclic_base(tmp_path: Path) -> None:
    write(tmp_path, "a.py", "_base_ = 'b.py'\n")
    write(tmp_path, "b.py", "_base_ = 'c.py'\n")
    write(tmp_path, "c.py", "_base_ = 'a.py'\n")
    with pytest.raises(ConfigError, match="cyclic _base_"):
        load_config(tmp_path / "a.py")
    write(tmp_path, "self.py", "_base_ = 'self.py'\n")
    with pytest.raises(ConfigError, match="cyclic _base_"):
        load_config(tmp_path / "self.py")


def test_diamond_base_is_not_a_cycle(tmp_path: Path) -> None:
    write(tmp_path, "d.py", "x = 1\ny = 1\n")
    write(tmp_path, "b.py", "_base_ = 'd.py'\nx = 2\n")
    write(tmp_path, "c.py", "_base_ = 'd.py'\ny = 3\n")
    # c re-applies d's x=1 after b set x=2: later bases win, as documented
    assert load_config(write(tmp_path, "a.py", "_base_ = ['b.py', 'c.py']\n")) == {"x": 1, "y": 3}


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.py")


# ----------------------------------------------------------------------------- names


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    root = tmp_path / "configs"
    write(root, "_base_/default_runtime.py", "seed = 0\n")
    write(root, "tests/tiny_semseg.py", "_base_ = '../_base_/default_runtime.py'\n")
    write(root, "demo/semseg_ptv3.py", "x = 1\n")
    write(root, "demo/_helper.py", "x = 1\n")
    return root


def test_list_configs_excludes_base_and_private(tree: Path) -> None:
    assert list_configs(tree) == ["demo/semseg_ptv3", "tests/tiny_semseg"]
    assert list_configs(tree / "missing") == []


def test_resolve_by_name_and_path(tree: Path, tmp_path: Path) -> None:
    expected = (tree / "tests/tiny_semseg.py").resolve()
    assert resolve_config_path("tests/tiny_semseg", [tree]) == expected
    assert resolve_config_path("tests/tiny_semseg.py", [tree]) == expected
    assert resolve_config_path(str(tree / "tests/tiny_semseg.py"), []) == expected
    assert resolve_config_path(str(tree / "tests/tiny_semseg"), []) == expected


def test_resolve_first_root_wins(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    write(a, "x/y.py", "v = 'a'\n")
    write(b, "x/y.py", "v = 'b'\n")
    write(b, "x/z.py", "v = 'b'\n")
    assert resolve_config_path("x/y", [a, b]) == (a / "x/y.py").resolve()
    assert resolve_config_path("x/z", [a, b]) == (b / "x/z.py").resolve()


def test_resolve_missing_suggests_closest(tree: Path) -> None:
    with pytest.raises(ConfigError) as ei:
        resolve_config_path("tests/tiny_semsge", [tree])
    msg = str(ei.value)
    assert "config 'tests/tiny_semsge' not found" in msg
    assert str(tree / "tests/tiny_semsge.py") in msg
    assert "did you mean 'tests/tiny_semseg'?" in msg
    assert "pimm ls" in msg


def test_resolve_missing_bare_name_suggests_full_name(tree: Path) -> None:
    with pytest.raises(ConfigError, match="did you mean 'tests/tiny_semseg'"):
        resolve_config_path("tiny_semseg", [tree])


def test_resolve_missing_never_suggests_base(tree: Path) -> None:
    with pytest.raises(ConfigError) as ei:
        resolve_config_path("default_runtime", [tree])
    assert "_base_/default_runtime'?" not in str(ei.value)


# ----------------------------------------------------------------------------- overrides


def test_parse_override_value_types() -> None:
    tokens = [
        "a=3", "b=0.5", "c=true", "d=false", "e=null", "f=[1,2]", "g={a: 1, b: [x]}",
        "h=abc", "i=", "j=1e-3", "k=-2", "l='3'", "m=a=b", "n=[1,2", "o=2024-01-01",
    ]
    assert parse_overrides(tokens) == [
        ("a", 3), ("b", 0.5), ("c", True), ("d", False), ("e", None), ("f", [1, 2]),
        ("g", {"a": 1, "b": ["x"]}), ("h", "abc"), ("i", ""), ("j", 0.001), ("k", -2),
        ("l", "3"), ("m", "a=b"), ("n", "[1,2"), ("o", "2024-01-01"),
    ]


def test_parse_override_dotted_key() -> None:
    assert parse_overrides(["data.train.max_len=32"]) == [("data.train.max_len", 32)]


@pytest.mark.parametrize("token", ["lr", "data.train.max_len"])
def test_parse_override_missing_equals(token: str) -> None:
    with pytest.raises(ConfigError, match=f"override '{token}' is not key=value"):
        parse_overrides([token])


@pytest.mark.parametrize("token", ["--resume", "-v", "--lr=0.1", "--"])
def test_parse_override_flag_after_separator(token: str) -> None:
    with pytest.raises(ConfigError, match="flags go before the -- separator"):
        parse_overrides([token])


@pytest.mark.parametrize("token", ["=3", "a..b=1", "a.=1", ".a=1"])
def test_parse_override_empty_key(token: str) -> None:
    with pytest.raises(ConfigError, match="empty key"):
        parse_overrides([token])


def _cfg() -> dict:
    return {
        "seed": 3,
        "data": {"train": {"max_len": 64, "split": "train"}, "val": None},
        "optimizer": {"type": "AdamW", "lr": 0.001},
        "learning_map": {0: 1, 1: 0},
    }


def test_apply_overrides_nested_and_replace_dict() -> None:
    cfg = _cfg()
    out = apply_overrides(cfg, parse_overrides([
        "data.train.max_len=32", "seed=5", "optimizer={type: SGD, lr: 0.1}", "data.val={split: val}",
        "learning_map.0=2",
    ]))
    assert out["data"]["train"] == {"max_len": 32, "split": "train"}
    assert out["seed"] == 5
    assert out["optimizer"] == {"type": "SGD", "lr": 0.1}
    assert out["data"]["val"] == {"split": "val"}
    assert out["learning_map"] == {0: 2, 1: 0}


def test_apply_overrides_does_not_mutate_input() -> None:
    cfg = _cfg()
    before = _cfg()
    value = [1, 2]
    out = apply_overrides(cfg, [("data.train.max_len", 1), ("seed", value)])
    assert cfg == before
    value.append(3)  # the result must not alias the override value either
    assert out["seed"] == [1, 2]
    out["optimizer"]["lr"] = 9
    assert cfg["optimizer"]["lr"] == 0.001


def test_apply_overrides_unknown_key_suggests_closest() -> None:
    with pytest.raises(ConfigError) as ei:
        apply_overrides(_cfg(), [("data.train.max_lne", 32)])
    assert "unknown config key 'data.train.max_lne'; did you mean 'data.train.max_len'?" in str(ei.value)
    with pytest.raises(ConfigError, match="unknown config key 'optimiser.lr'; did you mean 'optimizer.lr'"):
        apply_overrides(_cfg(), [("optimiser.lr", 1.0)])


def test_apply_overrides_unknown_key_under_none_is_strict() -> None:
    with pytest.raises(ConfigError, match="'data.val' is not a dict"):
        apply_overrides(_cfg(), [("data.val.split", "val")])


def test_apply_overrides_non_dict_traversal() -> None:
    with pytest.raises(ConfigError, match=r"cannot set 'seed\.x': 'seed' is not a dict \(it is int 3\)"):
        apply_overrides(_cfg(), [("seed.x", 1)])


def test_flatten_keys_includes_intermediate() -> None:
    assert flatten_keys({"a": {"b": {"c": 1}, "d": 2}, "e": [1]}) == ["a", "a.b", "a.b.c", "a.d", "e"]


# ----------------------------------------------------------------------------- dump / hash


def test_dump_load_round_trip(tmp_path: Path) -> None:
    cfg = {
        "seed": 0,
        "model": {"type": "Net", "shape": (1,), "pairs": [(1, 2), [3, (4,)]], "nested": {}},
        "lr": 1e-5, "inf": float("inf"), "ninf": -math.inf, "s": "a 'quoted'\nline",
        "none": None, "learning_map": {0: 1, 2: 3}, "long": list(range(100)),
    }
    out = tmp_path / "out" / "resolved.py"
    dump_config(cfg, out)
    text = out.read_text()
    assert text.startswith("# resolved by pimm; do not edit")
    assert config_hash(cfg) in text
    back = load_config(out)
    assert back == cfg
    assert isinstance(back["model"]["shape"], tuple) and isinstance(back["model"]["pairs"][1], list)
    assert config_hash(back) == config_hash(cfg)
    assert [p.name for p in out.parent.iterdir()] == ["resolved.py"]  # no temp file left behind


def test_dump_rejects_bad_top_level_keys(tmp_path: Path) -> None:
    for key in ["not an identifier", "_private", "class", 3]:
        with pytest.raises(ConfigError, match="top-level key"):
            dump_config({key: 1}, tmp_path / "x.py")
    with pytest.raises(ConfigError, match="set"):
        dump_config({"a": {1, 2}}, tmp_path / "x.py")
    assert not (tmp_path / "x.py").exists()


def test_config_hash_canonical() -> None:
    a = {"b": [1, (2, 3)], "a": {"y": 1, "x": 2}}
    b = {"a": {"x": 2, "y": 1}, "b": [1, [2, 3]]}
    assert config_hash(a) == config_hash(b)
    assert len(config_hash(a)) == 64
    assert config_hash({"a": 1}) != config_hash({"a": 1.0})
    assert config_hash({"a": 1}) != config_hash({"a": True})


# ----------------------------------------------------------------------------- properties

_keys = st.text(alphabet="abcdefghij_XYZ0123456789 .-", min_size=1, max_size=8).filter(
    lambda k: k != "_delete_"
)
_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False),
    st.text(max_size=20),
)
_values = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.lists(inner, max_size=4).map(tuple),
        st.dictionaries(_keys, inner, max_size=4),
    ),
    max_leaves=20,
)
_top_keys = st.from_regex(r"[a-z][a-z0-9_]{0,7}", fullmatch=True).filter(lambda k: not keyword.iskeyword(k))
_configs = st.dictionaries(_top_keys, _values, max_size=5)
_fast = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _same(a: object, b: object) -> bool:
    """Equality that also tells tuples from lists (== says (1,) != [1] already)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@_fast
@given(cfg=_configs)
def test_property_dump_load_round_trip(tmp_path: Path, cfg: dict) -> None:
    path = tmp_path / "resolved.py"
    dump_config(cfg, path)
    back = load_config(path)
    assert back == cfg and _same(back, cfg)
    assert config_hash(back) == config_hash(cfg)


_dicts = st.recursive(
    st.dictionaries(_keys, _scalars, max_size=4),
    lambda inner: st.dictionaries(_keys, st.one_of(_scalars, inner, st.lists(_scalars, max_size=3)), max_size=4),
    max_leaves=15,
)


@_fast
@given(base=_dicts, child=_dicts)
def test_property_deep_merge(base: dict, child: dict) -> None:
    merged = merge_configs(base, child)

    def check(b: dict, c: dict, m: dict) -> None:
        for k, v in c.items():
            assert k in m
            if isinstance(v, dict) and isinstance(b.get(k), dict):
                check(b[k], v, m[k])
            else:
                assert m[k] == v
        for k, v in b.items():
            if k not in c:
                assert m[k] == v

    check(base, child, merged)
    assert set(merged) == set(base) | set(child)


@_fast
@given(base=_dicts, child=_dicts)
def test_property_deep_merge_through_files(tmp_path: Path, base: dict, child: dict) -> None:
    # the same merge, end to end: _base_ file plus child file, both written by dump_config
    base_cfg = {f"k{i}": v for i, v in enumerate(base.values())}
    child_cfg = {f"k{i}": v for i, v in enumerate(child.values())}
    dump_config(base_cfg, tmp_path / "base.py")
    dump_config(child_cfg, tmp_path / "child_body.py")
    body = (tmp_path / "child_body.py").read_text()
    (tmp_path / "child.py").write_text("_base_ = 'base.py'\n" + body)
    assert load_config(tmp_path / "child.py") == merge_configs(base_cfg, child_cfg)


@_fast
@given(
    key=st.from_regex(r"[a-z][a-z0-9_]{0,5}(\.[a-z][a-z0-9_]{0,5}){0,2}", fullmatch=True),
    value=_scalars,
)
def test_property_parse_overrides_round_trips_yaml_scalars(key: str, value: object) -> None:
    [(k, v)] = parse_overrides([f"{key}={yaml.safe_dump(value)}"])
    assert k == key
    assert v == value and type(v) is type(value)
