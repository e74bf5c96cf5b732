"""tests/kube.py: a pod's container rendered as a local process, as the kubelet would run it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests import kube
from tests.procs import ROOT

DEPLOY = ROOT / "deploy" / "kubernetes"


def cluster(
    tmp_path: Path, objects: list[dict[str, Any]], **secrets: dict[str, bytes]
) -> kube.Cluster:
    return kube.Cluster(
        objects=objects,
        secrets=secrets,
        image={"/opt/app": tmp_path / "app"},
        image_env={"PATH": "/venv/bin:/usr/bin"},
        workdir="/opt/app",
        root=tmp_path / "k8s",
    )


def template(
    container: dict[str, Any], volumes: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    return {"metadata": {}, "spec": {"containers": [container], "volumes": volumes or []}}


CONFIG = {"kind": "ConfigMap", "metadata": {"name": "job"}, "data": {"A": "1", "HOST": "h"}}


def test_env_is_envfrom_then_env_with_references_to_earlier_variables(tmp_path: Path) -> None:
    box = {
        "name": "c",
        "command": ["python", "/opt/app/run.py"],
        "args": ["--host", "$(POD_IP)", "--literal", "$$(POD_IP)", "--unknown", "$(NOPE)"],
        "envFrom": [{"configMapRef": {"name": "job"}}],
        "env": [
            {"name": "A", "value": "2"},  # env wins over envFrom
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "WHERE", "value": "$(HOST):$(A)"},
            {"name": "EARLY", "value": "$(LATE)"},  # not defined yet: left as written
            {"name": "LATE", "value": "x"},
        ],
    }
    process = kube.render(
        cluster(tmp_path, [CONFIG]), template(box), kube.Pod("p-0", "127.0.0.7"), "c"
    )
    assert process.argv == (
        "python",
        str(tmp_path / "app" / "run.py"),
        "--host",
        "127.0.0.7",
        "--literal",
        "$(POD_IP)",
        "--unknown",
        "$(NOPE)",
    )
    assert process.env == {
        "PATH": "/venv/bin:/usr/bin",
        "A": "2",
        "HOST": "h",
        "POD_IP": "127.0.0.7",
        "WHERE": "h:2",
        "EARLY": "$(LATE)",
        "LATE": "x",
    }
    assert process.cwd == tmp_path / "app"


def test_indexed_job_pod_gives_its_index_through_the_downward_api(tmp_path: Path) -> None:
    job = {
        "kind": "Job",
        "metadata": {"name": "w"},
        "spec": {"completionMode": "Indexed", "template": {"metadata": {"labels": {"a": "b"}}}},
    }
    pod = kube.indexed_job_pod(job, 3, "127.0.0.9", attempt=1)
    path = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    assert kube.downward(pod, path) == "3"
    assert kube.downward(pod, "metadata.labels['a']") == "b"
    assert kube.downward(pod, "metadata.name") == pod.name == "w-3-a1"
    assert pod.extra_env == {"JOB_COMPLETION_INDEX": "3"}
    with pytest.raises(kube.ManifestError, match="not read here"):
        kube.downward(pod, "status.hostIPs")
    with pytest.raises(kube.ManifestError, match="not an Indexed Job"):
        kube.indexed_job_pod({**job, "spec": {"template": {}}}, 0, "127.0.0.9")


def test_mounts_are_rewritten_longest_prefix_first_and_secrets_become_files(tmp_path: Path) -> None:
    box = {
        "name": "c",
        "command": ["run"],
        "env": [
            {"name": "SECRET", "value": "/etc/app/secret/key"},
            {"name": "NESTED", "value": "/etc/app/secret-not/key"},
            {"name": "DATA", "value": "/data"},
        ],
        "volumeMounts": [
            {"name": "s", "mountPath": "/etc/app/secret"},
            {"name": "d", "mountPath": "/data"},
            {"name": "e", "mountPath": "/scratch"},
        ],
    }
    volumes = [
        {"name": "s", "secret": {"secretName": "sec", "defaultMode": 0o440}},
        {"name": "d", "persistentVolumeClaim": {"claimName": "shared"}},
        {"name": "e", "emptyDir": {}},
        {"name": "t", "secret": {"secretName": "absent", "optional": True}},
    ]
    process = kube.render(
        cluster(tmp_path, [], sec={"key": b"k"}),
        template(box, volumes),
        kube.Pod("p-1", "127.0.0.2"),
        "c",
    )
    secret_dir = tmp_path / "k8s" / "pods" / "p-1" / "volumes" / "s"
    assert process.env["SECRET"] == str(secret_dir / "key")
    assert process.env["NESTED"] == "/etc/app/secret-not/key"  # a prefix of a name, not a path
    assert process.env["DATA"] == str(tmp_path / "k8s" / "claims" / "shared")
    assert process.files == (kube.LocalFile(secret_dir / "key", b"k", 0o440),)
    assert tmp_path / "k8s" / "pods" / "p-1" / "empty" / "e" in process.directories


def test_a_missing_secret_that_is_not_optional_is_an_error(tmp_path: Path) -> None:
    box = {"name": "c", "command": ["run"], "volumeMounts": [{"name": "s", "mountPath": "/s"}]}
    volumes = [{"name": "s", "secret": {"secretName": "absent"}}]
    with pytest.raises(kube.ManifestError, match="does not exist"):
        kube.render(cluster(tmp_path, []), template(box, volumes), kube.Pod("p", "1.2.3.4"), "c")


def test_statefulset_pods_get_their_own_claims(tmp_path: Path) -> None:
    sts = {
        "kind": "StatefulSet",
        "metadata": {"name": "sched"},
        "spec": {
            "template": template(
                {"name": "c", "command": ["run", "/state"], "volumeMounts": [
                    {"name": "state", "mountPath": "/state"}
                ]}
            ),
            "volumeClaimTemplates": [{"metadata": {"name": "state"}}],
        },
    }  # fmt: skip
    pod = kube.statefulset_pod(sts, 1, "127.0.0.3")
    assert pod.name == "sched-1"
    assert pod.labels["apps.kubernetes.io/pod-index"] == "1"
    process = kube.render(cluster(tmp_path, []), kube.pod_template(sts, pod), pod, "c")
    assert process.argv == ("run", str(tmp_path / "k8s" / "claims" / "state-sched-1"))


def test_kustomizations_with_more_than_resources_are_refused(tmp_path: Path) -> None:
    (tmp_path / "kustomization.yaml").write_text("resources: [a.yaml]\npatches: []\n")
    with pytest.raises(kube.ManifestError, match="patches"):
        kube.load_kustomization(tmp_path)


def test_the_variants_load_with_their_base() -> None:
    for variant in ("directory", "etcd"):
        objects = kube.load_kustomization(DEPLOY / variant)
        kinds = sorted((o["kind"], o["metadata"]["name"]) for o in objects)
        assert kinds == [
            ("ConfigMap", "cluster-job"),
            ("Job", "cluster-spares"),
            ("Job", "cluster-workers"),
            ("NetworkPolicy", "cluster-default-deny"),
            ("NetworkPolicy", "cluster-scheduler"),
            ("NetworkPolicy", "cluster-workers"),
            ("PersistentVolumeClaim", "cluster-shared"),
            ("Service", "cluster-scheduler"),
            ("StatefulSet", "cluster-scheduler"),
        ]


def test_statefulset_pods_are_named_by_their_headless_service() -> None:
    objects = kube.load_kustomization(DEPLOY / "directory")
    sts = kube.find(objects, "StatefulSet", "cluster-scheduler")
    pod = kube.statefulset_pod(sts, 0, "127.0.0.10")
    names = kube.dns_names(objects, pod, sts)
    assert names[0] == "cluster-scheduler-0.cluster-scheduler"
    config = kube.find(objects, "ConfigMap", "cluster-job")
    assert config["data"]["MS_SCHED_HOST"] in names  # what the workers dial resolves


def test_kustomize_images_rename_the_image_as_kustomize_edit_set_image_does(
    tmp_path: Path,
) -> None:
    (tmp_path / "kustomization.yaml").write_text(
        f"resources: [{DEPLOY / 'directory'}]\n"
        "images:\n  - name: mscluster\n    newName: registry.example.com/ml/mscluster\n"
        "    newTag: '1.2'\n"
    )
    objects = kube.load_kustomization(tmp_path)
    images = {box["image"] for obj in objects for box in kube.containers(obj)}
    assert images == {"registry.example.com/ml/mscluster:1.2"}
