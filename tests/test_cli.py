"""The ``radixrt`` command line: --version, --help, the commands' help, unknown commands, every server flag's
help text and default, and docs/flags.md generated from the same metadata."""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from radixrt import __version__
from radixrt.config import flags, flags_doc, server_args
from radixrt.config.flags import arg
from radixrt.config.server_args import ServerArgs
from radixrt.entrypoints import cli, demo
from radixrt.entrypoints.launch_server import build_parser

REPO = Path(__file__).resolve().parent.parent


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run(
        [sys.executable, "-m", "radixrt.entrypoints.cli", *argv],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=120,
    )


# -- docs/flags.md and the flags' metadata -------------------------------------------------------------
def test_flags_doc_is_up_to_date() -> None:
    page = (REPO / flags_doc.DOC_PATH).read_text()
    assert page == flags_doc.render(), (
        f"docs/flags.md is out of date with ServerArgs: run `{flags_doc.COMMAND}`"
    )
    for f in dataclasses.fields(ServerArgs):
        assert f"`--{f.name.replace('_', '-')}`" in page, f.name


def test_every_flag_has_help_and_a_section() -> None:
    specs = ServerArgs.flag_specs()
    assert [s.name for s in specs] == [f.name for f in dataclasses.fields(ServerArgs)]
    for spec in specs:
        assert len(spec.help) >= 15 and spec.help.endswith("."), spec.name
        assert spec.section in server_args.SECTIONS.values(), spec.name
    assert len({s.section for s in specs}) == len(server_args.SECTIONS)


def test_a_field_without_help_is_refused() -> None:
    @dataclasses.dataclass
    class Settings:
        documented: int = arg(1, "Has help.")
        bare: int = 2

    with pytest.raises(ValueError, match="Settings.bare: no help text"):
        flags.flag_specs(Settings, {"documented": "Main"})
    with pytest.raises(ValueError, match="sections: nope"):
        flags.flag_specs(Settings, {"documented": "Main", "nope": "Other"})


def test_serve_help_shows_every_flag_with_help_default_and_choices() -> None:
    text = build_parser("radixrt serve").format_help()
    flat = " ".join(text.split())  # argparse wraps lines
    for spec in ServerArgs.flag_specs():
        assert spec.flag in text, spec.name
        first_words = " ".join(spec.help.split()[:4])
        assert first_words in flat, (spec.name, first_words)
        if spec.choices:
            assert "{" + ",".join(spec.choices) + "}" in text, spec.name
    assert flat.count("(default: ") == len(dataclasses.fields(ServerArgs))
    for title in server_args.SECTIONS.values():
        assert f"\n{title}:\n" in text, title
    assert "--max-total-tokens MAX_TOTAL_TOKENS Size of the KV pool in tokens." in flat
    assert (
        "--log-interval LOG_INTERVAL Seconds between" in flat and "interval. 0: off. (default: 5.0)" in flat
    )
    assert "--disable-radix-cache Disable prefix caching" in flat and "(default: off)" in flat


def test_parsed_defaults_equal_the_dataclass_and_flags_parse() -> None:
    parser = build_parser("radixrt serve")
    assert ServerArgs.from_cli(parser.parse_args([])) == ServerArgs()
    args = ServerArgs.from_cli(
        parser.parse_args(
            ["--max-total-tokens", "8192", "--mem-fraction-static", "0.5", "--log-requests",
             "--schedule-policy", "fcfs", "--log-interval", "2.5", "--dtype", "bf16"]
        )
    )  # fmt: skip
    assert (args.max_total_tokens, args.mem_fraction_static, args.log_requests) == (8192, 0.5, True)
    assert (args.schedule_policy, args.log_interval, args.dtype) == ("fcfs", 2.5, "bf16")


@pytest.mark.parametrize(
    ("flag", "value"), [("--schedule-policy", "random"), ("--dtype", "int3"), ("--max-total-tokens", "lots")]
)
def test_a_bad_flag_value_exits_2(flag: str, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser("radixrt serve").parse_args([flag, value])
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err


def test_choices_match_the_runtime() -> None:
    """The names ServerArgs spells out (so that parsing flags imports no torch) are the runtime's."""
    from radixrt.kernels import base
    from radixrt.layers import QUANTIZATION_CHOICES
    from radixrt.mem_cache import kv_pool
    from radixrt.models import config

    assert server_args.QUANTIZATION_CHOICES == QUANTIZATION_CHOICES
    assert set(server_args.DTYPES) == {"auto", *config._DTYPES}
    assert set(server_args.ATTENTION_BACKENDS) == {"auto", *base._BACKENDS}
    assert server_args.KV_CACHE_DTYPES == kv_pool.KV_CACHE_DTYPES
    with pytest.raises(ValueError, match="log_level: 'loud' not in"):
        ServerArgs(log_level="loud")
    with pytest.raises(ValueError, match="attention_backend: 'fast' not in"):
        ServerArgs(attention_backend="fast")
    with pytest.raises(ValueError, match="log_interval: must be >= 0"):
        ServerArgs(log_interval=-1)


# -- the radixrt command -------------------------------------------------------------------------------
def test_version_help_and_unknown_commands(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out == f"radixrt {__version__}\n"
    with pytest.raises(SystemExit) as exc:
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert exc.value.code == 0 and "usage: radixrt" in out
    for name in cli.COMMANDS:
        assert f"\n    {name} " in out, name
    for argv, message in [(["bogus"], "invalid choice: 'bogus'"), ([], "required: <command>"),
                          (["--port", "1"], "the command comes first, then its flags: radixrt serve --port 1")]:  # fmt: skip
        with pytest.raises(SystemExit) as exc:
            cli.main(argv)
        assert exc.value.code == 2, argv
        assert message in capsys.readouterr().err, argv


def test_the_command_gets_every_later_argument_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[str, list[str]]] = []
    monkeypatch.setattr(cli, "_serve", lambda argv: seen.append(("serve", argv)) or 7)
    monkeypatch.setattr(cli, "_demo", lambda argv: seen.append(("demo", argv)) or 0)
    rest = ["--model-path", "m", "--help", "-h", "--version", "--port=1", "--", "x"]
    assert cli.main(["serve", *rest]) == 7
    assert cli.main(["demo", "--max-new-tokens", "3"]) == 0
    assert seen == [("serve", rest), ("demo", ["--max-new-tokens", "3"])]


def test_demo_help_describes_the_embedded_model(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["demo", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert exc.value.code == 0 and out.startswith("usage: radixrt demo")
    assert "SmolLM2-135M-Instruct (real weights" in out and "--max-new-tokens" in out
    assert "random weights" not in out and "noise" not in out
    assert "random weights" not in (demo.__doc__ or "")


def test_console_script_in_a_subprocess() -> None:
    """What a user types: the real process, exit codes and streams (and --help imports no torch)."""
    version = _run("--version")
    assert (version.returncode, version.stdout) == (0, f"radixrt {__version__}\n")
    unknown = _run("launch")
    assert unknown.returncode == 2 and "invalid choice: 'launch'" in unknown.stderr and not unknown.stdout
    serve_help = _run("serve", "--help")
    assert serve_help.returncode == 0, serve_help.stderr
    assert serve_help.stdout.startswith("usage: radixrt serve") and "--log-requests" in serve_help.stdout
    probe = (
        "import sys\nfrom radixrt.entrypoints.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.stdout.strip().endswith("False"), out.stdout + out.stderr


def test_flags_doc_command_writes_the_page(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert flags_doc.main(["--write", "--root", str(tmp_path)]) == 0
    assert (tmp_path / "docs" / "flags.md").read_text() == flags_doc.render()
    capsys.readouterr()
    assert flags_doc.main([]) == 0
    assert capsys.readouterr().out == flags_doc.render()


def test_add_flags_on_a_plain_parser() -> None:
    """benchmarks/serving.py parses --server-args with ServerArgs.add_cli_args on its own parser."""
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(["--page-size", "16", "--disable-radix-cache"])
    assert vars(ns).keys() == {f.name for f in dataclasses.fields(ServerArgs)}
    assert (ns.page_size, ns.disable_radix_cache, ns.tenants) == (16, True, None)
