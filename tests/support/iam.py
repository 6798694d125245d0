"""What AWS would authorise: every S3 and EC2 request a test's code sends, recorded on the server (moto behind a
recording WSGI layer: pyarrow's S3 filesystem speaks through the AWS C++ SDK, not botocore, so only the server sees
all of it), mapped to the IAM action, resource and condition keys AWS evaluates for it, and judged against the
shipped policies (``deploy/iam``) by a small evaluator of the policy language they use.

The mapping follows AWS's service authorisation reference: HeadBucket is ``s3:ListBucket`` with no ``s3:prefix``
in the request; ListObjects(V2) is ``s3:ListBucket`` with ``s3:prefix`` the request's prefix (a list without one
is modelled as the prefix "", never as an absent key: the stricter reading); GetBucketLocation carries no prefix;
a multi-object delete is ``s3:DeleteObject`` on each key; a copy reads the source and writes the destination.
RunInstances is authorised on every resource it names or creates (the instance with ``ec2:InstanceType`` and the
tags of its tag specification, the image, the subnet, the security groups, each new volume and network interface
with their own tag specifications, the key pair, the spot request), plus ``ec2:CreateTags`` with
``ec2:CreateAction=RunInstances`` for each resource type it tags and ``iam:PassRole`` for its instance profile.
A request this module cannot map is an error (a new kind of call is noticed, not waved through)."""

from __future__ import annotations

import contextlib
import io
import json
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, parse_qsl, unquote, urlsplit

ROOT = Path(__file__).resolve().parents[2]
IAM = ROOT / "deploy" / "iam"
ACCOUNT = "123456789012"
"""moto's account, the one every ARN here names."""


# ---- recording ---------------------------------------------------------------------------------------------

@dataclass
class Call:
    """One HTTP request to the AWS server: who signed it and what it asked."""

    key_id: str
    service: str
    region: str
    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    body: bytes = b""

    def form(self) -> dict[str, str]:
        """A Query-API request's parameters (EC2, IAM, STS: form-encoded body, or the URL's query)."""
        params = dict(parse_qsl(self.body.decode(errors="replace"), keep_blank_values=True))
        params.update({k: v[0] for k, v in self.query.items()})
        return params


AUTH = re.compile(r"Credential=([^/]+)/\d{8}/([^/]+)/([^/]+)/aws4_request")


def _recording(app: Callable, calls: list[Call], lock: threading.Lock) -> Callable:
    """``app`` (moto's WSGI dispatcher) behind a layer that appends every signed request to ``calls``."""

    def wrapped(environ: dict[str, Any], start_response: Callable) -> Any:
        m = AUTH.search(environ.get("HTTP_AUTHORIZATION", ""))
        if m:
            raw = environ.get("RAW_URI") or environ.get("REQUEST_URI") or environ.get("PATH_INFO", "")
            split = urlsplit(raw)
            query = parse_qs(environ.get("QUERY_STRING", ""), keep_blank_values=True)
            method = environ["REQUEST_METHOD"]
            body = b""
            # Only the bodies the mapping reads: a Query-API form and S3's multi-object delete (its keys).
            if method == "POST" and (m.group(3) != "s3" or "delete" in query):
                length = int(environ.get("CONTENT_LENGTH") or 0)
                body = environ["wsgi.input"].read(length) if length else b""
                environ["wsgi.input"] = io.BytesIO(body)
            headers = {k[5:].replace("_", "-").lower(): v for k, v in environ.items() if k.startswith("HTTP_")}
            with lock:
                calls.append(Call(m.group(1), m.group(3), m.group(2), method, unquote(split.path), query, headers,
                                  body))
        return app(environ, start_response)

    return wrapped


@contextlib.contextmanager
def recording_moto_server(port: int) -> Iterator[tuple[Any, list[Call]]]:
    """moto's threaded server on loopback ``port``, every signed request recorded: (server, calls)."""
    from moto.moto_server.threaded_moto_server import ThreadedMotoServer
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from werkzeug.serving import make_server

    calls: list[Call] = []
    lock = threading.Lock()

    class Recording(ThreadedMotoServer):
        def _server_entry(self) -> None:
            app = _recording(DomainDispatcherApplication(create_backend_app), calls, lock)
            self._server = make_server(self._ip_address, self._port, app, True, request_handler=MotoRequestHandler)
            self._server_ready_event.set()
            self._server.serve_forever()

    srv = Recording(ip_address="127.0.0.1", port=port, verbose=False)
    srv.start()
    try:
        yield srv, calls
    finally:
        srv.stop()


# ---- what AWS authorises for each request -------------------------------------------------------------------

@dataclass(frozen=True)
class Authorisation:
    """One (action, resource, condition keys) AWS evaluates for a request; ``api`` names the request."""

    api: str
    action: str
    resource: str
    context: dict[str, Any] = field(default_factory=dict, hash=False)

    def __str__(self) -> str:
        return f"{self.api}: {self.action} on {self.resource} {self.context or ''}".rstrip()


class Unmapped(AssertionError):
    """A request the mapping does not know: add it (with what AWS's authorisation reference says) rather than
    letting it through unjudged."""


BUCKET_NAME = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
"""What S3 accepts as a bucket name."""


def s3_authorisations(call: Call) -> list[Authorisation]:
    """The authorisations of one path-style S3 request."""
    bucket, _, key = call.path.lstrip("/").partition("/")
    q, m = call.query, call.method
    arn_bucket, arn_key = f"arn:aws:s3:::{bucket}", f"arn:aws:s3:::{bucket}/{key}"
    if not bucket:
        raise Unmapped(f"S3 {m} {call.path}: ListBuckets or an unknown service call")
    if not BUCKET_NAME.fullmatch(bucket):
        # Arrow's backend probe (a HeadBucket of "$extremelyunlikelytoexist$", sent to read which S3 answers from
        # its error): AWS refuses the name itself (InvalidBucketName) before any authorisation, and Arrow expects
        # the refusal.
        assert m == "HEAD" and not key, f"S3 {m} {call.path}: not a bucket name"
        return []
    if not key:
        if m == "HEAD":
            return [Authorisation("HeadBucket", "s3:ListBucket", arn_bucket)]
        if m == "GET" and "location" in q:
            return [Authorisation("GetBucketLocation", "s3:GetBucketLocation", arn_bucket)]
        if m == "GET" and "uploads" in q:
            return [Authorisation("ListMultipartUploads", "s3:ListBucketMultipartUploads", arn_bucket,
                                  {"s3:prefix": q.get("prefix", [""])[0]})]
        if m == "GET" and not set(q) - {"list-type", "prefix", "delimiter", "max-keys", "continuation-token",
                                        "start-after", "marker", "encoding-type", "fetch-owner"}:
            api = "ListObjectsV2" if "list-type" in q else "ListObjects"
            ctx = {"s3:prefix": q.get("prefix", [""])[0]}
            for k in ("delimiter", "max-keys"):
                if k in q:
                    ctx[f"s3:{k}"] = q[k][0]
            return [Authorisation(api, "s3:ListBucket", arn_bucket, ctx)]
        if m == "POST" and "delete" in q:
            keys = re.findall(rb"<Key>(.*?)</Key>", call.body)
            return [Authorisation("DeleteObjects", "s3:DeleteObject", f"{arn_bucket}/{k.decode()}") for k in keys]
        if m == "PUT" and not q:
            return [Authorisation("CreateBucket", "s3:CreateBucket", arn_bucket)]
        if m == "DELETE" and not q:
            return [Authorisation("DeleteBucket", "s3:DeleteBucket", arn_bucket)]
        raise Unmapped(f"S3 {m} {call.path}?{'&'.join(q)}")
    if m in ("GET", "HEAD") and "uploadId" in q:
        return [Authorisation("ListParts", "s3:ListMultipartUploadParts", arn_key)]
    if m in ("GET", "HEAD") and not set(q) - {"partNumber", "versionId", "response-content-type"}:
        if "versionId" in q:
            return [Authorisation(f"{m}Object", "s3:GetObjectVersion", arn_key)]
        return [Authorisation("GetObject" if m == "GET" else "HeadObject", "s3:GetObject", arn_key)]
    if m == "PUT" and not set(q) - {"partNumber", "uploadId"}:
        api = "UploadPart" if "uploadId" in q else "PutObject"
        out = [Authorisation(api, "s3:PutObject", arn_key)]
        source = call.headers.get("x-amz-copy-source")
        if source:  # CopyObject / UploadPartCopy: the source is read
            src = unquote(source).lstrip("/").split("?", 1)[0]
            out.append(Authorisation(f"{api}Copy", "s3:GetObject", f"arn:aws:s3:::{src}"))
        return out
    if m == "POST" and "uploads" in q:
        return [Authorisation("CreateMultipartUpload", "s3:PutObject", arn_key)]
    if m == "POST" and "uploadId" in q:
        return [Authorisation("CompleteMultipartUpload", "s3:PutObject", arn_key)]
    if m == "DELETE" and "uploadId" in q:
        return [Authorisation("AbortMultipartUpload", "s3:AbortMultipartUpload", arn_key)]
    if m == "DELETE" and not q:
        return [Authorisation("DeleteObject", "s3:DeleteObject", arn_key)]
    raise Unmapped(f"S3 {m} {call.path}?{'&'.join(q)}")


def _indexed(params: dict[str, str], prefix: str) -> list[str]:
    """The values of ``<prefix>.1``, ``<prefix>.2``, ... of a Query-API request."""
    out, i = [], 1
    while f"{prefix}.{i}" in params:
        out.append(params[f"{prefix}.{i}"])
        i += 1
    return out


def _tag_specs(params: dict[str, str]) -> dict[str, dict[str, str]]:
    """RunInstances' TagSpecification.N: resource type -> its tags."""
    out: dict[str, dict[str, str]] = {}
    i = 1
    while f"TagSpecification.{i}.ResourceType" in params:
        tags, j = {}, 1
        while f"TagSpecification.{i}.Tag.{j}.Key" in params:
            tags[params[f"TagSpecification.{i}.Tag.{j}.Key"]] = params.get(f"TagSpecification.{i}.Tag.{j}.Value", "")
            j += 1
        out.setdefault(params[f"TagSpecification.{i}.ResourceType"], {}).update(tags)
        i += 1
    return out


def _request_tags(tags: dict[str, str]) -> dict[str, Any]:
    return {**{f"aws:RequestTag/{k}": v for k, v in tags.items()}, **({"aws:TagKeys": sorted(tags)} if tags else {})}


EC2_ID_TYPES = {"i-": "instance", "vol-": "volume", "eni-": "network-interface", "sg-": "security-group",
                "subnet-": "subnet", "sir-": "spot-instances-request"}


def ec2_authorisations(call: Call, resource_tags: Callable[[str], dict[str, str]]) -> list[Authorisation]:
    """The authorisations of one EC2 Query-API request; ``resource_tags(id)``: the tags the resource has (what
    ``ec2:ResourceTag/*`` reads)."""
    p = call.form()
    action = p.get("Action", "")
    region, arn = call.region, f"arn:aws:ec2:{call.region}:{ACCOUNT}"

    def existing(rid: str) -> str:
        kind = next((t for pre, t in EC2_ID_TYPES.items() if rid.startswith(pre)), None)
        if kind is None:
            raise Unmapped(f"EC2 {action}: resource id {rid}")
        return f"{arn}:{kind}/{rid}"

    def on_resource(rid: str, extra: dict[str, Any] | None = None) -> Authorisation:
        ctx = {f"ec2:ResourceTag/{k}": v for k, v in resource_tags(rid).items()}
        return Authorisation(action, f"ec2:{action}", existing(rid), {**ctx, **(extra or {})})

    if action == "RunInstances":
        specs = _tag_specs(p)
        new = {"instance": {"ec2:InstanceType": p.get("InstanceType", "m1.small")}}
        new["volume"] = {}
        nic = "NetworkInterface.1."
        if not p.get(f"{nic}NetworkInterfaceId"):
            new["network-interface"] = {}
        if p.get("InstanceMarketOptions.MarketType") == "spot":
            new["spot-instances-request"] = {}
        out = [Authorisation(action, "ec2:RunInstances", f"{arn}:{kind}/*", {**ctx, **_request_tags(specs.get(kind, {}))})
               for kind, ctx in new.items()]
        named = [f"arn:aws:ec2:{region}::image/{p['ImageId']}"]
        subnet = p.get("SubnetId") or p.get(f"{nic}SubnetId")
        named += [f"{arn}:subnet/{subnet}"] if subnet else []
        groups = _indexed(p, "SecurityGroupId") + _indexed(p, f"{nic}SecurityGroupId")
        named += [f"{arn}:security-group/{g}" for g in groups]
        named += [f"{arn}:key-pair/{p['KeyName']}"] if p.get("KeyName") else []
        named += [f"{arn}:network-interface/{p[nic + 'NetworkInterfaceId']}"] if p.get(f"{nic}NetworkInterfaceId") else []
        out += [Authorisation(action, "ec2:RunInstances", r) for r in named]
        for kind, tags in specs.items():  # tagging on create: CreateTags with ec2:CreateAction=RunInstances
            out.append(Authorisation(f"{action}(tags)", "ec2:CreateTags", f"{arn}:{kind}/*",
                                     {"ec2:CreateAction": "RunInstances", **_request_tags(tags)}))
        profile = p.get("IamInstanceProfile.Name") or p.get("IamInstanceProfile.Arn", "").rsplit("/", 1)[-1]
        if profile:  # the project's profiles hold the role of the same name (deploy/aws/provision.py)
            out.append(Authorisation(f"{action}(profile)", "iam:PassRole", f"arn:aws:iam::{ACCOUNT}:role/{profile}",
                                     {"iam:PassedToService": "ec2.amazonaws.com"}))
        return out
    if action == "CreateTags":
        tags = {v: p.get(k[:-4] + ".Value", "") for k, v in p.items() if re.fullmatch(r"Tag\.\d+\.Key", k)}
        return [on_resource(r, _request_tags(tags)) for r in _indexed(p, "ResourceId")]
    if action in ("TerminateInstances", "StopInstances", "StartInstances", "RebootInstances"):
        return [on_resource(r) for r in _indexed(p, "InstanceId")]
    if action.startswith("Describe"):  # not scoped by resource in AWS
        return [Authorisation(action, f"ec2:{action}", "*")]
    raise Unmapped(f"EC2 {action} ({sorted(p)})")


def authorisations(calls: list[Call], key_id: str,
                   resource_tags: Callable[[str], dict[str, str]] = lambda rid: {}) -> list[Authorisation]:
    """Every authorisation of the requests ``key_id`` signed."""
    out = []
    for c in calls:
        if c.key_id != key_id:
            continue
        if c.service == "s3":
            out += s3_authorisations(c)
        elif c.service == "ec2":
            out += ec2_authorisations(c, resource_tags)
        else:
            raise Unmapped(f"{c.service} {c.method} {c.path} ({c.form().get('Action')})")
    return out


# ---- the policy evaluator -------------------------------------------------------------------------------------

def load_policy(name: str, values: dict[str, str]) -> dict:
    """``deploy/iam/<name>`` with ``values`` filled in as deploy/aws/provision.py fills them (a list value such as
    SUBNET_ARNS is spliced into the JSON list it stands in)."""
    text = (IAM / name).read_text()
    for k, v in values.items():
        text = text.replace("${" + k + "}", v)
    assert "${" not in text, (name, re.findall(r"\$\{\w+\}", text))
    return json.loads(text)


def policy_values(bucket: str, prefix: str, region: str = "us-east-1") -> dict[str, str]:
    """What deploy/aws/provision.py fills into the policies, for a work directory ``s3://<bucket>/<prefix>`` (the
    EC2 values are placeholders: the S3 requests judged with these touch none of them)."""
    return {"ACCOUNT": ACCOUNT, "REGION": region, "BUCKET": bucket, "PREFIX": prefix, "CLUSTER": "adlm",
            "REPOSITORY": "adlm", "GPU_AMI": "ami-0gpu", "CPU_AMI": "ami-0cpu", "SECURITY_GROUP": "sg-0adlm",
            "INSTANCE_TYPES": "c6i.8xlarge", "SUBNET_ARNS": f"arn:aws:ec2:{region}:{ACCOUNT}:subnet/subnet-a"}


NODE_POLICIES = ("head.json", "worker.json", "pods.json")
"""The policies a node's (or a KubeRay pod's) storage requests run under."""


def assert_node_policies_allow(calls: list[Call], key_id: str, bucket: str, prefix: str) -> list[Authorisation]:
    """Every S3 request ``key_id`` signed is allowed by each of ``NODE_POLICIES`` for the work directory
    ``s3://<bucket>/<prefix>``, and the bucket check (HeadBucket) is among them and refused once ``s3:prefix`` is
    put back on the ListBucket grants (the control); returns the authorisations."""
    auths = authorisations(calls, key_id)
    assert "HeadBucket" in {a.api for a in auths}, sorted({a.api for a in auths})
    for name in NODE_POLICIES:
        policy = load_policy(name, policy_values(bucket, prefix))
        assert not denied(policy, auths), f"{name} refuses:\n" + "\n".join(denied(policy, auths))
        control = with_prefix_on_every_list(policy, prefix)
        assert "HeadBucket" in {a.api for a in auths if decide(control, a) != "Allow"}, name
    return auths


def _list(x: Any) -> list:
    return [x] if isinstance(x, str | bool) else list(x)


def _like(value: str, pattern: str) -> bool:
    """IAM's wildcard match: ``*`` any run of characters, ``?`` one character, nothing else special."""
    return re.fullmatch("".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern),
                        value, re.S) is not None


def _test(op: str, got: str, want: str) -> bool:
    if op in ("StringEquals", "ArnEquals"):
        return got == want
    if op in ("StringLike", "ArnLike"):
        return _like(got, want)
    if op == "StringEqualsIgnoreCase":
        return got.lower() == want.lower()
    if op == "Bool":
        return got.lower() == str(want).lower()
    raise AssertionError(f"condition operator {op} is not modelled: add it to tests/support/iam.py")


def _condition(op: str, key: str, wanted: Any, context: dict[str, Any]) -> bool:
    """One condition (operator, key, its policy values) against a request's ``context``."""
    want = _list(wanted)
    if op == "Null":
        return (key not in context) == (str(want[0]).lower() == "true")
    qualifier, _, op = op.rpartition(":")
    if_exists = op.endswith("IfExists")
    op = op.removesuffix("IfExists")
    negated = "Not" in op
    base = op.replace("Not", "")
    if key not in context:
        # A missing key: no match; a negated operator then holds, as does ForAllValues (nothing to check).
        return if_exists or negated or qualifier == "ForAllValues"
    got = _list(context[key])
    if qualifier == "ForAllValues":
        hit = all(any(_test(base, g, w) for w in want) for g in got)
    elif qualifier == "ForAnyValue":
        hit = any(_test(base, g, w) for g in got for w in want)
    else:
        assert len(got) == 1, f"{key} has several values: use ForAllValues/ForAnyValue"
        hit = any(_test(base, got[0], w) for w in want)
    return not hit if negated else hit


def _applies(st: dict, a: Authorisation) -> bool:
    actions, resources = st.get("Action"), st.get("Resource")
    if actions is not None and not any(_like(a.action.lower(), x.lower()) for x in _list(actions)):
        return False
    if "NotAction" in st and any(_like(a.action.lower(), x.lower()) for x in _list(st["NotAction"])):
        return False
    if resources is not None and not any(_like(a.resource, r) for r in _list(resources)):
        return False
    return all(_condition(op, k, v, a.context) for op, conds in st.get("Condition", {}).items()
               for k, v in conds.items())


def decide(policy: dict, a: Authorisation) -> str:
    """"Allow", "Deny" (an explicit Deny statement) or "ImplicitDeny" (no statement allows it)."""
    matching = [st for st in policy["Statement"] if _applies(st, a)]
    if any(st["Effect"] == "Deny" for st in matching):
        return "Deny"
    return "Allow" if any(st["Effect"] == "Allow" for st in matching) else "ImplicitDeny"


def denied(policy: dict, auths: list[Authorisation]) -> list[str]:
    """What ``policy`` does not allow of ``auths`` (one line each, duplicates once)."""
    return sorted({str(a) for a in auths if decide(policy, a) != "Allow"})


def with_prefix_on_every_list(policy: dict, prefix: str) -> dict:
    """The control: ``policy`` with an ``s3:prefix`` condition put back on every statement that grants
    ``s3:ListBucket`` (what the policies said before HeadBucket was known to need it without one)."""
    out = json.loads(json.dumps(policy))
    for st in out["Statement"]:
        if "s3:ListBucket" in _list(st.get("Action", [])):
            st["Condition"] = {"StringLike": {"s3:prefix": [prefix, f"{prefix}/*"]}}
    return out
