"""deploy/kubernetes: every manifest is valid Kubernetes, and its containers, run exactly as the
manifests say (tests/kube.py, tests/kube_local.py), form a job that survives a killed worker
pod's process and finishes."""

from __future__ import annotations

import json
import os
import secrets
import signal
import stat
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import pytest
import yaml
from kubernetes_validate import utils as kubernetes_validate

from cluster.protocol.config import RecoveryConfig
from cluster.protocol.errors import ConfigError
from cluster.storage.recovery_dir import check_recovery_path
from cluster.testing import Process, free_port, wait_until
from cluster.transport import certs
from tests import kube
from tests.kube_local import (
    LocalCluster,
    image_env,
    local_cluster,
    mount_claim,
    why_not_available,
)
from tests.procs import PYTHON, ROOT, Procs

DEPLOY = ROOT / "deploy" / "kubernetes"
MANIFESTS = sorted(p for p in DEPLOY.rglob("*.yaml") if p.name != "kustomization.yaml")
# The newest schema kubernetes-validate ships (it validates offline, from its own copies).
KUBERNETES = kubernetes_validate.latest_version()
JOB_S = 90


def test_the_schema_is_of_a_current_release() -> None:
    major, minor = (int(part) for part in KUBERNETES.split(".")[:2])
    assert (major, minor) >= (1, 33)  # backoffLimitPerIndex is GA from 1.33


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_manifest_validates_against_the_kubernetes_schema(path: Path) -> None:
    documents = [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    assert documents
    for doc in documents:
        # strict: a misspelt or misplaced field is an error, not silently dropped
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)


@pytest.mark.parametrize("variant", ["directory", "etcd"])
def test_every_variant_is_what_the_readme_says(variant: str) -> None:
    objects = kube.load_kustomization(DEPLOY / variant)
    config = kube.find(objects, "ConfigMap", "cluster-job")["data"]
    workers = kube.find(objects, "Job", "cluster-workers")["spec"]
    sts = kube.find(objects, "StatefulSet", "cluster-scheduler")
    assert workers["completions"] == workers["parallelism"] == int(config["MS_WORKER_NUM"])
    assert workers["completionMode"] == "Indexed"
    assert workers["template"]["spec"]["restartPolicy"] == "Never"
    assert workers["backoffLimitPerIndex"] >= 1
    hosts = config["MS_SCHED_HOST"].split(",")
    assert len(hosts) == sts["spec"]["replicas"]
    for ordinal, host in enumerate(hosts):
        pod = kube.statefulset_pod(sts, ordinal, "10.0.0.1")
        assert host in kube.dns_names(objects, pod, sts)
    template = sts["spec"]["template"]
    (box,) = template["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in box["ports"]}
    assert ports["grpc"] == int(config["MS_SCHED_PORT"])
    # TCP probes: the port speaks mutual TLS, which the kubelet's gRPC probe cannot.
    assert box["livenessProbe"]["tcpSocket"]["port"] == ports["grpc"]
    assert box["readinessProbe"]["tcpSocket"]["port"] == ports["grpc"]
    annotations = template["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    metrics = [e["value"] for e in box["env"] if e["name"] == "CLUSTER_METRICS_PORT"]
    assert int(annotations["prometheus.io/port"]) == ports["metrics"] == int(metrics[0])
    if variant == "etcd":
        assert config["CLUSTER_STATE_URL"].startswith("etcd://")
    else:
        assert sts["spec"]["replicas"] == 1
        assert sts["spec"]["volumeClaimTemplates"]


def test_a_failed_worker_pod_is_replaced_alone_with_its_index() -> None:
    objects = kube.load_kustomization(DEPLOY / "base")
    spec = kube.find(objects, "Job", "cluster-workers")["spec"]
    assert spec["podReplacementPolicy"] == "Failed"  # never two processes of one rank
    assert spec["maxFailedIndexes"] == 0  # an index out of retries ends the whole Job
    assert "backoffLimit" not in spec  # retries per index, not shared by all
    (ignore,) = [r for r in spec["podFailurePolicy"]["rules"] if r["action"] == "Ignore"]
    assert ignore["onPodConditions"] == [{"type": "DisruptionTarget"}]
    (box,) = spec["template"]["spec"]["containers"]
    env = {e["name"]: e for e in box["env"]}
    index = f"metadata.annotations['{kube.INDEX_ANNOTATION}']"
    assert env["MS_NODE_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == index


@pytest.mark.parametrize("variant", ["directory", "etcd"])
def test_the_spares_run_the_workers_container_as_spares(variant: str) -> None:
    objects = kube.load_kustomization(DEPLOY / variant)
    workers = kube.find(objects, "Job", "cluster-workers")["spec"]
    spares = kube.find(objects, "Job", "cluster-spares")["spec"]
    (worker,) = workers["template"]["spec"]["containers"]
    (spare,) = spares["template"]["spec"]["containers"]
    # The same program on the same files: a spare that takes a rank trains as its worker did.
    for key in ("image", "command", "args", "envFrom", "volumeMounts", "resources"):
        assert spare[key] == worker[key], key
    assert spares["template"]["spec"]["volumes"] == workers["template"]["spec"]["volumes"]
    env = {e["name"]: e for e in spare["env"]}
    assert env["CLUSTER_SPARE"]["value"] == "1"
    index = f"metadata.annotations['{kube.INDEX_ANNOTATION}']"
    assert env["SPARE_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"] == index
    assert env["MS_NODE_ID"]["value"] == "spare-$(SPARE_INDEX)"  # never a worker's index
    assert spares["completionMode"] == "Indexed"
    assert spares["completions"] == spares["parallelism"] >= 1
    assert spares["podReplacementPolicy"] == "Failed"


@pytest.fixture
def network_or_skip() -> None:
    why = why_not_available()
    if why:
        pytest.skip(why)


def job_secrets(objects: list[kube.Manifest], tmp_path: Path) -> dict[str, dict[str, bytes]]:
    """What the README's `kubectl create secret` commands make: the job secret, and the
    certificates of `mscluster certs` for the schedulers' Service names (TLS is on)."""
    hosts = kube.find(objects, "ConfigMap", "cluster-job")["data"]["MS_SCHED_HOST"].split(",")
    made = tmp_path / "tls"
    certs.make_pki(made, hosts=hosts)
    return {
        "cluster-job-secret": {"job.secret": secrets.token_hex(32).encode()},
        "cluster-tls": {f.name: f.read_bytes() for f in made.iterdir()},
    }


def start_schedulers(local: LocalCluster) -> tuple[kube.Manifest, list[Process], list[kube.Pod]]:
    sts = kube.find(local.objects, "StatefulSet", "cluster-scheduler")
    pods = [kube.statefulset_pod(sts, i, local.address()) for i in range(sts["spec"]["replicas"])]
    local.name_pods(sts, pods)
    return sts, [local.start(sts, pod, "scheduler") for pod in pods], pods


def wait_serving(local: LocalCluster, pod: kube.Pod, port: int) -> None:
    """The manifests' tcpSocket probe (the port speaks mutual TLS): a connection to the pod's
    IP is accepted, within a bound."""
    probe = (
        "import socket, sys, time\n"
        "end = time.monotonic() + 30\n"
        "while True:\n"
        "    try:\n"
        "        socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2).close()\n"
        "        break\n"
        "    except OSError:\n"
        "        if time.monotonic() > end:\n"
        "            raise\n"
        "        time.sleep(0.1)  # sleep-ok: a bounded poll inside the pod\n"
        "print('listening')\n"
    )
    done = local.run(["python", "-c", probe, pod.ip, str(port)], timeout_s=60)
    assert done.stdout.strip() == "listening", done.stdout + done.stderr


def wait_epoch(proc: Process, epoch: int, job: list[Process]) -> None:
    """Until `proc` has begun training epoch `epoch` (16 steps each); a process of the job
    that ends first is a failure at once, with its output."""

    def reached() -> bool:
        for other in job:
            assert other.popen.poll() is None, f"{other.name} ended:\n{other.output[-3000:]}"
        return f"epoch: {epoch} step: 1," in proc.output

    wait_until(reached, JOB_S, f"{proc.name} in epoch {epoch}")


def status(local: LocalCluster, pod: kube.Pod) -> dict[str, Any]:
    """`mscluster status --json` as `kubectl exec` into the scheduler's pod would run it, by the
    pod's Service name (the name its certificate carries), with the pod's TLS config and job
    secret (the container's environment has CLUSTER_JOB_SECRET_FILE)."""
    name = f"{pod.name}.cluster-scheduler"
    volumes = local.root / "pods" / pod.name / "volumes"
    tls = volumes / "tls" / "ssl.json"
    argv = ["env", f"CLUSTER_JOB_SECRET_FILE={volumes / 'job-secret' / 'job.secret'}"]
    argv += ["mscluster", "status", "--addr", f"{name}:8118", "--json", "--tls-config", str(tls)]
    done = local.run(argv, 60)
    assert done.returncode == 0, done.stdout + done.stderr
    return cast("dict[str, Any]", json.loads(done.stdout))


def start_workers(local: LocalCluster) -> tuple[kube.Manifest, list[Process]]:
    job = kube.find(local.objects, "Job", "cluster-workers")
    count = job["spec"]["completions"]
    pods = [kube.indexed_job_pod(job, i, local.address()) for i in range(count)]
    return job, [local.start(job, pod, "worker") for pod in pods]


@dataclass
class DirectoryJob:
    """The directory variant as local processes: its scheduler pod serving, its worker pods
    started (the spares Job's are not: `start_spare`)."""

    local: LocalCluster
    sts: kube.Manifest
    scheduler: Process
    scheduler_pod: kube.Pod
    job: kube.Manifest
    workers: list[Process]

    def all_exit_0(self, *others: Process) -> None:
        for proc in [*self.workers, *others, self.scheduler]:
            assert proc.wait(JOB_S) == 0, proc.output[-3000:]


@contextmanager
def directory_job(tmp_path: Path, processes: Procs) -> Iterator[DirectoryJob]:
    objects = kube.load_kustomization(DEPLOY / "directory")
    with local_cluster(
        objects, job_secrets(objects, tmp_path), tmp_path / "k8s", processes
    ) as local:
        sts, (scheduler,), (scheduler_pod,) = start_schedulers(local)
        wait_serving(local, scheduler_pod, 8118)
        job, workers = start_workers(local)
        yield DirectoryJob(local, sts, scheduler, scheduler_pod, job, workers)


@pytest.mark.timeout(300)
def test_directory_variant_forms_survives_a_killed_worker_pod_and_finishes(
    network_or_skip: None, tmp_path: Path, processes: Procs
) -> None:
    # The spares Job scaled to 0 (its pods are not started): the job waits for the replacement.
    with directory_job(tmp_path, processes) as run:
        local, job, workers, scheduler_pod = run.local, run.job, run.workers, run.scheduler_pod
        # Mid-run (checkpoints every 10 steps), pod 2's process is killed; as its pod failure
        # policy has the Job controller do, a new pod of index 2 starts once it has ended.
        wait_epoch(workers[2], 3, [run.scheduler, *workers])
        workers[2].popen.send_signal(signal.SIGKILL)
        assert workers[2].wait(30) == -signal.SIGKILL
        replacement = kube.indexed_job_pod(job, 2, local.address(), attempt=1)
        workers[2] = local.start(job, replacement, "worker")
        wait_until(lambda: status(local, scheduler_pod)["generation"] == 2, JOB_S, "generation 2")
        run.all_exit_0()
    events = finished_as_without_the_kill(tmp_path, job, scheduler_pod)
    kinds = [event["event"] for event in events]
    assert kinds.count("failed") == 1, kinds
    assert kinds.count("rejoined") == 1, kinds
    assert kinds[-1] == "finished"
    generations = [e["generation"] for e in events if e["event"] == "generation"]
    assert generations == [2], events


@pytest.mark.timeout(300)
def test_directory_variant_resumes_in_the_scheduler_pod_made_again_on_its_claim(
    network_or_skip: None, tmp_path: Path, processes: Procs
) -> None:
    # `kubectl delete pod cluster-scheduler-0` mid-run (as a drain, an eviction, a rollout): the
    # kubelet's SIGTERM, then the StatefulSet's new pod of that name, which mounts the same
    # claim (the kubelet's fsGroup walk included, tests/kube_local.py) and resumes the job while
    # the workers train on. Every process exits 0 and the result is that of the job without it.
    with directory_job(tmp_path, processes) as run:
        stopped = run.scheduler
        wait_epoch(run.workers[0], 3, [stopped, *run.workers])
        stopped.popen.send_signal(signal.SIGTERM)
        grace_s = run.sts["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert stopped.wait(grace_s) == 0, stopped.output[-3000:]
        assert "the job is left to resume (scheduler stopped by SIGTERM)" in stopped.output
        run.scheduler = again = run.local.start(run.sts, run.scheduler_pod, "scheduler")
        wait_until(
            lambda: "resuming job" in again.output or again.popen.poll() is not None,
            JOB_S,
            "the new scheduler resuming the job (or refusing its claim)",
        )
        assert "resuming job" in again.output, again.output[-3000:]
        run.all_exit_0()
    events = finished_as_without_the_kill(tmp_path, run.job, run.scheduler_pod)
    kinds = [event["event"] for event in events]
    assert "failed" not in kinds, kinds
    assert kinds[-1] == "finished"


def start_spare(local: LocalCluster, index: int = 0) -> Process:
    job = kube.find(local.objects, "Job", "cluster-spares")
    return local.start(job, kube.indexed_job_pod(job, index, local.address()), "worker")


def node(local: LocalCluster, pod: kube.Pod, node_id: str) -> dict[str, Any] | None:
    nodes = status(local, pod)["nodes"]
    return next((n for n in nodes if n["node_id"] == node_id), None)


@pytest.mark.timeout(300)
def test_directory_variant_with_its_spare_replaces_a_killed_worker_pod_at_once(
    network_or_skip: None, tmp_path: Path, processes: Procs
) -> None:
    # The whole kustomization: scheduler, 4 worker pods and the spare pod. Worker pod 2's process
    # is killed: the spare takes rank 2 at once (no MS_NODE_TIMEOUT wait); the Job's new pod of
    # index 2 waits out its guard and comes back as a spare; every process exits 0.
    with directory_job(tmp_path, processes) as run:
        local, job, workers, scheduler_pod = run.local, run.job, run.workers, run.scheduler_pod
        spare = start_spare(local)
        every = [run.scheduler, spare, *workers]
        wait_epoch(workers[2], 3, every)
        waiting = node(local, scheduler_pod, "spare-0")
        assert waiting is not None
        assert (waiting["spare"], waiting["rank"]) == (True, None), waiting
        workers[2].popen.send_signal(signal.SIGKILL)
        assert workers[2].wait(30) == -signal.SIGKILL
        wait_until(lambda: status(local, scheduler_pod)["generation"] == 2, JOB_S, "generation 2")
        promoted = node(local, scheduler_pod, "spare-0")
        assert promoted is not None
        assert (promoted["spare"], promoted["rank"]) == (False, 2), promoted
        replacement = kube.indexed_job_pod(job, 2, local.address(), attempt=1)
        workers[2] = local.start(job, replacement, "worker")
        run.all_exit_0(spare)
    events = finished_as_without_the_kill(tmp_path, job, scheduler_pod)
    kinds = [event["event"] for event in events]
    assert kinds.count("failed") == 1, kinds
    assert kinds.count("promoted") == 1, kinds
    assert kinds[-1] == "finished"


def test_tls_is_on_by_default_and_every_pod_needs_its_secret() -> None:
    for variant in ("directory", "etcd"):
        objects = kube.load_kustomization(DEPLOY / variant)
        config = kube.find(objects, "ConfigMap", "cluster-job")["data"]
        assert config["CLUSTER_TLS_CONFIG"] == "/etc/cluster/tls/ssl.json"
        for obj in objects:
            spec = obj.get("spec", {}).get("template", {}).get("spec", {})
            for volume in spec.get("volumes", []):
                if "secret" in volume:
                    assert not volume["secret"].get("optional"), (obj["metadata"], volume)


def test_every_pod_is_closed_by_default() -> None:
    """No service-account token, seccomp, non-root, a read-only root with writable volumes
    only where needed, no capability, limits on every container."""
    objects = kube.load_kustomization(DEPLOY / "etcd") + kube.load_kustomization(DEPLOY / "base")
    for obj in objects:
        spec = obj.get("spec", {}).get("template", {}).get("spec")
        if spec is None:
            continue
        assert spec["automountServiceAccountToken"] is False
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert spec["securityContext"]["runAsNonRoot"] is True
        for box in kube.containers(obj):
            context = box["securityContext"]
            assert context["readOnlyRootFilesystem"] is True
            assert context["allowPrivilegeEscalation"] is False
            assert context["capabilities"] == {"drop": ["ALL"]}
            assert {"cpu", "memory"} <= set(box["resources"]["limits"])
            assert {"cpu", "memory"} <= set(box["resources"]["requests"])


def test_every_claim_keeps_the_modes_the_job_gave_it_from_pod_to_pod() -> None:
    """fsGroup without `fsGroupChangePolicy: OnRootMismatch` has the kubelet give the group
    write access to every directory of a claim at every mount: the next pod's scheduler or
    worker refuses its own MS_RECOVERY_PATH."""
    objects = kube.load_kustomization(DEPLOY / "etcd") + kube.load_kustomization(
        DEPLOY / "directory"
    )
    for obj in objects:
        spec = obj.get("spec", {}).get("template", {}).get("spec")
        if spec is None:
            continue
        ownership = kube.ownership(spec)
        assert ownership.fs_group is not None, obj["metadata"]
        assert ownership.change_policy == "OnRootMismatch", obj["metadata"]


@pytest.mark.parametrize("policy", ["Always", "OnRootMismatch"])
def test_a_claim_made_again_keeps_the_recovery_path_the_job_made_with_on_root_mismatch(
    tmp_path: Path, policy: str
) -> None:
    """tests/kube_local.py's kubelet: the recovery directory a first pod made on a claim is
    refused in the next pod after the walk of `Always`, and kept as it was with
    `OnRootMismatch`, whose claim (2775, the fsGroup's) the recovery-path check accepts."""
    if os.geteuid() != 0:
        pytest.skip("giving files to the group 10001 (the kubelet's fsGroup) needs root")
    claim = tmp_path / "claims" / "state-cluster-scheduler-0"
    claim.mkdir(parents=True)
    ownership = kube.Ownership(10001, policy)
    mount_claim(claim, ownership)  # the first pod: a new volume is walked either way
    assert (stat.S_IMODE(claim.stat().st_mode), claim.stat().st_gid) == (0o2775, 10001)
    recovery = RecoveryConfig(claim / "state")
    check_recovery_path(recovery)  # the first scheduler makes it, 0700
    (recovery.path / "scheduler.json").write_text("{}")
    mount_claim(claim, ownership)  # the StatefulSet's next pod, on the same claim
    if policy == "Always":
        assert stat.S_IMODE(recovery.path.stat().st_mode) == 0o2770
        with pytest.raises(ConfigError, match=r"can be written by users other than its owner"):
            check_recovery_path(recovery)
    else:
        assert stat.S_IMODE(recovery.path.stat().st_mode) & 0o777 == 0o700
        check_recovery_path(recovery)


def finished_as_without_the_kill(
    tmp_path: Path, job: kube.Manifest, scheduler_pod: kube.Pod
) -> list[dict[str, Any]]:
    """The trained parameters on the claim `cluster-shared` are those of the same training
    without the kill; the scheduler's event journal, from its claim."""
    shared = tmp_path / "k8s" / "claims" / "cluster-shared"
    assert (shared / "out" / "final.sha256").read_text() == fault_free_hash(tmp_path, job)
    state = tmp_path / "k8s" / "claims" / f"state-{scheduler_pod.name}"
    return [json.loads(line) for line in (state / "events.jsonl").read_text().splitlines()]


def fault_free_hash(tmp_path: Path, job: kube.Manifest) -> str:
    """The result of the workers' training without the kill (mscluster run on this host, the
    same arguments but the per-step sleep, which changes nothing computed)."""
    (box,) = job["spec"]["template"]["spec"]["containers"]
    args = list(box["args"])
    args[args.index("--out") + 1] = str(tmp_path / "fault-free")
    delay = args.index("--step-delay")
    del args[delay : delay + 2]
    run = [PYTHON, "-m", "cluster", "run", "--worker-num", "4", "--local-worker-num", "4"]
    run += ["--master-port", str(free_port()), "--log-dir", str(tmp_path / "fault-free-logs")]
    done = subprocess.run(
        [*run, str(ROOT / "examples" / "train_mlp.py"), *args],
        capture_output=True,
        text=True,
        timeout=JOB_S,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return (tmp_path / "fault-free" / "final.sha256").read_text()


def scheduler_has_state_url() -> bool:
    done = subprocess.run(
        ["mscluster", "scheduler", "--help"],
        env=image_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    # The workers must also know every scheduler address (MS_SCHED_HOST=h1,h2 or
    # CLUSTER_SCHED_ADDRS; issue #14's second phase): until then the pods cannot follow a leader.
    config = (ROOT / "cluster" / "protocol" / "config.py").read_text()
    return "--state-url" in done.stdout and "CLUSTER_SCHED_ADDRS" in config


@pytest.mark.timeout(300)
def test_etcd_variant_survives_the_leader_pod(
    network_or_skip: None, tmp_path: Path, processes: Procs, request: pytest.FixtureRequest
) -> None:
    if not scheduler_has_state_url():
        pytest.skip(
            "standby schedulers on etcd (`mscluster scheduler --state-url`, CLUSTER_STATE_URL, "
            "MS_SCHED_HOST=h1,h2; issue #14, branch ha) are not on this branch yet"
        )
    # Your etcd with authentication on, and its user for the job: the fixture's.
    etcd = request.getfixturevalue("etcd_auth_cluster")
    objects = kube.load_kustomization(DEPLOY / "etcd")
    config = kube.find(objects, "ConfigMap", "cluster-job")
    config["data"]["CLUSTER_STATE_URL"] = etcd.state_url()
    config["data"]["CLUSTER_ETCD_USER"] = etcd.user
    found = job_secrets(objects, tmp_path)
    found["cluster-etcd-login"] = {"password": etcd.password.encode()}
    # On this host's network, to reach the etcd fixture; each pod on an address of its own.
    with local_cluster(objects, found, tmp_path / "k8s", processes, private_network=False) as local:
        _, schedulers, scheduler_pods = start_schedulers(local)
        _, workers = start_workers(local)
        wait_epoch(workers[0], 3, [*schedulers, *workers])
        # The leader is the one that formed the job (a standby only waits).
        leader = next(i for i, p in enumerate(schedulers) if "topology ready" in p.output)
        schedulers[leader].popen.send_signal(signal.SIGKILL)
        assert schedulers[leader].wait(30) == -signal.SIGKILL
        # The StatefulSet's pod comes back (same name, same address): a standby now.
        schedulers[leader] = local.start(
            kube.find(objects, "StatefulSet", "cluster-scheduler"),
            scheduler_pods[leader],
            "scheduler",
        )
        for proc in workers:
            assert proc.wait(JOB_S) == 0, proc.output[-3000:]
