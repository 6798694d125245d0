"""The node policies (deploy/iam) against the S3 requests the storage layer really sends: every request that
pipelines/core/storage.py (pyarrow's S3 filesystem, over the AWS C++ SDK) and MLflow's S3 artifact client (boto3) make
for a stage's work, recorded on the S3 server (tests/support/iam.py), mapped to what AWS authorises and allowed by
head.json, worker.json and pods.json; the same requests outside the work prefix are refused. The control: with an
``s3:prefix`` condition put back on every ``s3:ListBucket`` grant, the bucket check (HeadBucket) is refused.
The whole smoke pipeline's requests are judged the same way in tests/e2e/test_cluster.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.cluster import s3_server
from tests.support.iam import (
    NODE_POLICIES,
    assert_node_policies_allow,
    authorisations,
    decide,
    load_policy,
    policy_values,
)

NODE_KEY = "AKIANODEROLEEXAMPLE1"
"""The access key the nodes' requests are signed with here (an instance role's, on AWS): how they are told
apart from the test's own set-up requests."""
PREFIX = "adlm"


@pytest.fixture(scope="module")
def bucket() -> Iterator[object]:
    with s3_server("adlm-bucket") as s3:
        yield s3


def _stage_work(root: str, tmp: Path) -> None:
    """What the stages do with their work directory: check it, write, read, list, publish, move folders, delete;
    the parquet shards Ray Data writes and reads; MLflow's S3 client logging, listing and fetching artifacts."""
    import shutil

    import pyarrow as pa
    import pyarrow.parquet as pq
    from mlflow.store.artifact.s3_artifact_repo import S3ArtifactRepository

    from pipelines.core import storage

    storage.check_location.cache_clear()
    assert storage.resolve_workdir(root) == root
    storage.write_text(storage.join(root, "run", "summary.md"), "# summary\n")
    assert storage.read_text(storage.join(root, "run", "summary.md")) == "# summary\n"
    assert storage.exists(storage.join(root, "run")) and storage.is_file(storage.join(root, "run", "summary.md"))
    assert storage.list_dir(storage.join(root, "run")) == ["summary.md"]
    folder = tmp / "ckpt"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"\0" * 4096)
    (folder / "config.json").write_text("{}")
    storage.upload_dir(folder, storage.join(root, "ckpt"))
    shutil.copytree(folder, tmp / "to-publish")
    storage.publish_dir(tmp / "to-publish", storage.join(root, "published"))
    assert sorted(p.name for p in storage.download_dir(storage.join(root, "ckpt"), tmp / "back").iterdir()) == [
        "config.json", "model.safetensors"]
    storage.sha256_file(storage.join(root, "ckpt", "config.json"))
    fs, inner = storage.get_fs(storage.join(root, "data", "part-0.parquet"))
    pq.write_table(pa.table({"ids": [[1, 2], [3]]}), inner, filesystem=fs)
    assert pq.read_table(inner, filesystem=fs).num_rows == 2
    storage.delete_dir(storage.join(root, "ckpt"))
    repo = S3ArtifactRepository(storage.join(root, "mlartifacts", "run-1"))
    repo.log_artifacts(str(folder), "checkpoint")
    assert {f.path for f in repo.list_artifacts("checkpoint")} == {"checkpoint/config.json",
                                                                   "checkpoint/model.safetensors"}
    (tmp / "fetched").mkdir()
    repo.download_artifacts("checkpoint", str(tmp / "fetched"))


def _as_node(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process's AWS identity from now on: the nodes' key (boto3's default session, which caches the
    credentials it first found, is dropped so that MLflow's client takes it too)."""
    import boto3

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", NODE_KEY)
    monkeypatch.setattr(boto3, "DEFAULT_SESSION", None)


def test_every_request_of_the_storage_layer_is_one_the_node_policies_allow(bucket, tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    _as_node(monkeypatch)
    before = len(bucket.calls)
    _stage_work(f"s3://{bucket.bucket}/{PREFIX}", tmp_path)
    auths = assert_node_policies_allow(bucket.calls[before:], NODE_KEY, bucket.bucket, PREFIX)
    # What the mapping saw: the bucket check, listings, reads, writes, deletes (a request it cannot map fails).
    apis = {a.api for a in auths}
    assert {"HeadBucket", "ListObjectsV2", "GetObject", "HeadObject", "PutObject", "CreateMultipartUpload",
            "DeleteObjects"} <= apis, apis


def test_the_same_work_outside_the_prefix_is_refused(bucket, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _as_node(monkeypatch)
    before = len(bucket.calls)
    _stage_work(f"s3://{bucket.bucket}/elsewhere", tmp_path)
    auths = authorisations(bucket.calls[before:], NODE_KEY)
    for name in NODE_POLICIES:
        policy = load_policy(name, policy_values(bucket.bucket, PREFIX))
        allowed = {a.api for a in auths if decide(policy, a) == "Allow"}
        assert allowed <= {"HeadBucket", "GetBucketLocation"}, (name, allowed)  # the bucket's existence only
        assert {"ListObjectsV2", "GetObject", "PutObject"} & {a.api for a in auths} - allowed
