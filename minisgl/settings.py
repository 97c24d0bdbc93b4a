"""User settings declared once, as dataclass fields: CLI flags, TOML keys and keywords follow.

A config *section* is a frozen dataclass. A field made by `setting(default, help, ...)` is a user
setting: its metadata carries the help text and, where needed, the allowed values, extra flags
that each set a fixed value (`alias`) and other names for the setting itself (`also`: vLLM's and
SGLang's, so that their users' command lines, config files and keywords work unchanged). A field
made by `section(factory)` nests another section, whose settings belong to the same tree. Any other
field is a runtime value (a rank's place, an address, a resolved path) that whoever starts a rank
fills in with `dataclasses.replace`; it is not user-settable.

From a tree (an instance of the root section, whose values are the defaults):
- `add_flags` declares one argparse flag per setting (`--max-kv-tokens`; a bool whose default is
  False is `--x`, one whose default is True is `--no-x`, an Optional[bool] is `--x` / `--no-x`);
- `check_values` validates a mapping of settings (a TOML file, keywords): keys take dashes or
  underscores and any of a setting's names, an unknown key, a value of the wrong type or one
  setting given under two names is a ValueError naming the keys;
- `build` returns the tree with those values: each section is constructed again, innermost first,
  so its own `__post_init__` judges the values (the one place each check is written);
- `names` and `values` list the settings and their values.

Setting names are unique across a tree. This module knows nothing of minisgl's sections.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import typing
from typing import (Any, Callable, Dict, Iterable, Iterator, List, Mapping, NamedTuple, Optional,
                    Sequence, Tuple, TypeVar, Union)

T = TypeVar("T")

_HELP = "help"
_CHOICES = "choices"
_ANY_CASE = "any_case"
_ALIAS = "alias"
_ALSO = "also"
_SECTION = "section"
_JSON = "json"
_TYPES = (bool, int, float, str)
_METAVARS = {int: "N", float: "X"}


class Alias(NamedTuple):
    """One more spelling of a setting, as a flag and a TOML key that set it to `value` when given
    (a TOML value of false leaves the setting as it is), e.g. `--disable-overlap`."""
    name: str  # dashed, without the leading "--"
    value: Any
    help: str


def setting(default: Any, help: str, *, choices: Optional[Sequence[str]] = None,
            any_case: bool = False, alias: Union[None, Alias, Sequence[Alias]] = None,
            also: Sequence[str] = (), json_value: bool = False) -> Any:
    """A user-settable field. `choices`: the allowed values, checked by `check_choices` (case
    aside where `any_case`); None passes where the default is None. `alias`: one or more flags
    (and keys) that each set a fixed value. `also`: other names of the setting (dashed), each
    a flag and a key taking its value (not for a bool that is on by default: its flag is
    `--no-NAME`). `json_value`: a str setting holding a JSON object (`json_object` parses
    it), which a TOML table or a Python dict (an `LLM()` keyword, as vLLM's) also gives."""
    if also and isinstance(default, bool) and default:
        raise TypeError(f"setting {also}: a bool on by default takes no other names")
    metadata: Dict[str, Any] = {_HELP: help}
    if choices is not None:
        metadata[_CHOICES] = tuple(choices)
        metadata[_ANY_CASE] = any_case
    if alias is not None:
        metadata[_ALIAS] = (alias,) if isinstance(alias, Alias) else tuple(alias)
    if also:
        metadata[_ALSO] = tuple(also)
    if json_value:
        metadata[_JSON] = True
    return dataclasses.field(default=default, metadata=metadata)


def json_object(text: Optional[str], name: str, what: str = "",
                keys: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    """A setting whose value is a JSON object (`what` says of what; `keys`, where given, the
    only keys it may have), parsed: empty where unset; ValueError naming the setting (and the
    key) where it is not JSON, not an object or has another key."""
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{name} is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object{' of ' + what if what else ''}, got "
                         f"{text!r:.80}")
    other = sorted(set(value) - set(keys)) if keys is not None else []
    if other:
        raise ValueError(f"{name}: {other[0]} is not supported (minisgl takes "
                         f"{', '.join(keys or ())})")
    return value


def section(factory: Callable[[], Any]) -> Any:
    """A field holding a nested section (built by `factory` by default)."""
    return dataclasses.field(default_factory=factory, metadata={_SECTION: True})


class Setting(NamedTuple):
    name: str
    path: Tuple[str, ...]  # the section fields leading to it from the root
    type: type  # bool, int, float or str
    optional: bool  # None is a value
    value: Any  # in the tree it was read from (the default, where that is a root's)
    help: str
    choices: Optional[Tuple[str, ...]]
    aliases: Tuple[Alias, ...]  # flags (and keys) that each set a fixed value
    also: Tuple[str, ...]  # other names, dashed
    json_value: bool = False  # a JSON object's text, which a mapping gives too

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def flags(self) -> List[str]:
        """The setting's own flag, then one per other name."""
        return [self.flag, *("--" + a for a in self.also)]

    @property
    def keys(self) -> List[str]:
        """Every name that sets it in a mapping (underscored): its own and the others."""
        return [self.name, *(a.replace("-", "_") for a in self.also)]


def _value_type(hint: Any, where: str) -> Tuple[type, bool]:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    optional = typing.get_origin(hint) is typing.Union and len(args) == 1
    base = args[0] if optional else hint
    if base not in _TYPES:
        raise TypeError(f"setting {where}: type {hint!r} is not one of bool, int, float, str or "
                        f"Optional of one")
    return base, optional


def _walk(node: Any, path: Tuple[str, ...]) -> Iterator[Setting]:
    hints = typing.get_type_hints(type(node))
    for f in dataclasses.fields(node):
        if f.metadata.get(_SECTION):
            yield from _walk(getattr(node, f.name), path + (f.name,))
        elif _HELP in f.metadata:
            base, optional = _value_type(hints[f.name], f.name)
            yield Setting(f.name, path, base, optional, getattr(node, f.name), f.metadata[_HELP],
                          f.metadata.get(_CHOICES), f.metadata.get(_ALIAS, ()),
                          f.metadata.get(_ALSO, ()), f.metadata.get(_JSON, False))


def settings_of(root: Any) -> List[Setting]:
    """Every setting of the tree `root`, in field order (a nested section where it stands)."""
    out = list(_walk(root, ()))
    seen: Dict[str, Setting] = {}
    for s in out:
        for name in (*s.keys, *(a.name.replace("-", "_") for a in s.aliases)):
            if name in seen:
                raise TypeError(f"setting {name!r} is declared twice in {type(root).__name__}")
            seen[name] = s
    return out


def names(root: Any) -> List[str]:
    """The settings' names: the keywords a tree takes."""
    return [s.name for s in settings_of(root)]


def values(cfg: Any) -> Dict[str, Any]:
    """{name: value} of every setting of the tree `cfg`."""
    return {s.name: s.value for s in settings_of(cfg)}


def check_choices(section_cfg: Any) -> None:
    """Raise ValueError, naming the field and the allowed values, for a field of this section
    (not of nested ones) whose value is not among its `choices`."""
    for f in dataclasses.fields(section_cfg):
        choices = f.metadata.get(_CHOICES)
        value = getattr(section_cfg, f.name)
        if choices is None or value in choices or (value is None and f.default is None):
            continue
        if f.metadata[_ANY_CASE] and isinstance(value, str) and value.lower() in choices:
            continue
        allowed = (" or ".join(choices) if len(choices) == 2
                   else f"one of {', '.join(choices)}")
        raise ValueError(f"{f.name} must be {allowed}, got {value!r}")


# --- command line ---------------------------------------------------------------------------------
def _help(s: Setting) -> str:
    text = s.help
    if s.type is not bool and s.value is not None:
        text += f" (default: {s.value})"
    return text.replace("%", "%%")


def add_flags(parser: argparse.ArgumentParser, root: Any, *, skip: Iterable[str] = (),
              given_only: bool = False) -> None:
    """One flag per setting of `root` (those named in `skip` aside), in a group per nested
    section, the destination being the setting's name. Defaults are `root`'s values, or, with
    `given_only`, absent from the namespace unless the flag is given (for a file beneath)."""
    left_out = set(skip)
    groups: Dict[Tuple[str, ...], Any] = {(): parser}
    for s in settings_of(root):
        if s.name in left_out:
            continue
        if s.path not in groups:
            groups[s.path] = parser.add_argument_group(f"{s.path[-1]} settings")
        _add_flag(groups[s.path], s, argparse.SUPPRESS if given_only else s.value)


def _add_flag(group: Any, s: Setting, default: Any) -> None:
    common = dict(dest=s.name, default=default)
    if s.type is bool and s.optional:
        group.add_argument(*s.flags, action=argparse.BooleanOptionalAction, help=_help(s),
                           **common)
    elif s.type is bool and s.value:
        group.add_argument("--no-" + s.flag[2:], action="store_false",
                           help=f"turn off {s.name}: {_help(s)}", **common)
    elif s.type is bool:
        group.add_argument(*s.flags, action="store_true", help=_help(s), **common)
    else:
        group.add_argument(*s.flags, type=s.type, choices=s.choices, help=_help(s),
                           metavar=_METAVARS.get(s.type) if s.choices is None else None, **common)
    for alias in s.aliases:
        group.add_argument("--" + alias.name, action="store_const", const=alias.value,
                           help=alias.help.replace("%", "%%"), **common)


def from_namespace(ns: argparse.Namespace, root: Any) -> Dict[str, Any]:
    """The settings of `root` that `ns` holds (from `add_flags`), by name."""
    given = vars(ns)
    return {name: given[name] for name in names(root) if name in given}


# --- mappings: TOML files, keywords ------------------------------------------------------------
def _checked(s: Setting, key: str, value: Any) -> Any:
    if value is None and s.optional:
        return None
    if s.json_value and isinstance(value, Mapping):  # a TOML table, a keyword's dict
        return json.dumps(dict(value))
    if s.type is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, s.type) or (s.type is int and isinstance(value, bool)):
        raise ValueError(f"{key} must be of type {s.type.__name__}, got {value!r}")
    return value


def check_values(root: Any, raw: Mapping[str, Any], where: str) -> Dict[str, Any]:
    """`raw` as {setting name: value}: keys with dashes or underscores, other names and
    aliases applied, each value of its setting's type (an int where a float is wanted becomes
    one). Raises ValueError naming an unknown key (`where` says whose), a value of the wrong
    type, or two keys that set one setting (`tp` and `tensor-parallel-size`; `overlap` and
    `disable-overlap`)."""
    by_name: Dict[str, Setting] = {}
    by_key: Dict[str, Setting] = {}
    aliases: Dict[str, Tuple[Setting, Alias]] = {}
    for s in settings_of(root):
        by_name[s.name] = s
        by_key.update((k, s) for k in s.keys)
        aliases.update((a.name.replace("-", "_"), (s, a)) for a in s.aliases)
    out: Dict[str, Any] = {}
    given_as: Dict[str, str] = {}  # setting name -> the key that gave it

    def give(s: Setting, key: str, value: Any) -> None:
        if s.name in given_as:
            raise ValueError(f"{where}: {given_as[s.name]!r} and {key!r} both set {s.name}")
        given_as[s.name], out[s.name] = key, value

    for key, value in raw.items():
        name = key.replace("-", "_")
        if name in by_key:
            give(by_key[name], key, _checked(by_key[name], key, value))
        elif name in aliases or _negated(name, by_name) is not None:
            if not isinstance(value, bool):
                raise ValueError(f"{key} must be of type bool, got {value!r}")
            if name in aliases and value:  # false leaves the setting as it is
                s, alias = aliases[name]
                give(s, key, alias.value)
            elif name not in aliases:  # a `--no-X` flag's name: X turned off
                give(by_name[name[len("no_"):]], key, not value)
        else:
            raise ValueError(f"{where}: unknown setting {key!r}")
    return out


def _negated(name: str, by_name: Mapping[str, Setting]) -> Optional[Setting]:
    """The setting whose `--no-...` flag `name` is (a bool on by default, or an optional
    one: `_add_flag` gives both a `--no-` flag), or None."""
    s = by_name.get(name[len("no_"):]) if name.startswith("no_") else None
    return s if s is not None and s.type is bool and (s.optional or s.value) else None


def build(root: T, raw: Mapping[str, Any], where: str) -> T:
    """`root` with the settings in `raw` (checked by `check_values`). Every section is built
    again, innermost first, so its `__post_init__` raises ValueError for a bad value."""
    return _replace_tree(root, check_values(root, raw, where))


def _replace_tree(node: T, given: Mapping[str, Any]) -> T:
    changes: Dict[str, Any] = {}
    for f in dataclasses.fields(node):  # type: ignore[arg-type]
        if f.metadata.get(_SECTION):
            changes[f.name] = _replace_tree(getattr(node, f.name), given)
        elif _HELP in f.metadata and f.name in given:
            changes[f.name] = given[f.name]
    return dataclasses.replace(node, **changes)  # type: ignore[type-var]
