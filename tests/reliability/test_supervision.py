"""The supervisor's decisions, without processes: how many restarts, and when a worker
that still runs counts as hung."""

from __future__ import annotations

from services.supervisor import HUNG_KILL_S, HungWatch, RestartBudget


def test_restart_budget_allows_a_few_per_window_then_gives_up():
    budget = RestartBudget(limit=3, window_s=60.0)
    assert [budget.take(t) for t in (0.0, 1.0, 2.0, 3.0)] == [True, True, True, False]
    assert budget.take(61.5)  # the first restart has left the window


def test_hung_watch_kills_only_a_worker_that_was_ready_and_stayed_unready():
    watch = HungWatch("w1")
    watch.observe(set(), 1.0)  # still loading: never ready yet
    assert not watch.hung(100.0)
    watch.observe({"w1"}, 10.0)
    watch.observe(set(), 102.0)  # the scheduler lost it
    assert not watch.hung(102.0 + HUNG_KILL_S - 0.1)
    watch.observe(None, 103.0)  # the gateway did not answer: no conclusion either way
    assert watch.hung(102.0 + HUNG_KILL_S + 0.1)


def test_hung_watch_does_not_take_the_old_workers_readiness_for_the_new_one():
    watch = HungWatch("w1")
    watch.observe({"w1"}, 10.0)
    watch.new_worker("w2")
    watch.observe({"w1"}, 201.0)  # the scheduler has not noticed the old one died yet
    watch.observe(set(), 202.0)  # now it has; the new worker is loading
    assert not watch.hung(215.0)
    watch.observe({"w2"}, 220.0)  # the new worker is ready
    watch.observe({"w1"}, 300.0)  # only a stale report names the old one: not the new one's
    assert watch.hung(300.0 + HUNG_KILL_S + 0.1)


def test_hung_watch_waits_for_the_worker_again_after_another_child_restarts():
    watch = HungWatch("w1")
    watch.observe({"w1"}, 10.0)
    watch.reset()  # the scheduler restarted: the same worker reconnects and resets
    watch.observe(set(), 11.0)
    assert not watch.hung(100.0)
    watch.observe({"w1"}, 101.0)
    watch.observe(set(), 102.0)
    assert watch.hung(102.0 + HUNG_KILL_S + 0.1)


def test_hung_watch_forgets_a_pause_that_ended():
    watch = HungWatch("w1")
    watch.observe({"w1"}, 5.0)
    watch.observe(set(), 6.0)
    watch.observe({"w1"}, 7.0)
    assert not watch.hung(100.0)


def test_serve_options_reach_the_worker_as_the_worker_parses_them():
    from services import cli, flags
    from services.supervisor import child_argv

    args = cli.build_parser().parse_args(["serve", "--dram-gb", "0.5", "--kv-prefault", "--policy", "fcfs"])
    argv = child_argv(args, flags.worker_args)
    assert argv == ["--dram-gb", "0.5", "--kv-prefault"]
    worker = cli.build_parser().parse_args(["worker", *argv])
    assert worker.kv_prefault and worker.dram_gb == 0.5


def test_is_stopped_tells_a_frozen_process_from_a_running_one():
    import signal
    import subprocess
    import time

    from services.supervisor import is_stopped

    proc = subprocess.Popen(["sleep", "30"])
    try:
        assert not is_stopped(proc.pid)
        proc.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while not is_stopped(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert is_stopped(proc.pid)
        proc.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 5
        while is_stopped(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not is_stopped(proc.pid)
    finally:
        proc.kill()
        proc.wait()
    assert not is_stopped(proc.pid)  # gone: not stopped
