"""cluster.yaml as Ray 2.60's own launcher takes it, against moto's EC2/IAM server: the cluster docs'
provisioning step (deploy/aws/provision.py) on a VPC with two private subnets, then Ray's `prepare_config`,
`validate_config` and `bootstrap_aws` on the config it wrote, as `ray up` runs them. What AWS would start is
read back with boto3: no security group of the cluster accepts anything from 0.0.0.0/0, every node type keeps
the AMI it was provisioned with (not Ray's default "Deep Learning AMI (Ubuntu 18.04) V71.0", CUDA 11.2 drivers),
and the head and the workers carry their own instance profiles with the policies of deploy/iam/. Every EC2 request
Ray's node provider then sends with the head's credentials (launching each worker type, tagging, listing,
terminating) is recorded on the server and allowed by deploy/iam/head.json, while a launch of another instance
type, one with untagged disks and interfaces and the termination of an instance outside the cluster are not."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest
import yaml

from pipelines.core.runtime import environ
from tests.conftest import free_port, load_script

ROOT = Path(__file__).resolve().parents[2]
REGION = "us-west-2"
SSH_CIDR = "10.20.0.0/16"
REGISTRY = "123456789012.dkr.ecr.us-west-2.amazonaws.com/adlm"


def _provisioner():
    return load_script(ROOT / "deploy" / "aws" / "provision.py", "adlm_provision")


@pytest.fixture(scope="module")
def aws(tmp_path_factory: pytest.TempPathFactory):
    """A moto EC2/IAM/STS server on loopback that records every request (tests/support/iam.py), this process's AWS
    settings pointed at it and HOME at a scratch folder (Ray's bootstrap writes its key pair under ~/.ssh); a VPC
    with two private subnets and an AMI."""
    import boto3

    from tests.support.iam import recording_moto_server

    home = tmp_path_factory.mktemp("home")
    os.environ.setdefault("MOTO_EC2_LOAD_DEFAULT_AMIS", "false")  # 1,300 AMIs nobody here uses: seconds saved
    with recording_moto_server(free_port()) as (srv, calls):
        host, port = srv.get_host_and_port()
        env = {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "testing",
               "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": REGION, "AWS_EC2_METADATA_DISABLED": "true",
               "HOME": str(home), "MOTO_EC2_LOAD_DEFAULT_AMIS": "false"}
        with environ(env):
            ec2 = boto3.client("ec2", region_name=REGION)
            vpc = ec2.create_vpc(CidrBlock="10.20.0.0/16")["Vpc"]["VpcId"]
            subnets = [ec2.create_subnet(VpcId=vpc, CidrBlock=f"10.20.{i}.0/24", AvailabilityZone=f"{REGION}{z}")
                       ["Subnet"]["SubnetId"] for i, z in enumerate("ab")]
            # The Deep Learning Base AMI's SSM parameter is AWS's, which moto does not serve: the docs pass the AMI
            # they looked up explicitly, as this does.
            ami = ec2.register_image(Name="Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 22.04) test",
                                     Architecture="x86_64", RootDeviceName="/dev/sda1")["ImageId"]
            yield {"ec2": ec2, "iam": boto3.client("iam", region_name=REGION), "vpc": vpc, "subnets": subnets,
                   "ami": ami, "home": home, "calls": calls}


def _provision(aws: dict, out: Path, **extra: str) -> int:
    args = {"--region": REGION, "--vpc": aws["vpc"], "--subnets": ",".join(aws["subnets"]), "--ssh-cidr": SSH_CIDR,
            "--bucket": "adlm-bucket", "--prefix": "adlm", "--registry": REGISTRY,
            "--mlflow-uri": "http://mlflow.internal:5000", "--gpu-ami": aws["ami"], "--cpu-ami": aws["ami"],
            "--out": str(out), **extra}
    return _provisioner().main([a for kv in args.items() for a in kv])


def _bootstrap(cfg: dict) -> dict:
    # Private modules of Ray: checked with ray==2.60.0, the version pyproject.toml pins.
    # private: Ray's cluster launcher's config checks and AWS bootstrap have no public API
    from ray.autoscaler._private.aws.config import bootstrap_aws

    # private: Ray's cluster launcher's config checks and AWS bootstrap have no public API
    from ray.autoscaler._private.util import prepare_config, validate_config

    cfg = prepare_config(copy.deepcopy(cfg))
    validate_config(cfg)
    return bootstrap_aws(cfg)


def _open_rules(ec2, group_ids: set[str]) -> list[dict]:
    groups = ec2.describe_security_groups(GroupIds=sorted(group_ids))["SecurityGroups"]
    return [r for g in groups for r in g["IpPermissions"]
            if any(x["CidrIp"] == "0.0.0.0/0" for x in r.get("IpRanges", []))
            or any(x["CidrIpv6"] == "::/0" for x in r.get("Ipv6Ranges", []))]


@pytest.fixture(scope="module")
def booted(aws: dict, tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("cfg") / "cluster.local.yaml"
    assert _provision(aws, out) == 0
    cfg = yaml.safe_load(out.read_text())
    return {"raw": cfg, "boot": _bootstrap(cfg)}


def test_rays_bootstrap_opens_nothing_to_the_internet(aws: dict, booted: dict) -> None:
    ec2, boot = aws["ec2"], booted["boot"]
    assert boot["provider"]["use_internal_ips"] is True  # private addresses only
    groups = {g for n in boot["available_node_types"].values() for g in n["node_config"]["SecurityGroupIds"]}
    assert len(groups) == 1
    assert not _open_rules(ec2, groups)
    rules = ec2.describe_security_groups(GroupIds=sorted(groups))["SecurityGroups"][0]["IpPermissions"]
    ssh = [r for r in rules if r.get("FromPort") == 22]
    assert [x["CidrIp"] for r in ssh for x in r["IpRanges"]] == [SSH_CIDR]
    # Nothing else reachable from outside the group: every other rule names the group itself.
    assert all(r.get("UserIdGroupPairs") and not r.get("IpRanges") for r in rules if r.get("FromPort") != 22)
    names = {g["GroupName"] for g in ec2.describe_security_groups(
        Filters=[{"Name": "vpc-id", "Values": [aws["vpc"]]}])["SecurityGroups"]}
    assert "ray-autoscaler-adlm" not in names  # Ray created no group of its own
    for node in boot["available_node_types"].values():
        assert set(node["node_config"]["SubnetIds"]) <= set(aws["subnets"])


def test_without_the_pre_created_group_ray_would_open_ssh_to_everyone(aws: dict, booted: dict) -> None:
    """The control that shows the check above can fail: Ray's own group (no SecurityGroupIds) merges its
    default SSH rule from 0.0.0.0/0 into the configured ones."""
    cfg = copy.deepcopy(booted["raw"])
    cfg["cluster_name"] = "adlm-control"
    for node in cfg["available_node_types"].values():
        node["node_config"].pop("SecurityGroupIds")
    boot = _bootstrap(cfg)
    groups = {g for n in boot["available_node_types"].values() for g in n["node_config"]["SecurityGroupIds"]}
    assert _open_rules(aws["ec2"], groups)


def test_every_node_type_keeps_its_pinned_gpu_driver_ami(aws: dict, booted: dict) -> None:
    # private: Ray's cluster launcher's config checks and AWS bootstrap have no public API
    from ray.autoscaler._private.aws.config import DEFAULT_AMI

    for name, node in booted["boot"]["available_node_types"].items():
        assert node["node_config"]["ImageId"] == aws["ami"], name
        assert node["node_config"]["ImageId"] != DEFAULT_AMI[REGION], name


def test_head_and_workers_carry_their_own_roles_with_the_shipped_policies(aws: dict, booted: dict) -> None:
    iam, boot = aws["iam"], booted["boot"]
    nodes = boot["available_node_types"]
    assert nodes[boot["head_node_type"]]["node_config"]["IamInstanceProfile"] == {"Name": "adlm-ray-head"}
    assert not boot["head_node"]  # Ray's default role (EC2 and S3 full access) was not made or attached
    for name, node in nodes.items():
        if name != boot["head_node_type"]:
            assert node["node_config"]["IamInstanceProfile"] == {"Name": "adlm-ray-worker"}, name
    for profile, doc in (("adlm-ray-head", "head.json"), ("adlm-ray-worker", "worker.json")):
        roles = iam.get_instance_profile(InstanceProfileName=profile)["InstanceProfile"]["Roles"]
        assert [r["RoleName"] for r in roles] == [profile]
        got = iam.get_role_policy(RoleName=profile, PolicyName=profile)["PolicyDocument"]
        got = json.loads(got) if isinstance(got, str) else got
        want = json.loads((ROOT / "deploy" / "iam" / doc).read_text())
        assert [s["Sid"] for s in got["Statement"]] == [s["Sid"] for s in want["Statement"]]
        assert "${" not in json.dumps(got)  # account, region, bucket, cluster all filled
        if doc == "head.json":  # launches from the provisioned image, subnets and group only
            launch = {r for st in got["Statement"] if st["Action"] == "ec2:RunInstances" for r in st["Resource"]
                      if isinstance(st["Resource"], list)}
            assert f"arn:aws:ec2:{REGION}::image/{aws['ami']}" in launch
            assert {r.rsplit("/", 1)[1] for r in launch if ":subnet/" in r} == set(aws["subnets"])
            assert {r.rsplit("/", 1)[1] for r in launch if ":security-group/" in r} == set(
                boot["available_node_types"][boot["head_node_type"]]["node_config"]["SecurityGroupIds"])
    assert not [r for r in iam.list_roles()["Roles"] if r["RoleName"] == "ray-autoscaler-v1"]
    # The Spot service-linked role AWS needs before it takes a spot worker's request.
    # (AWS names it AWSServiceRoleForEC2Spot, moto otherwise: it is found by its path.)
    spot = iam.list_roles(PathPrefix="/aws-service-role/spot.amazonaws.com/")["Roles"]
    assert len(spot) == 1, spot


def test_provisioning_is_idempotent_and_refuses_an_open_ssh_range(aws: dict, booted: dict, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    again = tmp_path / "again.yaml"
    assert _provision(aws, again) == 0
    assert yaml.safe_load(again.read_text()) == booted["raw"]  # the same group, roles and AMIs
    assert _provision(aws, tmp_path / "open.yaml", **{"--ssh-cidr": "0.0.0.0/0"}) == 2
    assert _provision(aws, tmp_path / "bad-ami.yaml", **{"--gpu-ami": "ami-00000000000000000"}) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("error: --ssh-cidr 0.0.0.0/0 opens SSH to the internet")
    assert err[1].startswith("error: AMI ami-00000000000000000 is not available") and "aws ssm get-parameter" in err[1]
    assert not (tmp_path / "open.yaml").exists()


def test_the_kuberay_pods_get_a_role_of_their_own_that_only_their_service_account_assumes(aws: dict, booted: dict,
                                                                                        tmp_path: Path) -> None:
    """IRSA: ``--eks-oidc-provider`` adds ``adlm-ray-pods``, the role deploy/k8s/serviceaccount.yaml names, with
    pods.json's permissions (the bucket prefix: no secret, no registry, which the pods never call) and a trust in
    that OIDC provider for the adlm-ray service account only (the VMs' worker role trusts EC2 alone: a pod could
    not assume it)."""
    iam = aws["iam"]
    oidc = "oidc.eks.us-west-2.amazonaws.com/id/EXAMPLED539D4633E53DE1B71EXAMPLE"
    assert _provision(aws, tmp_path / "k8s.yaml", **{"--eks-oidc-provider": f"https://{oidc}",
                                                     "--namespace": "ml"}) == 0
    role = iam.get_role(RoleName="adlm-ray-pods")["Role"]
    trust = role["AssumeRolePolicyDocument"]
    trust = json.loads(trust) if isinstance(trust, str) else trust
    [st] = trust["Statement"]
    assert st["Principal"] == {"Federated": f"arn:aws:iam::123456789012:oidc-provider/{oidc}"}
    assert st["Action"] == "sts:AssumeRoleWithWebIdentity"
    assert st["Condition"]["StringEquals"][f"{oidc}:sub"] == "system:serviceaccount:ml:adlm-ray"
    got = iam.get_role_policy(RoleName="adlm-ray-pods", PolicyName="adlm-ray-pods")["PolicyDocument"]
    got = json.loads(got) if isinstance(got, str) else got
    want = json.loads((ROOT / "deploy" / "iam" / "pods.json").read_text())
    assert [s["Sid"] for s in got["Statement"]] == [s["Sid"] for s in want["Statement"]]
    assert not [a for st in got["Statement"] for a in ([st["Action"]] if isinstance(st["Action"], str) else st["Action"])
                if not a.startswith("s3:")]
    account = yaml.safe_load((ROOT / "deploy" / "k8s" / "serviceaccount.yaml").read_text())
    assert account["metadata"]["annotations"]["eks.amazonaws.com/role-arn"].endswith(":role/adlm-ray-pods")
    worker_trust = iam.get_role(RoleName="adlm-ray-worker")["Role"]["AssumeRolePolicyDocument"]
    assert "Federated" not in json.dumps(worker_trust)


def _doc(x: object) -> dict:
    return json.loads(x) if isinstance(x, str) else x


def test_the_tracking_server_gets_its_role_for_its_artifact_prefix_alone(aws: dict, capsys) -> None:
    """``--mlflow-role`` needs no VM argument: it creates ``adlm-mlflow-server`` (EC2 trust, an instance profile
    holding it) with pods.json for the server's artifact prefix, judged as AWS would: writing and reading artifacts
    and listing under that prefix are allowed, the work prefix and the bucket's root are not. A rerun changes
    nothing; without a prefix it is refused in one line."""
    from tests.support.iam import Authorisation, decide

    prov = _provisioner()
    args = ["--region", REGION, "--bucket", "adlm-bucket", "--prefix", "mlflow-artifacts", "--mlflow-role"]
    for _ in range(2):
        assert prov.main(args) == 0
    out = capsys.readouterr().out
    assert "adlm-mlflow-server: arn:aws:iam::123456789012:instance-profile/adlm-mlflow-server" in out
    iam = aws["iam"]
    assert "ec2.amazonaws.com" in json.dumps(_doc(iam.get_role(RoleName="adlm-mlflow-server")["Role"]
                                                  ["AssumeRolePolicyDocument"]))
    profile = iam.get_instance_profile(InstanceProfileName="adlm-mlflow-server")["InstanceProfile"]
    assert [r["RoleName"] for r in profile["Roles"]] == ["adlm-mlflow-server"]
    got = _doc(iam.get_role_policy(RoleName="adlm-mlflow-server", PolicyName="adlm-mlflow-server")["PolicyDocument"])
    bucket = "arn:aws:s3:::adlm-bucket"
    allowed = [Authorisation("PutObject", "s3:PutObject", f"{bucket}/mlflow-artifacts/1/abc/model.safetensors"),
               Authorisation("GetObject", "s3:GetObject", f"{bucket}/mlflow-artifacts/1/abc/MLmodel"),
               Authorisation("ListObjectsV2", "s3:ListBucket", bucket, {"s3:prefix": "mlflow-artifacts/1/"}),
               Authorisation("HeadBucket", "s3:ListBucket", bucket)]
    refused = [Authorisation("PutObject", "s3:PutObject", f"{bucket}/adlm/data/x.parquet"),
               Authorisation("ListObjectsV2", "s3:ListBucket", bucket, {"s3:prefix": ""}),
               Authorisation("GetSecretValue", "secretsmanager:GetSecretValue", "arn:aws:secretsmanager:*")]
    assert [decide(got, a) for a in allowed] == ["Allow"] * len(allowed)
    assert [decide(got, a) for a in refused] == ["ImplicitDeny"] * len(refused)
    assert prov.main(["--region", REGION, "--bucket", "adlm-bucket", "--prefix", "", "--mlflow-role"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --mlflow-role needs --prefix") and "\n" not in err


def test_the_kuberay_pods_role_alone_needs_no_vm_argument(aws: dict, capsys) -> None:
    """``--pods-only`` creates the pods' role with the region, bucket, prefix and OIDC provider alone (no VPC,
    subnets, registry or output); the VM cluster without its arguments is refused in one line naming them."""
    prov = _provisioner()
    oidc = "oidc.eks.us-west-2.amazonaws.com/id/PODSONLY0000000000000000000000"
    assert prov.main(["--region", REGION, "--bucket", "adlm-bucket", "--prefix", "adlm", "--pods-only",
                      "--eks-oidc-provider", oidc, "--namespace", "team"]) == 0
    assert capsys.readouterr().out.startswith("adlm-ray-pods: arn:aws:iam::123456789012:role/adlm-ray-pods")
    trust = _doc(aws["iam"].get_role(RoleName="adlm-ray-pods")["Role"]["AssumeRolePolicyDocument"])
    assert trust["Statement"][0]["Condition"]["StringEquals"][f"{oidc}:sub"] == "system:serviceaccount:team:adlm-ray"
    assert prov.main(["--region", REGION, "--bucket", "adlm-bucket", "--pods-only"]) == 2
    assert prov.main(["--region", REGION, "--bucket", "adlm-bucket"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0] == "error: --pods-only needs --eks-oidc-provider"
    assert err[1].startswith("error: the VM cluster") and "--vpc, --subnets, --ssh-cidr" in err[1]


def test_every_request_rays_node_provider_sends_is_one_the_head_policy_allows(aws: dict, booted: dict) -> None:
    """Ray's AWS node provider, as the head's autoscaler runs it with the head's credentials, on the provisioned
    config: launch each worker type (the spot ``cpu_worker`` and the ``gpu_worker``), update their tags, list and
    terminate them. Each request it sent, recorded on the server, mapped to what AWS authorises (RunInstances: the
    instance with its type and tags, the image, subnet, group, each new volume and interface, the spot request,
    tagging at launch, passing the worker role), is allowed by head.json filled as provisioned. Launching another
    instance type, a launch without the cluster's tag on its volumes and interfaces, and terminating an instance
    outside the cluster are recorded too, and denied."""
    import boto3

    # private: Ray's cluster launcher's config checks and AWS bootstrap have no public API
    from ray.autoscaler._private.aws.node_provider import AWSNodeProvider
    from ray.autoscaler.tags import TAG_RAY_NODE_KIND, TAG_RAY_NODE_STATUS, TAG_RAY_USER_NODE_TYPE

    from tests.support.iam import authorisations, decide, denied, load_policy

    boot, raw = booted["boot"], booted["raw"]
    head_key = "AKIAHEADNODEROLE0001"
    provider = AWSNodeProvider({**boot["provider"], "aws_credentials": {
        "aws_access_key_id": head_key, "aws_secret_access_key": "head"}}, boot["cluster_name"])
    launched = {}
    for name in ("cpu_worker", "gpu_worker"):
        node = boot["available_node_types"][name]["node_config"]
        tags = {TAG_RAY_NODE_KIND: "worker", TAG_RAY_USER_NODE_TYPE: name, TAG_RAY_NODE_STATUS: "uninitialized"}
        launched[name] = list(provider.create_node(node, tags, 1))
    nodes = provider.non_terminated_nodes({TAG_RAY_NODE_KIND: "worker"})
    assert sorted(nodes) == sorted(i for ids in launched.values() for i in ids)
    for i in nodes:
        provider.set_node_tags(i, {TAG_RAY_NODE_STATUS: "up-to-date"})
    provider.terminate_nodes(nodes)
    ec2 = boto3.client("ec2", region_name=REGION)

    def tags_of(rid: str) -> dict[str, str]:
        found = ec2.describe_tags(Filters=[{"Name": "resource-id", "Values": [rid]}])["Tags"]
        return {t["Key"]: t["Value"] for t in found}

    sent = [c for c in aws["calls"] if c.key_id == head_key]
    actions = {c.form().get("Action") for c in sent}
    assert {"RunInstances", "TerminateInstances", "DescribeInstances"} <= actions, actions
    group = boot["available_node_types"]["cpu_worker"]["node_config"]["SecurityGroupIds"][0]
    types = sorted({t["node_config"]["InstanceType"] for n, t in raw["available_node_types"].items()
                    if n != raw["head_node_type"]})
    values = {"ACCOUNT": "123456789012", "REGION": REGION, "BUCKET": "adlm-bucket", "PREFIX": "adlm",
              "CLUSTER": raw["cluster_name"], "REPOSITORY": "adlm", "GPU_AMI": aws["ami"], "CPU_AMI": aws["ami"],
              "SECURITY_GROUP": group, "INSTANCE_TYPES": '", "'.join(types),
              "SUBNET_ARNS": '", "'.join(f"arn:aws:ec2:{REGION}:123456789012:subnet/{s}" for s in aws["subnets"])}
    head = load_policy("head.json", values)
    auths = authorisations(aws["calls"], head_key, tags_of)
    kinds = {a.resource.rsplit(":", 1)[-1].split("/")[0] for a in auths if a.action == "ec2:RunInstances"}
    assert {"instance", "volume", "network-interface", "spot-instances-request", "image", "subnet",
            "security-group"} <= kinds, kinds
    assert not denied(head, auths), "\n".join(denied(head, auths))

    # The controls, sent the same way: each must be refused by the same policy.
    before = len(aws["calls"])
    cpu = boot["available_node_types"]["cpu_worker"]["node_config"]
    worker_tags = {TAG_RAY_NODE_KIND: "worker", TAG_RAY_USER_NODE_TYPE: "cpu_worker"}
    provider.create_node({**cpu, "InstanceType": "p5.48xlarge"}, worker_tags, 1)
    provider.create_node({k: v for k, v in cpu.items() if k != "TagSpecifications"}, worker_tags, 1)
    foreign = ec2.run_instances(ImageId=aws["ami"], MinCount=1, MaxCount=1, SubnetId=aws["subnets"][0])
    provider.terminate_node(foreign["Instances"][0]["InstanceId"])
    controls = authorisations(aws["calls"][before:], head_key, tags_of)
    refused = {(a.action, a.resource.rsplit(":", 1)[-1].split("/")[0]) for a in controls if decide(head, a) != "Allow"}
    assert ("ec2:RunInstances", "instance") in refused  # p5.48xlarge is no type of cluster.yaml's
    assert {("ec2:RunInstances", "volume"), ("ec2:RunInstances", "network-interface")} <= refused  # untagged
    assert ("ec2:TerminateInstances", "instance") in refused  # not the cluster's
