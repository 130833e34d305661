"""Offline checks of the cluster configs in cluster_configs/.

The Ray cluster launcher configs (`ray up cluster_configs/<cloud>.yaml`) go through the same
`prepare_config` + `validate_config` that `ray up` runs before it contacts a provider, and then
through this project's own rules, applied to the prepared config (so a Ray default that slips in
where a file leaves a field out is checked too):

- only SSH (22) may be reachable from the whole internet; the dashboard is not published;
- every `ray start` runs with token authentication, and the token file is copied to the nodes;
- every node installs torch, the Ray version used here, and rayapp;
- checkpoints go to storage that every node reaches.

The KubeRay manifest gets the same rules in Kubernetes terms. Each rule is a function returning
its complaints, and `test_checkers_reject_bad_configs` shows each one failing on a broken config.

Nothing here starts Ray, calls a cloud API or opens a network connection.
"""

from __future__ import annotations

import copy
import functools
import ipaddress
import json
import re
import shlex
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import ray
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

CONFIG_DIR = Path(__file__).resolve().parents[1] / "cluster_configs"

# File name -> provider type it must declare.
LAUNCHER_CONFIGS = {
    "aws-gpu.yaml": "aws",
    "gcp-gpu.yaml": "gcp",
    "azure-gpu.yaml": "azure",
    "onprem.yaml": "local",
}
KUBERAY_MANIFEST = "kuberay.yaml"

# Where each provider's checkpoints must go: storage every node of a multi-node cluster reaches.
STORAGE_SCHEMES = {"aws": ("s3://",), "gcp": ("gs://",), "azure": ("abfs://", "abfss://")}

SSH_PORT = 22
PUBLIC_SOURCES = {"*", "internet", "any"}  # Azure's names for "from anywhere"

Config = dict[str, Any]


# ---- loading ---------------------------------------------------------------------------


def load_yaml(name: str) -> Config:
    with open(CONFIG_DIR / name) as f:
        return yaml.safe_load(f)


def load_manifest(name: str = KUBERAY_MANIFEST) -> list[Config]:
    with open(CONFIG_DIR / name) as f:
        return [doc for doc in yaml.safe_load_all(f) if doc is not None]


def prepared(name: str) -> Config:
    """The config as `ray up` sees it after merging the provider's defaults (offline)."""
    return prepare_config(load_yaml(name))


# ---- shell command helpers ------------------------------------------------------------

_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")


def shell_segments(commands: Iterable[str]) -> list[list[str]]:
    """Each simple command of a list of shell command lines, split into words."""
    segments = []
    for command in commands:
        for part in re.split(r"&&|\|\||;|\||\n|\(|\)", command):
            try:
                words = shlex.split(part)
            except ValueError:
                words = part.split()
            if words:
                segments.append(words)
    return segments


def leading_env(words: list[str]) -> tuple[dict[str, str], list[str]]:
    """`A=1 B=2 cmd args` -> ({A: 1, B: 2}, [cmd, args])."""
    env: dict[str, str] = {}
    index = 0
    while index < len(words) and _ASSIGNMENT.match(words[index]):
        name, _, value = words[index].partition("=")
        env[name] = value
        index += 1
    return env, words[index:]


def ray_starts(commands: Iterable[str]) -> list[tuple[dict[str, str], list[str]]]:
    """(environment, argv) of every `ray start` in the commands."""
    found = []
    for words in shell_segments(commands):
        env, argv = leading_env(words)
        if argv[:2] == ["ray", "start"]:
            found.append((env, argv))
    return found


def pip_requirements(commands: Iterable[str]) -> list[str]:
    """The requirement strings of every `pip install` / `uv pip install` in the commands."""
    requirements = []
    for words in shell_segments(commands):
        _, argv = leading_env(words)
        for start in range(len(argv) - 1):
            if argv[start].endswith("pip") and argv[start + 1] == "install":
                requirements += [word for word in argv[start + 2 :] if not word.startswith("-")]
                break
    return requirements


def requirement_name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;@]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def home_path(path: str) -> str:
    """`$HOME/x`, `${HOME}/x` and `~/x` name the same file on a node."""
    for prefix in ("$HOME/", "${HOME}/"):
        if path.startswith(prefix):
            return "~/" + path[len(prefix) :]
    return path


def dashboard_hosts(argv: list[str]) -> list[str]:
    hosts = []
    for index, word in enumerate(argv):
        if word.startswith("--dashboard-host="):
            hosts.append(word.split("=", 1)[1])
        elif word == "--dashboard-host" and index + 1 < len(argv):
            hosts.append(argv[index + 1])
    return hosts


def is_public_bind(host: str) -> bool:
    return host in ("0.0.0.0", "::", "[::]", "")


def is_world(cidr: str) -> bool:
    """A source range that admits the whole internet."""
    if cidr.strip().lower() in PUBLIC_SOURCES:
        return True
    try:
        return ipaddress.ip_network(cidr, strict=False).prefixlen == 0
    except ValueError:
        return False


def node_setup_command_lists(config: Config) -> dict[str, list[str]]:
    """Setup commands the head and each kind of worker run, in a prepared config (setup_commands
    merged in). A node type's own `worker_setup_commands` replace the global ones; an on-premises
    config has a single node type for the head and the workers.
    """
    head = config["head_node_type"]
    lists = {f"{head} (head)": config["head_setup_commands"]}
    for name, node_type in config["available_node_types"].items():
        if name != head or node_type.get("max_workers", 0) > 0:
            lists[f"{name} (worker)"] = node_type.get(
                "worker_setup_commands", config["worker_setup_commands"]
            )
    return lists


# ---- checkers for the Ray launcher configs (each returns its complaints) ----------------


def start_command_problems(config: Config) -> list[str]:
    """Every `ray start` demands the token (read from a file) and keeps the dashboard private."""
    problems = []
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        starts = ray_starts(config.get(key, []))
        if not starts:
            problems.append(f"{key}: no `ray start`")
        for env, argv in starts:
            where = f"{key}: `{' '.join(argv[:3])} ...`"
            if env.get("RAY_AUTH_MODE") != "token":
                problems.append(f"{where} runs without RAY_AUTH_MODE=token")
            if "RAY_AUTH_TOKEN" in env:
                problems.append(f"{where} has the token itself in the config (RAY_AUTH_TOKEN=...)")
            if not env.get("RAY_AUTH_TOKEN_PATH"):
                problems.append(f"{where} names no RAY_AUTH_TOKEN_PATH")
            for host in dashboard_hosts(argv):
                if is_public_bind(host):
                    problems.append(
                        f"{where} publishes the dashboard on {host!r}; "
                        "use 127.0.0.1 and `ray dashboard`"
                    )
    return problems


def token_mount_problems(config: Config) -> list[str]:
    """The token file every `ray start` reads is copied to the nodes by file_mounts."""
    mounts = {
        home_path(remote): local for remote, local in (config.get("file_mounts") or {}).items()
    }
    paths = {
        home_path(env["RAY_AUTH_TOKEN_PATH"])
        for key in ("head_start_ray_commands", "worker_start_ray_commands")
        for env, _ in ray_starts(config.get(key, []))
        if env.get("RAY_AUTH_TOKEN_PATH")
    }
    if not paths:
        return ["no `ray start` reads a token file (RAY_AUTH_TOKEN_PATH)"]
    problems = []
    for path in sorted(paths):
        if not mounts.get(path):
            problems.append(f"token file {path} is not copied to the nodes (file_mounts)")
    return problems


def install_problems(config: Config) -> list[str]:
    """Every node installs torch, exactly the Ray used here, and rayapp."""
    problems = []
    for node_type, commands in node_setup_command_lists(config).items():
        requirements = pip_requirements(commands)
        by_name: dict[str, list[str]] = {}
        for requirement in requirements:
            by_name.setdefault(requirement_name(requirement), []).append(requirement)
        for needed in ("torch", "rayapp"):
            if needed not in by_name:
                problems.append(f"{node_type}: setup commands do not pip install {needed}")
        pins = [re.search(r"==\s*([^\s;,]+)", r) for r in by_name.get("ray", [])]
        if not pins or not all(pins) or {pin.group(1) for pin in pins} != {ray.__version__}:
            problems.append(
                f"{node_type}: setup commands must pin ray=={ray.__version__} (the Ray used here), "
                f"found {by_name.get('ray', [])}"
            )
    return problems


def storage_path_values(commands: Iterable[str]) -> list[str]:
    return re.findall(r"RAYAPP_STORAGE_PATH=([^\s'\"]+)", "\n".join(commands))


def nfs_mount_points(commands: Iterable[str]) -> list[str]:
    points = []
    for words in shell_segments(commands):
        _, argv = leading_env(words)
        if argv[:1] == ["sudo"]:
            argv = argv[1:]
        if (
            argv[:1] == ["mount"]
            and any(t.startswith("nfs") for t in argv if not t.startswith("-"))
            and len(argv) >= 3
        ):
            points.append(argv[-1].rstrip("/"))
    return points


def storage_problems(config: Config) -> list[str]:
    """Every node exports RAYAPP_STORAGE_PATH, on storage all nodes share."""
    provider = config["provider"]["type"]
    problems = []
    for node_type, commands in node_setup_command_lists(config).items():
        values = storage_path_values(commands)
        if not values:
            problems.append(f"{node_type}: setup commands do not set RAYAPP_STORAGE_PATH")
            continue
        for value in values:
            if provider in STORAGE_SCHEMES:
                if not value.startswith(STORAGE_SCHEMES[provider]):
                    problems.append(
                        f"{node_type}: RAYAPP_STORAGE_PATH={value} is not shared storage for "
                        f"{provider} (expected {' or '.join(STORAGE_SCHEMES[provider])})"
                    )
            else:
                mounts = nfs_mount_points(commands)
                if not value.startswith("/") or not any(
                    value.startswith(point + "/") for point in mounts
                ):
                    problems.append(
                        f"{node_type}: RAYAPP_STORAGE_PATH={value} is not below a shared (NFS) "
                        f"mount made in the setup commands ({mounts or 'none'})"
                    )
    return problems


# ---- ingress: what each provider's network lets in from the internet -------------------


def aws_ingress_problems(config: Config) -> list[str]:
    """The rules Ray gives the security group it creates: its defaults plus IpPermissions."""
    # Ray's own function, so a change of Ray's defaults is checked too; importing it needs boto3
    # but makes no AWS call.
    from ray.autoscaler._private.aws.config import _create_default_inbound_rules

    problems = []
    for name, node_type in config["available_node_types"].items():
        if "SecurityGroupIds" in node_type["node_config"]:
            problems.append(
                f"{name}: SecurityGroupIds names an existing group whose rules cannot be checked "
                "here; use provider.security_group.GroupName"
            )
    extra = config["provider"].get("security_group", {}).get("IpPermissions", [])
    for rule in _create_default_inbound_rules({"sg-of-this-cluster"}, extra):
        sources = [r.get("CidrIp", "") for r in rule.get("IpRanges", [])]
        sources += [r.get("CidrIpv6", "") for r in rule.get("Ipv6Ranges", [])]
        if not any(is_world(source) for source in sources):
            continue
        ssh_only = (
            str(rule.get("IpProtocol")).lower() in ("tcp", "6")
            and rule.get("FromPort") == SSH_PORT
            and rule.get("ToPort") == SSH_PORT
        )
        if not ssh_only:
            problems.append(f"security group admits {rule} from the internet; only tcp/22 may be")
    return problems


def gcp_network_name(network: str) -> str:
    return network.rstrip("/").rsplit("/", 1)[-1]


def gcp_ingress_problems(config: Config) -> list[str]:
    """The nodes sit in a network of their own whose declared firewall opens only SSH to the
    world."""
    problems = []
    rules = (config.get("metadata") or {}).get("gcp_firewall_rules")
    if not rules:
        return ["metadata.gcp_firewall_rules: the firewall of the nodes' network is not declared"]
    networks = set()
    for name, node_type in config["available_node_types"].items():
        interfaces = node_type["node_config"].get("networkInterfaces")
        if not interfaces or not all(i.get("network") for i in interfaces):
            problems.append(f"{name}: networkInterfaces with an explicit network are required")
            continue
        networks |= {gcp_network_name(i["network"]) for i in interfaces}
    if "default" in networks:
        problems.append(
            "nodes use the project's default network, whose firewall is not this file's"
        )
    for rule in rules:
        where = f"firewall rule {rule.get('name')!r}"
        if gcp_network_name(rule.get("network", "default")) not in networks:
            problems.append(
                f"{where} is for network {rule.get('network')!r}, not the nodes' {sorted(networks)}"
            )
        if rule.get("direction", "INGRESS").upper() != "INGRESS" or rule.get("disabled"):
            continue
        # A rule naming no source at all applies to every source (0.0.0.0/0).
        sources = rule.get("sourceRanges") or (
            [] if rule.get("sourceTags") or rule.get("sourceServiceAccounts") else ["0.0.0.0/0"]
        )
        if not any(is_world(source) for source in sources):
            continue
        for allowed in rule.get("allowed", []):
            protocol = str(allowed.get("IPProtocol", "")).lower()
            if protocol not in ("tcp", "6") or [str(p) for p in allowed.get("ports", [])] != [
                str(SSH_PORT)
            ]:
                problems.append(f"{where} admits {allowed} from the internet; only tcp/22 may be")
    return problems


@functools.lru_cache(maxsize=1)
def ray_azure_nsg_rules() -> tuple[dict, ...]:
    """Security rules of the network security group Ray's Azure deployment template creates."""
    import ray.autoscaler

    template_path = (
        Path(ray.autoscaler.__file__).parent / "_private" / "_azure" / "azure-config-template.json"
    )
    template = json.loads(template_path.read_text())
    groups = [
        r for r in template["resources"] if r["type"] == "Microsoft.Network/networkSecurityGroups"
    ]
    assert len(groups) == 1, f"expected one network security group in {template_path}"
    return tuple(groups[0]["properties"]["securityRules"])


def azure_ingress_problems(config: Config, nsg_rules: Iterable[dict] | None = None) -> list[str]:
    """Ray deploys every Azure cluster with its template's network security group, which no field
    of the config changes; those are the rules checked."""
    problems = []
    for rule in ray_azure_nsg_rules() if nsg_rules is None else nsg_rules:
        props = rule["properties"]
        if props.get("direction") != "Inbound" or props.get("access") != "Allow":
            continue
        sources = [props.get("sourceAddressPrefix", "")] + list(
            props.get("sourceAddressPrefixes", [])
        )
        if not any(is_world(source) for source in sources if source):
            continue
        ports = [props.get("destinationPortRange", "")] + list(
            props.get("destinationPortRanges", [])
        )
        ports = [str(p) for p in ports if p]
        if props.get("protocol", "").lower() not in ("tcp",) or ports != [str(SSH_PORT)]:
            problems.append(
                f"network security group rule {rule.get('name')!r} admits {ports} from the internet"
            )
    return problems


def local_ingress_problems(config: Config) -> list[str]:
    """On-premises hosts: Ray listens on the addresses given, so they must not be public ones."""
    problems = []
    provider = config["provider"]
    for host in [provider.get("head_ip")] + list(provider.get("worker_ips", [])):
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            continue  # a host name; its address is not known offline
        if address.is_global:
            problems.append(
                f"host {host} has a public address: Ray's ports would face the internet"
            )
    return problems


def ingress_problems(config: Config, azure_nsg_rules: Iterable[dict] | None = None) -> list[str]:
    provider = config["provider"]["type"]
    if provider == "aws":
        return aws_ingress_problems(config)
    if provider == "gcp":
        return gcp_ingress_problems(config)
    if provider == "azure":
        return azure_ingress_problems(config, azure_nsg_rules)
    if provider == "local":
        return local_ingress_problems(config)
    return [f"no ingress check for provider {provider!r}"]


LAUNCHER_CHECKERS: dict[str, Callable[[Config], list[str]]] = {
    "start_commands": start_command_problems,
    "token_mount": token_mount_problems,
    "install": install_problems,
    "storage": storage_problems,
    "ingress": ingress_problems,
}


# ---- checker for the KubeRay manifest --------------------------------------------------

RAY_KINDS = {"RayCluster", "RayJob"}
SHARED_SCHEMES = ("s3://", "gs://", "abfs://", "abfss://")


def env_of(container: dict) -> dict[str, dict]:
    return {entry["name"]: entry for entry in container.get("env") or []}


def token_env_problems(container: dict, where: str, secret_name: str | None = None) -> list[str]:
    """The container runs with RAY_AUTH_MODE=token and the token from a Secret (the one given)."""
    env = env_of(container)
    problems = []
    if env.get("RAY_AUTH_MODE", {}).get("value") != "token":
        problems.append(f"{where}: RAY_AUTH_MODE is not 'token'")
    token = env.get("RAY_AUTH_TOKEN")
    if token is None:
        problems.append(f"{where}: no RAY_AUTH_TOKEN")
    elif "value" in token:
        problems.append(
            f"{where}: RAY_AUTH_TOKEN is written in the manifest; take it from a Secret"
        )
    else:
        ref = (token.get("valueFrom") or {}).get("secretKeyRef") or {}
        if not ref.get("name") or not ref.get("key"):
            problems.append(f"{where}: RAY_AUTH_TOKEN does not come from a Secret (secretKeyRef)")
        elif secret_name and ref["name"] != secret_name:
            problems.append(
                f"{where}: RAY_AUTH_TOKEN comes from Secret {ref['name']!r}, "
                f"authOptions names {secret_name!r}"
            )
    return problems


def pod_storage_problems(
    pod_spec: dict, container: dict, where: str, rwx_claims: set[str]
) -> list[str]:
    path = env_of(container).get("RAYAPP_STORAGE_PATH", {}).get("value")
    if not path:
        return [f"{where}: no RAYAPP_STORAGE_PATH"]
    if path.startswith(SHARED_SCHEMES):
        return []
    claims = {
        v["name"]: v["persistentVolumeClaim"]["claimName"]
        for v in pod_spec.get("volumes") or []
        if v.get("persistentVolumeClaim")
    }
    for mount in container.get("volumeMounts") or []:
        mount_path = mount["mountPath"].rstrip("/")
        if (path == mount_path or path.startswith(mount_path + "/")) and claims.get(
            mount["name"]
        ) in rwx_claims:
            return []
    return [
        f"{where}: RAYAPP_STORAGE_PATH={path} is not on a ReadWriteMany volume claim of "
        "this manifest"
    ]


def ray_cluster_specs(docs: list[Config]) -> list[tuple[str, dict]]:
    specs = []
    for doc in docs:
        name = f"{doc.get('kind')}/{(doc.get('metadata') or {}).get('name')}"
        if doc.get("kind") == "RayCluster":
            specs.append((name, doc["spec"]))
        elif doc.get("kind") == "RayJob" and doc["spec"].get("rayClusterSpec"):
            specs.append((name, doc["spec"]["rayClusterSpec"]))
    return specs


def kuberay_problems(docs: list[Config]) -> list[str]:
    problems = []
    kinds = [doc.get("kind") for doc in docs]
    if not RAY_KINDS & set(kinds):
        problems.append(f"no RayCluster or RayJob among {kinds}")
    for doc in docs:
        kind, spec = doc.get("kind"), doc.get("spec") or {}
        if kind == "Service" and spec.get("type", "ClusterIP") in ("LoadBalancer", "NodePort"):
            problems.append(f"Service {doc['metadata']['name']} is {spec['type']}; use ClusterIP")
        if kind in ("Ingress", "Route", "Gateway"):
            problems.append(f"{kind} {doc['metadata']['name']} publishes the cluster")
        if kind == "Secret" and (doc.get("data") or doc.get("stringData")):
            problems.append(f"Secret {doc['metadata']['name']} carries its values in the manifest")

    rwx_claims = {
        doc["metadata"]["name"]
        for doc in docs
        if doc.get("kind") == "PersistentVolumeClaim"
        and "ReadWriteMany" in doc["spec"].get("accessModes", [])
    }
    cluster_secrets = {
        doc["metadata"]["name"]: (doc["spec"].get("authOptions") or {}).get("secretName")
        for doc in docs
        if doc.get("kind") == "RayCluster"
    }

    for name, spec in ray_cluster_specs(docs):
        # KubeRay itself calls the dashboard (RayJob status, job submission) and only knows the
        # token through authOptions; env variables alone would leave those calls unauthorized.
        auth = spec.get("authOptions") or {}
        if auth.get("mode") != "token":
            problems.append(f"{name}: authOptions.mode is not 'token'")
        elif not auth.get("secretName"):
            problems.append(f"{name}: authOptions.secretName does not name the token Secret")
        head = spec["headGroupSpec"]
        if head.get("serviceType", "ClusterIP") != "ClusterIP":
            problems.append(f"{name}: head serviceType {head['serviceType']}; use ClusterIP")
        head_service_type = ((head.get("headService") or {}).get("spec") or {}).get(
            "type", "ClusterIP"
        )
        if head_service_type != "ClusterIP":
            problems.append(f"{name}: headService type {head_service_type}; use ClusterIP")
        if head.get("enableIngress"):
            problems.append(f"{name}: enableIngress publishes the head")
        groups = [("head", head)] + [
            (f"worker group {g.get('groupName')}", g) for g in spec.get("workerGroupSpecs", [])
        ]
        for group_name, group in groups:
            pod_spec = group["template"]["spec"]
            ray_container = pod_spec["containers"][0]  # KubeRay runs Ray in the first container
            where = f"{name} {group_name}"
            problems += token_env_problems(ray_container, where, auth.get("secretName"))
            problems += pod_storage_problems(pod_spec, ray_container, where, rwx_claims)

    for doc in docs:
        if doc.get("kind") != "RayJob":
            continue
        name, spec = f"RayJob/{doc['metadata']['name']}", doc["spec"]
        selected = (spec.get("clusterSelector") or {}).get("ray.io/cluster")
        if not spec.get("rayClusterSpec") and selected not in cluster_secrets:
            problems.append(
                f"{name}: selects RayCluster {selected!r}, which this manifest does not define"
            )
        cluster_spec = spec.get("rayClusterSpec") or {}
        secret_name = (cluster_spec.get("authOptions") or {}).get(
            "secretName"
        ) or cluster_secrets.get(selected)
        if spec.get("submissionMode", "K8sJobMode") == "K8sJobMode":
            template = spec.get("submitterPodTemplate")
            if template:
                problems += token_env_problems(
                    template["spec"]["containers"][0], f"{name} submitter", secret_name
                )
        runtime_env = yaml.safe_load(spec.get("runtimeEnvYAML") or "{}") or {}
        names = {requirement_name(r) for r in runtime_env.get("pip") or []}
        for needed in ("torch", "rayapp"):
            if needed not in names:
                problems.append(f"{name}: runtime environment does not pip install {needed}")
        if "--storage-path" not in spec.get("entrypoint", ""):
            problems.append(f"{name}: entrypoint passes no --storage-path")
    return problems


# ---- tests: the files as committed -----------------------------------------------------


def test_every_config_file_is_covered():
    on_disk = {p.name for p in CONFIG_DIR.glob("*.yaml")}
    assert on_disk == set(LAUNCHER_CONFIGS) | {KUBERAY_MANIFEST}


@pytest.mark.parametrize("name", sorted(LAUNCHER_CONFIGS))
def test_launcher_config_passes_ray_validation(name):
    # `ray up` runs prepare_config (merges the provider's defaults.yaml, shipped with Ray) and
    # validate_config (Ray's JSON schema and node-type consistency) before it contacts the cloud:
    # both offline. Its next steps are skipped because they need the cloud: filling node
    # resources in (AWS asks the EC2 API for instance types; the files set `resources` instead)
    # and the provider's bootstrap (IAM roles, networks, key pairs).
    config = load_yaml(name)
    assert config["provider"]["type"] == LAUNCHER_CONFIGS[name]
    full = prepare_config(copy.deepcopy(config))
    validate_config(full)
    # No Ray default replaced a command list of the file.
    for key in (
        "setup_commands",
        "head_start_ray_commands",
        "worker_start_ray_commands",
        "file_mounts",
    ):
        assert full[key] == config[key], key


@pytest.mark.parametrize("check", sorted(LAUNCHER_CHECKERS))
@pytest.mark.parametrize("name", sorted(LAUNCHER_CONFIGS))
def test_launcher_config_follows_rule(name, check):
    assert LAUNCHER_CHECKERS[check](prepared(name)) == []


def test_kuberay_manifest_follows_rules():
    docs = load_manifest()
    assert {doc["kind"] for doc in docs} >= RAY_KINDS
    assert all(doc.get("apiVersion") and doc.get("metadata", {}).get("name") for doc in docs)
    assert kuberay_problems(docs) == []


def test_configs_hold_no_token():
    # The token comes from ~/.ray/auth_token or a Secret made from it, never from the repository.
    for path in sorted(CONFIG_DIR.glob("*.yaml")):
        text = path.read_text()
        assert not re.search(r"RAY_AUTH_TOKEN=(?!\S*auth_token)\S", text), path.name
        assert "stringData" not in text, path.name


# ---- tests: every rule rejects a config that breaks it ----------------------------------


def _first_ray_start(commands: list[str]) -> int:
    return next(i for i, c in enumerate(commands) if "ray start" in c)


def _edit_start(config: Config, key: str, old: str, new: str) -> None:
    index = _first_ray_start(config[key])
    assert old in config[key][index]
    config[key][index] = config[key][index].replace(old, new)


def _setup_without(config: Config, needle: str) -> None:
    for key in ("setup_commands", "head_setup_commands", "worker_setup_commands"):
        config[key] = [c for c in config[key] if needle not in c]


def _replace_in_setup(config: Config, old: str, new: str) -> None:
    for key in ("setup_commands", "head_setup_commands", "worker_setup_commands"):
        config[key] = [c.replace(old, new) for c in config[key]]


def _manifest_container(docs: list[Config], kind: str, group: str) -> dict:
    doc = next(d for d in docs if d["kind"] == kind)
    spec = doc["spec"]
    if group == "head":
        return spec["headGroupSpec"]["template"]["spec"]["containers"][0]
    if group == "submitter":
        return spec["submitterPodTemplate"]["spec"]["containers"][0]
    return spec["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]


def _keep_only(docs: list[Config], kind: str) -> None:
    docs[:] = [d for d in docs if d["kind"] == kind]


def _drop_env(container: dict, name: str) -> None:
    container["env"] = [e for e in container["env"] if e["name"] != name]


def _set_env(container: dict, name: str, value: str) -> None:
    _drop_env(container, name)
    container["env"].append({"name": name, "value": value})


WORLD_DASHBOARD = {
    "FromPort": 8265,
    "ToPort": 8265,
    "IpProtocol": "tcp",
    "IpRanges": [{"CidrIp": "0.0.0.0/0"}],
}
WORLD_ALL_V6 = {
    "FromPort": -1,
    "ToPort": -1,
    "IpProtocol": "-1",
    "Ipv6Ranges": [{"CidrIpv6": "::/0"}],
}
AZURE_WORLD_GCS = {
    "name": "RayGcs",
    "properties": {
        "priority": 1010,
        "protocol": "Tcp",
        "access": "Allow",
        "direction": "Inbound",
        "sourceAddressPrefix": "*",
        "sourcePortRange": "*",
        "destinationAddressPrefix": "*",
        "destinationPortRange": "6379",
    },
}

# (file, checker, how to break the config). The untouched file passes the same checker.
BAD_LAUNCHER_CASES = {
    "worker start without token auth": (
        "aws-gpu.yaml",
        start_command_problems,
        lambda c: _edit_start(c, "worker_start_ray_commands", "RAY_AUTH_MODE=token ", ""),
    ),
    "head start with auth disabled": (
        "gcp-gpu.yaml",
        start_command_problems,
        lambda c: _edit_start(
            c, "head_start_ray_commands", "RAY_AUTH_MODE=token", "RAY_AUTH_MODE=disabled"
        ),
    ),
    "dashboard on all interfaces": (
        "azure-gpu.yaml",
        start_command_problems,
        lambda c: _edit_start(
            c, "head_start_ray_commands", "--dashboard-host=127.0.0.1", "--dashboard-host=0.0.0.0"
        ),
    ),
    "dashboard on all interfaces, Ray's default start command": (
        "onprem.yaml",
        start_command_problems,
        lambda c: c.update(
            head_start_ray_commands=[
                "ray stop",
                "RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=~/.ray/auth_token ray start --head "
                "--dashboard-host 0.0.0.0",
            ]
        ),
    ),
    "token inline in the start command": (
        "aws-gpu.yaml",
        start_command_problems,
        lambda c: _edit_start(
            c,
            "head_start_ray_commands",
            "RAY_AUTH_MODE=token",
            "RAY_AUTH_MODE=token RAY_AUTH_TOKEN=abc123",
        ),
    ),
    "token file not mounted": (
        "onprem.yaml",
        token_mount_problems,
        lambda c: c["file_mounts"].pop("~/.ray/auth_token"),
    ),
    "token read from a path that is not mounted": (
        "gcp-gpu.yaml",
        token_mount_problems,
        lambda c: _edit_start(
            c, "worker_start_ray_commands", "$HOME/.ray/auth_token", "/etc/ray/token"
        ),
    ),
    "rayapp not installed": (
        "gcp-gpu.yaml",
        install_problems,
        lambda c: _setup_without(c, "rayapp @"),
    ),
    "torch not installed": (
        "azure-gpu.yaml",
        install_problems,
        lambda c: _setup_without(c, '"torch'),
    ),
    "another Ray version on the nodes": (
        "aws-gpu.yaml",
        install_problems,
        lambda c: _replace_in_setup(c, f"=={ray.__version__}", "==2.9.0"),
    ),
    "worker type with its own setup commands that skip the install": (
        "aws-gpu.yaml",
        install_problems,
        lambda c: c["available_node_types"]["gpu_worker"].update(
            worker_setup_commands=["echo nothing"]
        ),
    ),
    "no storage path": (
        "azure-gpu.yaml",
        storage_problems,
        lambda c: _replace_in_setup(c, "RAYAPP_STORAGE_PATH=", "UNRELATED="),
    ),
    "node-local storage on a cloud": (
        "aws-gpu.yaml",
        storage_problems,
        lambda c: _replace_in_setup(
            c, "s3://CHANGE-ME-bucket/rayapp", "/home/ubuntu/rayapp_results"
        ),
    ),
    "on-premises storage outside the NFS mount": (
        "onprem.yaml",
        storage_problems,
        lambda c: _replace_in_setup(
            c, "RAYAPP_STORAGE_PATH=/mnt/rayapp-shared/", "RAYAPP_STORAGE_PATH=/tmp/"
        ),
    ),
    "AWS dashboard open to the world": (
        "aws-gpu.yaml",
        ingress_problems,
        lambda c: c["provider"]["security_group"]["IpPermissions"].append(WORLD_DASHBOARD),
    ),
    "AWS everything open over IPv6": (
        "aws-gpu.yaml",
        ingress_problems,
        lambda c: c["provider"]["security_group"]["IpPermissions"].append(WORLD_ALL_V6),
    ),
    "AWS security group that cannot be checked": (
        "aws-gpu.yaml",
        ingress_problems,
        lambda c: c["available_node_types"]["head"]["node_config"].update(
            SecurityGroupIds=["sg-0123"]
        ),
    ),
    "GCP GCS port open to the world": (
        "gcp-gpu.yaml",
        ingress_problems,
        lambda c: c["metadata"]["gcp_firewall_rules"].append(
            {
                "name": "ray-gcs",
                "network": "rayapp-vpc",
                "sourceRanges": ["0.0.0.0/0"],
                "allowed": [{"IPProtocol": "tcp", "ports": ["6379"]}],
            }
        ),
    ),
    "GCP internal rule widened to the world": (
        "gcp-gpu.yaml",
        ingress_problems,
        lambda c: c["metadata"]["gcp_firewall_rules"][1].update(sourceRanges=["0.0.0.0/0"]),
    ),
    "GCP rule without a source range, so open to all": (
        "gcp-gpu.yaml",
        ingress_problems,
        lambda c: c["metadata"]["gcp_firewall_rules"][1].pop("sourceRanges"),
    ),
    "GCP nodes on the default network": (
        "gcp-gpu.yaml",
        ingress_problems,
        lambda c: c["available_node_types"]["gpu_worker"]["node_config"]["networkInterfaces"][
            0
        ].update(network="global/networks/default"),
    ),
    "on-premises host with a public address": (
        "onprem.yaml",
        ingress_problems,
        lambda c: c["provider"]["worker_ips"].append("8.8.8.8"),
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_LAUNCHER_CASES))
def test_checkers_reject_bad_configs(case):
    name, checker, break_config = BAD_LAUNCHER_CASES[case]
    config = prepared(name)
    assert checker(copy.deepcopy(config)) == []
    break_config(config)
    assert checker(config), f"{checker.__name__} accepted: {case}"


def test_azure_checker_rejects_a_world_open_port():
    config = prepared("azure-gpu.yaml")
    rules = list(ray_azure_nsg_rules())
    assert azure_ingress_problems(config, rules) == []
    assert azure_ingress_problems(config, rules + [AZURE_WORLD_GCS])
    assert ingress_problems(config, azure_nsg_rules=rules + [AZURE_WORLD_GCS])


def test_ray_validation_rejects_a_broken_config():
    config = prepared("aws-gpu.yaml")
    validate_config(copy.deepcopy(config))
    broken = copy.deepcopy(config)
    broken["available_node_types"]["gpu_worker"]["resources"]["GPU"] = "one"
    with pytest.raises(jsonschema.ValidationError):
        validate_config(broken)
    misspelled = copy.deepcopy(config)
    misspelled["setup_command"] = misspelled.pop("setup_commands")
    with pytest.raises(jsonschema.ValidationError):
        validate_config(misspelled)


BAD_MANIFEST_CASES: dict[str, Callable[[list[Config]], None]] = {
    "LoadBalancer Service": lambda docs: docs.append(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "ray-lb"},
            "spec": {"type": "LoadBalancer"},
        }
    ),
    "NodePort head Service": lambda docs: next(d for d in docs if d["kind"] == "RayCluster")[
        "spec"
    ]["headGroupSpec"].update(serviceType="NodePort"),
    "head service override as LoadBalancer": lambda docs: next(
        d for d in docs if d["kind"] == "RayCluster"
    )["spec"]["headGroupSpec"].update(headService={"spec": {"type": "LoadBalancer"}}),
    "cluster without authOptions": lambda docs: next(d for d in docs if d["kind"] == "RayCluster")[
        "spec"
    ].pop("authOptions"),
    "token from another Secret than authOptions names": lambda docs: _manifest_container(
        docs, "RayCluster", "worker"
    )["env"][1]["valueFrom"]["secretKeyRef"].update(name="other-secret"),
    "worker without token auth": lambda docs: _drop_env(
        _manifest_container(docs, "RayCluster", "worker"), "RAY_AUTH_MODE"
    ),
    "token written into the manifest": lambda docs: _set_env(
        _manifest_container(docs, "RayCluster", "head"), "RAY_AUTH_TOKEN", "abc123"
    ),
    "submitter without the token": lambda docs: _drop_env(
        _manifest_container(docs, "RayJob", "submitter"), "RAY_AUTH_TOKEN"
    ),
    "Secret with the token committed": lambda docs: docs.append(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "rayapp-ray-auth"},
            "stringData": {"auth_token": "x"},
        }
    ),
    "storage path off the shared volume": lambda docs: _set_env(
        _manifest_container(docs, "RayCluster", "worker"), "RAYAPP_STORAGE_PATH", "/tmp/checkpoints"
    ),
    "shared volume only ReadWriteOnce": lambda docs: next(
        d for d in docs if d["kind"] == "PersistentVolumeClaim"
    )["spec"].update(accessModes=["ReadWriteOnce"]),
    "job without rayapp": lambda docs: next(d for d in docs if d["kind"] == "RayJob")[
        "spec"
    ].update(runtimeEnvYAML="pip: [torch]"),
    "job for a cluster that is not defined": lambda docs: next(
        d for d in docs if d["kind"] == "RayJob"
    )["spec"].update(clusterSelector={"ray.io/cluster": "elsewhere"}),
    "no Ray resources at all": lambda docs: _keep_only(docs, "PersistentVolumeClaim"),
}


@pytest.mark.parametrize("case", sorted(BAD_MANIFEST_CASES))
def test_kuberay_checker_rejects_bad_manifests(case):
    docs = load_manifest()
    assert kuberay_problems(copy.deepcopy(docs)) == []
    BAD_MANIFEST_CASES[case](docs)
    assert kuberay_problems(docs), f"kuberay_problems accepted: {case}"


# ---- helpers have tests of their own where a slip would hide a problem -----------------


def test_shell_parsing_sees_env_prefixes_and_pip_requirements():
    commands = [
        "ulimit -n 65536; "
        "RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=$HOME/.ray/auth_token ray start --head",
        'test -x ~/v/bin/python || uv pip install "torch>=2.4" -q "rayapp @ git+https://x/rayapp@main"',
    ]
    assert ray_starts(commands) == [
        (
            {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": "$HOME/.ray/auth_token"},
            ["ray", "start", "--head"],
        )
    ]
    assert [requirement_name(r) for r in pip_requirements(commands)] == ["torch", "rayapp"]
    assert home_path("${HOME}/.ray/auth_token") == "~/.ray/auth_token"
    assert is_world("0.0.0.0/0") and is_world("::/0") and is_world("*")
    assert not is_world("10.0.0.0/8") and not is_world("203.0.113.0/24")
