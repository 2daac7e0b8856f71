"""Elastic torchrun: two one-process 'nodes' (`--nnodes=1:2`) train together, one fails as a node
does (its agent and worker SIGKILLed mid-epoch), and the other re-forms the rendezvous alone and
finishes the run at world size 1 from the last checkpoint, with the same global batch."""
from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import torch

from runs import MAIN, RECIPE, ROOT, TORCHRUN, free_port, kill_tree, read_jsonl, tiny_run, wait_until

STEPS_PER_EPOCH = 120 // 16                     # the fashion sample's 120 training images, global batch 16
EPOCHS = 3
CHECKPOINT = re.compile(r"^ep\d+-ba(\d+)\.pt$")

# The rendezvous a survivor re-forms alone (torch/distributed/elastic/rendezvous/dynamic_rendezvous.py):
# - a dead node leaves the rendezvous state only once its last heartbeat is older than
#   keep_alive_interval x keep_alive_max_attempt (`_sanitize`; 5 s x 3 unless set); until then the
#   round stays complete and the survivor only waits for the next one. 1 s x 3: the heartbeat comes
#   from a timer thread of the agent, which only watches its workers, so it is not 3 s late on a busy
#   machine (a node dropped so would stay out of the state until the next round).
# - the survivor alone is then min_nodes (1), and completes the round last_call_timeout after joining
#   (`_add_to_participants` sets the deadline, 30 s unless set). With both nodes present a round
#   completes at once (max_nodes), so this wait matters only at the first start, for the second agent
#   to join: 3 s is ample for two agents started together; should one miss it, it joins the next round
#   and the run restarts its workers, which the wait for a checkpoint at world size 2 below allows.
# - join_timeout bounds a whole round (600 s unless set): a rendezvous that cannot form fails the test
#   in 30 s, not at the test's time limit. close_timeout bounds the close at the end (30 s unless set).
# - is_host (c10d_rendezvous_backend.py `_create_tcp_store`): both agents are on 127.0.0.1, so both
#   would try to host the store and the first to bind it would; named, the killed agent is never it.
RDZV_CONF = "join_timeout=30,last_call_timeout=3,close_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=3"


def agent(port: int, is_host: bool, overrides: list[str], log: Path) -> subprocess.Popen:
    command = [*TORCHRUN, "--nnodes=1:2", "--nproc-per-node=1", "--max-restarts=1", "--rdzv-backend=c10d",
               f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=elastic",
               f"--rdzv-conf=is_host={str(is_host).lower()},{RDZV_CONF}",
               str(MAIN), "--config", str(RECIPE), *overrides]
    with open(log, "w") as out:                 # a file, not a pipe: the killed agent's is never drained
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                                start_new_session=True)


def mid_epoch_checkpoint_of_two(run_dir: Path, seen: set) -> bool:
    """Whether a checkpoint taken mid-epoch by two processes exists (loading each new one once:
    should the first round have formed without the second agent, its checkpoints are of one)."""
    directory = run_dir / "checkpoints"
    for path in directory.iterdir() if directory.is_dir() else ():
        match = CHECKPOINT.match(path.name)
        if not match or path in seen or int(match[1]) % STEPS_PER_EPOCH == 0:
            continue
        seen.add(path)
        try:
            if torch.load(path, weights_only=True)["world_size"] == 2:
                return True
        except FileNotFoundError:               # the newest K are kept: an older one may go meanwhile
            pass
    return False


@pytest.mark.timeout(150)
def test_a_node_fails_and_the_survivor_finishes_the_run_alone(sample_sets, tmp_path):
    run_dir, port = tmp_path / "run", free_port()
    overrides = tiny_run(sample_sets / "fashion", "folder", run_dir, f"max_duration={EPOCHS}ep",
                         "data.global_batch_size=16", "checkpoint.interval=3ba", "checkpoint.keep=10",
                         "log.interval=1")
    host = agent(port, True, overrides, tmp_path / "host.log")
    other = agent(port, False, overrides, tmp_path / "other.log")
    try:
        seen: set = set()
        wait_until(lambda: mid_epoch_checkpoint_of_two(run_dir, seen), host, "mid-epoch checkpoint of 2 processes",
                   seconds=60)
        assert other.poll() is None, (tmp_path / "other.log").read_text()[-3000:]
        kill_tree(other.pid)                    # the node fails: agent and worker at once, no clean-up
        other.wait()
        try:
            host.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail("the surviving agent did not finish within 60 s of the other's end:\n"
                        + (tmp_path / "host.log").read_text()[-5000:])
    finally:
        for process in (host, other):
            if process.poll() is None:
                kill_tree(process.pid)
                process.wait()
    output = (tmp_path / "host.log").read_text()
    assert host.returncode == 0, output[-5000:]

    resumed = re.findall(r"resumed from \S+\.pt.*", output)
    assert resumed and "on 1 process where it had 2" in resumed[-1], output[-5000:]
    assert int(re.search(r"-ba(\d+)\.pt", resumed[-1])[1]) % STEPS_PER_EPOCH, f"not mid-epoch: {resumed[-1]}"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 1 and summary["steps"] == EPOCHS * STEPS_PER_EPOCH, summary
    steps = [line["step"] for line in read_jsonl(run_dir / "metrics.jsonl") if "train_loss" in line]
    assert steps == list(range(1, EPOCHS * STEPS_PER_EPOCH + 1)), "each step's line once, across the resume"
