"""One settings model for torshmon's daemons: typed sections read from flags, then
``TORSHMON_*`` variables, then a YAML file, and checked by msgspec.

A daemon's settings are a ``Section`` (a frozen msgspec Struct) whose fields carry
their type, default, constraints and help in the annotation
(``Annotated[float, setting("...", gt=0)]``); sections nest (``straggler:`` in the
aggregator's file). ``Layers`` gathers the values of one model with where each came
from, so that every error is one line naming the setting, the place (``file:line``,
the variable) and what is allowed; a secret's value is never shown. Fields whose
names end in ``_s`` also take durations (``500ms``, ``2m``, ``1h``), ``_bytes``
fields sizes (``64MiB``). ``docs/configuration.md`` is generated from the models
(``torshmon.settings_doc``).
"""

from __future__ import annotations

import dataclasses
import os
import re
import reprlib
import typing
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Final, Generic, TypeVar

import msgspec
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from torshmon import yamlfile

__all__ = [
    "Layers",
    "Section",
    "SettingsError",
    "field_specs",
    "parse_duration_s",
    "parse_size_bytes",
    "setting",
]


class SettingsError(ValueError):
    """A setting with a bad value; one line naming the setting and what is allowed."""


def setting(
    description: str,
    *,
    env: str | None = None,
    flag: str | None = None,
    secret: bool = False,
    refuse_blank: bool = False,
    default_text: str | None = None,
    **constraints: Any,
) -> msgspec.Meta:
    """The annotation of one setting: its help, its variable (else one is derived from
    the field's path), its command-line flag, whether it is a secret (never shown),
    whether a blank variable is an error (not "unset"), how the docs write a computed
    default, and msgspec constraints (gt, ge, le, ...)."""
    extra = {
        "env": env,
        "flag": flag,
        "secret": secret,
        "refuse_blank": refuse_blank,
        "default_text": default_text,
    }
    return msgspec.Meta(description=description, extra=extra, **constraints)


class Section(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Base of every settings model: fields checked when built, secrets out of ``repr``.

    Built from code (``AggregatorSettings(port=0)``) a value is checked against its
    annotation as strictly as msgspec checks a typed value; built by ``Layers`` it was
    first converted from text. Subclasses that add ``__post_init__`` call this one first.
    """

    def __post_init__(self) -> None:
        for spec in field_specs(type(self)):
            if spec.section is not None:
                continue
            value = getattr(self, spec.name)
            converted = convert(spec, value, strict=True)
            if converted is not value:
                msgspec.structs.force_setattr(self, spec.name, converted)

    def __repr__(self) -> str:
        shown = ", ".join(
            f"{s.name}={getattr(self, s.name)!r}" for s in field_specs(type(self)) if not s.secret
        )
        return f"{type(self).__name__}({shown})"


# -- the model, as data ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class FieldSpec:
    """One field of a settings model: what the loader and the docs need to know."""

    name: str
    hint: Any  # the annotation, Annotated constraints included
    default: Any  # msgspec.NODEFAULT when a factory makes it
    factory: Callable[[], Any] | None
    description: str
    env: str | None
    flag: str | None
    secret: bool
    refuse_blank: bool
    default_text: str | None
    #: The model of a nested section (``straggler:``), else None.
    section: type | None


_SPECS: dict[type, tuple[FieldSpec, ...]] = {}


def field_specs(model: type) -> tuple[FieldSpec, ...]:
    """The fields of a Section or dataclass model, in order (cached per class)."""
    specs = _SPECS.get(model)
    if specs is None:
        specs = _SPECS[model] = tuple(_specs(model))
    return specs


def _specs(model: type) -> Iterator[FieldSpec]:
    hints = typing.get_type_hints(model, include_extras=True)
    fields: list[tuple[str, Any, Any]]
    if dataclasses.is_dataclass(model):
        missing: Any = dataclasses.MISSING
        fields = [(f.name, f.default, f.default_factory) for f in dataclasses.fields(model)]
    else:
        missing = msgspec.NODEFAULT
        fields = [(f.name, f.default, f.default_factory) for f in msgspec.structs.fields(model)]
    for name, default, factory in fields:
        hint = hints[name]
        meta = _meta(hint)
        extra = (meta.extra if meta is not None else None) or {}
        base = _strip(hint)
        section = base if _is_model(base) else None
        yield FieldSpec(
            name=name,
            hint=hint,
            default=default,
            factory=None if factory is missing else factory,
            description=(meta.description if meta is not None else None) or "",
            env=extra.get("env"),
            flag=extra.get("flag"),
            secret=bool(extra.get("secret")),
            refuse_blank=bool(extra.get("refuse_blank")),
            default_text=extra.get("default_text"),
            section=section,
        )


def _is_model(tp: Any) -> bool:
    return isinstance(tp, type) and (issubclass(tp, msgspec.Struct) or dataclasses.is_dataclass(tp))


def _meta(hint: Any) -> msgspec.Meta | None:
    if typing.get_origin(hint) is typing.Annotated:
        for item in hint.__metadata__:
            if isinstance(item, msgspec.Meta):
                return item
    return None


def _strip(hint: Any) -> Any:
    """The annotation without its constraints."""
    return hint.__origin__ if typing.get_origin(hint) is typing.Annotated else hint


def _args(hint: Any) -> set[Any]:
    """The members of a union (or the type itself)."""
    base = _strip(hint)
    members = typing.get_args(base) if typing.get_origin(base) in (typing.Union, _UnionType) else ()
    return set(members) if members else {base}


_UnionType = type(int | None)


# -- values from text -----------------------------------------------------------------------

_DURATION_UNITS: Final = {
    **{"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3},
    **{"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0},
}
_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*(ns|us|µs|ms|s|m|h|d)")
_SIZE_UNITS: Final = {
    **{"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9},
    **{"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40},
}
_SIZE = re.compile(r"(\d+(?:\.\d*)?)\s*([a-z]*)")
_BOOLEANS: Final = {
    **{"1": True, "true": True, "yes": True, "on": True},
    **{"0": False, "false": False, "no": False, "off": False},
}
DURATION_HELP: Final = "seconds, or a duration such as 500ms, 2m or 1h"
SIZE_HELP: Final = "bytes, or a size such as 64MiB"


def parse_duration_s(text: str) -> float | None:
    """Seconds in ``text``: a number, or parts such as ``500ms``, ``2m``, ``1h30m``;
    None if it is neither."""
    text = text.strip()
    try:
        return float(text)
    except ValueError:
        pass
    position, total = 0, 0.0
    for match in _DURATION_PART.finditer(text):
        if match.start() != position and text[position : match.start()].strip():
            return None
        total += float(match.group(1)) * _DURATION_UNITS[match.group(2)]
        position = match.end()
    return total if position and not text[position:].strip() else None


def parse_size_bytes(text: str) -> int | None:
    """Bytes in ``text``: an integer, or ``64MiB``, ``1.5GB``, ``512k``; None otherwise."""
    match = _SIZE.fullmatch(text.strip().lower())
    if match is None or match.group(2) not in _SIZE_UNITS:
        return None
    return round(float(match.group(1)) * _SIZE_UNITS[match.group(2)])


def _from_text(spec: FieldSpec, value: Any) -> Any:
    """A value from an environment variable, a flag or YAML text, in its field's type
    where the text is written the human way; anything else is left for msgspec."""
    members = _args(spec.hint)
    item = _item_model(spec)
    if item is not None and isinstance(value, list):
        specs = {s.name: s for s in field_specs(item)}
        return [
            {k: _from_text(specs[k], v) if k in specs else v for k, v in element.items()}
            if isinstance(element, dict)
            else element
            for element in value
        ]
    if isinstance(value, str):
        if bool in members and value.strip().lower() in _BOOLEANS:
            return _BOOLEANS[value.strip().lower()]
        if float in members and spec.name.endswith("_s"):
            seconds = parse_duration_s(value)
            return value if seconds is None else seconds
        if int in members and spec.name.endswith("_bytes"):
            size = parse_size_bytes(value)
            return value if size is None else size
        if any(typing.get_origin(m) is tuple for m in members):
            return [part.strip() for part in value.split(",") if part.strip()]
        if any(typing.get_origin(m) is dict for m in members):  # name=value,name=value
            pairs = [part.partition("=") for part in value.split(",") if part.strip()]
            if all(sep for _, sep, _ in pairs):
                return {name.strip(): number.strip() for name, _, number in pairs}
    return value


def convert(spec: FieldSpec, value: Any, *, strict: bool = False) -> Any:
    """``value`` as the field's type; SettingsError naming the field otherwise."""
    if not strict:
        value = _from_text(spec, value)
    try:
        return msgspec.convert(value, spec.hint, strict=strict)
    except msgspec.ValidationError as exc:
        raise SettingsError(_problem(spec, value, exc, strict=strict)) from None


def _problem(spec: FieldSpec, value: Any, exc: msgspec.ValidationError, *, strict: bool) -> str:
    shown = _shown(spec, value)
    try:
        msgspec.convert(value, _strip(spec.hint), strict=strict)
    except msgspec.ValidationError:
        kind = kind_text(spec)
        if kind is None:  # a list of targets and the like: msgspec says where
            return f"{spec.name}: {exc}"
        return f"{spec.name} must be {kind}, got {shown}"
    return f"{spec.name} must be {constraint_text(spec)}, got {shown}"


def _shown(spec: FieldSpec, value: Any) -> str:
    if spec.secret:
        return f"a value of type {type(value).__name__} (not shown)"
    return reprlib.repr(value)


def kind_text(spec: FieldSpec) -> str | None:
    """What type a field takes, in words (None for lists of objects)."""
    members = _args(spec.hint) - {type(None)}
    words = []
    for member in members:
        if member is bool:
            words.append("true or false")
        elif member is int:
            words.append("an integer" + (f" ({SIZE_HELP})" if spec.name.endswith("_bytes") else ""))
        elif member is float:
            words.append("a float" + (f" ({DURATION_HELP})" if spec.name.endswith("_s") else ""))
        elif member is str:
            words.append("a string")
        elif typing.get_args(member) == (str, ...):
            words.append("a list of strings")
        elif typing.get_args(member) == (float, ...):
            words.append("a list of floats")
        elif typing.get_origin(member) is dict and typing.get_args(member) == (str, float):
            words.append("a mapping of names to floats")
        elif typing.get_origin(member) is typing.Literal:
            words.append("one of " + ", ".join(repr(a) for a in typing.get_args(member)))
        else:
            return None
    return " or ".join(sorted(words))


def constraint_text(spec: FieldSpec) -> str:
    """A field's constraints in words (``> 0``, ``in 0..65535``), "" without any."""
    meta = _meta(spec.hint)
    if meta is None:
        return ""
    if meta.ge is not None and meta.le is not None:
        return f"in {meta.ge}..{meta.le}"
    parts = [
        f"{op} {bound}"
        for op, bound in ((">", meta.gt), (">=", meta.ge), ("<", meta.lt), ("<=", meta.le))
        if bound is not None
    ]
    return " and ".join(parts)


# -- layers -----------------------------------------------------------------------------------

M = TypeVar("M")
_Path = tuple[str, ...]


class Layers(Generic[M]):
    """The values given for one settings model, each with where it came from.

    Read the lowest layer first: ``read_yaml`` (the config file), then ``read_env``,
    then ``set``/``update`` (flags); a later value replaces an earlier one. ``build``
    converts and checks them and returns the model. Not thread-safe; one per load.
    """

    def __init__(self, model: type[M], *, env_prefix: str) -> None:
        self._model = model
        self._env_prefix = env_prefix
        self._values: dict[_Path, Any] = {}
        self._origins: dict[_Path, str] = {}

    def set(self, path: _Path, value: Any, origin: str = "") -> None:
        """Give the setting at ``path`` (``("straggler", "min_slowdown")``) a value."""
        self._values[path] = value
        self._origins[path] = origin

    def update(self, flags: Mapping[str, Any]) -> None:
        """Values given by name (None: not given); a mapping for a section.

        SettingsError for a name the model does not have.
        """
        self._update(self._model, (), flags)

    def _update(self, model: type, prefix: _Path, values: Mapping[str, Any]) -> None:
        specs = {s.name: s for s in field_specs(model)}
        for name, value in values.items():
            spec = specs.get(name)
            if spec is None:
                raise SettingsError(
                    f"unknown setting {_dotted(*prefix, name)!r}; {_known(model, name)}"
                )
            if value is None:
                continue
            if spec.section is not None and isinstance(value, Mapping):
                self._update(spec.section, (*prefix, name), value)
            else:
                self.set((*prefix, name), value)

    def env_name(self, path: _Path, spec: FieldSpec) -> str:
        """The variable of a setting: its own, else the prefix and its path
        (``TORSHMON_AGGREGATOR_STRAGGLER__MIN_SLOWDOWN``)."""
        return spec.env or self._env_prefix + "__".join(path).upper()

    def leaves(self) -> Iterator[tuple[_Path, FieldSpec]]:
        """Every setting that is not a section, with its path."""
        return _leaves(self._model, ())

    def read_env(self, env: Mapping[str, str]) -> None:
        """The variables that are set; blank ones count as unset, but a blank token
        (most likely a substitution that failed) is a SettingsError. Lists of objects
        (notification targets) have variables of their own format: the model's loader
        reads those."""
        leaves = dict(self.leaves())
        for old, new in _renamed(self._model).items():
            var = self._env_prefix + old.upper()
            path = tuple(new.split("."))
            if env.get(var, "").strip() and path in leaves:
                raise SettingsError(
                    f"{var} is not read any more: {old} is {new} now "
                    f"({self.env_name(path, leaves[path])})"
                )
        for path, spec in leaves.items():
            var = self.env_name(path, spec)
            if var not in env or _item_model(spec) is not None:
                continue
            if env[var].strip():
                self.set(path, env[var], var)
            elif spec.refuse_blank:
                raise SettingsError(f"{var} is set but empty; unset it to run without one")

    def read_yaml(self, path: str | os.PathLike[str]) -> None:
        """The settings in a YAML file: SettingsError as ``file:line: reason``."""
        source = os.fspath(path)
        try:
            root = yamlfile.compose(yamlfile.read_text(Path(path), what="config file"), source)
        except yamlfile.YamlFileError as exc:
            raise SettingsError(str(exc)) from None
        if root is not None:
            self._read_mapping(root, self._model, (), source)

    def _read_mapping(self, node: Node, model: type, prefix: _Path, source: str) -> None:
        if _is_null(node):
            return
        if not isinstance(node, MappingNode):
            what = f"{_dotted(*prefix)} settings" if prefix else "settings"
            raise SettingsError(f"{source}:{_line(node)}: expected a mapping of {what}")
        specs = {s.name: s for s in field_specs(model)}
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, ScalarNode) else None
            spec = specs.get(key) if isinstance(key, str) else None
            if spec is None:
                raise SettingsError(
                    f"{source}:{_line(key_node)}: unknown setting {_describe(key_node, prefix)}; "
                    f"{_known(model, key)}"
                )
            path = (*prefix, spec.name)
            if spec.section is not None:
                self._read_mapping(value_node, spec.section, path, source)
                continue
            item = _item_model(spec)
            if item is not None and isinstance(value_node, SequenceNode):
                for element in value_node.value:
                    self._check_keys(element, item, path, source)
            self.set(path, yamlfile.construct(value_node), f"{source}:{_line(value_node)}")

    def _check_keys(self, node: Node, model: type, path: _Path, source: str) -> None:
        """The keys of one object in a list (a notification target) are all known."""
        if not isinstance(node, MappingNode):
            return  # msgspec names the wrong type
        names = {s.name for s in field_specs(model)}
        for key_node, _ in node.value:
            if not (isinstance(key_node, ScalarNode) and key_node.value in names):
                raise SettingsError(
                    f"{source}:{_line(key_node)}: unknown setting "
                    f"{_describe(key_node, path)} of an item; {_known(model)}"
                )

    def build(self) -> M:
        """The model: each value converted to its type and checked; SettingsError
        naming the setting, where it came from and what is allowed."""
        model: M = self._build(self._model, ())
        return model

    def _build(self, model: type, prefix: _Path) -> Any:
        values: dict[str, Any] = {}
        for spec in field_specs(model):
            path = (*prefix, spec.name)
            if spec.section is not None:
                if any(p[: len(path)] == path for p in self._values):
                    values[spec.name] = self._build(spec.section, path)
            elif path in self._values:
                values[spec.name] = self._convert(path, spec)
        try:
            return model(**values)
        except (SettingsError, ValueError, TypeError) as exc:
            section = f"{_dotted(*prefix)}: " if prefix else ""
            raise SettingsError(f"{section}{exc}") from None

    def _convert(self, path: _Path, spec: FieldSpec) -> Any:
        try:
            return convert(spec, self._values[path])
        except SettingsError as exc:
            origin = self._origins.get(path, "")
            where = f"{origin}: " if origin else ""
            name = _dotted(*path)
            raise SettingsError(f"{where}{name}{str(exc)[len(spec.name) :]}") from None


def _leaves(model: type, prefix: _Path) -> Iterator[tuple[_Path, FieldSpec]]:
    for spec in field_specs(model):
        if spec.section is not None:
            yield from _leaves(spec.section, (*prefix, spec.name))
        else:
            yield (*prefix, spec.name), spec


def _item_model(spec: FieldSpec) -> type | None:
    """The object type of a ``tuple[X, ...]`` field whose items are objects."""
    base = _strip(spec.hint)
    args = typing.get_args(base)
    if typing.get_origin(base) is tuple and len(args) == 2 and _is_model(args[0]):
        return typing.cast(type, args[0])
    return None


def _dotted(*path: str) -> str:
    return ".".join(path)


def _known(model: type, name: object = None) -> str:
    """What to say after "unknown setting": its new place if it was renamed (a model's
    ``renamed`` maps the names of earlier versions to dotted paths), else the names known."""
    new = _renamed(model).get(name) if isinstance(name, str) else None
    if new is not None:
        return f"it is {new!r} now"
    return "known: " + ", ".join(sorted(s.name for s in field_specs(model)))


def _renamed(model: type) -> Mapping[str, str]:
    renamed: Mapping[str, str] = getattr(model, "renamed", {})
    return renamed


def _line(node: Node) -> int:
    return node.start_mark.line + 1


def _is_null(node: Node) -> bool:
    return isinstance(node, ScalarNode) and node.tag == "tag:yaml.org,2002:null"


def _describe(node: Node, prefix: _Path) -> str:
    if isinstance(node, ScalarNode):
        return repr(_dotted(*prefix, node.value[:64]))
    return "(a list or mapping)"
