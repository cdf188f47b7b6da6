"""A scheduler default is written once, in `SchedulerConfig`: changing it there changes the
CLI's flags and their help, the config the service builds from them, and the simulator's;
the sim-vs-live replay runs the config the live server parses from its own command line."""

from __future__ import annotations

import argparse
from dataclasses import fields

import pytest

from bench.sim import simlive, sweep
from bench.sim.costmodel import MODELS, load_hardware
from services import flags
from services.cli import build_parser
from services.scheduler.core import SchedulerConfig
from services.supervisor import child_argv
from shared import config


def change_default(monkeypatch, name: str, value) -> None:
    """What editing `name`'s default in services/scheduler/core/config.py amounts to: the
    field's default, the class attribute and the generated __init__'s default."""
    names = [f.name for f in fields(SchedulerConfig)]
    defaults = list(SchedulerConfig.__init__.__defaults__)
    defaults[names.index(name)] = value
    monkeypatch.setattr(SchedulerConfig.__init__, "__defaults__", tuple(defaults))
    monkeypatch.setattr(SchedulerConfig.__dataclass_fields__[name], "default", value)
    monkeypatch.setattr(SchedulerConfig, name, value)


def command(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def simulated_config() -> SchedulerConfig:
    """The config `bench sim` runs with its defaults."""
    p = argparse.ArgumentParser()
    sweep.add_arguments(p)
    args = p.parse_args(["--rates", "1", "--policies", "lvf"])
    (job,) = sweep.jobs_from_args(args, load_hardware("gh200"), MODELS[args.model])
    return job.setup.cfg


def option_help(parser: argparse.ArgumentParser, flag: str) -> str:
    """The lines `--help` prints for one option."""
    text = parser.format_help()
    start = text.index("\n  " + flag)
    end = text.find("\n  -", start + 1)
    return " ".join(text[start:end].split())


@pytest.mark.parametrize(("name", "value"), [("tbt_slo", 0.25), ("ttft_slo", 2.5), ("alpha", 1.5), ("beta_f", 0.25)])
def test_a_default_changed_in_the_config_reaches_the_cli_the_service_and_the_simulator(monkeypatch, name, value):
    before = getattr(SchedulerConfig(), name)
    change_default(monkeypatch, name, value)
    assert getattr(SchedulerConfig(), name) == value != before
    flag = "--" + name.replace("_", "-")
    parser = build_parser()
    for cmd in ("serve", "scheduler"):
        assert f"(default {value})" in option_help(command(parser, cmd), flag)
        args = parser.parse_args([cmd])
        assert getattr(SchedulerConfig.from_flags(args), name) == value  # what the service runs
    serve = parser.parse_args(["serve"])
    assert flag not in child_argv(serve, flags.scheduler_args)  # the child's own default is the same one

    assert getattr(simulated_config(), name) == value


def test_every_config_flag_defaults_to_the_config():
    base = SchedulerConfig()
    args = build_parser().parse_args(["scheduler"])
    assert SchedulerConfig.from_flags(args) == base
    names = {f.name for f in SchedulerConfig.flag_fields()}
    assert {"policy", "ttft_slo", "tbt_slo", "alpha", "beta_f", "beta_b", "xfer_budget"} <= names
    assert "block_size" not in names  # the worker's flag: the scheduler takes the worker's block size
    assert build_parser().parse_args(["worker"]).block_size == base.block_size == config.DEFAULT_BLOCK_SIZE


def test_the_replay_runs_the_config_the_live_server_parses():
    # B_xfer pinned on both sides: a live server left to itself takes it from its measured
    # copy bandwidth, which the replay cannot know
    assert simlive.Setting().scheduler_config() == SchedulerConfig(xfer_budget=SchedulerConfig().b_xfer)
    setting = simlive.Setting(policy="fcfs", tbt_slo=0.2, xfer_budget=96, max_num_seqs=8)
    assert setting.scheduler_config() == SchedulerConfig(policy="fcfs", tbt_slo=0.2, xfer_budget=96, max_num_seqs=8)


def test_kv_block_bytes_are_computed_once():
    from services.worker.kv_pool import MODEL_KV_SPECS

    spec, shape = MODEL_KV_SPECS["qwen2.5-32b"], MODELS["qwen2.5-32b"]
    assert spec.block_bytes == shape.kv_block_bytes(spec.block_size, 2) == 4 << 20  # 4 MiB, fp16
    assert spec.segment_bytes == shape.kv_segment_bytes(spec.block_size, 2)


BOOL_KNOBS = ("eager_rotation", "reserve_full_prompt", "rotary_yields")


def test_a_bool_knob_is_a_switch_both_ways_and_serve_passes_it_to_the_scheduler():
    assert {f.name for f in SchedulerConfig.flag_fields()} >= set(BOOL_KNOBS)
    parser = build_parser()
    with pytest.raises(SystemExit):  # not `--rotary-yields False`, which a bool type reads as True
        parser.parse_args(["scheduler", "--rotary-yields", "False"])
    serve = parser.parse_args(["serve", "--no-rotary-yields", "--no-reserve-full-prompt", "--policy", "fcfs"])
    argv = child_argv(serve, flags.scheduler_args)
    assert sorted(argv) == sorted(["--no-rotary-yields", "--no-reserve-full-prompt", "--policy", "fcfs"])
    child = SchedulerConfig.from_flags(parser.parse_args(["scheduler", *argv]))  # what the scheduler child runs
    assert child == SchedulerConfig(policy="fcfs", rotary_yields=False, reserve_full_prompt=False)


@pytest.mark.parametrize("name", BOOL_KNOBS)
def test_a_bool_default_flipped_in_the_config_flips_the_help_the_child_argv_and_the_simulator(monkeypatch, name):
    before = getattr(SchedulerConfig(), name)
    change_default(monkeypatch, name, not before)
    on, off = "--" + name.replace("_", "-"), "--no-" + name.replace("_", "-")
    parser = build_parser()
    for cmd in ("serve", "scheduler"):
        assert f"(default {not before})" in option_help(command(parser, cmd), on)
        assert getattr(SchedulerConfig.from_flags(parser.parse_args([cmd])), name) is (not before)
    assert child_argv(parser.parse_args(["serve"]), flags.scheduler_args) == []  # the child has the same default
    old = on if before else off  # the former default, asked for on `serve`, reaches the child
    argv = child_argv(parser.parse_args(["serve", old]), flags.scheduler_args)
    assert argv == [old]
    assert getattr(SchedulerConfig.from_flags(parser.parse_args(["scheduler", *argv])), name) is before

    assert getattr(simulated_config(), name) is (not before)


def test_the_pipeline_depth_defaults_by_device_everywhere():
    """Unset, the depth is the one `config.default_pipeline_depth` gives the worker's device:
    the service's flag and the simulator's leave it unset, and the simulator resolves it from
    the profile (GPU profiles pipeline, the cpu ones do not) as the service does from the worker."""
    import inspect

    from bench.sim import engine
    from services.scheduler.service import SchedulerService

    assert (config.default_pipeline_depth(on_cpu=True), config.default_pipeline_depth(on_cpu=False)) == (1, 2)
    parser = build_parser()
    for cmd in ("serve", "scheduler"):
        assert parser.parse_args([cmd]).pipeline_depth is None
        assert "1 on a CPU worker, 2 on a GPU" in option_help(command(parser, cmd), "--pipeline-depth")
    assert inspect.signature(SchedulerService).parameters["pipeline_depth"].default is None
    assert engine.SimSetup.__dataclass_fields__["pipeline_depth"].default is None
    assert inspect.signature(engine.make_setup).parameters["depth"].default is None
    p = argparse.ArgumentParser()
    sweep.add_arguments(p)
    assert p.parse_args([]).pipeline_depth is None
