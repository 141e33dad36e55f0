"""cache_affinity end to end, as processes: a coordinator whose KV index follows real (simulated) workers' KV
events, converging after a coordinator restart and a worker restart, and routing a conversation's next turn
back to the decode worker that holds it."""

from __future__ import annotations


import httpx
import pytest

from tests.helpers import (
    ServerProcess,
    index_matches_workers,
    management_url,
    pdserve_argv,
    scrape,
    start_coordinator,
    start_sim_worker,
    wait_for,
    write_config,
)

pytestmark = pytest.mark.system

HEARTBEAT_S = 1.0
STORY = ("Once upon a time there was a lighthouse keeper who counted the ships that passed his rock every "
         "night, and wrote each one's name in a book that nobody ever read. ")


def sim_worker_on(role: str, port: str) -> ServerProcess:
    return ServerProcess(pdserve_argv("worker", "--role", role, "--port", port, "--simulate"),
                         "pdserve worker ready:", timeout_s=30)


def complete(coordinator: ServerProcess, prompt: str) -> dict:
    url = coordinator.address
    reply = httpx.post(f"{url}/v1/completions", json={"model": "pdserve-tiny", "prompt": prompt, "max_tokens": 8,
                                                      "temperature": 0, "ignore_eos": True}, timeout=30)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_the_index_converges_after_a_coordinator_and_a_worker_restart_and_a_next_turn_goes_home(
        model_dir, tmp_path):
    prefill = start_sim_worker("prefill")
    decodes = [start_sim_worker("decode"), start_sim_worker("decode")]
    config = write_config(tmp_path / "c.json", [prefill.address], [d.address for d in decodes], model_dir, sections={
        "digs_scheduler_config": {"algorithm_type": "cache_affinity"},
        "health_config": {"check_interval_s": HEARTBEAT_S, "heartbeat_interval_s": HEARTBEAT_S}})
    coordinator = start_coordinator(config)
    workers = [prefill, *decodes]
    try:
        complete(coordinator, STORY * 2)
        held = wait_for(lambda: index_matches_workers(coordinator, workers), 10, "the index to match the workers")
        assert held[prefill.address]["blocks"] > 0 and sum(held[d.address]["blocks"] for d in decodes) > 0

        # A conversation's next turn: the decode worker holding the first goes on with it.
        holder = next(d for d in decodes if held[d.address]["blocks"])
        complete(coordinator, STORY * 2 + "The keeper wrote one more name. " * 3)
        routed = scrape(management_url(coordinator))
        expected = routed[("pdserve_instance_expected_cached_tokens_total",
                           (("address", holder.address), ("role", "decode")))]
        assert expected > 0

        coordinator.stop()  # a new coordinator learns everything from the workers' snapshots
        coordinator = start_coordinator(config)
        # Converged, whenever the coordinator's own view says so: how soon (about a heartbeat on an idle machine) is
        # a latency figure, not something a loaded machine can promise.
        wait_for(lambda: index_matches_workers(coordinator, workers), 60, "the restarted coordinator's index")

        port = holder.address.rsplit(":", 1)[1]
        old_epoch = held[holder.address]["epoch"]
        holder.stop()
        restarted = sim_worker_on("decode", port)
        decodes[decodes.index(holder)] = restarted
        workers = [prefill, *decodes]
        now = wait_for(lambda: index_matches_workers(coordinator, workers), 60, "the restarted worker's entries")
        assert now[restarted.address]["epoch"] != old_epoch and now[restarted.address]["blocks"] == 0
    finally:
        coordinator.stop()
        for worker in workers:
            worker.stop()
