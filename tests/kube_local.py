"""The pods of deploy/kubernetes as local processes (tests/kube.py renders them; this runs them).

Each pod gets an address of its own on a loopback network private to the test (a network
namespace, so the manifests' fixed ports 8118 and 9464 are free whatever else runs here) and
the cluster's DNS names of its headless Service through that namespace's /etc/hosts
(`ip netns exec` binds /etc/netns/NAME/hosts over it). Needs root and iproute2;
`why_not_available` says why not otherwise. The namespace, its hosts file and every process
are always removed. Each claim is mounted as the kubelet mounts it (`mount_claim`): with the
pod's fsGroup, the kubelet's walk over its files, on every start of a pod that mounts it unless
the manifest says `fsGroupChangePolicy: OnRootMismatch`.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

from cluster.testing import Process
from tests import kube
from tests.netns import why_not_available
from tests.procs import ROOT, Procs

__all__ = ["LocalCluster", "local_cluster", "mount_claim", "why_not_available"]

IMAGE_ROOT = "/opt/cluster"  # deploy/kubernetes/Dockerfile: COPY . /opt/cluster
# What the kubelet adds to each entry of a volume it gives to fsGroup (pkg/volume/
# volume_linux.go: rwMask, execMask and os.ModeSetgid): group rw, and to a directory group x
# and setgid.
GROUP_RW = 0o660
GROUP_DIRECTORY = 0o110 | stat.S_ISGID


def mount_claim(root: Path, ownership: kube.Ownership) -> None:
    """What the kubelet does to a claim's files as it mounts it in a pod whose securityContext
    sets fsGroup (`SetVolumeOwnership` in pkg/volume/volume_linux.go). With `Always` (also what
    a manifest that says nothing gets), on every mount: every entry's group becomes fsGroup with
    read and write, and every directory's also execute and setgid (links: their group only), so
    that a directory a program made 0700 is 2770 in the next pod. With `OnRootMismatch`, only
    while the volume's root is not yet so (its group fsGroup, rwx for it, setgid): on its first
    mount. Done to every claim, as a CSI driver with `fsGroupPolicy: File` does (the default,
    `ReadWriteOnceWithFSType`, does it to a block-backed ReadWriteOnce claim such as the
    scheduler's state, not to an NFS ReadWriteMany one)."""
    group = ownership.fs_group
    if group is None:
        return
    if ownership.change_policy == "OnRootMismatch" and not _root_mismatch(root, group):
        return
    for path in _entries(root):
        os.lchown(path, -1, group)
        mode = path.lstat().st_mode
        if stat.S_ISLNK(mode):
            continue  # chmod would change what the link points to
        added = GROUP_RW | (GROUP_DIRECTORY if stat.S_ISDIR(mode) else 0)
        path.chmod(stat.S_IMODE(mode) | added)


def _root_mismatch(root: Path, group: int) -> bool:
    """The kubelet's `requiresPermissionChange`: the root is not fsGroup's, rwx and setgid."""
    st = root.stat()
    wanted = GROUP_RW | 0o110
    return (
        st.st_gid != group
        or not stat.S_ISDIR(st.st_mode)
        or st.st_mode & wanted != wanted
        or not st.st_mode & stat.S_ISGID
    )


def _entries(root: Path) -> Iterator[Path]:
    """`root` and everything under it, links not followed."""
    yield root
    for directory, directories, files in os.walk(root):
        for name in [*directories, *files]:
            yield Path(directory) / name


def image_env() -> dict[str, str]:
    """The image's environment: its ENV, and a PATH on which `python` and `mscluster` are this
    checkout's (PYTHONPATH too: the venv's editable install may be another checkout's)."""
    return {
        "PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin",
        "PYTHONPATH": str(ROOT),
        "PYTHONUNBUFFERED": "1",
    }


@dataclass
class LocalCluster:
    namespace: str
    objects: Sequence[kube.Manifest]
    secrets: Mapping[str, Mapping[str, bytes]]
    root: Path
    processes: Procs
    private_network: bool = True
    hosts: dict[str, str] = field(default_factory=dict)  # name -> address
    _next_ip: int = 10

    @property
    def cluster(self) -> kube.Cluster:
        return kube.Cluster(
            objects=self.objects,
            secrets=self.secrets,
            image={IMAGE_ROOT: ROOT},
            image_env=image_env(),
            workdir=IMAGE_ROOT,
            root=self.root,
        )

    def address(self) -> str:
        self._next_ip += 1
        return f"127.0.0.{self._next_ip}"

    @property
    def hosts_file(self) -> Path:
        if self.private_network:
            return Path("/etc/netns") / self.namespace / "hosts"
        return self.root / "hosts"

    def command(self, argv: Sequence[str]) -> list[str]:
        if self.private_network:
            return [shutil.which("ip") or "ip", "netns", "exec", self.namespace, *argv]
        # This host's network (to reach servers outside, e.g. the etcd fixture), with the
        # cluster's names: a mount namespace of its own with the hosts file bound over
        # /etc/hosts; exec all the way, so the process started is the container's.
        script = 'mount --bind "$0" /etc/hosts && exec "$@"'
        return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script,
                str(self.hosts_file), *argv]  # fmt: skip

    def name_pods(self, sts: kube.Manifest, pods: Sequence[kube.Pod]) -> None:
        """Cluster DNS for a StatefulSet's pods; set before any pod that dials them starts."""
        lines = ["127.0.0.1 localhost"]
        for pod in pods:
            for name in kube.dns_names(self.objects, pod, sts):
                self.hosts.setdefault(name, pod.ip)
        lines += [f"{ip} {name}" for name, ip in self.hosts.items()]
        self.hosts_file.parent.mkdir(parents=True, exist_ok=True)
        self.hosts_file.write_text("\n".join(lines) + "\n")

    def start(self, workload: kube.Manifest, pod: kube.Pod, container: str) -> Process:
        """The pod's container as a process: its files written, then run as rendered."""
        process = kube.render(self.cluster, kube.pod_template(workload, pod), pod, container)
        for directory in process.directories:
            directory.mkdir(parents=True, exist_ok=True)
        for claim in process.claims:
            mount_claim(claim, process.ownership)
        for item in process.files:
            item.path.write_bytes(item.content)
            item.path.chmod(item.mode)
        return self.processes.start(
            pod.name, self.command(process.argv), process.env, cwd=process.cwd
        )

    def run(self, argv: Sequence[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
        """A command in the pods' network (a probe, `mscluster status`), as the kubelet would."""
        return subprocess.run(
            self.command(argv),
            env={**os.environ, **image_env()},
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@contextmanager
def local_cluster(
    objects: Sequence[kube.Manifest],
    secrets: Mapping[str, Mapping[str, bytes]],
    root: Path,
    processes: Procs,
    private_network: bool = True,
) -> Iterator[LocalCluster]:
    """`private_network=False`: the pods on this host's loopback (addresses 127.0.0.11 on)."""
    namespace = f"cl-k8s-{os.getpid() % 100000}"
    etc = Path("/etc/netns") / namespace
    try:
        if private_network:
            _ip("netns", "add", namespace)
            _ip("-n", namespace, "link", "set", "lo", "up")
            etc.mkdir(parents=True, exist_ok=True)
        yield LocalCluster(namespace, objects, secrets, root, processes, private_network)
    finally:
        processes.kill_all()
        if private_network:
            subprocess.run(
                ["ip", "netns", "delete", namespace], capture_output=True, timeout=30, check=False
            )
            with suppress(OSError):
                shutil.rmtree(etc)
