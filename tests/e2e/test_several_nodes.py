"""Several nodes and object storage, on this machine: a two-node Ray cluster (a head and a
second `ray start --address` node, one CPU each, own ports and temp dirs), a service
pointed at it with TUNEYARD_RAY_ADDRESS, and storage on a real S3-compatible server
(moto) on loopback, which both nodes reach.

One worker fits on each node, so a two-worker run has a rank on each; a tensor-parallel
group of two fits on neither. The node-loss test kills the second node's raylet by PID and
comes last: it replaces that node.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from ray.job_submission import JobSubmissionClient
from transformers import AutoModelForCausalLM

from app.cli.tiny_assets import write_jsonl_dataset
from contract.storage import Storage
from tests.conftest import S3Server
from tests.e2e.conftest import Service, make_service
from tests.e2e.helpers import assert_export_matches_engine, assert_succeeded, checkpoints
from tests.e2e.two_nodes import TwoNodeCluster, start_two_node_cluster

pytestmark = [pytest.mark.e2e, pytest.mark.own_cluster]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TwoNodeCluster]:
    cluster = start_two_node_cluster(tmp_path_factory.mktemp("two-nodes"))
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def bucket(s3_server: S3Server) -> str:
    return s3_server.create_bucket()


@pytest.fixture(scope="module")
def on_two_nodes(
    cluster: TwoNodeCluster,
    s3_server: S3Server,
    bucket: str,
    tmp_path_factory: pytest.TempPathFactory,
    tiny_models_root: Path,
) -> Iterator[Service]:
    svc = make_service(
        tmp_path_factory.mktemp("several-nodes-home"),
        tmp_path_factory.mktemp("several-nodes-data"),
        [tiny_models_root],
    )
    svc.env.update(
        {
            "TUNEYARD_RAY_ADDRESS": cluster.dashboard_url,
            **cluster.env,
            "TUNEYARD_STORAGE_PATH": f"s3://{bucket}/tuneyard",
            # The endpoint and credentials, as the AWS tools read them; the service passes
            # them on to every job.
            **s3_server.env,
            "TUNEYARD_PLACEMENT_TIMEOUT_S": "20",
            # Per-cluster settings reach jobs this way: here the interface gloo's ranks
            # on the two nodes reach each other on.
            "TUNEYARD_JOB_ENV": json.dumps(
                {**json.loads(svc.env["TUNEYARD_JOB_ENV"]), "GLOO_SOCKET_IFNAME": "lo"}
            ),
        }
    )
    with svc.running():
        yield svc


def _upload(service: Service, name: str, rows: int, seed: int) -> str:
    data = write_jsonl_dataset(service.data_dir / name, rows=rows, seed=seed)
    with open(data, "rb") as f:
        r = service.http.post("/v1/files", files={"file": (name, f)})
    assert r.status_code == 201, r.text
    file_id: str = r.json()["id"]
    return file_id


def _request(model: Path, source: str, **overrides: Any) -> dict[str, Any]:
    request: dict[str, Any] = {
        "model": str(model),
        "dataset": {"source": source},
        "training": {
            "max_steps": 8,
            "learning_rate": 1e-3,
            "batch_size_per_worker": 8,
            "seq_length": 64,
        },
        "deepspeed": {"zero_stage": 3},
        "resources": {"num_workers": 2, "cpus_per_worker": 1},
        "checkpointing": {"every_n_steps": 2, "keep_last": 1},
        "fault_tolerance": {"max_failures": 1},
    }
    for group, fields in overrides.items():
        request[group] = {**request[group], **fields}
    return request


def _events(service: Service, run_id: str, kind: str) -> list[dict[str, Any]]:
    data = service.http.get(f"/v1/runs/{run_id}/events").json()["data"]
    return [e for e in data if e["type"] == kind]


def placed_on(service: Service, run_id: str) -> list[str]:
    """The short node ids of the run's workers_placed events."""
    return [
        part.split(":")[0].removeprefix("node ")
        for event in _events(service, run_id, "workers_placed")
        for part in event["message"].split("(", 1)[1].rstrip(")").split("; ")
    ]


def _wait_for_checkpoint(service: Service, run_id: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not checkpoints(service, run_id, "deepspeed"):
        run = service.http.get(f"/v1/runs/{run_id}").json()
        assert run["status"] not in ("succeeded", "failed", "cancelled"), run
        assert time.monotonic() < deadline, run
        time.sleep(0.2)


def test_a_zero3_run_on_two_nodes_checkpoints_resumes_and_exports_to_s3(
    on_two_nodes: Service,
    cluster: TwoNodeCluster,
    s3_env: S3Server,
    bucket: str,
    tiny_model_dir: Path,
    tmp_path: Path,
) -> None:
    service = on_two_nodes
    s3_server = s3_env  # and this process reads the bucket as the service does
    source = _upload(service, "news-s3.jsonl", rows=600, seed=21)
    run = service.submit(_request(tiny_model_dir, source))
    run_id = run["id"]
    # The upload is an object, and the run reads it from there.
    assert run["spec"]["dataset"]["source"] == f"s3://{bucket}/tuneyard/files/{source}.jsonl"
    _wait_for_checkpoint(service, run_id)
    assert service.http.post(f"/v1/runs/{run_id}/cancel").status_code == 200
    assert service.wait_terminal(run_id, timeout_s=180)["status"] == "cancelled"

    assert service.http.post(f"/v1/runs/{run_id}/resume").status_code == 200
    run = service.wait_terminal(run_id)
    assert_succeeded(service, run)

    # One rank on each node, as Ray's node ids say.
    placed = _events(service, run_id, "workers_placed")
    assert placed, "no workers_placed event"
    node_ids = set(cluster.alive_nodes().values())
    assert len(node_ids) == 2
    for event in placed:
        assert "2 workers on 2 nodes" in event["message"], event
        for node_id in node_ids:
            assert f"node {node_id[:12]}" in event["message"], (event, node_ids)

    # Attempt 2 went on from a checkpoint it read back from S3, not from step 0.
    page = service.http.get(
        f"/v1/runs/{run_id}/metrics", params={"name": "loss", "limit": 1000}
    ).json()["data"]
    second = sorted(m["step"] for m in page if m["attempt"] == 2)
    assert second[0] > 1 and second[-1] == 8, second

    # Checkpoints and the model are URIs in the bucket; keep_last 1 left one checkpoint.
    prefix = f"s3://{bucket}/tuneyard/{run_id}/"
    recorded = checkpoints(service, run_id, "deepspeed")
    assert recorded and all(c["path"].startswith(prefix) for c in recorded), recorded
    assert run["output"]["model_path"] == f"{prefix}export"
    kept = {
        key.split("/")[2]
        for key in s3_server.keys(bucket, f"tuneyard/{run_id}/")
        if key.split("/")[2].startswith("checkpoint_step_")
    }
    assert kept == {"checkpoint_step_00000008"}, kept
    # The list says which ones keep_last pruned: exactly those no longer in the bucket.
    assert [c["path"].rsplit("/", 1)[1] for c in recorded if not c["pruned"]] == sorted(kept)

    # The job got the cluster's settings and the object store's endpoint and credentials.
    jobs = JobSubmissionClient(
        cluster.dashboard_url,
        headers={"Authorization": f"Bearer {cluster.token_path.read_text().strip()}"},
    )
    env_vars = jobs.get_job_info(run["ray_submission_id"]).runtime_env["env_vars"]
    assert env_vars["GLOO_SOCKET_IFNAME"] == "lo"
    for name in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        assert env_vars[name] == s3_server.env[name]

    # Out of storage without cluster access: `tuneyard download`, then from_pretrained.
    dest = tmp_path / "model"
    result = service.cli("download", run_id, str(dest))
    assert result.returncode == 0, result.stderr
    check = Storage(f"s3://{bucket}/tuneyard").fetch(f"{prefix}export_check.pt", tmp_path / "c")
    assert_export_matches_engine(run, auto=AutoModelForCausalLM, export=dest, check=check)


def test_tensor_parallel_groups_that_would_span_nodes_are_refused(
    on_two_nodes: Service, tiny_model_dir: Path
) -> None:
    request = _request(
        tiny_model_dir,
        _upload(on_two_nodes, "news-tp.jsonl", rows=100, seed=22),
        deepspeed={"zero_stage": 1, "tensor_parallel_size": 2},
    )
    response = on_two_nodes.http.post("/v1/runs/validate", json=request)
    assert response.status_code == 200, response.text
    report = response.json()
    assert not report["valid"]
    problems = {e["field"]: e["message"] for e in report["errors"]}
    assert (
        "tensor-parallel groups of 2, each on one node"
        in problems["deepspeed.tensor_parallel_size"]
    ), problems
    # Without tensor parallelism the same two workers are placeable, one per node.
    request["deepspeed"] = {"zero_stage": 1}
    response = on_two_nodes.http.post("/v1/runs/validate", json=request)
    assert response.status_code == 200 and response.json()["valid"], response.text


def test_a_node_lost_mid_run_fails_the_run_saying_so_and_a_resume_goes_on(
    on_two_nodes: Service, cluster: TwoNodeCluster, tiny_model_dir: Path
) -> None:
    service = on_two_nodes
    source = _upload(service, "news-lost.jsonl", rows=4000, seed=23)
    # The node is killed at the first checkpoint (step 3): the steps after it are the
    # margin for the kill to land mid-run, and what the resumed attempt trains.
    steps = 30
    request = _request(
        tiny_model_dir,
        source,
        training={"max_steps": steps},
        deepspeed={"zero_stage": 2},
        checkpointing={"every_n_steps": 3, "keep_last": 2, "export_hf": False},
    )
    run_id = service.submit(request)["id"]
    _wait_for_checkpoint(service, run_id)
    second = cluster.nodes[-1]
    os.kill(second.raylet_pid(), signal.SIGKILL)

    # Ray Train restarts the workers once (max_failures 1), but one node holds one of
    # them: the placement timeout (20 s) ends the attempt, a cluster error naming the lost
    # node; the service starts another from the latest checkpoint, which finds no room
    # either. The run fails, and its error says a node was lost.
    run = service.wait_terminal(run_id, timeout_s=300)
    assert run["status"] == "failed", run
    assert run["progress"]["step"] < steps
    assert "the cluster lost node" in run["error"]["message"], run["error"]
    lost_node = next(iter(set(placed_on(service, run_id)) - {cluster.head_node_id()[:12]}))
    assert f"node {lost_node[:12]}" in run["error"]["message"], (run["error"], lost_node)

    # A node back, and the run goes on from its last checkpoint in S3.
    cluster.add_node()
    assert service.http.post(f"/v1/runs/{run_id}/resume").status_code == 200
    run = service.wait_terminal(run_id, timeout_s=400)
    assert_succeeded(service, run)
    page = service.http.get(
        f"/v1/runs/{run_id}/metrics", params={"name": "loss", "limit": 1000}
    ).json()["data"]
    resumed_steps = sorted(m["step"] for m in page if m["attempt"] == run["attempt"])
    assert resumed_steps[0] > 1 and resumed_steps[-1] == steps, resumed_steps
