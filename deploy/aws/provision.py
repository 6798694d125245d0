"""Create what cluster.yaml needs in an AWS account and write the filled cluster config that `ray up` starts.

    python deploy/aws/provision.py --region us-west-2 --vpc vpc-0abc --subnets subnet-a,subnet-b \
        --ssh-cidr 10.0.0.0/16 --bucket your-bucket --prefix adlm \
        --registry 123456789012.dkr.ecr.us-west-2.amazonaws.com/adlm \
        --mlflow-uri http://mlflow.internal:5000 --out cluster.local.yaml

What it does (idempotent: a rerun finds what exists and changes nothing there):

1. The security group ``adlm-ray`` in ``--vpc``: all traffic between its members, SSH from ``--ssh-cidr`` only
   (a VPN or a bastion; 0.0.0.0/0 is refused). Every node type names it (``SecurityGroupIds``), so Ray's
   bootstrap adds no rule of its own (left to itself it opens SSH to 0.0.0.0/0).
2. The IAM roles and instance profiles ``adlm-ray-head`` and ``adlm-ray-worker`` with the inline policies of
   ``deploy/iam/head.json`` and ``deploy/iam/worker.json`` (least privilege: EC2 launch limited to the worker
   instance types cluster.yaml names, tagged ``ray-cluster-name=<cluster>`` with new volumes and network
   interfaces tagged so too, from the provisioned AMIs, subnets and group; tagging only at launch or of instances
   already tagged so, terminating only those; ``iam:PassRole`` on the worker role only; the bucket, listed only
   within the prefix, and the objects under the prefix; the two secrets; read access to the image repository), and
   the account's Spot service-linked role ``AWSServiceRoleForEC2Spot`` when missing (AWS takes no spot request
   without it).
3. The AMI of every node type: the current AWS Deep Learning Base AMI with NVIDIA drivers (Ubuntu 22.04), read
   from its public SSM parameter (``--gpu-ami`` / ``--cpu-ami`` pin one yourself) and written into the config,
   so the cluster keeps the AMI it was provisioned with until you provision again.
4. With ``--eks-oidc-provider``: the KubeRay pods' role ``adlm-ray-pods`` (IRSA, deploy/k8s/serviceaccount.yaml)
   with ``deploy/iam/pods.json`` (the bucket prefix only: the pods get their secrets from Kubernetes and their
   images through the nodes' role), trusted only by that EKS cluster's OIDC provider for the service account
   ``<--namespace>:adlm-ray`` (deploy/iam/trust-eks.json; the worker role trusts EC2 only). The OIDC provider
   itself must be registered in IAM first (``eksctl utils associate-iam-oidc-provider``).
5. ``--out``: cluster.yaml with every ``${NAME}`` filled.

Two parts alone, without the VM cluster's arguments:

    python deploy/aws/provision.py --region us-west-2 --bucket your-bucket --prefix mlflow-artifacts --mlflow-role
    python deploy/aws/provision.py --region us-west-2 --bucket your-bucket --prefix adlm --pods-only \
        --eks-oidc-provider oidc.eks.us-west-2.amazonaws.com/id/EXAMPLE --namespace default

- ``--mlflow-role``: the tracking server's role and instance profile ``adlm-mlflow-server``: ``deploy/iam/pods.json``
  for the server's artifact prefix (``--prefix``, e.g. ``mlflow-artifacts``: what ``MLFLOW_ARTIFACTS_DESTINATION``
  names), trusted by EC2; attach it to the server's machine. The server writes every run's artifacts with it, so
  the nodes need no access to that prefix.
- ``--pods-only``: step 4 alone, for a KubeRay cluster (no security group, node roles, AMI or config).

It does not create the VPC, the subnets, the bucket, the repository or the two secrets (``adlm/ray-auth-token``:
the token; ``adlm/mlflow-credentials``: an INI file ``[mlflow]`` with ``mlflow_tracking_username`` and
``mlflow_tracking_password``); docs/operations/cluster.md says how. Needs boto3 and credentials allowed to create the above.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
IAM_DIR = ROOT / "deploy" / "iam"
GROUP_NAME = "adlm-ray"
ROLES = {"adlm-ray-head": "head.json", "adlm-ray-worker": "worker.json"}
POD_ROLE = "adlm-ray-pods"
"""KubeRay's pods' role (IRSA, deploy/k8s/serviceaccount.yaml): pods.json's permissions, trusted by one EKS
cluster's OIDC provider for the adlm-ray service account only (deploy/iam/trust-eks.json)."""
POD_POLICY = "pods.json"
MLFLOW_ROLE = "adlm-mlflow-server"
"""The tracking server's role and instance profile (``--mlflow-role``): pods.json's permissions on the server's
artifact prefix, trusted by EC2 (the machine mlflow/server.sh runs on)."""
DLAMI_PARAMETER = "/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-22.04/latest/ami-id"
"""The public SSM parameter naming the current Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 22.04):
NVIDIA driver, Docker and the NVIDIA container toolkit, which the images' CUDA 13.0 torch needs (driver >= 580)."""
OPEN = ("0.0.0.0/0", "::/0")
SPOT_ROLE_PATH = "/aws-service-role/spot.amazonaws.com/"
"""Where the service-linked role AWS needs before it takes a spot request (``AWSServiceRoleForEC2Spot``;
cluster.yaml's spot worker types) lives: one per account, found by its path."""


class ProvisionError(ValueError):
    """A setting that cannot give a safe cluster (one line, naming the fix)."""


def fill(template: str, values: dict[str, str]) -> str:
    """``template`` with every ``${NAME}`` of ``values`` replaced; an unfilled one outside comments is an error."""
    out = re.sub(r"\$\{([A-Z_]+)\}", lambda m: values.get(m.group(1), m.group(0)), template)
    left = sorted({m for line in out.splitlines() if not line.lstrip().startswith("#")
                   for m in re.findall(r"\$\{([A-Z_]+)\}", line)})
    if left:
        raise ProvisionError(f"no value for {', '.join(left)}")
    return out


def policy(name: str, values: dict[str, str]) -> dict[str, Any]:
    """The policy document ``deploy/iam/<name>`` for this account, region, bucket prefix and cluster."""
    return json.loads(fill((IAM_DIR / name).read_text(), values))


def ensure_security_group(ec2: Any, vpc: str, ssh_cidr: str, cluster: str) -> str:
    """The group's id, created with its two rules when missing; a found group open to the internet is refused."""
    found = ec2.describe_security_groups(Filters=[{"Name": "vpc-id", "Values": [vpc]},
                                                 {"Name": "group-name", "Values": [GROUP_NAME]}])["SecurityGroups"]
    if found:
        sg = found[0]
        open_rules = [r for r in sg.get("IpPermissions", [])
                      if any(x.get("CidrIp") in OPEN for x in r.get("IpRanges", []))
                      or any(x.get("CidrIpv6") in OPEN for x in r.get("Ipv6Ranges", []))]
        if open_rules:
            raise ProvisionError(f"security group {sg['GroupId']} ({GROUP_NAME}) accepts traffic from anywhere: "
                                 "remove its 0.0.0.0/0 rules (ray up would expose the nodes)")
        return sg["GroupId"]
    gid = ec2.create_security_group(
        GroupName=GROUP_NAME, VpcId=vpc, Description="ADLM Ray cluster: members and SSH from one range only",
        TagSpecifications=[{"ResourceType": "security-group",
                            "Tags": [{"Key": "ray-cluster-name", "Value": cluster}]}])["GroupId"]
    ec2.authorize_security_group_ingress(GroupId=gid, IpPermissions=[
        {"IpProtocol": "-1", "UserIdGroupPairs": [{"GroupId": gid}]},
        {"IpProtocol": "tcp", "FromPort": 22, "ToPort": 22,
         "IpRanges": [{"CidrIp": ssh_cidr, "Description": "ray up / ray attach from the VPN or bastion"}]},
    ])
    return gid


def ensure_instance_role(iam: Any, role: str, doc: str, values: dict[str, str], description: str) -> str:
    """An EC2 role with its instance profile: created when missing, its inline policy ``deploy/iam/<doc>``
    (replaced on every run); returns the instance profile's ARN."""
    try:
        iam.get_role(RoleName=role)
    except iam.exceptions.NoSuchEntityException:
        iam.create_role(RoleName=role, AssumeRolePolicyDocument=(IAM_DIR / "trust-ec2.json").read_text(),
                        Description=description)
    iam.put_role_policy(RoleName=role, PolicyName=role, PolicyDocument=json.dumps(policy(doc, values)))
    try:
        profile = iam.get_instance_profile(InstanceProfileName=role)["InstanceProfile"]
    except iam.exceptions.NoSuchEntityException:
        profile = iam.create_instance_profile(InstanceProfileName=role)["InstanceProfile"]
    if not any(r["RoleName"] == role for r in profile.get("Roles", [])):
        iam.add_role_to_instance_profile(InstanceProfileName=role, RoleName=role)
    return profile["Arn"]


def ensure_roles(iam: Any, values: dict[str, str]) -> dict[str, str]:
    """Role name -> instance profile ARN of the head's and the workers' roles."""
    return {role: ensure_instance_role(iam, role, doc, values, "ADLM Ray cluster node role (deploy/iam)")
            for role, doc in ROLES.items()}


def ensure_spot_role(iam: Any) -> None:
    """The account's service-linked role for Spot (``AWSServiceRoleForEC2Spot``, under ``SPOT_ROLE_PATH``),
    created when missing: AWS refuses a spot ``RunInstances`` (the spot worker types) without it, and only a
    first spot request through the console creates it on its own."""
    if not iam.list_roles(PathPrefix=SPOT_ROLE_PATH)["Roles"]:
        iam.create_service_linked_role(AWSServiceName="spot.amazonaws.com")


def ensure_pod_role(iam: Any, values: dict[str, str]) -> str:
    """The pods' role (``POD_ROLE``), created or its trust and policy brought up to date; returns its ARN."""
    trust = json.dumps(policy("trust-eks.json", values))
    try:
        arn = iam.get_role(RoleName=POD_ROLE)["Role"]["Arn"]
        iam.update_assume_role_policy(RoleName=POD_ROLE, PolicyDocument=trust)
    except iam.exceptions.NoSuchEntityException:
        arn = iam.create_role(RoleName=POD_ROLE, AssumeRolePolicyDocument=trust,
                              Description="ADLM KubeRay pods (IRSA; deploy/k8s/serviceaccount.yaml)")["Role"]["Arn"]
    iam.put_role_policy(RoleName=POD_ROLE, PolicyName=POD_ROLE, PolicyDocument=json.dumps(policy(POD_POLICY, values)))
    return arn


def worker_instance_types(cluster_yaml: str) -> list[str]:
    """The instance types of cluster.yaml's worker node types: the only ones the head may launch (the head's own
    is launched by ``ray up``, with the operator's credentials)."""
    import yaml

    cfg = yaml.safe_load(cluster_yaml)
    return sorted({t["node_config"]["InstanceType"] for name, t in cfg["available_node_types"].items()
                   if name != cfg["head_node_type"]})


def current_ami(ssm: Any) -> str:
    return ssm.get_parameter(Name=DLAMI_PARAMETER)["Parameter"]["Value"]


VM_ARGUMENTS = ("vpc", "subnets", "ssh_cidr", "registry", "mlflow_uri", "out")
"""What the VM cluster needs beyond the region and the bucket (``--mlflow-role`` and ``--pods-only`` do not)."""


def _needs(args: argparse.Namespace, names: tuple[str, ...], what: str) -> None:
    missing = ["--" + n.replace("_", "-") for n in names if not getattr(args, n)]
    if missing:
        raise ProvisionError(f"{what} needs {', '.join(missing)}")


def _session(args: argparse.Namespace, session: Any | None) -> tuple[Any, str]:
    import boto3

    session = session or boto3.session.Session(region_name=args.region)
    return session, session.client("sts").get_caller_identity()["Account"]


def provision_mlflow_role(args: argparse.Namespace, session: Any | None = None) -> str:
    """The tracking server's role (``MLFLOW_ROLE``) for the artifact prefix ``--prefix`` of ``--bucket``; returns
    its instance profile's ARN."""
    prefix = args.prefix.strip("/")
    if not prefix:
        raise ProvisionError("--mlflow-role needs --prefix: the server's artifact prefix (e.g. mlflow-artifacts)")
    session, account = _session(args, session)
    values = {"ACCOUNT": account, "REGION": args.region, "BUCKET": args.bucket, "PREFIX": prefix}
    return ensure_instance_role(session.client("iam"), MLFLOW_ROLE, POD_POLICY, values,
                                "ADLM MLflow tracking server: its artifact prefix (deploy/iam/pods.json)")


def provision_pods(args: argparse.Namespace, session: Any | None = None) -> str:
    """The KubeRay pods' role alone (step 4); returns its ARN."""
    _needs(args, ("eks_oidc_provider",), "--pods-only")
    session, account = _session(args, session)
    values = {"ACCOUNT": account, "REGION": args.region, "BUCKET": args.bucket, "PREFIX": args.prefix.strip("/"),
              "OIDC_PROVIDER": args.eks_oidc_provider.removeprefix("https://"), "NAMESPACE": args.namespace}
    return ensure_pod_role(session.client("iam"), values)


def provision(args: argparse.Namespace, session: Any | None = None) -> str:
    """Create the group, roles and profiles; returns the filled cluster config (YAML text)."""
    _needs(args, VM_ARGUMENTS, "the VM cluster (without --mlflow-role or --pods-only)")
    if args.ssh_cidr in OPEN:
        raise ProvisionError("--ssh-cidr 0.0.0.0/0 opens SSH to the internet: give your VPN's or bastion's range")
    if "/" not in args.registry:
        raise ProvisionError("--registry must be <registry host>/<repository>, e.g. "
                             "123456789012.dkr.ecr.us-west-2.amazonaws.com/adlm")
    session, account = _session(args, session)
    host, repository = args.registry.split("/", 1)
    cluster_yaml = Path(args.config).read_text()
    cluster = re.search(r"^cluster_name:\s*(\S+)", cluster_yaml, re.M).group(1)
    values = {"ACCOUNT": account, "REGION": args.region, "BUCKET": args.bucket, "PREFIX": args.prefix.strip("/"),
              "CLUSTER": cluster, "REPOSITORY": repository, "REGISTRY": args.registry, "REGISTRY_HOST": host,
              "MLFLOW_TRACKING_URI": args.mlflow_uri}
    ec2 = session.client("ec2")
    subnets = [s for s in args.subnets.split(",") if s]
    vpcs = {s["VpcId"] for s in ec2.describe_subnets(SubnetIds=subnets)["Subnets"]}
    if vpcs != {args.vpc}:
        raise ProvisionError(f"--subnets are in {sorted(vpcs)}, not in --vpc {args.vpc}")
    values["SECURITY_GROUP"] = ensure_security_group(ec2, args.vpc, args.ssh_cidr, cluster)
    ami = None if args.gpu_ami and args.cpu_ami else current_ami(session.client("ssm"))
    for image in {args.gpu_ami or ami, args.cpu_ami or ami}:
        try:
            ec2.describe_images(ImageIds=[image])
        except Exception as e:  # noqa: BLE001 - botocore's ClientError: say which AMI in one line
            raise ProvisionError(f"AMI {image} is not available in {args.region} ({e}); look up the current one: "
                                 f"aws ssm get-parameter --name {DLAMI_PARAMETER}") from None
    # The lists go inside the templates' ["${SUBNETS}"] and the head policy's "${SUBNET_ARNS}" and
    # ["${INSTANCE_TYPES}"]: the head launches cluster.yaml's worker types from the provisioned images, subnets and
    # group only.
    values.update(GPU_AMI=args.gpu_ami or ami, CPU_AMI=args.cpu_ami or ami, SUBNETS='", "'.join(subnets),
                  INSTANCE_TYPES='", "'.join(worker_instance_types(cluster_yaml)),
                  SUBNET_ARNS='", "'.join(f"arn:aws:ec2:{args.region}:{account}:subnet/{s}" for s in subnets))
    iam = session.client("iam")
    ensure_spot_role(iam)
    ensure_roles(iam, values)
    if args.eks_oidc_provider:
        values.update(OIDC_PROVIDER=args.eks_oidc_provider.removeprefix("https://"), NAMESPACE=args.namespace)
        ensure_pod_role(iam, values)
    return fill(cluster_yaml, values)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python deploy/aws/provision.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--region", required=True)
    p.add_argument("--bucket", required=True, help="the work directory's bucket (ADLM_WORKDIR=s3://bucket/prefix)")
    p.add_argument("--prefix", default="adlm", help="the work directory's prefix in the bucket (default adlm); with "
                                                    "--mlflow-role, the tracking server's artifact prefix")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--mlflow-role", action="store_true", help=f"create only the tracking server's role and "
                      f"instance profile {MLFLOW_ROLE} (pods.json on --prefix), and print the profile's ARN")
    mode.add_argument("--pods-only", action="store_true", help="create only the KubeRay pods' role (needs "
                      "--eks-oidc-provider), and print its ARN")
    p.add_argument("--vpc", help="the VPC of the subnets (the VM cluster)")
    p.add_argument("--subnets", help="comma-separated private subnet ids, one per zone (the VM cluster)")
    p.add_argument("--ssh-cidr", help="the only range SSH is accepted from: a VPN or bastion (the VM cluster)")
    p.add_argument("--registry", help="<ECR host>/<repository> of the images, tags gpu-0.1.0 and cpu-0.1.0 "
                                      "(the VM cluster)")
    p.add_argument("--mlflow-uri", help="the tracking server every node reaches, mlflow/server.sh (the VM cluster)")
    p.add_argument("--gpu-ami", default=None, help=f"pin an AMI (default: the SSM parameter {DLAMI_PARAMETER})")
    p.add_argument("--cpu-ami", default=None, help="pin the CPU nodes' AMI (default: the same as the GPU nodes')")
    p.add_argument("--eks-oidc-provider", default=None,
                   help="also the KubeRay pods' IRSA role adlm-ray-pods, trusted by this EKS OIDC provider "
                        "(oidc.eks.<region>.amazonaws.com/id/<id>: aws eks describe-cluster --query "
                        "cluster.identity.oidc.issuer)")
    p.add_argument("--namespace", default="default", help="the KubeRay cluster's namespace (with --eks-oidc-provider)")
    p.add_argument("--config", default=str(ROOT / "cluster.yaml"), help="the template (default: cluster.yaml)")
    p.add_argument("--out", help="where to write the filled cluster config (the VM cluster)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.mlflow_role:
            arn = provision_mlflow_role(args)
            print(f"{MLFLOW_ROLE}: {arn}; attach it to the tracking server's machine: aws ec2 "
                  f"associate-iam-instance-profile --instance-id <id> --iam-instance-profile Name={MLFLOW_ROLE}")
            return 0
        if args.pods_only:
            print(f"{POD_ROLE}: {provision_pods(args)}")
            return 0
        text = provision(args)
    except ProvisionError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    Path(args.out).write_text(text)
    print(f"wrote {args.out}: ray up {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
