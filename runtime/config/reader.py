"""Strict reading of DeepSpeed-style config mappings: files, types, "auto", unknown keys.

This module owns the mechanics that make `runtime.config` strict: loading JSON/YAML with duplicate-key
detection, reading each key through a check with the key path in the message (the checks themselves,
Bool, Int, ..., are in `runtime.config.checks`), resolving or refusing "auto", and telling apart keys
that are unknown (a typo: "did you mean ...") from keys DeepSpeed has that we do not support yet.
The section modules of `runtime.config` declare the schema on top of it; nothing here knows section names.
"""

from __future__ import annotations

import difflib
import json
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from runtime.errors import UserError

AUTO = "auto"


class ConfigError(UserError, ValueError):
    """A bad config value. The message always starts with the key path: "zero_optimization.stage: ..."."""

    hint = (
        "fix that key in the config (the --deepspeed_config file, or the dict given to runtime.initialize); "
        "README.md's config reference lists every key"
    )

    def __init__(self, path: str, message: str, *, hint: str | None = None) -> None:
        self.path = path
        super().__init__(f"{path}: {message}", hint=hint)


def describe(value: Any) -> str:
    """A value as "type repr" for error messages: "str '5'" and "int 5" must read differently."""
    return f"{type(value).__name__} {value!r}"


class FrozenDict(dict):
    """A dict that refuses mutation; still a dict, so json.dumps, pickle and torch.save take it as is."""

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("this config mapping is read-only")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = _refuse  # type: ignore[assignment]
    __ior__ = _refuse  # type: ignore[assignment]

    def __reduce__(self) -> tuple[Any, ...]:
        return (FrozenDict, (dict(self),))

    def __copy__(self) -> FrozenDict:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> FrozenDict:
        return self


def freeze(value: Any) -> Any:
    """Deep read-only copy: mappings become FrozenDict, lists become tuples."""
    if isinstance(value, Mapping):
        return FrozenDict({k: freeze(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(freeze(v) for v in value)
    return value


def thaw(value: Any) -> Any:
    """Deep plain copy (dicts and lists), for json.dumps or for editing."""
    if isinstance(value, Mapping):
        return {k: thaw(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [thaw(v) for v in value]
    return value


# ---------------------------------------------------------------------------------------------------------
# Files


def _no_duplicate_pairs(where: str) -> Callable[[list[tuple[str, Any]]], dict[str, Any]]:
    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise ConfigError(key, f"duplicate key in {where} (JSON keeps only the last one silently)")
            out[key] = value
        return out

    return hook


class _StrictYamlLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys instead of keeping the last one."""


def _construct_mapping(loader: _StrictYamlLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    loader.flatten_mapping(node)
    out: dict[Any, Any] = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in out:
            line = key_node.start_mark.line + 1
            raise ConfigError(str(key), f"duplicate key at line {line} of {loader.name}")
        out[key] = loader.construct_object(value_node, deep=deep)
    return out


_StrictYamlLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
# YAML 1.1 (PyYAML) reads 1e-8 and 5e8 as strings: it wants a dot before the exponent. DeepSpeed configs
# write numbers that way all the time, so read them as floats like JSON does.
_StrictYamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


# A file that cannot be parsed has no key to fix: its own hint says what to fix in the text.
FILE_HINT = (
    "fix the file's text (a JSON config is one object in double quotes, without comments or trailing commas)"
)
YAML_HINT = "fix the file's text at that line (a YAML config is one mapping of keys to values)"


def _syntax_hint(text: str, line: int, column: int) -> str:
    """A hint naming the usual cause of a JSON syntax error at (line, column), from the text around it."""
    lines = text.splitlines() or [""]
    current = lines[min(line, len(lines)) - 1]
    before = "\n".join([*lines[: line - 1], current[: column - 1]]).rstrip()
    here = current[column - 1 :].lstrip()
    if before.endswith(",") and here[:1] in ("}", "]", ""):
        return "remove the trailing comma before it: JSON allows none after a list's or object's last item"
    if here.startswith(("//", "/*", "#")):
        return "remove the comment: JSON has none (a .yaml config may have # comments)"
    if here.startswith("'"):
        return "use double quotes: JSON strings and keys take no single quotes"
    if line == 1 and column == 1 and _is_yaml_mapping(text):
        return "the text is YAML: name the file .yaml (or .yml) to read it as YAML"
    return FILE_HINT


def _is_yaml_mapping(text: str) -> bool:
    try:
        return isinstance(yaml.safe_load(text), Mapping)
    except yaml.YAMLError:
        return False


def _read_text(file: Path, path: str | os.PathLike) -> str:
    """The file's text as UTF-8 (a leading byte-order mark, as some Windows editors write, is skipped)."""
    if file.is_dir():
        raise ConfigError(str(path), "is a directory, not a config file", hint="name the file in it")
    if not file.exists():
        where = f"check the path (a relative one starts at the current directory, {os.getcwd()})"
        raise ConfigError(str(path), "config file not found", hint=where)
    try:
        data = file.read_bytes()
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise ConfigError(str(path), f"cannot be read: {reason}", hint="check its permissions") from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        utf16 = ": it is UTF-16" if data[:2] in (b"\xff\xfe", b"\xfe\xff") else ""
        raise ConfigError(
            str(path),
            f"not UTF-8 text (byte {exc.start} is 0x{data[exc.start]:02x}){utf16}",
            hint="save the file as UTF-8",
        ) from None


def read_config_file(path: str | os.PathLike) -> Any:
    """Parse a .json / .yaml / .yml config file; other suffixes are read as JSON. Every way the file can be
    unreadable (missing, a directory, not UTF-8, not parseable, empty) is one ConfigError naming it."""
    file = Path(path)
    text = _read_text(file, path)
    if not text.strip():
        raise ConfigError(str(path), "the config file is empty", hint="write the config's JSON object in it")
    if file.suffix.lower() in (".yaml", ".yml"):
        try:
            loader = _StrictYamlLoader(text)
            loader.name = str(file)
            try:
                data = loader.get_single_data()
            finally:
                loader.dispose()
        except yaml.MarkedYAMLError as exc:
            # PyYAML's own text spans several lines with a drawing of the spot; one line names the same
            mark = exc.problem_mark or exc.context_mark
            where = f"line {mark.line + 1} column {mark.column + 1}: " if mark is not None else ""
            problem = f"not valid YAML: {where}{exc.problem or exc.context}"
            raise ConfigError(str(path), problem, hint=YAML_HINT) from None
        except yaml.YAMLError as exc:
            problem = f"not valid YAML: {' '.join(str(exc).split())}"
            raise ConfigError(str(path), problem, hint=YAML_HINT) from None
        if data is None:
            raise ConfigError(str(path), "the config file is empty", hint="write the config's keys in it")
        return data
    try:
        return json.loads(text, object_pairs_hook=_no_duplicate_pairs(str(path)))
    except json.JSONDecodeError as exc:
        raise ConfigError(
            str(path),
            f"not valid JSON: line {exc.lineno} column {exc.colno}: {exc.msg}",
            hint=_syntax_hint(text, exc.lineno, exc.colno),
        ) from None


# ---------------------------------------------------------------------------------------------------------
# Reading a section


class AutoRefused(Exception):
    """Raised by an "auto" resolver that cannot resolve; the message says why."""


NO_TRAINER_ARGS = (
    'HF Trainer fills this "auto" from its TrainingArguments and dslaunch has no such source; '
    "set a value in the config (or pass it in load_config(auto_values=...))"
)


@dataclass
class ReadContext:
    """State shared by every section while one config is read."""

    auto_values: Mapping[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    unresolved_auto: list[tuple[str, str]] = field(default_factory=list)
    unknown: list[tuple[str, str, tuple[str, ...]]] = field(default_factory=list)  # (path, key, candidates)
    known_paths: set[str] = field(default_factory=set)

    def note(self, text: str) -> None:
        self.notes.append(text)

    def raise_pending(self) -> None:
        """Raise the first unknown key, else every unresolved "auto" at once."""
        if self.unknown:
            path, key, candidates = self.unknown[0]
            raise ConfigError(path, unknown_key_message(key, candidates, self.known_paths))
        if self.unresolved_auto:
            first_path, why = self.unresolved_auto[0]
            others = [p for p, _ in self.unresolved_auto[1:]]
            also = f" (also unresolved: {', '.join(others)})" if others else ""
            raise ConfigError(first_path, f'"auto" cannot be resolved: {why}{also}')


def unknown_key_message(key: str, candidates: tuple[str, ...], known_paths: set[str]) -> str:
    lowered = {c.lower(): c for c in candidates}
    guess = lowered.get(key.lower()) or next(
        iter(difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)), None
    )
    if guess:
        return f'unknown key; did you mean "{guess}"?'
    # The right key in the wrong section: point at where it belongs.
    elsewhere = sorted(p for p in known_paths if p.rsplit(".", 1)[-1] == key)
    if elsewhere:
        return f'unknown key here; "{key}" belongs at "{elsewhere[0]}"'
    return f"unknown key; expected one of: {', '.join(sorted(candidates))}"


class SectionReader:
    """Reads one mapping, remembering which keys were read so that leftovers can be diagnosed.

    Typical use: `r.get(key, check, default)` for every supported key, `r.ignored(...)` and
    `r.default_only(...)` for DeepSpeed keys we accept without acting on, then `r.finish(unsupported=...)`.
    """

    def __init__(self, data: Any, path: str, ctx: ReadContext) -> None:
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            raise ConfigError(path or "config", f"expected a mapping of keys to values, got {describe(data)}")
        for key in data:
            if not isinstance(key, str):
                raise ConfigError(self._join(path, str(key)), f"keys must be strings, got {describe(key)}")
        self.data = data
        self.path = path
        self.ctx = ctx
        self.known: list[str] = []
        self.resolved: dict[str, Any] = {}

    @staticmethod
    def _join(path: str, key: str) -> str:
        return f"{path}.{key}" if path else key

    def key_path(self, key: str) -> str:
        return self._join(self.path, key)

    def _declare(self, key: str) -> None:
        if key not in self.known:
            self.known.append(key)
        self.ctx.known_paths.add(self.key_path(key))

    def has(self, key: str) -> bool:
        self._declare(key)
        return key in self.data

    def get(
        self,
        key: str,
        check: Callable[[str, Any], Any],
        default: Any,
        *,
        auto: Callable[[], Any] | None = None,
    ) -> Any:
        """The checked value of `key`, or `default` when absent.

        "auto" is taken from ctx.auto_values[path] if given there, else from `auto()` (which may raise
        AutoRefused), else refused with the key path (collected, so all unresolved keys are named at once).
        """
        self._declare(key)
        path = self.key_path(key)
        if key not in self.data:
            return default
        value = self.data[key]
        if isinstance(value, str) and value == AUTO:
            if path in self.ctx.auto_values:
                value = self.ctx.auto_values[path]
            else:
                try:
                    if auto is None:
                        raise AutoRefused(NO_TRAINER_ARGS)
                    value = auto()
                except AutoRefused as why:
                    self.ctx.unresolved_auto.append((path, str(why)))
                    return default
                if value is None:  # resolvers return None for "use the default"
                    return default
        return check(path, value)

    def section(self, key: str) -> SectionReader:
        """A reader for the nested mapping at `key` (empty when absent)."""
        self._declare(key)
        return SectionReader(self.data.get(key), self.key_path(key), self.ctx)

    def alias(self, old: str, new: str, why: str = "deprecated DeepSpeed name") -> None:
        """Accept `old` as another name of `new` (both at once is an error)."""
        self._declare(old)
        if old not in self.data:
            return
        if new in self.data:
            raise ConfigError(self.key_path(old), f'is another name for "{new}"; set only one of them')
        self.data = {**self.data, new: self.data[old]}
        self.ctx.note(f'{self.key_path(old)}: read as "{new}" ({why})')

    def ignored(self, key: str, default: Any, why: str) -> None:
        """A DeepSpeed key that has no effect here; a non-default value is accepted with a note."""
        self._declare(key)
        if key in self.data and self.data[key] != default:
            self.ctx.note(f"{self.key_path(key)}: {self.data[key]!r} ignored ({why})")

    def default_only(self, key: str, default: Any, what: str) -> None:
        """A DeepSpeed key whose only accepted value is its default (others ask for a missing feature)."""
        self._declare(key)
        if key in self.data and self.data[key] != default:
            raise ConfigError(
                self.key_path(key),
                f"a DeepSpeed option dslaunch does not support: {what} ({self.data[key]!r}); remove the key "
                f"or set it to {default!r}",
            )

    def finish(self, unsupported: Mapping[str, str] | None = None) -> None:
        """Diagnose keys nobody read: DeepSpeed features we lack raise now, typos are collected."""
        for key in self.data:
            if key in self.known:
                continue
            if unsupported and key in unsupported:
                value = self.data[key]
                if value is None:  # DeepSpeed's own default for an optional section: not asked for
                    continue
                if isinstance(value, Mapping) and value.get("enabled") is False:
                    self.ctx.note(
                        f"{self.key_path(key)}: ignored (disabled; dslaunch does not support it yet)"
                    )
                    continue
                raise ConfigError(
                    self.key_path(key),
                    f"a DeepSpeed option dslaunch does not support: {unsupported[key]}; remove this key",
                )
            self.ctx.unknown.append((self.key_path(key), key, tuple(self.known)))
