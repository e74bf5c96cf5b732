"""A Kubernetes pod's container as a local process: pure, no I/O but reading manifests.

What the kubelet would run, taken from the manifests as they are: the container's command and
args, its environment (the ConfigMaps of `envFrom`, then `env`, with the Downward API's values
and `$(VAR)` references filled in as Kubernetes does), and its volumes: Secrets and ConfigMaps
become files to write, claims and emptyDirs directories. Paths inside the container (mount
points, the image's own directories) are rewritten to directories of this machine, longest
prefix first, wherever an argument or an environment value names them. The pod's `fsGroup` and
`fsGroupChangePolicy` come with the claims they apply to (`Ownership`): what the kubelet does to
a claim's files on each mount (tests/kube_local.py does it).

`load_kustomization` reads a kustomize directory whose kustomization uses `resources` and
`images` only (the manifests here use nothing else, so that a test reads exactly what `kubectl
apply -k` applies); any other field is refused rather than ignored.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

Manifest = dict[str, Any]

KUSTOMIZATION_FIELDS = {"apiVersion", "kind", "resources", "images"}
INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")
_FIELD = re.compile(r"^metadata\.(annotations|labels)\['([^']+)'\]$")


class ManifestError(AssertionError):
    """A manifest this helper (or Kubernetes) cannot run as written."""


def load_kustomization(directory: Path) -> list[Manifest]:
    """Every object `kubectl apply -k directory` would apply, in order."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kustomization) - KUSTOMIZATION_FIELDS
    if unknown:
        raise ManifestError(f"{directory}/kustomization.yaml uses {sorted(unknown)}: not read here")
    objects: list[Manifest] = []
    for entry in kustomization.get("resources", []):
        path = (directory / entry).resolve()
        if path.is_dir():
            objects.extend(load_kustomization(path))
        else:
            objects.extend(doc for doc in yaml.safe_load_all(path.read_text()) if doc)
    for image in kustomization.get("images", []):
        for obj in objects:
            for box in containers(obj):
                if box["image"].partition(":")[0] == image["name"]:
                    box["image"] = _image(image, box["image"])
    return objects


def containers(obj: Manifest) -> list[Manifest]:
    spec = obj.get("spec", {}).get("template", {}).get("spec", {})
    return [*spec.get("initContainers", []), *spec.get("containers", [])]


def _image(rule: Manifest, image: str) -> str:
    """kustomize's `images` rule applied to `image` (newName, then newTag or digest)."""
    name, _, tag = image.partition(":")
    name = rule.get("newName", name)
    if "digest" in rule:
        return f"{name}@{rule['digest']}"
    tag = str(rule.get("newTag", tag))
    return f"{name}:{tag}" if tag else name


def find(objects: Sequence[Manifest], kind: str, name: str) -> Manifest:
    for obj in objects:
        if obj["kind"] == kind and obj["metadata"]["name"] == name:
            return obj
    raise ManifestError(f"no {kind} {name!r} among the manifests")


@dataclass(frozen=True)
class Pod:
    """One pod of a workload, as the cluster would make it."""

    name: str
    ip: str
    namespace: str = "default"
    annotations: Mapping[str, str] = field(default_factory=dict)
    labels: Mapping[str, str] = field(default_factory=dict)
    node_name: str = "node-0"
    extra_env: Mapping[str, str] = field(default_factory=dict)  # what a controller injects


def statefulset_pod(sts: Manifest, ordinal: int, ip: str) -> Pod:
    template = sts["spec"]["template"]["metadata"]
    name = f"{sts['metadata']['name']}-{ordinal}"
    labels = {
        **template.get("labels", {}),
        "statefulset.kubernetes.io/pod-name": name,
        "apps.kubernetes.io/pod-index": str(ordinal),
    }
    return Pod(name, ip, annotations=dict(template.get("annotations", {})), labels=labels)


def indexed_job_pod(job: Manifest, index: int, ip: str, attempt: int = 0) -> Pod:
    """Pod `index` of an Indexed Job; `attempt` numbers its replacements (a new pod each)."""
    spec = job["spec"]
    if spec.get("completionMode") != "Indexed":
        raise ManifestError(f"Job {job['metadata']['name']!r} is not an Indexed Job")
    template = spec["template"]["metadata"]
    annotations = {**template.get("annotations", {}), INDEX_ANNOTATION: str(index)}
    labels = {**template.get("labels", {}), INDEX_ANNOTATION: str(index)}
    name = f"{job['metadata']['name']}-{index}-a{attempt}"
    return Pod(name, ip, annotations=annotations, labels=labels,
               extra_env={"JOB_COMPLETION_INDEX": str(index)})  # fmt: skip


@dataclass(frozen=True)
class LocalFile:
    path: Path
    content: bytes
    mode: int


FS_GROUP_CHANGE_POLICIES = ("Always", "OnRootMismatch")


@dataclass(frozen=True)
class Ownership:
    """The pod's `securityContext.fsGroup` (None: not set) and `fsGroupChangePolicy`
    (Kubernetes' default, `Always`, when the manifest says nothing)."""

    fs_group: int | None = None
    change_policy: str = "Always"


@dataclass(frozen=True)
class LocalProcess:
    """A container as a process of this machine: run `argv` in `cwd` with exactly `env`, after
    writing `files` and making `directories`; `claims` (among them) are mounted with
    `ownership`."""

    argv: tuple[str, ...]
    env: dict[str, str]
    cwd: Path
    files: tuple[LocalFile, ...]
    directories: tuple[Path, ...]
    claims: tuple[Path, ...] = ()
    ownership: Ownership = Ownership()


@dataclass(frozen=True)
class Cluster:
    """What the manifests refer to but do not hold, and where the pods' files go here.

    `secrets`: each Secret's keys and bytes (made by `kubectl create secret` in real life);
    `image`: the image's directories mapped to this machine's (its WORKDIR among them);
    `image_env`: the image's own environment (its ENV and a PATH where `python` and
    `mscluster` are this machine's); `root`: where volumes live."""

    objects: Sequence[Manifest]
    secrets: Mapping[str, Mapping[str, bytes]]
    image: Mapping[str, Path]
    image_env: Mapping[str, str]
    workdir: str
    root: Path


def render(cluster: Cluster, template: Manifest, pod: Pod, container: str) -> LocalProcess:
    """Container `container` of the pod template `template` in `pod`, as a local process."""
    spec = template["spec"]
    (box,) = [c for c in spec["containers"] if c["name"] == container] or [None]
    if box is None:
        raise ManifestError(f"no container {container!r} in the pod template")
    volumes, files, directories = _volumes(cluster, spec.get("volumes", []), pod)
    claims = {volumes[v["name"]] for v in spec.get("volumes", []) if "persistentVolumeClaim" in v}
    mounts = {
        m["mountPath"]: volumes[m["name"]] / m.get("subPath", "")
        for m in box.get("volumeMounts", [])
    }
    rewrite = _rewriter({**cluster.image, **mounts})
    env = _environment(cluster, box, pod)
    expanded = {k: rewrite(v) for k, v in env.items()}
    argv = [_expand(part, env) for part in [*box.get("command", []), *box.get("args", [])]]
    return LocalProcess(
        argv=tuple(rewrite(part) for part in argv),
        env={**cluster.image_env, **expanded},
        cwd=Path(rewrite(box.get("workingDir", cluster.workdir))),
        files=tuple(files),
        directories=tuple(directories),
        claims=tuple(d for d in directories if d in claims),
        ownership=ownership(spec),
    )


def ownership(spec: Manifest) -> Ownership:
    """The pod spec's fsGroup and fsGroupChangePolicy (the API server's default filled in)."""
    context = spec.get("securityContext", {})
    policy = context.get("fsGroupChangePolicy", "Always")
    if policy not in FS_GROUP_CHANGE_POLICIES:
        raise ManifestError(f"fsGroupChangePolicy {policy!r} is not one of Kubernetes'")
    fs_group = context.get("fsGroup")
    return Ownership(None if fs_group is None else int(fs_group), policy)


def _environment(cluster: Cluster, box: Manifest, pod: Pod) -> dict[str, str]:
    env: dict[str, str] = dict(pod.extra_env)
    for source in box.get("envFrom", []):
        if "configMapRef" not in source:
            raise ManifestError(f"envFrom {source} is not read here")
        data = find(cluster.objects, "ConfigMap", source["configMapRef"]["name"])["data"]
        env.update({source.get("prefix", "") + k: str(v) for k, v in data.items()})
    for var in box.get("env", []):
        if "value" in var:
            env[var["name"]] = _expand(str(var["value"]), env)
        elif "fieldRef" in var.get("valueFrom", {}):
            env[var["name"]] = downward(pod, var["valueFrom"]["fieldRef"]["fieldPath"])
        else:
            raise ManifestError(f"env {var['name']!r}: {var.get('valueFrom')} is not read here")
    return env


def downward(pod: Pod, path: str) -> str:
    """The Downward API's value of `fieldPath` for `pod`."""
    simple = {
        "metadata.name": pod.name,
        "metadata.namespace": pod.namespace,
        "status.podIP": pod.ip,
        "status.podIPs": pod.ip,
        "spec.nodeName": pod.node_name,
    }
    if path in simple:
        return simple[path]
    match = _FIELD.match(path)
    if match is None:
        raise ManifestError(f"fieldRef {path!r} is not read here")
    where = pod.annotations if match[1] == "annotations" else pod.labels
    return where.get(match[2], "")


def _expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' `$(VAR)`: a defined variable's value; `$$` is `$`; anything else as it is."""

    def one(match: re.Match[str]) -> str:
        if match[0] == "$$":
            return "$"
        return env.get(match[1], match[0])

    return _REF.sub(one, text)


def _rewriter(mapping: Mapping[str, Path]) -> Any:
    prefixes = sorted(mapping, key=lambda p: len(PurePosixPath(p).parts), reverse=True)

    def rewrite(value: str) -> str:
        for prefix in prefixes:
            if value == prefix or value.startswith(prefix.rstrip("/") + "/"):
                return str(mapping[prefix]) + value[len(prefix.rstrip("/")) :]
        return value

    return rewrite


def _volumes(
    cluster: Cluster, volumes: Sequence[Manifest], pod: Pod
) -> tuple[dict[str, Path], list[LocalFile], list[Path]]:
    where: dict[str, Path] = {}
    files: list[LocalFile] = []
    directories: list[Path] = []
    for volume in volumes:
        name = volume["name"]
        if "persistentVolumeClaim" in volume:
            where[name] = cluster.root / "claims" / volume["persistentVolumeClaim"]["claimName"]
        elif "emptyDir" in volume:
            where[name] = cluster.root / "pods" / pod.name / "empty" / name
        elif "secret" in volume or "configMap" in volume:
            where[name] = cluster.root / "pods" / pod.name / "volumes" / name
            files.extend(_projected(cluster, volume, where[name]))
        else:
            raise ManifestError(f"volume {name!r} of a kind not read here: {sorted(volume)}")
        directories.append(where[name])
    return where, files, directories


def _projected(cluster: Cluster, volume: Manifest, directory: Path) -> list[LocalFile]:
    if "secret" in volume:
        source = volume["secret"]
        data = cluster.secrets.get(source["secretName"])
    else:
        source = volume["configMap"]
        found = [
            o
            for o in cluster.objects
            if o["kind"] == "ConfigMap" and o["metadata"]["name"] == source["name"]
        ]
        data = {k: str(v).encode() for k, v in found[0]["data"].items()} if found else None
    if data is None:
        if source.get("optional"):
            return []
        raise ManifestError(f"volume {volume['name']!r}: its {sorted(volume)[0]} does not exist")
    mode = int(source.get("defaultMode", 0o644))
    items = source.get("items") or [{"key": key, "path": key} for key in data]
    return [LocalFile(directory / item["path"], data[item["key"]], mode) for item in items]


def pod_template(workload: Manifest, pod: Pod) -> Manifest:
    """The pod template of a workload for `pod`: a StatefulSet's claim templates become the
    claims its controller makes for that pod (`state-cluster-scheduler-0`)."""
    template = dict(workload["spec"]["template"])
    spec = dict(template["spec"])
    claims = [
        {
            "name": claim["metadata"]["name"],
            "persistentVolumeClaim": {"claimName": f"{claim['metadata']['name']}-{pod.name}"},
        }
        for claim in workload["spec"].get("volumeClaimTemplates", [])
    ]
    spec["volumes"] = [*spec.get("volumes", []), *claims]
    template["spec"] = spec
    return template


def dns_names(objects: Sequence[Manifest], pod: Pod, sts: Manifest) -> list[str]:
    """The names cluster DNS gives a StatefulSet pod through its headless Service: the pod's own
    (`cluster-scheduler-0.cluster-scheduler`) and the Service's, short and in full."""
    service = find(objects, "Service", sts["spec"]["serviceName"])
    if service["spec"].get("clusterIP") != "None":
        raise ManifestError(f"Service {service['metadata']['name']!r} is not headless")
    name = service["metadata"]["name"]
    full = f"{name}.{pod.namespace}.svc.cluster.local"
    return [f"{pod.name}.{name}", f"{pod.name}.{full}", name, full]
