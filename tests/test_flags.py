"""Flags: vLLM's names as aliases, how `superinfer serve` re-renders options for its children
(switches both ways, lists, secrets only in the environment), the API key's sources, and
--max-model-len's bounds."""

from __future__ import annotations

import argparse

import pytest

from services import flags
from services.cli import build_parser
from services.supervisor import child_argv, child_env
from shared import config
from shared.modelfile import default_model_path, read_model_config


def serve(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


@pytest.mark.parametrize(
    "vllm,ours,value",
    [
        ("--max-num-batched-tokens", "--max-batched-tokens", "256"),
        ("--gpu-memory-utilization", "--hbm-fraction", "0.5"),
        ("--tensor-parallel-size", "--tp", "3"),
    ],
)
def test_vllm_names_are_aliases_passed_on_by_our_names(vllm, ours, value):
    args = serve(vllm, value)
    assert args == serve(ours, value)
    group = flags.worker_args if ours != "--max-batched-tokens" else flags.scheduler_args
    argv = child_argv(args, group)
    assert argv == [ours, value] and vllm not in argv


def test_switches_lists_and_values_are_rendered_for_the_child():
    args = serve("--kv-prefault", "--max-model-len", "64", "--served-model-name", "a", "b", "--seed", "3")
    assert child_argv(args, flags.worker_args) == ["--max-model-len", "64", "--kv-prefault"]
    gateway = child_argv(args, flags.gateway_args)
    assert gateway == ["--served-model-name", "a", "b", "--seed", "3"]
    assert build_parser().parse_args(["gateway", *gateway]).served_model_name == ["a", "b"]


def test_a_bool_option_is_rendered_both_ways():
    def group(p):
        p.add_argument("--eager", action=argparse.BooleanOptionalAction, default=True)
        p.add_argument("--fast", action=argparse.BooleanOptionalAction, default=False)

    p = argparse.ArgumentParser()
    group(p)
    assert child_argv(p.parse_args(["--no-eager", "--fast"]), group) == ["--no-eager", "--fast"]
    assert child_argv(p.parse_args([]), group) == []
    argv = child_argv(p.parse_args(["--no-eager"]), group)
    assert p.parse_args(argv) == p.parse_args(["--no-eager"])


def test_the_api_key_reaches_the_gateway_only_through_its_environment():
    args = serve("--api-key", "sekret", "--admin-token", "tok")
    assert "sekret" not in child_argv(args, flags.gateway_args)
    assert child_env(args, flags.gateway_args)[config.API_KEY_ENV] == "sekret"
    assert config.API_KEY_ENV not in child_env(args, flags.admin_token_arg)
    assert child_env(args, flags.admin_token_arg)[config.ADMIN_TOKEN_ENV] == "tok"
    assert child_env(serve(), flags.gateway_args) is None  # inherits the supervisor's


def test_the_api_key_comes_from_the_flag_or_the_environment(monkeypatch):
    gateway = lambda *a: build_parser().parse_args(["gateway", *a])  # noqa: E731
    monkeypatch.delenv(config.API_KEY_ENV, raising=False)
    monkeypatch.delenv(config.VLLM_API_KEY_ENV, raising=False)
    assert flags.api_key(gateway()) is None
    monkeypatch.setenv(config.VLLM_API_KEY_ENV, "v")
    assert flags.api_key(gateway()) == "v"
    monkeypatch.setenv(config.API_KEY_ENV, "s")
    assert flags.api_key(gateway()) == "s"
    assert flags.api_key(gateway("--api-key", "k")) == "k"


def test_max_model_len_shortens_the_context_window_but_never_extends_it():
    from services.worker.service import max_model_len

    cfg = read_model_config(default_model_path())
    assert max_model_len(cfg, None) == cfg.max_position
    assert max_model_len(cfg, 64) == 64
    for bad in (0, cfg.max_position + 1):
        with pytest.raises(ValueError, match="--max-model-len"):
            max_model_len(cfg, bad)


def test_a_knob_the_worker_device_decides_reaches_the_scheduler_only_when_given():
    """--mirror-watermark and --slo-chunking are unset unless given (the scheduler picks them
    for the worker's device); given, they are passed on to the scheduler."""
    assert serve().mirror_watermark is None
    assert child_argv(serve(), flags.scheduler_args) == []
    args = serve("--mirror-watermark", "0.3")
    assert args.mirror_watermark == 0.3
    assert child_argv(args, flags.scheduler_args) == ["--mirror-watermark", "0.3"]
    with pytest.raises(SystemExit):
        serve("--mirror-watermark", "half")
    assert serve().slo_chunking is None
    args = serve("--no-slo-chunking")
    assert args.slo_chunking is False
    assert child_argv(args, flags.scheduler_args) == ["--no-slo-chunking"]
