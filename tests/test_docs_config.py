"""docs/configuration.md is what the flags render: every option of every service is on it,
with its default, and a flag added anywhere shows up without touching the renderer."""

from __future__ import annotations

import difflib

import pytest

from services import cli, config_docs
from shared.log import LOG_FORMAT_ENV

FIX = f"regenerate it with `{config_docs.REGENERATE}` and commit it"


def _options(parser) -> set[str]:
    return {s for a in parser._actions if config_docs._documented(a) for s in a.option_strings}


def test_every_flag_of_every_service_is_on_the_page():
    page = config_docs.DEFAULT_PATH.read_text()
    parser = cli.build_parser()
    commands = config_docs._subcommands(parser)
    missing = sorted(
        f"{name or 'superinfer'}: {s}"
        for name, p in [(None, parser)] + [(n, commands[n]) for n in config_docs.SERVICES]
        for s in _options(p)
        if f"`{s}" not in page
    )
    assert not missing, f"{config_docs.DEFAULT_PATH} lacks {', '.join(missing)}; {FIX}"


def test_the_committed_page_is_what_the_flags_render():
    page = config_docs.DEFAULT_PATH.read_text()
    rendered = config_docs.render(cli.build_parser)
    diff = "".join(difflib.unified_diff(page.splitlines(True), rendered.splitlines(True), "committed", "rendered", n=0))
    assert page == rendered, f"{config_docs.DEFAULT_PATH} differs from the flags; {FIX}:\n{diff[:3000]}"


def test_a_flag_added_anywhere_is_rendered_with_its_default_and_help():
    def build():
        parser = cli.build_parser()
        worker = config_docs._subcommands(parser)["worker"]
        worker.add_argument("--kv-widgets", type=float, default=0.5, help="widgets per block (default %(default)s)")
        group = worker.add_argument_group("fault injection")
        group.add_argument("--crash-after", type=int, metavar="N", default=None, help="exit after N steps")
        return parser

    page = config_docs.render(build)
    assert "| `--kv-widgets KV_WIDGETS` | `0.5` | widgets per block |" in page
    assert "### fault injection\n\n| option | default | description |\n|---|---|---|\n" in page
    assert "| `--crash-after N` | — | exit after N steps |" in page
    # serve does not take them: they stay out of its section
    serve = page[page.index("## `superinfer serve`") : page.index("## `superinfer gateway`")]
    assert "--kv-widgets" not in serve and "fault injection" not in serve


def test_the_page_shows_the_defaults_of_a_clean_environment(monkeypatch):
    monkeypatch.setenv("SUPERINFER_ZMQ_KEYS", "/secret/keys")
    monkeypatch.setenv(LOG_FORMAT_ENV, "json")
    page = config_docs.render(cli.build_parser)
    assert "/secret/keys" not in page and "| `auto` |" in page
    assert page == config_docs.DEFAULT_PATH.read_text()


@pytest.fixture
def keep_log_env(monkeypatch):
    monkeypatch.setenv(LOG_FORMAT_ENV, "auto")  # main() sets it; restored after the test


def test_the_command_writes_the_page_and_checks_it(tmp_path, capsys, keep_log_env):
    out = tmp_path / "configuration.md"
    assert cli.main(["docs", "config", "--check", "--output", str(out)]) == 1  # none yet
    assert config_docs.REGENERATE in capsys.readouterr().err
    assert cli.main(["docs", "config", "--output", str(out)]) == 0
    assert out.read_text() == config_docs.render(cli.build_parser)
    assert cli.main(["docs", "config", "--check", "--output", str(out)]) == 0
    out.write_text(out.read_text().replace("`--policy", "`--polcy"))
    assert cli.main(["docs", "config", "--check", "--output", str(out)]) == 1
