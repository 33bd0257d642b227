"""The server command's settings: the command line, ``APBV_SERVE_*`` environment variables and
a TOML file (``--config-file``), merged by pydantic-settings.

Every flag of the ``serve`` parser is a setting, read from the parser itself (a flag added
later is one at once): its key is the flag's destination (``--max-queue``: ``max_queue``), its
environment variable ``APBV_SERVE_`` + the key in capitals (``APBV_SERVE_MAX_QUEUE``), and its
type, choices and default are the flag's. Precedence, key by key: command line > environment >
file > the flag's default. A repeatable flag (``--media-root``) is a TOML array, or in the
environment a JSON array or a comma-separated list. An unknown key in the file, or an
``APBV_SERVE_*`` variable that names no setting, is an error naming it and the keys there are;
a value of the wrong type is an error naming its key. ``--config-file`` itself may come from
``APBV_SERVE_CONFIG_FILE``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

ENV_PREFIX = "APBV_SERVE_"
OWN_FLAGS = ("help", "config_file", "print_config")
"""Destinations of the parser that are not settings: ``--help``, the file itself (its
variable is ``APBV_SERVE_CONFIG_FILE``) and ``--print-config``."""
SECRET_KEYS = ("api_key",)
"""Settings whose values :func:`render_toml` does not print."""
PRECEDENCE = "command line > APBV_SERVE_* environment > --config-file > defaults"


@dataclass(frozen=True)
class Setting:
    """One flag of the parser as a setting: ``key`` (the destination), ``flag`` (its longest
    spelling), ``kind`` (int, float, str or bool), ``choices`` (or None), ``default``,
    ``repeatable`` (an ``append`` flag: a list of ``kind``) and ``convert`` (a flag's own
    ``type=`` function, applied to text from the environment or the file as argparse applies
    it to the command line's; ``kind`` is then object)."""

    key: str
    flag: str
    kind: type
    choices: tuple[Any, ...] | None
    default: Any
    repeatable: bool
    convert: Callable[[str], Any] | None = None

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.key.upper()


def settings_of(parser: argparse.ArgumentParser) -> list[Setting]:
    """The settings of every flag of ``parser`` but :data:`OWN_FLAGS` (argparse keeps its
    actions in ``_actions``, the same since Python 2.7). A kind of flag other than a value,
    a repeatable value or an on-switch is an internal error, found by the tests."""
    found = []
    for action in parser._actions:
        if action.dest in OWN_FLAGS or action.dest == argparse.SUPPRESS:
            continue
        flag = max(action.option_strings, key=len)
        repeatable = isinstance(action, argparse._AppendAction)
        if isinstance(action, argparse._StoreTrueAction):
            kind: type = bool
        else:
            assert isinstance(action, argparse._StoreAction) or repeatable, \
                f"{flag}: a {type(action).__name__} flag cannot be a setting"
            kind = str if action.type is None else action.type  # type: ignore[assignment]
        convert: Any = None if kind in (bool, int, float, str) else action.type
        choices = tuple(action.choices) if action.choices is not None else None
        found.append(Setting(action.dest, flag, object if convert else kind, choices,
                             action.default, repeatable, convert))
    return found


def _split(value: Any) -> Any:
    """A repeatable setting's environment value: a JSON array, or items split at commas."""
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            return json.loads(text)
        return [item.strip() for item in text.split(",") if item.strip()]
    return value


def _converter(convert: Callable[[str], Any]) -> Callable[[Any], Any]:
    def apply(value: Any) -> Any:
        if not isinstance(value, str):
            return value
        try:
            return convert(value)
        except (argparse.ArgumentTypeError, TypeError) as exc:
            raise ValueError(str(exc)) from None
    return apply


def _model(settings: list[Setting], toml_file: Path | None, environ: Mapping[str, str]) -> Any:
    """A pydantic-settings model of ``settings``: init values (the command line), then
    ``environ`` (names in any case), then ``toml_file``."""
    from pydantic import BeforeValidator, Field, create_model
    from pydantic_settings import (
        BaseSettings,
        NoDecode,
        SettingsConfigDict,
        TomlConfigSettingsSource,
    )

    class Sources(BaseSettings):
        model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, case_sensitive=False,
                                          extra="forbid", toml_file=toml_file)

        @classmethod
        def settings_customise_sources(cls, settings_cls: Any, init_settings: Any,
                                       env_settings: Any, dotenv_settings: Any,
                                       file_secret_settings: Any) -> tuple[Any, ...]:
            env_settings.env_vars = {k.lower(): v for k, v in environ.items()}
            sources = [init_settings, env_settings]
            if toml_file is not None:
                sources.append(TomlConfigSettingsSource(settings_cls))
            return tuple(sources)

    fields: dict[str, Any] = {}
    for s in settings:
        kind: Any = Literal[s.choices] if s.choices else s.kind
        if s.convert is not None:
            kind = Annotated[Any, BeforeValidator(_converter(s.convert))]
        if s.repeatable:
            kind = Annotated[list[kind], NoDecode, BeforeValidator(_split)]
        elif s.default is None:
            kind = kind | None
        fields[s.key] = (kind, Field(default=s.default))
    return create_model("ServeSettings", __base__=Sources, **fields)


def _read_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ValueError(f"--config-file {str(path)!r} "
                         f"{'is not a file' if path.exists() else 'does not exist'}")
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"--config-file {str(path)!r} is not valid TOML: {exc}") from None


def _env_names(environ: Mapping[str, str]) -> dict[str, str]:
    """{upper-case name: name} of the ``APBV_SERVE_*`` variables set in ``environ``."""
    return {k.upper(): k for k in environ if k.upper().startswith(ENV_PREFIX)}


def _check_names(settings: list[Setting], data: dict[str, Any], path: Path | None,
                 environ: Mapping[str, str]) -> None:
    keys = [s.key for s in settings]
    for key in data:
        if key not in keys:
            raise ValueError(f"unknown key {key!r} in --config-file {str(path)!r}; the keys "
                             f"are the serve flags' names: {', '.join(keys)}")
    known = {s.env for s in settings} | {ENV_PREFIX + "CONFIG_FILE"}
    for upper, name in sorted(_env_names(environ).items()):
        if upper not in known:
            raise ValueError(f"unknown environment variable {name}: the APBV_SERVE_* "
                             f"variables are {', '.join(sorted(known))}")


def _message(error: dict[str, Any], by_key: dict[str, Setting], sources: dict[str, str]) -> str:
    key = str(error["loc"][0]) if error.get("loc") else "?"
    setting = by_key.get(key)
    where = f"{setting.flag}, {setting.env} or key {key!r} of --config-file" if setting else key
    return (f"serve setting {key!r} ({where}; this value from {sources.get(key, '?')}): "
            f"{error['msg']}, got {error.get('input')!r}")


def resolve(parser: argparse.ArgumentParser, argv: list[str], args: argparse.Namespace,
            environ: Mapping[str, str] | None = None) -> argparse.Namespace:
    """``args`` (``parser``'s parse of ``argv``) with every setting resolved: the value given
    on the command line, else ``APBV_SERVE_<KEY>``, else the ``--config-file`` key, else the
    flag's default. The result's ``setting_sources`` maps each key to where its value came
    from ("command line", "environment APBV_SERVE_X", "file PATH" or "default"). ValueError
    for an unknown key or variable, a value of the wrong type, or two exclusive flags set."""
    from apbv import import_extra

    import_extra("pydantic_settings", package="pydantic-settings", extra="serve",
                 purpose="the server's settings")
    from pydantic import ValidationError

    environ = os.environ if environ is None else environ
    settings = settings_of(parser)
    by_key = {s.key: s for s in settings}
    given = _given(parser, argv)
    names = _env_names(environ)
    file_name = args.config_file or environ.get(names.get(ENV_PREFIX + "CONFIG_FILE", ""))
    path = Path(file_name) if file_name else None
    data = _read_file(path) if path is not None else {}
    _check_names(settings, data, path, environ)
    sources = {}
    for s in settings:
        sources[s.key] = ("command line" if s.key in given else
                          f"environment {names[s.env]}" if s.env in names else
                          f"file {path}" if s.key in data else "default")
    try:
        cli = {k: getattr(args, k) for k in given if k in by_key}
        values = _model(settings, path, environ)(_env_file=None, **cli)
    except ValidationError as exc:
        raise ValueError("; ".join(_message(e, by_key, sources)  # type: ignore[arg-type]
                                   for e in exc.errors()[:3])) from None
    resolved = argparse.Namespace(**vars(args))
    for s in settings:
        setattr(resolved, s.key, getattr(values, s.key))
    resolved.config_file = str(path) if path is not None else None
    resolved.setting_sources = sources
    _check_exclusive(parser, resolved, sources)
    return resolved


def _given(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The destinations ``argv`` sets on the command line (a parse with every default
    suppressed, so a flag given with its default value still counts)."""
    quiet = argparse.ArgumentParser(add_help=False, argument_default=argparse.SUPPRESS)
    for action in parser._actions:
        if action.option_strings and action.dest not in ("help",):
            kwargs: dict[str, Any] = {"dest": action.dest, "default": argparse.SUPPRESS}
            if isinstance(action, argparse._StoreTrueAction):
                kwargs["action"] = "store_true"
            elif isinstance(action, argparse._AppendAction):
                kwargs["action"] = "append"
            quiet.add_argument(*action.option_strings, **kwargs)
    return set(vars(quiet.parse_known_args(argv)[0]))


def _check_exclusive(parser: argparse.ArgumentParser, ns: argparse.Namespace,
                     sources: dict[str, str]) -> None:
    for group in parser._mutually_exclusive_groups:
        keys = [a.dest for a in group._group_actions if getattr(ns, a.dest) is not None]
        if len(keys) > 1:
            raise ValueError("serve settings " + " and ".join(
                f"{k!r} (from {sources[k]})" for k in keys) + " exclude each other: set one")


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return ("nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
                if math.isinf(value) else repr(value))
    if isinstance(value, int):
        return str(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(str(value), ensure_ascii=False).replace("\x7f", "\\u007f")


def render_toml(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> str:
    """The resolved settings of ``ns`` as a ``--config-file`` (each key with where its value
    came from; an unset key and a secret's value as a comment only)."""
    lines = [f"# the server's settings ({PRECEDENCE})"]
    for s in settings_of(parser):
        value, source = getattr(ns, s.key), ns.setting_sources[s.key]
        if s.key in SECRET_KEYS and value:
            lines.append(f"# {s.key}: set, not shown (from {source})")
        elif value is None:
            lines.append(f"# {s.key}: unset (from {source})")
        else:
            lines.append(f"{s.key} = {_toml_value(value)}  # {source}")
    return "\n".join(lines) + "\n"
