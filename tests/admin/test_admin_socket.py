"""The admin socket of a live scheduler loop (symbolic worker): queries under rotation,
tokens, malformed messages, abort, drain, and attribution on final outputs."""

from __future__ import annotations

import asyncio

import msgspec
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from shared import protocol as p
from tests.admin.conftest import TOKEN, run_rig, until

BLOCK = 4


def check_rows(rows: list[p.RequestRow], num_hbm: int) -> None:
    """What the policy and the block manager promise about each state."""
    for r in rows:
        if r.state == "running":
            assert r.vlt <= 0.0 and r.num_hbm_blocks > 0, r
        elif r.state == "rotary":
            # VLT has no clamp: it is negative only for a request still within its TTFT slack
            # (the rig's beta_F * S_F = 0.025 s), one that has emitted tokens lags at once (beta_B = 0).
            assert r.vlt >= (0.0 if r.num_output_tokens else -0.025 - 1e-9), r
            assert r.num_hbm_blocks == 0 and r.num_dram_blocks > 0, r
            assert r.num_output_tokens > 0 or r.times.running_s > 0, r  # it ran before
        else:
            assert r.state == "waiting" and r.vlt >= -0.025 - 1e-9, r
            assert r.num_hbm_blocks == r.num_dram_blocks == 0, r
        assert r.age_s >= r.times.waiting_s + r.times.rotary_s + r.times.running_s - 1e-6
    assert sum(r.num_hbm_blocks for r in rows) <= num_hbm


def test_queues_stats_abort_drain(tmp_path):
    async def scenario(rig):
        gw, admin = rig.gateway, rig.admin
        ids = [f"r{i}" for i in range(5)]
        for rid in ids:
            await gw.add(rid)

        seen: dict[str, int] = {}

        async def rotating() -> bool:
            reply = await admin.ask(p.QueuesQuery())
            check_rows(reply.rows, 10)
            for r in reply.rows:
                seen[r.state] = seen.get(r.state, 0) + 1
            return "rotary" in seen and "running" in seen

        assert await until(rotating), seen

        # Commands need the token; queries do not.
        denied = await admin.ask(p.AbortCommand("r0"))
        assert isinstance(denied, p.AdminError) and denied.type == "permission_denied"
        denied = await admin.ask(p.DrainCommand(token="wrong"))
        assert isinstance(denied, p.AdminError) and denied.type == "permission_denied"
        missing = await admin.ask(p.AbortCommand("nope", token=TOKEN))
        assert isinstance(missing, p.AdminError) and missing.type == "not_found"

        # Malformed messages get an error reply and the loop keeps serving.
        for junk in (b"\xc1garbage", msgspec.msgpack.encode(["admin_abort"]), msgspec.msgpack.encode({"x": 1})):
            err = await admin.raw(junk)
            assert isinstance(err, p.AdminError) and err.type == "invalid_request_error", err

        live = {r.request_id for r in (await admin.ask(p.QueuesQuery())).rows}
        victim = sorted(live)[-1]
        ack = await admin.ask(p.AbortCommand(victim, token=TOKEN))
        assert isinstance(ack, p.AdminAck), ack
        assert await until(lambda: (gw.final(victim) is not None))
        assert gw.final(victim).finish_reason == "abort" and gw.final(victim).attribution is not None

        ack = await admin.ask(p.DrainCommand(token=TOKEN))
        assert isinstance(ack, p.AdminAck) and "draining" in ack.message
        await gw.add("late")
        assert await until(lambda: ("late" in gw.errors))
        assert gw.errors["late"].type == "service_unavailable"

        others = [rid for rid in ids if rid != victim]
        assert await until(lambda: (all(gw.final(r) for r in others)), timeout=20)
        stats = await admin.ask(p.StatsQuery())
        assert isinstance(stats, p.StatsReply) and stats.draining and stats.num_finished == len(others)

        assert isinstance(await admin.ask(p.DrainCommand(token=TOKEN, undo=True)), p.AdminAck)
        await gw.add("after")
        assert await until(lambda: (gw.final("after") is not None), timeout=20)
        return others, stats, generate_latest(rig.service.observer.metrics.exposed.registry).decode()

    others, stats, metrics = asyncio.run(run_rig(tmp_path, scenario))
    st, w = stats.stats, stats.window
    assert st.num_rotations_out > 0 and st.num_blocks_swapped_in > 0
    assert w.num_steps > 0 and w.rotations_per_s > 0 and w.blocks_moved_per_s > 0
    assert w.num_finished == len(others) and w.ttft_attainment is not None
    assert 0.0 <= w.stall_ratio <= 1.0 and w.transfer_bytes_per_s is None  # no block size in bytes
    for name in (
        "superinfer:num_requests_running", "superinfer:kv_cache_usage_perc", "superinfer:rotations_total",
        "superinfer:kv_blocks_moved_total", "superinfer:step_time_seconds_bucket", "superinfer:pipeline_stalls_total",
        "superinfer:slo_requests_total", "superinfer:vlt_at_admission_seconds_bucket", "superinfer:draining",
        "superinfer:kv_transfer_seconds_total", "superinfer:request_phase_seconds_bucket",
    ):
        assert name in metrics, name
    # Every series carries the worker's model name (vLLM's model_name label).
    samples = [s for family in text_string_to_metric_families(metrics) for s in family.samples]
    assert samples and all(s.labels.get("model_name") == "toy" for s in samples), metrics
    assert any(s.name == "superinfer:rotations_total" and s.labels["direction"] == "out" and s.value > 0 for s in samples)


def test_final_outputs_carry_attribution_that_adds_up(tmp_path):
    """Waiting + rotary + running is the request's whole life at the scheduler, which the
    gateway sees from its send to the final output; swap-in waits are part of running."""

    async def scenario(rig):
        gw = rig.gateway
        ids = [f"b{i}" for i in range(4)]
        for rid in ids:
            await gw.add(rid, prompt_len=6, max_tokens=24)
        assert await until(lambda: all(gw.final(r) for r in ids), timeout=20)
        return [(gw.final(r), len(gw.outputs[r]), gw.final_at[r] - gw.sent_at[r]) for r in ids]

    rotated = 0
    for out, num_outputs, life_s in asyncio.run(run_rig(tmp_path, scenario)):
        a = out.attribution
        assert out.finish_reason == "length" and num_outputs == 24
        assert a is not None and a.running_s > 0 and a.waiting_s >= 0 and a.rotary_s >= 0
        assert a.transfer_wait_s <= a.running_s
        total = a.waiting_s + a.rotary_s + a.running_s
        assert life_s - 0.05 < total <= life_s, (total, life_s)
        if a.rotary_s > 0:  # it was swapped out, so swapped in by a step that waited for it
            assert a.num_preemptions > 0 and a.transfer_wait_s > 0, a
            rotated += 1
    assert rotated > 0
