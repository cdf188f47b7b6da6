"""The front door stays short and true: the README and the benchmark pages within their lengths,
every link a file in git, nothing pointing outside the repository or at a result file git does
not hold, every command in docs/benchmarks.md one the CLI accepts, and the gateway and the
scheduler importable and startable where torch is not installed."""

from __future__ import annotations

import argparse
import importlib
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from services import cli

ROOT = Path(__file__).resolve().parents[1]
LIMITS = {"README.md": 150, "docs/results.md": 300, "docs/benchmarks.md": 300, "docs/cpu-performance.md": 400}
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
OUTPUT_FLAGS = ("--json ", "--out ", "--out-dir ", "--results ")
# paths of the machine the project was built on, spelt so that this file does not match itself
OUTSIDE = "|".join([r"\.\./shared/\S*", "/" + r"work/\S*", "shared/" + r"peer/\S*"])


def tracked() -> set[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return set(out.splitlines())


def docs() -> list[str]:
    """Every page a reader opens: the markdown files in git."""
    return sorted(p for p in tracked() if p.endswith(".md"))


def front_pages() -> list[str]:
    """The pages this project writes by hand or renders from committed rows."""
    return ["README.md", "deploy/README.md", *sorted(p for p in tracked() if re.fullmatch(r"docs/[^/]+\.md", p))]


@pytest.mark.parametrize("page", sorted(LIMITS))
def test_page_within_its_length(page):
    lines = len((ROOT / page).read_text().splitlines())
    assert lines <= LIMITS[page], f"{page} has {lines} lines, its limit is {LIMITS[page]}: keep the current figures only"


def test_every_link_is_a_file_in_git():
    files = tracked()
    folders = {str(Path(f).parent) for f in files} | {str(p) for f in files for p in Path(f).parents}
    broken = []
    for page in docs():
        for target in LINK.findall((ROOT / page).read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            path = (ROOT / page).parent.joinpath(target.split("#")[0]).resolve()
            if not path.is_relative_to(ROOT):
                broken.append((page, target, "outside the repository"))
                continue
            rel = str(path.relative_to(ROOT))
            if rel not in files and rel not in folders:
                broken.append((page, target, "not in git"))
    assert not broken, broken


def test_nothing_points_outside_the_repository():
    """The peers' scripts live in bench/peers/; no page or script names a path of this machine."""
    offending = []
    for path in sorted(tracked()):
        if path == "bench/summary.json" or not path.endswith((".md", ".py", ".sh", ".yaml", ".toml")):
            continue  # the summary keeps older runs' commands as they were run
        text = (ROOT / path).read_text(errors="replace")
        offending += [(path, m) for m in re.findall(OUTSIDE, text)]
    assert not offending, offending


def test_no_page_cites_a_result_file():
    """bench/results/ is not in git: a page may say a command writes there, never quote a file from it."""
    citations = []
    for page in front_pages():
        text = (ROOT / page).read_text()
        for m in re.finditer(r"bench/results/([^\s`'\")]*)", text):
            name = m.group(1)
            if not name or name.endswith("/") or "<" in name or text[: m.start()].endswith(OUTPUT_FLAGS):
                continue
            citations.append((page, m.group(0)))
    assert not citations, citations


def test_the_readme_quotes_only_current_runs():
    """A run the README cites is the current run of some comparison in bench/summary.json: a re-run
    replaces the row, and an old run's figures cannot linger beside the new ones."""
    from bench import summary

    current = {e["source"].removesuffix(".json") for e, _ in summary.current_entries(summary.load())}
    cited = set(re.findall(r"compare_[0-9]{8}-[0-9]{6}(?:\+[0-9]{6})?", (ROOT / "README.md").read_text()))
    assert cited, "the README cites no run"
    assert cited <= current, f"not the current run of any comparison: {sorted(cited - current)}"


# -- the commands in docs/benchmarks.md ----------------------------------------------------------

SHIM = """
superinfer() { "$PY" -c 'import json, sys; print(json.dumps(["superinfer"] + sys.argv[1:]))' "$@"; }
bash() { "$PY" -c 'import json, sys; print(json.dumps(["bash"] + sys.argv[1:]))' "$@"; }
"""


def commands_in(page: str) -> list[list[str]]:
    """Each `superinfer` or `bash` command the page's shell blocks run (variables expanded by bash
    itself, nothing executed), and each `superinfer ...` command in a table cell."""
    text = (ROOT / page).read_text()
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        run = subprocess.run(["bash", "-c", SHIM + block], capture_output=True, text=True, timeout=60,
                             env={"HOME": "/home/reader", "PATH": "/usr/bin:/bin", "PY": sys.executable})
        assert run.returncode == 0, (block, run.stderr)
        out += [json.loads(line) for line in run.stdout.splitlines()]
    out += [shlex.split(c) for c in re.findall(r"^\| `(superinfer [^`]+)`", text, flags=re.M)]
    return out


def check_command(argv: list[str]) -> None:
    """Parse `argv` with the parser that would run it; a --target's start command is checked too."""
    if argv[0] == "bash":
        script = ROOT / argv[1]
        assert script.is_file() and argv[1].startswith("bench/peers/"), argv
        return
    assert argv[0] == "superinfer", argv
    args = argv[1:]
    if args[0] == "bench":
        module_name, _ = cli.BENCHMARKS[args[1]]
        parser = argparse.ArgumentParser(prog=f"superinfer bench {args[1]}", exit_on_error=False)
        importlib.import_module(module_name).add_arguments(parser)
        parsed = parser.parse_args(args[2:])
        for target in getattr(parsed, "target", None) or []:  # bench compare's Targets
            if target.start:
                check_command(shlex.split(target.start))
    else:
        cli.build_parser().parse_args(args)


def test_every_benchmark_command_parses():
    commands = commands_in("docs/benchmarks.md")
    assert len(commands) >= 20
    for argv in commands:
        try:
            check_command(argv)
        except (SystemExit, argparse.ArgumentError) as e:
            pytest.fail(f"docs/benchmarks.md: {shlex.join(argv)}: {e}")


def test_the_readme_serves_without_the_dev_extra():
    first, second = re.findall(r"^    (.+)$", (ROOT / "README.md").read_text(), flags=re.M)[:2]
    assert "torch==2.13.0" in first and "pip install -e . " in first and first.endswith("superinfer serve")
    assert "[dev]" not in first
    assert "pip install -e '.[dev]'" in second and "pytest" in second


# -- the gateway and the scheduler without torch -------------------------------------------------

NO_TORCH = """
import importlib, pkgutil, sys

class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "triton", "cupy"):
            raise ImportError(f"{name} is not installed here")

sys.meta_path.insert(0, NoTorch())
for pkg in ("shared", "services.gateway", "services.scheduler"):
    root = importlib.import_module(pkg)
    for info in pkgutil.walk_packages(root.__path__, pkg + "."):
        importlib.import_module(info.name)
from services import cli
for command in ("gateway", "scheduler"):
    try:
        cli.main([command, "--help"])
    except SystemExit as e:
        assert e.code == 0, (command, e.code)
assert "torch" not in sys.modules
print("ok")
"""


def test_gateway_and_scheduler_import_and_start_without_torch():
    run = subprocess.run([sys.executable, "-c", NO_TORCH], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]


def test_the_torch_block_is_real():
    """The check above fails when torch is imported: the same hook, one torch import."""
    code = NO_TORCH.split("for pkg in")[0] + "import torch\n"
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and "is not installed here" in run.stderr
