"""``apbv serve``'s settings: every flag (read from the parser, so flags added later are
covered) has an ``APBV_SERVE_*`` variable and a ``--config-file`` key; command line >
environment > file > defaults, key by key; unknown keys and variables and wrong types are
errors naming them; ``--print-config`` prints a file that reads back to the same settings."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pydantic_settings")

from apbv.cli import serve  # noqa: E402
from apbv.cli.serve_settings import OWN_FLAGS, Setting, resolve, settings_of  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
OWN_TYPE_EXAMPLES: dict[str, str] = {}
"""For a flag with its own ``type=`` function: a text it reads to a value unlike the default."""


def _resolve(argv: list[str], environ: dict[str, str], file: Path | None = None) -> Any:
    parser = serve.parser()
    argv = [*argv, "--config-file", str(file)] if file is not None else argv
    return resolve(parser, argv, parser.parse_args(argv), environ)


def _other_value(s: Setting) -> tuple[Any, str, str]:
    """A value of ``s`` unlike its default: (value, as an environment variable, as TOML)."""
    if s.convert is not None:  # a flag's own type= function: its text is the flag's to read
        if s.key not in OWN_TYPE_EXAMPLES:
            pytest.fail(f"{s.flag} has its own type: add a text of it to OWN_TYPE_EXAMPLES")
        text = OWN_TYPE_EXAMPLES[s.key]
        return s.convert(text), text, f'"{text}"'
    if s.kind is bool:
        return True, "true", "true"
    if s.choices:
        value = next(c for c in s.choices if c != s.default)
        return value, str(value), f'"{value}"'
    if s.repeatable:
        return ["a.b=1", "c"], "a.b=1,c", '["a.b=1", "c"]'
    if s.kind is int:
        value = (s.default or 0) + 3
        return value, str(value), str(value)
    if s.kind is float:
        value = (s.default or 0.0) + 1.5
        return value, repr(value), repr(value)
    return "some-value", "some-value", '"some-value"'


def test_every_flag_has_an_env_var_and_a_file_key(tmp_path: Path) -> None:
    parser = serve.parser()
    settings = settings_of(parser)
    flags = {a.dest for a in parser._actions if a.option_strings} - set(OWN_FLAGS)
    assert {s.key for s in settings} == flags and len(flags) >= 40, sorted(flags)
    for s in settings:
        value, env_text, toml_text = _other_value(s)
        assert value != s.default, s
        from_env = _resolve([], {s.env: env_text})
        assert getattr(from_env, s.key) == value, (s.env, env_text, getattr(from_env, s.key))
        assert from_env.setting_sources[s.key] == f"environment {s.env}"
        file = tmp_path / f"{s.key}.toml"
        file.write_text(f"{s.key} = {toml_text}\n")
        from_file = _resolve([], {}, file)
        assert getattr(from_file, s.key) == value, (s.key, toml_text, getattr(from_file, s.key))
        assert from_file.setting_sources[s.key] == f"file {file}"


def test_command_line_beats_environment_beats_file_beats_default(tmp_path: Path) -> None:
    file = tmp_path / "serve.toml"
    file.write_text('port = 1111\nread_timeout_s = 9\nmax_queue = 5\n'
                    'media_root = ["/srv/a", "/srv/b"]\n')
    env = {"APBV_SERVE_PORT": "2222", "APBV_SERVE_MAX_QUEUE": "6"}
    # --max-queue 16 is the flag's default: given on the command line, it still wins
    ns = _resolve(["--max-queue", "16", "--world-size", "1"], env, file)
    assert (ns.port, ns.read_timeout_s, ns.max_queue, ns.world_size, ns.replicas) == \
        (2222, 9.0, 16, 1, 1)
    assert ns.media_root == ["/srv/a", "/srv/b"]
    assert ns.setting_sources["port"] == "environment APBV_SERVE_PORT"
    assert ns.setting_sources["read_timeout_s"] == f"file {file}"
    assert ns.setting_sources["max_queue"] == "command line"
    assert ns.setting_sources["replicas"] == "default"
    # the file may be named by the environment; the command line's name wins over it
    other = tmp_path / "other.toml"
    other.write_text("port = 3333\n")
    assert _resolve([], {"APBV_SERVE_CONFIG_FILE": str(other)}).port == 3333
    assert _resolve([], {"APBV_SERVE_CONFIG_FILE": str(other)}, file).port == 1111
    assert _resolve([], {"APBV_SERVE_MEDIA_ROOT": '["/x,y", "/z"]'}).media_root == ["/x,y", "/z"]


def _size_gib(text: str) -> float:
    """A flag's own type, as a later flag may have one: "4GiB" -> 4.0."""
    if not text.endswith("GiB"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 4GiB")
    return float(text[:-3])


def test_a_flag_with_its_own_type_converts_text_from_every_place(tmp_path: Path) -> None:
    parser = serve.parser()
    parser.add_argument("--host-budget", type=_size_gib, default=None)
    parser.add_argument("--extra-budget", type=_size_gib, action="append", default=[])
    file = tmp_path / "serve.toml"
    file.write_text('host_budget = "3GiB"\nextra_budget = ["1GiB", "2GiB"]\n')

    def resolved(argv: list[str], environ: dict[str, str]) -> Any:
        argv = [*argv, "--config-file", str(file)]
        return resolve(parser, argv, parser.parse_args(argv), environ)

    ns = resolved([], {})
    assert (ns.host_budget, ns.extra_budget) == (3.0, [1.0, 2.0])
    assert resolved([], {"APBV_SERVE_HOST_BUDGET": "5GiB"}).host_budget == 5.0
    assert resolved(["--host-budget", "6GiB"], {"APBV_SERVE_HOST_BUDGET": "5GiB"}) \
        .host_budget == 6.0
    with pytest.raises(ValueError) as info:
        resolved([], {"APBV_SERVE_HOST_BUDGET": "lots"})
    assert "serve setting 'host_budget'" in str(info.value) and \
        "'lots' is not a size like 4GiB" in str(info.value), str(info.value)


def _error(argv: list[str], environ: dict[str, str], file: Path | None = None) -> str:
    with pytest.raises(ValueError) as info:
        _resolve(argv, environ, file)
    return str(info.value)


def test_bad_settings_are_errors_naming_the_key(tmp_path: Path) -> None:
    file = tmp_path / "serve.toml"
    file.write_text("prot = 8000\n")
    message = _error([], {}, file)
    assert message.startswith(f"unknown key 'prot' in --config-file {str(file)!r}; the keys "
                              "are the serve flags' names: "), message
    assert "port, " in message and "max_queue" in message, message
    file.write_text('port = "http"\n')
    message = _error([], {}, file)
    assert message.startswith("serve setting 'port' (--port, APBV_SERVE_PORT or key 'port' of "
                              f"--config-file; this value from file {file}): "), message
    assert "valid integer" in message and "got 'http'" in message, message
    file.write_text("max_queue = 4.5\n")
    assert "'max_queue'" in _error([], {}, file) and "4.5" in _error([], {}, file)
    message = _error([], {"APBV_SERVE_LOG_LEVEL": "loud"})
    assert "'log_level'" in message and "'debug', 'info', 'warning' or 'error'" in message
    assert "environment APBV_SERVE_LOG_LEVEL" in message and "got 'loud'" in message, message
    message = _error([], {"APBV_SERVE_MAX_QUEU": "4"})
    assert message.startswith("unknown environment variable APBV_SERVE_MAX_QUEU: the "
                              "APBV_SERVE_* variables are "), message
    assert "APBV_SERVE_MAX_QUEUE" in message, message
    assert _error([], {}, tmp_path / "none.toml") == \
        f"--config-file {str(tmp_path / 'none.toml')!r} does not exist"
    file.write_text("port = \n")
    assert _error([], {}, file).startswith(f"--config-file {str(file)!r} is not valid TOML")
    assert _error(["--fps", "2"], {"APBV_SERVE_NFRAMES": "8"}) == \
        ("serve settings 'fps' (from command line) and 'nframes' (from environment "
         "APBV_SERVE_NFRAMES) exclude each other: set one")


def test_print_config_reads_back_the_same(tmp_path: Path) -> None:
    """The real command: ``apbv serve --config-file F --print-config`` with a variable
    overriding one of F's keys; its output, as a file, gives the same settings."""
    file = tmp_path / "serve.toml"
    file.write_text('port = 9001\nread_timeout_s = 9\nallow_host = ["trusted.example"]\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("APBV_")}
    env.update(PYTHONPATH=str(ROOT), APBV_SERVE_READ_TIMEOUT_S="2.5",
               APBV_SERVE_API_KEY="sk-secret")
    done = subprocess.run([sys.executable, "-m", "apbv", "serve", "--config-file", str(file),
                           "--replicas", "2", "--print-config"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    printed = tomllib.loads(done.stdout)
    assert (printed["port"], printed["read_timeout_s"], printed["replicas"]) == (9001, 2.5, 2)
    assert printed["allow_host"] == ["trusted.example"] and "api_key" not in printed
    assert "sk-secret" not in done.stdout
    assert "read_timeout_s = 2.5  # environment APBV_SERVE_READ_TIMEOUT_S" in done.stdout
    assert f"port = 9001  # file {file}" in done.stdout
    again = tmp_path / "printed.toml"
    again.write_text(done.stdout)
    ns = _resolve([], {}, again)
    for key, value in printed.items():
        assert getattr(ns, key) == value, (key, value, getattr(ns, key))
