"""`mscluster certs`, then `mscluster run --tls-config` and `mscluster status --tls-config`."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
from pathlib import Path

from cluster.testing import free_port
from tests.procs import MSCLUSTER, ROOT, Procs, certs, mscluster, run_args

EXAMPLE = str(ROOT / "examples" / "allgather_check.py")


def test_certs_then_a_tls_job_through_the_launcher(tmp_path: Path) -> None:
    made = certs(tmp_path / "pki")
    assert made.returncode == 0, made.stderr
    assert f"--tls-config {tmp_path / 'pki' / 'ssl.json'}" in made.stdout
    ssl_json, logs = tmp_path / "pki" / "ssl.json", tmp_path / "logs"
    args = run_args(
        "--tls-config", ssl_json, EXAMPLE, worker_num=4, master_port=free_port(), log_dir=logs
    )
    result = subprocess.run(args, capture_output=True, text=True, timeout=90, check=False)
    assert result.returncode == 0, result.stderr
    for i in range(4):
        log = (tmp_path / "logs" / f"worker_{i}.log").read_text()
        assert "allgather rank=" in log
        assert "relay" not in log, log  # it went through the relay all along
    # The workers' one connection: the relay's, over TLS with the launcher's client identity.
    assert "mscluster relay: serving unix:" in (tmp_path / "logs" / "relay.log").read_text()


def test_cluster_tls_config_alone_is_the_launchers_tls_config(tmp_path: Path) -> None:
    """CLUSTER_TLS_CONFIG in the launcher's environment, without --tls-config, is its TLS too:
    the children use it, and so do the launcher's own reads of the scheduler (its progress
    line counts the registered workers, where it said "scheduler not answering")."""
    assert certs(tmp_path / "pki").returncode == 0
    env = {**os.environ, "CLUSTER_TLS_CONFIG": str(tmp_path / "pki" / "ssl.json")}
    logs = tmp_path / "logs"
    args = run_args(EXAMPLE, "--hold", "3", worker_num=2, master_port=free_port(), log_dir=logs)
    result = subprocess.run(args, capture_output=True, text=True, timeout=90, check=False, env=env)
    assert result.returncode == 0, result.stderr
    assert "2/2 registered" in result.stdout + result.stderr, result.stdout + result.stderr


def test_a_launcher_identity_that_does_not_load_is_refused_before_anything_is_made(
    tmp_path: Path,
) -> None:
    """`mscluster run --dry-run` passed a client password the real run refused; the real run
    refused it after it had made --log-dir, and left its job.secret and launcher.lock there."""
    assert certs(tmp_path / "pki").returncode == 0
    wrong = tmp_path / "wrong.pass"
    wrong.write_text("not the password\n")
    wrong.chmod(0o600)
    env = {**os.environ, "CLUSTER_TLS_CLIENT_PASSWORD_FILE": str(wrong)}
    ssl_json, logs = tmp_path / "pki" / "ssl.json", tmp_path / "logs"
    for dry_run in (["--dry-run"], []):
        args = run_args(
            *dry_run, "--tls-config", ssl_json, EXAMPLE, master_port=free_port(), log_dir=logs
        )
        result = subprocess.run(
            args, env=env, capture_output=True, text=True, timeout=60, check=False
        )
        assert result.returncode == 2, (dry_run, result.stderr)
        assert result.stderr.strip().splitlines() == [
            "mscluster: TLSConfigError: wrong password for client_cert_path "
            f"{tmp_path / 'pki' / 'client.p12'}"
        ]
        assert result.stdout == ""
        assert not logs.exists()


def test_certs_refuses_to_overwrite_without_force(tmp_path: Path) -> None:
    assert certs(tmp_path).returncode == 0
    again = certs(tmp_path)
    assert again.returncode == 2
    assert "--force" in again.stderr
    assert len(again.stderr.strip().splitlines()) == 1
    assert certs(tmp_path, "--force").returncode == 0


def test_certs_refuses_a_host_no_certificate_can_hold_in_one_line(tmp_path: Path) -> None:
    made = certs(tmp_path / "pki", "--host", "sched.example", "--host", "\u00e9.example")
    assert made.returncode == 2
    assert made.stderr.strip().splitlines() == [
        "mscluster: ConfigError: --host '\u00e9.example' is neither an IP address nor a host "
        "name a certificate can hold: give an address (an IPv6 one maybe in [ ], without a "
        "%zone) or a name of at most 253 ASCII letters, digits, - and _ in labels of at most "
        "63, separated by dots"
    ]
    assert not (tmp_path / "pki").exists()  # checked before anything is made


def test_certs_force_replaces_secrets_owner_only_never_writing_through_a_link(
    tmp_path: Path,
) -> None:
    out, elsewhere = tmp_path / "pki", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.write_text("not a secret\n")
    for name in ("server.pass", "server.p12"):  # readable by everyone, from before
        (out / name).write_text("old\n")
        (out / name).chmod(0o644)
    for name in ("client.pass", "client.p12"):  # links planted where the secrets go
        (out / name).symlink_to(elsewhere)
    made = certs(out, "--force")
    assert made.returncode == 0, made.stderr
    for name in ("server.pass", "server.p12", "client.pass", "client.p12", "client-revoked.p12"):
        assert not (out / name).is_symlink(), name
        assert stat.S_IMODE((out / name).stat().st_mode) == 0o600, name
    assert elsewhere.read_text() == "not a secret\n"
    assert (out / "server.pass").read_text() != "old\n"
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]  # no temporary left


def test_status_of_a_tls_job(processes: Procs, tmp_path: Path) -> None:
    assert certs(tmp_path / "pki").returncode == 0
    ssl_json = str(tmp_path / "pki" / "ssl.json")
    port, logs = free_port(), tmp_path / "logs"
    args = run_args("--tls-config", ssl_json, EXAMPLE, worker_num=2, master_port=port, log_dir=logs)
    run = processes.start("run", [*args, "--hold", "60"], os.environ)
    run.wait_for_output("2/2 registered (ready)", 60)  # the launcher polls over TLS
    addr = f"127.0.0.1:{port}"
    # The job has a secret (the launcher made one); the client certificate admits this reader,
    # which holds no secret (and runs where no logs/job.secret is).
    assert (tmp_path / "logs" / "job.secret").exists()
    cwd = tmp_path / "pki"
    table = mscluster("status", "--addr", addr, "--tls-config", ssl_json, secret_file=None, cwd=cwd)
    assert table.returncode == 0, table.stderr
    assert "2/2 registered" in table.stdout
    plain = subprocess.run(
        [*MSCLUSTER, "status", "--addr", addr],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
        env={k: v for k, v in os.environ.items() if not k.startswith("CLUSTER_TLS")},
    )
    assert plain.returncode == 2
    assert "uses TLS and this reader does not: give it --tls-config" in plain.stderr
    run.popen.send_signal(signal.SIGINT)
    assert run.wait(20) == 130


def test_a_standalone_scheduler_and_relay_take_ssl_jsons_own_cipher_list(
    processes: Procs, tmp_path: Path
) -> None:
    """`mscluster scheduler` with CLUSTER_TLS_CONFIG naming an ssl.json whose cipher_list is not
    gRPC's default (a Kubernetes scheduler pod's) failed at start: it imported grpc before
    passing the list on. It now serves, and a relay and a worker of the same config finish the
    job through it."""
    assert certs(tmp_path / "pki").returncode == 0
    ssl_json = tmp_path / "pki" / "ssl.json"
    one_suite = tmp_path / "pki" / "one-suite.json"
    data = json.loads(ssl_json.read_text())
    one_suite.write_text(json.dumps({**data, "cipher_list": "ECDHE-ECDSA-AES256-GCM-SHA384"}))
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MS_", "CLUSTER_", "GRPC_S"))}
    env |= {
        "CLUSTER_TLS_CONFIG": str(one_suite),
        "MS_WORKER_NUM": "1",
        "MS_SCHED_HOST": "127.0.0.1",
        "MS_SCHED_PORT": str(port),
        "PYTHONUNBUFFERED": "1",
    }
    sched = processes.start("scheduler", [*MSCLUSTER, "scheduler", "--topo-timeout", "60"], env)
    sched.wait_for_output("listening on", 30)
    socket = f"unix:{tmp_path / 'relay.sock'}"
    relay = processes.start("relay", [*MSCLUSTER, "relay", "--socket", socket], env)
    relay.wait_for_output("mscluster relay: serving", 30)
    worker = processes.start_role(
        "worker", "MS_WORKER", [EXAMPLE], {**env, "CLUSTER_RELAY": socket}
    )
    assert worker.wait(60) == 0, worker.output
    assert "allgather rank=0 size=1" in worker.output
    assert "relay" not in worker.output  # it went through the relay all along
    assert sched.wait(30) == 0, sched.output
