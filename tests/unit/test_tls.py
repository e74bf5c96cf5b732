"""Unit tests of cluster.tls and cluster.certs: ssl.json, PKCS#12, CA, CRL, ciphers, expiry.

Every certificate is made here, by cluster.certs, in tmp_path; no key is committed.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
import re
import stat
import subprocess
from pathlib import Path
from typing import Any

import pytest

from cluster.protocol.config import TLSOptions
from cluster.protocol.environment import from_env, tls_options_from_env
from cluster.protocol.errors import ConfigError, TLSConfigError
from cluster.transport import certs, tls
from tests.aio import eventually
from tests.procs import PYTHON, ROOT

TUTORIAL_CIPHERS = (
    "ECDHE-R SA-AES128-GCM-SHA256:ECDHE-ECDSA-AES256-GCM-SHA384:ECDHE-RSA-AES256-GCM-SHA384:"
    "ECDHE-ECDSA-AES128-GCM-SHA256:DHE-RSA-AES128-GCM-SHA256:ECDHE-RSA-CHACHA20-POLY1305"
)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> certs.Pki:
    return certs.make_pki(tmp_path_factory.mktemp("pki"))


def config(pki: certs.Pki, tmp: Path, name: str = "ssl", **changes: Any) -> Path:
    """A copy of pki's ssl.json in `tmp` with `changes` (None drops a key)."""
    data = json.loads(pki.ssl_json.read_text())
    for key, value in data.items():
        if key.endswith(("_path", "_file")) and value:
            data[key] = str(pki.dir / value)
    data.update(changes)
    path = tmp / f"{name}.json"
    path.write_text(json.dumps({k: v for k, v in data.items() if v is not None}))
    return path


def client(path: Path, **kw: Any) -> tls.Identity:
    return tls.load_identity(TLSOptions(path, **kw), server=False)


# -- make_pki ----------------------------------------------------------------------------------


def test_make_pki_writes_a_complete_config_with_private_secrets(pki: certs.Pki) -> None:
    for name in certs.PKI_FILES:
        assert (pki.dir / name).is_file(), name
    for secret in ("server.p12", "client.p12", "client-revoked.p12", "server.pass", "client.pass"):
        assert stat.S_IMODE((pki.dir / secret).stat().st_mode) == 0o600, secret
    assert not list(pki.dir.glob("*.key"))  # the CA's key stays in memory
    settings = tls.load_settings(pki.ssl_json)
    assert settings.crl_path == pki.crl
    assert settings.ciphers == tls.GRPC_DEFAULT_SUITES
    server = tls.load_identity(TLSOptions(pki.ssl_json), server=True)
    worker = tls.load_identity(TLSOptions(pki.ssl_json), server=False)
    names = server.cert.extensions.get_extension_for_class(certs.x509.SubjectAlternativeName)
    assert {str(n.value) for n in names.value} == {"127.0.0.1", "::1", "localhost"}
    assert tls.expiry_warnings(server) == tls.expiry_warnings(worker) == []


def test_make_pki_does_not_overwrite_a_ca(pki: certs.Pki) -> None:
    with pytest.raises(ConfigError, match=r"already holds ca\.pem"):
        certs.make_pki(pki.dir)


def test_make_pki_adds_hosts_to_the_server_certificate(tmp_path: Path) -> None:
    made = certs.make_pki(tmp_path, hosts=["sched.example", "10.1.2.3"])
    server = tls.load_identity(TLSOptions(made.ssl_json), server=True)
    names = server.cert.extensions.get_extension_for_class(certs.x509.SubjectAlternativeName)
    assert {"sched.example", "10.1.2.3"} <= {str(n.value) for n in names.value}


def test_a_bracketed_ipv6_host_is_an_ip_address_of_the_server_certificate(tmp_path: Path) -> None:
    """`--host [2001:db8::5]`, as the rest of the CLI takes an IPv6 address, was written as a
    DNS name that no address ever matches."""
    made = certs.make_pki(tmp_path, hosts=["[2001:db8::5]", "[::1]"])
    server = tls.load_identity(TLSOptions(made.ssl_json), server=True)
    names = server.cert.extensions.get_extension_for_class(certs.x509.SubjectAlternativeName)
    addresses = names.value.get_values_for_type(certs.x509.IPAddress)
    assert [str(a) for a in addresses] == ["127.0.0.1", "::1", "2001:db8::5"]
    assert names.value.get_values_for_type(certs.x509.DNSName) == ["localhost"]


@pytest.mark.parametrize(
    "host", ["\u00e9.example", "", "a b", "a:b", "[x]", "fe80::1%eth0", "-a.b", "x" * 64 + ".a"]
)
def test_a_host_no_certificate_can_hold_is_one_clear_error(host: str) -> None:
    """A non-ASCII name was a ValueError traceback from cryptography; '' and 'a b' became
    DNS names no client accepts."""
    with pytest.raises(ConfigError, match=r"^--host .* is neither an IP address nor a host name"):
        certs.server_name("--host", host)


# -- ssl.json ----------------------------------------------------------------------------------


def test_relative_paths_are_relative_to_the_json(pki: certs.Pki) -> None:
    settings = tls.load_settings(pki.ssl_json)
    assert settings.server_cert_path == pki.dir / "server.p12"
    assert settings.client_password_file == pki.dir / "client.pass"
    assert settings.warning_days == 90


@pytest.mark.parametrize("days", [7, 180])
def test_warning_window_bounds_are_accepted(pki: certs.Pki, tmp_path: Path, days: int) -> None:
    path = config(pki, tmp_path, cert_expire_warning_time_in_day=days)
    assert tls.load_settings(path).warning_days == days


@pytest.mark.parametrize("days", [6, 181, 0, "90", 30.5, True])
def test_warning_window_out_of_range(pki: certs.Pki, tmp_path: Path, days: object) -> None:
    path = config(pki, tmp_path, cert_expire_warning_time_in_day=days)
    with pytest.raises(
        TLSConfigError, match=r"cert_expire_warning_time_in_day=.*between 7 and 180"
    ):
        tls.load_settings(path)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"ca_cert_path": None}, "ca_cert_path in .* must be a non-empty string"),
        ({"server_cert_path": ""}, "server_cert_path in .* must be a non-empty string"),
        ({"crl_paht": "crl.pem"}, "unknown keys crl_paht"),
        ({"cipher_list": ""}, "cipher_list in .* must be a non-empty string"),
    ],
)
def test_bad_config_keys(
    pki: certs.Pki, tmp_path: Path, changes: dict[str, Any], message: str
) -> None:
    with pytest.raises(TLSConfigError, match=message):
        tls.load_settings(config(pki, tmp_path, **changes))


def test_missing_or_broken_config_file(tmp_path: Path) -> None:
    with pytest.raises(TLSConfigError, match=r"the TLS config .*nope\.json does not exist"):
        tls.load_settings(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(TLSConfigError, match="is not valid JSON"):
        tls.load_settings(tmp_path / "bad.json")


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ('{"cert_expire_warning_time_in_day": ' + "9" * 5000 + "}", "value has 5000 digits$"),
        ("[" * 100_000 + "]" * 100_000, "it is nested too deeply$"),
        ('{"server_cert_path": "\xff"}', "can't decode byte 0xff"),
    ],
    ids=["huge-integer", "deep-nesting", "not-utf8"],
)
def test_a_config_json_cannot_read_is_a_tls_config_error(
    tmp_path: Path, text: str, said: str
) -> None:
    """A 5000-digit integer (ValueError) or deep nesting (RecursionError) escaped as a
    traceback: each is one TLSConfigError naming the file."""
    path = tmp_path / "ssl.json"
    path.write_bytes(text.encode("latin-1"))
    with pytest.raises(
        TLSConfigError, match=rf"^the TLS config {re.escape(str(path))} is not valid JSON: .*{said}"
    ):
        tls.load_settings(path)


@pytest.mark.parametrize(
    "key", ["server_cert_path", "ca_cert_path", "crl_path", "client_password_file", "cipher_list"]
)
@pytest.mark.parametrize(
    ("held", "said"),
    [("\0", r"a NUL character \(\\u0000\)"), ("\ud800", r"a lone surrogate \(\\ud800")],
    ids=["nul", "surrogate"],
)
def test_a_value_no_file_or_cipher_name_can_hold_is_a_tls_config_error(
    pki: certs.Pki, tmp_path: Path, key: str, held: str, said: str
) -> None:
    """A NUL in ssl.json was a ValueError traceback (open(): embedded null byte; OpenSSL's
    set_ciphers: embedded null character), and so was a path of a lone surrogate."""
    value = f"ECDHE-RSA-AES128-GCM-SHA256:{held}" if key == "cipher_list" else f"ca{held}.pem"
    path = config(pki, tmp_path, **{key: value})
    with pytest.raises(TLSConfigError, match=rf"^{key} in {re.escape(str(path))} holds {said}"):
        tls.load_settings(path)


@pytest.mark.parametrize("name", ["ECDHE\0", "\ud800"])
def test_a_cipher_name_openssl_cannot_be_given_is_no_cipher_name(name: str) -> None:
    with pytest.raises(TLSConfigError, match="is not a cipher suite name"):
        tls.parse_cipher_list(name, Path("ssl.json"))


def test_a_long_value_of_the_wrong_type_is_quoted_short(pki: certs.Pki, tmp_path: Path) -> None:
    with pytest.raises(TLSConfigError, match=r"must be a non-empty string, not \[1, .*chars\)$"):
        tls.load_settings(config(pki, tmp_path, server_cert_path=[1] * 100_000))


# -- cipher list -------------------------------------------------------------------------------


def test_the_tutorials_typo_is_reported_not_dropped(pki: certs.Pki, tmp_path: Path) -> None:
    path = config(pki, tmp_path, cipher_list=TUTORIAL_CIPHERS)
    with pytest.raises(TLSConfigError) as caught:
        tls.load_settings(path)
    message = str(caught.value)
    assert "'ECDHE-R SA-AES128-GCM-SHA256' is not a cipher suite name" in message
    assert "'DHE-RSA-AES128-GCM-SHA256' is not an ECDHE AEAD suite" in message
    assert "ECDHE-RSA-CHACHA20-POLY1305'" not in message.split(". Use only", maxsplit=1)[0]


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("TLS_AES_128_GCM_SHA256", "TLS 1.3 suite"),
        ("ECDHE-RSA-AES128-SHA256", "not an ECDHE AEAD suite"),
        ("AES128-GCM-SHA256", "not an ECDHE AEAD suite"),
        ("ECDHE-ECDSA-AES128-CCM", "not an ECDHE AEAD suite"),
        ("HIGH", "not an ECDHE AEAD suite"),
        ("ECDHE_RSA_AES128", "not a cipher suite name"),
    ],
)
def test_only_tls12_ecdhe_aead_suites(name: str, why: str) -> None:
    with pytest.raises(TLSConfigError, match=f"'{name}' is .*{why}"):
        tls.parse_cipher_list(f"ECDHE-RSA-AES128-GCM-SHA256:{name}", Path("ssl.json"))


def test_every_supported_suite_is_accepted() -> None:
    text = ":".join(tls.TLS12_SUITES)
    assert tls.parse_cipher_list(text, Path("ssl.json")) == tls.TLS12_SUITES
    with pytest.raises(TLSConfigError, match="stray ':'"):
        tls.parse_cipher_list(text + ":", Path("ssl.json"))


def test_cipher_list_is_set_before_grpc_is_imported(pki: certs.Pki, tmp_path: Path) -> None:
    settings = tls.load_settings(config(pki, tmp_path, cipher_list="ECDHE-ECDSA-AES256-GCM-SHA384"))
    environ: dict[str, str] = {}
    tls.apply_cipher_suites(settings, environ, modules={})
    assert environ == {"GRPC_SSL_CIPHER_SUITES": "ECDHE-ECDSA-AES256-GCM-SHA384"}
    # grpc imported since, with that list: fine.
    tls.apply_cipher_suites(settings, environ, modules={"grpc": object()})


def test_cipher_list_after_grpc_was_imported(pki: certs.Pki, tmp_path: Path) -> None:
    default = tls.load_settings(pki.ssl_json)  # gRPC's own default list: no conflict
    tls.apply_cipher_suites(default, {}, modules={"grpc": object()})
    narrow = tls.load_settings(config(pki, tmp_path, cipher_list="ECDHE-ECDSA-AES256-GCM-SHA384"))
    with pytest.raises(TLSConfigError) as caught:
        tls.apply_cipher_suites(narrow, {}, modules={"grpc": object()})
    assert "grpc was imported before" in str(caught.value)
    assert "GRPC_SSL_CIPHER_SUITES=ECDHE-ECDSA-AES256-GCM-SHA384 in the environment" in str(
        caught.value
    )


def test_launch_environment(pki: certs.Pki) -> None:
    assert tls.launch_environment(pki.ssl_json) == {
        "CLUSTER_TLS_CONFIG": str(pki.ssl_json.absolute()),
        "GRPC_SSL_CIPHER_SUITES": ":".join(tls.GRPC_DEFAULT_SUITES),
    }


# -- p12, CA, CRL ------------------------------------------------------------------------------


def test_wrong_password_says_so(pki: certs.Pki, tmp_path: Path) -> None:
    with pytest.raises(
        TLSConfigError, match=r"^wrong password for client_cert_path .*client\.p12$"
    ):
        client(pki.ssl_json, client_password=b"not it")


def test_no_password_for_an_encrypted_p12(pki: certs.Pki, tmp_path: Path) -> None:
    path = config(pki, tmp_path, client_password_file=None)
    with pytest.raises(TLSConfigError, match="needs a password and none was given"):
        client(path)


def test_password_sources_in_order(pki: certs.Pki, tmp_path: Path) -> None:
    wrong = tmp_path / "wrong.pass"
    wrong.write_bytes(b"nope\n")
    # A file named in the environment beats the password itself, which beats ssl.json's file.
    client(pki.ssl_json, client_password_file=pki.client_password_file, client_password=b"x")
    client(pki.ssl_json, client_password=pki.client_password)
    with pytest.raises(TLSConfigError, match="wrong password"):
        client(pki.ssl_json, client_password_file=wrong, client_password=pki.client_password)
    with pytest.raises(TLSConfigError, match=r"the password file \(CLUSTER_TLS_CLIENT_PASSWORD_"):
        client(pki.ssl_json, client_password_file=tmp_path / "missing.pass")


@pytest.mark.parametrize(
    ("key", "make", "message"),
    [
        ("client_cert_path", lambda d: d / "missing.p12", r"client_cert_path .* does not exist"),
        ("client_cert_path", lambda d: d, r"client_cert_path .* cannot be read"),
        ("ca_cert_path", lambda d: d / "missing.pem", r"ca_cert_path .* does not exist"),
        ("crl_path", lambda d: d / "missing.crl", r"crl_path .* does not exist"),
    ],
)
def test_missing_or_unreadable_files(
    pki: certs.Pki, tmp_path: Path, key: str, make: Any, message: str
) -> None:
    path = config(pki, tmp_path, **{key: str(make(tmp_path))})
    with pytest.raises(TLSConfigError, match=message):
        client(path)


def test_not_a_p12_and_not_a_ca(pki: certs.Pki, tmp_path: Path) -> None:
    junk = tmp_path / "junk"
    junk.write_bytes(b"-----BEGIN NONSENSE-----\n")
    with pytest.raises(TLSConfigError, match="is not a PKCS#12"):
        client(config(pki, tmp_path, client_cert_path=str(junk)))
    with pytest.raises(TLSConfigError, match="holds no certificate"):
        client(config(pki, tmp_path, ca_cert_path=str(junk)))
    with pytest.raises(TLSConfigError, match="is not a CRL"):
        client(config(pki, tmp_path, crl_path=str(junk)))


def test_a_p12_cut_short_says_so_not_wrong_password(pki: certs.Pki, tmp_path: Path) -> None:
    whole = pki.client_p12.read_bytes()
    half = tmp_path / "half.p12"
    half.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(TLSConfigError, match=r"half\.p12 is cut short: \d+ bytes of a PKCS#12"):
        client(config(pki, tmp_path, client_cert_path=str(half)))


def own_p12(pki: certs.Pki, tmp: Path, name: str, ca: certs.Authority, **issue: Any) -> Path:
    key, cert = certs.issue(ca, name, server=False, **issue)
    return certs.write_p12(tmp / f"{name}.p12", key, cert, pki.client_password, ca)


def test_certificate_of_another_ca(pki: certs.Pki, tmp_path: Path) -> None:
    other = own_p12(pki, tmp_path, "other", certs.new_ca("another CA"))
    with pytest.raises(TLSConfigError, match=r"other\.p12 .* is not signed by the CA in ca_cert"):
        client(config(pki, tmp_path, client_cert_path=str(other)))


def test_expired_and_not_yet_valid(pki: certs.Pki, tmp_path: Path) -> None:
    now = certs.now_utc()
    old_span = certs.Validity(days=10, not_before=now - dt.timedelta(days=30))
    old = own_p12(pki, tmp_path, "old", pki.ca, validity=old_span)
    with pytest.raises(TLSConfigError, match=r"old\.p12 has expired: it was valid until"):
        client(config(pki, tmp_path, client_cert_path=str(old)))
    future_span = certs.Validity(not_before=now + dt.timedelta(days=2))
    future = own_p12(pki, tmp_path, "future", pki.ca, validity=future_span)
    with pytest.raises(TLSConfigError, match=r"future\.p12 is not yet valid"):
        client(config(pki, tmp_path, client_cert_path=str(future)))


def test_crl_of_another_ca(pki: certs.Pki, tmp_path: Path) -> None:
    foreign = tmp_path / "foreign.crl"
    foreign.write_bytes(certs.crl_pem(certs.new_ca("another CA"), []))
    with pytest.raises(TLSConfigError, match=r"crl_path .*foreign\.crl is not signed by the CA"):
        client(config(pki, tmp_path, crl_path=str(foreign)))


def test_own_certificate_revoked(pki: certs.Pki, tmp_path: Path) -> None:
    path = config(pki, tmp_path, client_cert_path=str(pki.revoked_client_p12))
    with pytest.raises(TLSConfigError, match=r"client-revoked\.p12 .* is revoked: the CRL"):
        client(path)
    # Without the CRL this process cannot know; the scheduler's per-call check refuses it.
    client(
        config(pki, tmp_path, "nocrl", client_cert_path=str(pki.revoked_client_p12), crl_path=None)
    )


def test_weak_rsa_key(pki: certs.Pki, tmp_path: Path) -> None:
    weak = own_p12(pki, tmp_path, "weak", pki.ca, key=certs.new_key("rsa", 1024))
    with pytest.raises(TLSConfigError, match="1024-bit RSA key, too weak: use at least 2048"):
        client(config(pki, tmp_path, client_cert_path=str(weak)))
    strong = own_p12(pki, tmp_path, "strong", pki.ca, key=certs.new_key("rsa", 2048))
    client(config(pki, tmp_path, client_cert_path=str(strong)))


# -- expiry and the CRL while running ----------------------------------------------------------


def test_expiry_warning_window(pki: certs.Pki, tmp_path: Path) -> None:
    soon = own_p12(pki, tmp_path, "soon", pki.ca, validity=certs.Validity(days=20))
    within = client(config(pki, tmp_path, "a", client_cert_path=str(soon)))
    [warning] = tls.expiry_warnings(within)
    assert "soon.p12 expires in 19 days" in warning
    assert "cert_expire_warning_time_in_day=90" in warning
    outside = client(
        config(pki, tmp_path, "b", client_cert_path=str(soon), cert_expire_warning_time_in_day=7)
    )
    assert tls.expiry_warnings(outside) == []
    later = certs.now_utc() + dt.timedelta(days=30)
    assert "has expired" in tls.expiry_warnings(outside, later)[0]


async def test_expiry_is_rechecked_with_an_injected_period(pki: certs.Pki, tmp_path: Path) -> None:
    soon = own_p12(pki, tmp_path, "soon", pki.ca, validity=certs.Validity(days=20))
    identity = client(config(pki, tmp_path, client_cert_path=str(soon)))
    reports: list[str] = []
    task = asyncio.create_task(tls.recheck_expiry(identity, reports.append, period_s=0.01))
    try:
        await eventually(lambda: len(reports) >= 3, "three expiry reports", 10)
    finally:
        task.cancel()
    assert all("soon.p12 expires in" in r for r in reports)


def test_peer_check_follows_the_crl_file(pki: certs.Pki, tmp_path: Path) -> None:
    crl = tmp_path / "crl.pem"
    crl.write_bytes(certs.crl_pem(pki.ca, []))
    scheduler = tls.load_identity(TLSOptions(config(pki, tmp_path, crl_path=str(crl))), server=True)
    check = tls.PeerCheck(scheduler)
    _, cert = certs.issue(pki.ca, "worker", server=False)
    assert check.problem(cert) is None
    crl.write_bytes(certs.crl_pem(pki.ca, [cert]))
    os.utime(crl, ns=(1, 1))  # a new stamp even within the filesystem's time resolution
    assert check.problem(cert) == "is revoked (the CRL lists it)"
    # A replacement that does not check out leaves the last good list in force.
    crl.write_bytes(certs.crl_pem(certs.new_ca("another CA"), []))
    assert check.problem(cert) == "is revoked (the CRL lists it)"
    span = certs.Validity(days=1, not_before=certs.now_utc() - dt.timedelta(days=9))
    expired = certs.issue(pki.ca, "old", server=False, validity=span)[1]
    assert (check.problem(expired) or "").startswith("expired on")


# -- the environment and set_ps_context ---------------------------------------------------------


def test_tls_variables(tmp_path: Path) -> None:
    env = {
        "MS_ROLE": "MS_WORKER",
        "MS_WORKER_NUM": "2",
        "MS_SCHED_HOST": "127.0.0.1",
        "MS_SCHED_PORT": "8118",
    }
    assert from_env(env).tls is None
    options = from_env(
        {
            **env,
            "CLUSTER_TLS_CONFIG": "ssl.json",
            "CLUSTER_TLS_CLIENT_PASSWORD": "s3cret",
            "CLUSTER_TLS_SERVER_PASSWORD_FILE": "/run/server.pass",
            "CLUSTER_TLS_SERVER_NAME": "sched.example",
        }
    ).tls
    assert options == TLSOptions(
        Path("ssl.json"),
        client_password=b"s3cret",
        server_password_file=Path("/run/server.pass"),
        server_name="sched.example",
    )
    assert "s3cret" not in repr(options)
    assert tls_options_from_env({}, Path("x.json")) == TLSOptions(Path("x.json"))


def run_python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MS_", "CLUSTER_", "GRPC_"))}
    return subprocess.run(
        [PYTHON, "-c", code],
        env={**clean, **env},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_import_cluster_does_not_import_grpc() -> None:
    result = run_python("import cluster; import sys; assert 'grpc' not in sys.modules")
    assert result.returncode == 0, result.stderr


def test_set_ps_context_sets_the_cipher_list_before_grpc(pki: certs.Pki, tmp_path: Path) -> None:
    path = config(pki, tmp_path, cipher_list="ECDHE-ECDSA-AES256-GCM-SHA384")
    code = (
        "import os, cluster\n"
        f"cluster.set_ps_context(enable_ssl=True, config_file_path={str(path)!r})\n"
        "import grpc\n"
        "print(os.environ['GRPC_SSL_CIPHER_SUITES'])\n"
    )
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ECDHE-ECDSA-AES256-GCM-SHA384"


def test_grpc_imported_first_is_one_clear_line(pki: certs.Pki, tmp_path: Path) -> None:
    path = config(pki, tmp_path, cipher_list="ECDHE-ECDSA-AES256-GCM-SHA384")
    code = f"import grpc, cluster\ncluster.set_ps_context(True, {str(path)!r})\n"
    result = run_python(code)
    assert result.returncode == 1
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("cluster: TLSConfigError: cipher_list in ")
    assert "grpc was imported before" in line
    # The way out the message gives works.
    fixed = run_python(code, GRPC_SSL_CIPHER_SUITES="ECDHE-ECDSA-AES256-GCM-SHA384")
    assert fixed.returncode == 0, fixed.stderr


def test_enable_ssl_without_a_config_is_an_error() -> None:
    result = run_python("import cluster; cluster.set_ps_context(enable_ssl=True)")
    assert result.returncode == 1
    assert result.stderr.strip() == (
        "cluster: TLSConfigError: set_ps_context(enable_ssl=True) needs config_file_path "
        "(an ssl.json), or CLUSTER_TLS_CONFIG naming one"
    )


def test_prepare_reuses_an_identity_until_a_file_changes(
    pki: certs.Pki, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # prepare() may set GRPC_SSL_CIPHER_SUITES; monkeypatch puts the environment back after.
    monkeypatch.setenv("GRPC_SSL_CIPHER_SUITES", ":".join(tls.GRPC_DEFAULT_SUITES))
    path = config(pki, tmp_path)
    first = tls.prepare(TLSOptions(path), server=False)
    assert tls.prepare(TLSOptions(path), server=False) is first
    os.utime(path, ns=(1, 1))
    assert tls.prepare(TLSOptions(path), server=False) is not first
