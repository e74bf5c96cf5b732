"""One real test per server, proving its fixture: the server starts, does its job, and is gone
after the test."""

from __future__ import annotations

import socket
from pathlib import Path

import aetcd
from prometheus_client import CollectorRegistry, Counter, start_http_server
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

from tests.servers.browser import save_screenshot
from tests.servers.etcd import EtcdCluster
from tests.servers.prometheus import Prometheus, value_is
from tests.servers.slurm import Slurm, scontrol_hostnames, short_hostname


async def _put_then_get(cluster: EtcdCluster, member: int, key: bytes, value: bytes) -> None:
    port = cluster.members[member].client_port
    async with aetcd.Client(host="127.0.0.1", port=port, timeout=10) as client:
        await client.put(key, value)
        got = await client.get(key)
        assert got is not None
        assert got.value == value


async def test_etcd_cluster_keeps_serving_with_its_leader_killed(etcd_cluster: EtcdCluster) -> None:
    assert len(etcd_cluster.endpoints) == 3
    key = f"{etcd_cluster.prefix}greeting".encode()
    await _put_then_get(etcd_cluster, 0, key, b"one")

    leader = etcd_cluster.leader()
    etcd_cluster.kill(leader)
    assert not etcd_cluster.running(leader)
    etcd_cluster.wait_healthy()  # the two others elect a leader
    survivor = (leader + 1) % 3
    await _put_then_get(etcd_cluster, survivor, key, b"two")

    etcd_cluster.restart(leader)
    async with aetcd.Client(
        host="127.0.0.1", port=etcd_cluster.members[leader].client_port, timeout=10
    ) as client:
        got = await client.get(key)
    assert got is not None
    assert got.value == b"two"  # the restarted member caught up


async def test_etcd_cluster_keeps_its_data_across_a_full_stop(etcd_cluster: EtcdCluster) -> None:
    key = f"{etcd_cluster.prefix}kept".encode()
    await _put_then_get(etcd_cluster, 2, key, b"before the stop")
    etcd_cluster.stop()
    assert not any(etcd_cluster.running(i) for i in range(3))
    etcd_cluster.start()
    assert etcd_cluster.etcdctl("get", "--print-value-only", key.decode()).strip() == (
        "before the stop"
    )


def test_prometheus_scrapes_a_counter_from_an_exporter(prometheus: Prometheus) -> None:
    registry = CollectorRegistry()
    events = Counter("cluster_test_events", "Events counted by the test.", registry=registry)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        target = f"127.0.0.1:{server.server_port}"
        prometheus.set_targets([target])
        prometheus.wait_for(f'up{{instance="{target}"}}', value_is(1), timeout_s=20)
        events.inc(3)
        samples = prometheus.wait_for("cluster_test_events_total", value_is(3), timeout_s=20)
        assert samples[0].metric["instance"] == target
        assert samples[0].metric["job"] == "cluster"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def test_slurm_runs_a_job_on_one_node_and_on_both(slurm: Slurm) -> None:
    # Each srun is bounded (slurm.run's timeout): a healthy private Slurm answers in well under
    # a second; a broken one would hang here, not pass slowly.
    done = slurm.run(["srun", "-N1", "hostname"], timeout_s=20)
    assert done.stdout.strip() in {socket.gethostname(), short_hostname()}

    done = slurm.run(
        ["srun", "-N1", "printenv", "SLURM_NODEID", "SLURM_JOB_NUM_NODES", "SLURM_JOB_NODELIST"],
        timeout_s=20,
    )
    node_id, node_count, node_list = done.stdout.split()
    assert (node_id, node_count) == ("0", "1")
    assert node_list in slurm.node_names  # either: the other may still be completing a job

    done = slurm.run(
        ["srun", "-N2", "--label", "printenv", "SLURM_NODEID", "SLURMD_NODENAME"], timeout_s=20
    )
    by_task: dict[str, list[str]] = {}
    for line in done.stdout.splitlines():
        task, _, value = line.partition(": ")
        by_task.setdefault(task.strip(), []).append(value.strip())
    assert by_task == {"0": ["0", "node1"], "1": ["1", "node2"]}

    done = slurm.run(["scontrol", "show", "hostnames", "a[1-3],b[08-10]"], timeout_s=20)
    assert done.stdout.split() == ["a1", "a2", "a3", "b08", "b09", "b10"]


def test_scontrol_expands_node_lists_without_a_running_slurm(scontrol_env: dict[str, str]) -> None:
    assert scontrol_hostnames("a[1-3],b[08-10]", scontrol_env) == [
        *("a1", "a2", "a3"),
        *("b08", "b09", "b10"),
    ]
    assert scontrol_hostnames("node[1-2,7],gpu-x", scontrol_env) == [
        *("node1", "node2", "node7"),
        "gpu-x",
    ]


PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>chaos report</title></head>
<body>
<h1>faults</h1>
<ul id="faults"></ul>
<script>
  const faults = [["kill", "worker 2"], ["partition", "worker 0"], ["restart", "scheduler"]];
  const list = document.getElementById("faults");
  for (const [kind, target] of faults) {
    const item = document.createElement("li");
    item.className = "fault " + kind;
    item.textContent = kind + ": " + target;
    list.appendChild(item);
  }
  document.body.dataset.ready = "yes";
</script>
</body></html>
"""


def test_chromium_renders_a_local_page_built_by_javascript(
    browser: WebDriver, tmp_path: Path
) -> None:
    page = tmp_path / "report.html"
    page.write_text(PAGE)
    browser.get(page.as_uri())
    WebDriverWait(browser, 20).until(
        lambda driver: driver.find_element(By.TAG_NAME, "body").get_attribute("data-ready") == "yes"
    )
    assert browser.title == "chaos report"
    items = browser.find_elements(By.CSS_SELECTOR, "#faults li.fault")
    assert [item.text for item in items] == [
        "kill: worker 2",
        "partition: worker 0",
        "restart: scheduler",
    ]
    assert browser.find_element(By.CSS_SELECTOR, "li.restart").text == "restart: scheduler"
    shot = save_screenshot(browser, tmp_path, "report")
    assert shot.read_bytes().startswith(b"\x89PNG")
    assert shot.stat().st_size > 1000
