"""Offline checks of the cluster configs in cluster_configs/.

The Ray cluster launcher configs (`ray up cluster_configs/<cloud>.yaml`) go through the
`prepare_config` + `validate_config` that `ray up` itself runs before it contacts a provider (Ray's
JSON schema and node-type consistency). On top of that, the few rules that guard the mistakes a
user of these files would otherwise make, checked on the prepared config (so a Ray default that
slips in where a file leaves a field out is checked too):

- every value the user must replace is marked CHANGE-ME, as each file's header says;
- every `ray start` demands the token, read from a file that file_mounts copies to the nodes, and
  keeps the dashboard on 127.0.0.1;
- every node installs torch, rayapp and exactly the Ray used here;
- checkpoints go to storage every node reaches; only SSH is open to the internet.

The KubeRay manifest gets the same rules in Kubernetes terms. Each rule returns its complaints,
and the bad-config tests show each one failing on a config broken the way a user might.
Nothing here starts Ray, calls a cloud API or opens a network connection.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import ray
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

CONFIG_DIR = Path(__file__).resolve().parents[1] / "cluster_configs"
# File name -> the provider type it declares.
LAUNCHER_CONFIGS = {
    "aws-gpu.yaml": "aws",
    "gcp-gpu.yaml": "gcp",
    "azure-gpu.yaml": "azure",
    "onprem.yaml": "local",
}
KUBERAY_MANIFEST = "kuberay.yaml"
# Storage every node of a multi-node cluster reaches, by provider; on premises, an NFS mount.
SHARED_STORAGE = {"aws": ("s3://",), "gcp": ("gs://",), "azure": ("abfs://", "abfss://")}
WORLD = {"0.0.0.0/0", "::/0", "*", "internet", "any"}
PLACEHOLDER = "CHANGE-ME"

Config = dict[str, Any]


def prepared(name: str) -> Config:
    """The config as `ray up` sees it after merging the provider's defaults (offline)."""
    return prepare_config(yaml.safe_load((CONFIG_DIR / name).read_text()))


def manifest() -> list[Config]:
    text = (CONFIG_DIR / KUBERAY_MANIFEST).read_text()
    return [doc for doc in yaml.safe_load_all(text) if doc]


def setup_lists(config: Config) -> dict[str, str]:
    """The setup commands each node runs (setup_commands merged in by prepare_config), as one text
    per node: a node type's own worker_setup_commands replace the global ones."""
    head = config["head_node_type"]
    lists = {f"{head} (head)": config["head_setup_commands"]}
    for name, node_type in config["available_node_types"].items():
        if name != head or node_type.get("max_workers", 0) > 0:
            lists[f"{name} (worker)"] = node_type.get(
                "worker_setup_commands", config["worker_setup_commands"]
            )
    return {node: "\n".join(commands) for node, commands in lists.items()}


def ray_starts(config: Config) -> list[str]:
    return [
        command
        for key in ("head_start_ray_commands", "worker_start_ray_commands")
        for command in config[key]
        if "ray start" in command
    ]


# ---- rayapp's rules for the launcher configs (each returns its complaints) ---------------


def placeholder_problems(config: Config) -> list[str]:
    """Where the user's own resources go (tracking server, checkpoint bucket, their fork of
    rayapp), the file holds a CHANGE-ME value, never a real-looking one they could miss."""
    setup = "\n".join(config["setup_commands"])
    values = {
        "MLFLOW_TRACKING_URI": re.findall(r"MLFLOW_TRACKING_URI=(\S+?)'", setup),
        "rayapp's pip URL": re.findall(r"rayapp @ (\S+?)\"", setup),
    }
    if config["provider"]["type"] in SHARED_STORAGE:
        values["RAYAPP_STORAGE_PATH"] = re.findall(r"RAYAPP_STORAGE_PATH=(\S+?)'", setup)
    problems = [f"{what}: none set" for what, found in values.items() if not found]
    problems += [
        f"{what}: {value} is not marked {PLACEHOLDER}"
        for what, found in values.items()
        for value in found
        if PLACEHOLDER not in value
    ]
    return problems


def start_problems(config: Config) -> list[str]:
    """Every `ray start` demands the token, from a file file_mounts copies to the nodes, and keeps
    the dashboard private."""
    mounts = {path.replace("$HOME/", "~/") for path in config.get("file_mounts") or {}}
    problems = [] if ray_starts(config) else ["no `ray start` command"]
    for command in ray_starts(config):
        where = f"`{' '.join(command.split())[:60]}...`"
        if "RAY_AUTH_MODE=token " not in command:
            problems.append(f"{where} runs without RAY_AUTH_MODE=token")
        if re.search(r"RAY_AUTH_TOKEN=", command):
            problems.append(f"{where} holds the token itself; read it from RAY_AUTH_TOKEN_PATH")
        path = re.search(r"RAY_AUTH_TOKEN_PATH=(\S+)", command)
        if not path:
            problems.append(f"{where} names no RAY_AUTH_TOKEN_PATH")
        elif path.group(1).replace("$HOME/", "~/") not in mounts:
            problems.append(f"{where}: token file {path.group(1)} is not in file_mounts")
        if re.search(r"--dashboard-host[= ](?!127\.0\.0\.1)", command):
            problems.append(f"{where} publishes the dashboard; use 127.0.0.1 and `ray dashboard`")
    return problems


def install_problems(config: Config) -> list[str]:
    """Every node installs torch, rayapp and the Ray version used here."""
    problems = []
    for node, setup in setup_lists(config).items():
        installs = "\n".join(re.findall(r"pip install (.*)", setup))
        for needed in ('"torch', '"rayapp @', f'"ray[default,train]=={ray.__version__}"'):
            if needed not in installs:
                problems.append(
                    f"{node}: setup commands do not pip install {needed.strip(chr(34))}"
                )
    return problems


def storage_problems(config: Config) -> list[str]:
    """Every node sets RAYAPP_STORAGE_PATH to storage all nodes share."""
    provider = config["provider"]["type"]
    problems = []
    for node, setup in setup_lists(config).items():
        paths = re.findall(r"RAYAPP_STORAGE_PATH=([^\s'\"]+)", setup)
        nfs = re.findall(r"mount -t nfs\S* .* (/\S+)\)?$", setup, flags=re.MULTILINE)
        shared = SHARED_STORAGE.get(provider) or tuple(f"{point.rstrip(')')}/" for point in nfs)
        if not paths:
            problems.append(f"{node}: setup commands do not set RAYAPP_STORAGE_PATH")
        problems += [
            f"{node}: RAYAPP_STORAGE_PATH={path} is not on shared storage ({shared or 'none'})"
            for path in paths
            if not shared or not path.startswith(shared)
        ]
    return problems


def ingress_problems(config: Config) -> list[str]:
    """The rules the file adds to its cloud's firewall admit nothing from the internet but SSH.
    (Ray's own defaults are SSH from anywhere and all traffic inside the cluster.)"""
    provider = config["provider"]
    problems = []
    for rule in (provider.get("security_group") or {}).get("IpPermissions", []):  # AWS
        sources = [r.get("CidrIp") for r in rule.get("IpRanges", [])]
        sources += [r.get("CidrIpv6") for r in rule.get("Ipv6Ranges", [])]
        if WORLD & set(sources) and (rule.get("FromPort"), rule.get("ToPort")) != (22, 22):
            problems.append(f"security group rule {rule} admits more than SSH from the internet")
    for rule in (config.get("metadata") or {}).get("gcp_firewall_rules", []):  # GCP
        # a rule naming no source applies to every source
        sources = rule.get("sourceRanges") or (None if rule.get("sourceTags") else ["0.0.0.0/0"])
        ssh_only = all(a.get("ports") == ["22"] for a in rule.get("allowed", []))
        if WORLD & set(sources or []) and not ssh_only:
            problems.append(
                f"firewall rule {rule['name']!r} admits more than SSH from the internet"
            )
    return problems


LAUNCHER_RULES: dict[str, Callable[[Config], list[str]]] = {
    "placeholders": placeholder_problems,
    "start": start_problems,
    "install": install_problems,
    "storage": storage_problems,
    "ingress": ingress_problems,
}


# ---- the same rules for the KubeRay manifest -------------------------------------------------


def containers(docs: list[Config]) -> dict[str, Config]:
    """The Ray container of every head, worker group and job submitter, by where it is."""
    found = {}
    for doc in docs:
        spec, name = doc.get("spec") or {}, f"{doc['kind']}/{doc['metadata']['name']}"
        pods = {"head": (spec.get("headGroupSpec") or {}).get("template")}
        pods |= {
            group["groupName"]: group["template"] for group in spec.get("workerGroupSpecs", [])
        }
        pods["submitter"] = spec.get("submitterPodTemplate")
        for group, pod in pods.items():
            if doc["kind"] in ("RayCluster", "RayJob") and pod:
                found[f"{name} {group}"] = pod["spec"]["containers"][0]  # KubeRay's Ray container
    return found


def kuberay_problems(docs: list[Config]) -> list[str]:
    kinds = {doc["kind"] for doc in docs}
    problems = [] if {"RayCluster", "RayJob"} <= kinds else [f"no RayCluster and RayJob: {kinds}"]
    for doc in docs:
        name, spec = f"{doc['kind']}/{doc['metadata']['name']}", doc.get("spec") or {}
        if doc["kind"] == "Secret" and (doc.get("data") or doc.get("stringData")):
            problems.append(f"{name} carries the token in the manifest")
        if doc["kind"] == "Service" and spec.get("type", "ClusterIP") != "ClusterIP":
            problems.append(f"{name} is {spec['type']}; use ClusterIP")
        if doc["kind"] == "RayCluster":
            if spec.get("authOptions") != {"mode": "token", "secretName": "rayapp-ray-auth"}:
                problems.append(f"{name}: authOptions must be token auth from rayapp-ray-auth")
            if spec["headGroupSpec"].get("serviceType", "ClusterIP") != "ClusterIP":
                problems.append(f"{name}: the head's serviceType is not ClusterIP")
        if doc["kind"] == "RayJob":
            pip = yaml.safe_load(spec.get("runtimeEnvYAML") or "{}").get("pip", [])
            for needed in ("torch", "rayapp @"):
                if not any(entry.startswith(needed) for entry in pip):
                    problems.append(f"{name}: its runtime environment does not install {needed}")
    claims = {
        doc["metadata"]["name"]
        for doc in docs
        if doc["kind"] == "PersistentVolumeClaim" and "ReadWriteMany" in doc["spec"]["accessModes"]
    }
    shared_mounts = {
        volume["name"]
        for doc in docs
        if doc["kind"] == "RayCluster"
        for group in [doc["spec"]["headGroupSpec"], *doc["spec"]["workerGroupSpecs"]]
        for volume in group["template"]["spec"].get("volumes", [])
        if volume.get("persistentVolumeClaim", {}).get("claimName") in claims
    }
    for where, container in containers(docs).items():
        env = {entry["name"]: entry for entry in container.get("env", [])}
        if env.get("RAY_AUTH_MODE", {}).get("value") != "token":
            problems.append(f"{where}: RAY_AUTH_MODE is not token")
        secret = env.get("RAY_AUTH_TOKEN", {}).get("valueFrom", {}).get("secretKeyRef", {})
        if secret.get("name") != "rayapp-ray-auth":
            problems.append(f"{where}: RAY_AUTH_TOKEN does not come from Secret rayapp-ray-auth")
        if "submitter" not in where:
            path = env.get("RAYAPP_STORAGE_PATH", {}).get("value", "")
            mounted = [m for m in container.get("volumeMounts", []) if m["name"] in shared_mounts]
            if not any(path.startswith(m["mountPath"]) for m in mounted):
                problems.append(f"{where}: RAYAPP_STORAGE_PATH={path!r} is not on a RWX volume")
    return problems


# ---- the files as committed ------------------------------------------------------------------


def test_every_config_file_is_covered_and_says_how_to_find_its_placeholders():
    on_disk = {p.name for p in CONFIG_DIR.glob("*.yaml")}
    assert on_disk == set(LAUNCHER_CONFIGS) | {KUBERAY_MANIFEST}
    for name in on_disk:
        text = (CONFIG_DIR / name).read_text()
        assert f"Every value you must replace contains {PLACEHOLDER}" in text, name
        # the token comes from ~/.ray/auth_token or a Secret made from it, never from the file
        assert not re.search(r"RAY_AUTH_TOKEN=(?!\S*auth_token)\S", text), name


@pytest.mark.parametrize("name", sorted(LAUNCHER_CONFIGS))
def test_launcher_config_passes_ray_validation_and_rayapps_rules(name):
    # `ray up` runs prepare_config (the provider's defaults.yaml merged in) and validate_config
    # before it contacts the cloud; its next steps (node resources from the EC2 API, IAM,
    # networks) need the cloud and are not run here.
    config = yaml.safe_load((CONFIG_DIR / name).read_text())
    assert config["provider"]["type"] == LAUNCHER_CONFIGS[name]
    full = prepare_config(copy.deepcopy(config))
    validate_config(full)
    for key in ("setup_commands", "head_start_ray_commands", "worker_start_ray_commands"):
        assert full[key] == config[key], f"a Ray default replaced {key}"
    assert {rule: check(full) for rule, check in LAUNCHER_RULES.items()} == dict.fromkeys(
        LAUNCHER_RULES, []
    )


def test_kuberay_manifest_follows_the_rules():
    assert kuberay_problems(manifest()) == []


def test_ray_validation_rejects_a_wrong_type_and_a_misspelled_key():
    broken = prepared("aws-gpu.yaml")
    broken["available_node_types"]["gpu_worker"]["resources"]["GPU"] = "one"
    with pytest.raises(jsonschema.ValidationError):
        validate_config(broken)
    misspelled = prepared("aws-gpu.yaml")
    misspelled["setup_command"] = misspelled.pop("setup_commands")
    with pytest.raises(jsonschema.ValidationError):
        validate_config(misspelled)


# ---- each rule rejects a config broken the way a user might ----------------------------------


def _edit(config: Config, key: str, old: str, new: str) -> None:
    assert any(old in command for command in config[key]), (key, old)
    config[key] = [command.replace(old, new) for command in config[key]]


def _edit_setup(config: Config, old: str, new: str) -> None:
    for key in ("setup_commands", "head_setup_commands", "worker_setup_commands"):
        config[key] = [command.replace(old, new) for command in config[key]]


BAD_LAUNCHER_CASES: dict[str, tuple[str, str, Callable[[Config], object]]] = {
    "a real-looking bucket left in": (
        "gcp-gpu.yaml",
        "placeholders",
        lambda c: _edit_setup(c, "gs://CHANGE-ME-bucket", "gs://team-bucket"),
    ),
    "worker start without token auth": (
        "aws-gpu.yaml",
        "start",
        lambda c: _edit(c, "worker_start_ray_commands", "RAY_AUTH_MODE=token ", ""),
    ),
    "token inline in the start command": (
        "azure-gpu.yaml",
        "start",
        lambda c: _edit(
            c, "head_start_ray_commands", "TOKEN_PATH=", "TOKEN=ab RAY_AUTH_TOKEN_PATH="
        ),
    ),
    "token file not copied to the nodes": (
        "onprem.yaml",
        "start",
        lambda c: c["file_mounts"].pop("~/.ray/auth_token"),
    ),
    "dashboard on every interface": (
        "gcp-gpu.yaml",
        "start",
        lambda c: _edit(
            c, "head_start_ray_commands", "--dashboard-host=127.0.0.1", "--dashboard-host 0.0.0.0"
        ),
    ),
    "rayapp not installed": (
        "gcp-gpu.yaml",
        "install",
        lambda c: _edit_setup(c, '"rayapp @', '"other @'),
    ),
    "another Ray version on the nodes": (
        "aws-gpu.yaml",
        "install",
        lambda c: _edit_setup(c, f"=={ray.__version__}", "==2.9.0"),
    ),
    "a worker type whose own setup commands skip the install": (
        "aws-gpu.yaml",
        "install",
        lambda c: c["available_node_types"]["gpu_worker"].update(worker_setup_commands=["true"]),
    ),
    "node-local checkpoints on a cloud": (
        "aws-gpu.yaml",
        "storage",
        lambda c: _edit_setup(c, "s3://CHANGE-ME-bucket/rayapp", "/home/ubuntu/checkpoints"),
    ),
    "on-premises checkpoints outside the NFS mount": (
        "onprem.yaml",
        "storage",
        lambda c: _edit_setup(c, "STORAGE_PATH=/mnt/rayapp-shared/", "STORAGE_PATH=/tmp/"),
    ),
    "AWS dashboard open to the world": (
        "aws-gpu.yaml",
        "ingress",
        lambda c: c["provider"]["security_group"]["IpPermissions"].append(
            {"FromPort": 8265, "ToPort": 8265, "IpRanges": [{"CidrIp": "0.0.0.0/0"}]}
        ),
    ),
    "GCP internal rule widened to the world": (
        "gcp-gpu.yaml",
        "ingress",
        lambda c: c["metadata"]["gcp_firewall_rules"][1].pop("sourceRanges"),
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_LAUNCHER_CASES))
def test_each_rule_rejects_a_launcher_config_broken_that_way(case):
    name, rule, break_config = BAD_LAUNCHER_CASES[case]
    config = prepared(name)
    break_config(config)
    assert LAUNCHER_RULES[rule](config), f"{rule} accepted: {case}"


def _cluster(docs: list[Config]) -> Config:
    return next(doc for doc in docs if doc["kind"] == "RayCluster")["spec"]


def _worker_env(docs: list[Config]) -> list[Config]:
    return _cluster(docs)["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["env"]


BAD_MANIFEST_CASES: dict[str, Callable[[list[Config]], object]] = {
    "a LoadBalancer Service": lambda docs: docs.append(
        {"kind": "Service", "metadata": {"name": "lb"}, "spec": {"type": "LoadBalancer"}}
    ),
    "a NodePort head": lambda docs: _cluster(docs)["headGroupSpec"].update(serviceType="NodePort"),
    "no authOptions": lambda docs: _cluster(docs).pop("authOptions"),
    "a worker without token auth": lambda docs: _worker_env(docs).pop(0),
    "the token written into the manifest": lambda docs: _worker_env(docs)[1].update(
        value="abc", valueFrom={}
    ),
    "a Secret with the token committed": lambda docs: docs.append(
        {"kind": "Secret", "metadata": {"name": "rayapp-ray-auth"}, "stringData": {"t": "x"}}
    ),
    "checkpoints off the shared volume": lambda docs: _worker_env(docs)[2].update(value="/tmp"),
    "a job without rayapp": lambda docs: next(d for d in docs if d["kind"] == "RayJob")[
        "spec"
    ].update(runtimeEnvYAML="pip: [torch]"),
}


@pytest.mark.parametrize("case", sorted(BAD_MANIFEST_CASES))
def test_the_kuberay_rules_reject_a_manifest_broken_that_way(case):
    docs = manifest()
    BAD_MANIFEST_CASES[case](docs)
    assert kuberay_problems(docs), f"kuberay_problems accepted: {case}"
