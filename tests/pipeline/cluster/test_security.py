"""Safe defaults: the cluster listens on 127.0.0.1 and speaks TLS with per-run credentials
(or the configured ones), rewards never evaluate model text as code, checkpoints load without
unpickling."""

from __future__ import annotations

import ast
import asyncio
import os
import shutil
import socket
import ssl
import stat
import subprocess
from pathlib import Path
from urllib.parse import urlparse

import psutil
import pytest
from distributed import Client
from distributed.comm import connect
from distributed.comm.addressing import get_address_host_port
from distributed.security import Security

from rlhfless.ops.rollouts import reward
from rlhfless.pipeline.cluster.deploy import deployment_from_config
from rlhfless.pipeline.cluster.pools import Pool, PoolCluster
from rlhfless.pipeline.cluster.security import make_security, run_credentials
from rlhfless.pipeline.config import ConfigError, load_config
from rlhfless.pipeline.durable import checkpoint, zarr_state
from rlhfless.schedulers.ledger import CostLedger

POOLS = [Pool("gen", 1, 1, {"GEN": 1}, "1GiB"), Pool("train", 1, 1, {"TRAIN": 1}, "1GiB")]
LOOPBACK = {"127.0.0.1", "::1"}


def host_of(address: str) -> str:
    return urlparse(address.replace("tcp://", "http://").replace("tls://", "http://")).hostname


def listening(pid: int) -> set[str]:
    """Addresses ``pid`` listens on (TCP)."""
    conns = psutil.Process(pid).net_connections(kind="tcp")
    return {c.laddr.ip for c in conns if c.status == psutil.CONN_LISTEN}


def test_cluster_listens_on_localhost_by_default(tmp_path):
    cfg = load_config(None, [f"runs_dir='{tmp_path}'"])
    with PoolCluster(POOLS, CostLedger(cfg.prices),
                     deployment=deployment_from_config(cfg, tmp_path)) as pc:
        info = pc.client.scheduler_info(n_workers=-1)
        assert host_of(pc.client.scheduler.address) == "127.0.0.1"
        for address, worker in info["workers"].items():
            assert host_of(address) == "127.0.0.1"
            assert host_of(worker["nanny"]) == "127.0.0.1"
        pids = [psutil.Process().pid, *pc.client.run(lambda: psutil.Process().pid).values()]
        for pid in pids:
            assert listening(pid) <= LOOPBACK, (pid, listening(pid))


def test_security_section_is_checked(tmp_path):
    with pytest.raises(ConfigError, match="security key .tls_foo. is not a security setting"):
        load_config(None, ["security={tls_foo='x'}"])
    with pytest.raises(ConfigError, match="security.require_encryption = 'yes' must be"):
        load_config(None, ["security={require_encryption='yes'}"])
    with pytest.raises(ConfigError, match="security = 3 must be a table"):
        load_config(None, ["security=3"])
    with pytest.raises(ConfigError, match="enabled = false turns TLS off, but"):
        load_config(None, ["security={enabled=false, tls_ca_file='ca.pem'}"])
    with pytest.raises(FileNotFoundError, match="tls_ca_file"):
        make_security({"tls_ca_file": str(tmp_path / "missing.pem")}, tmp_path)
    assert make_security({"enabled": False}, tmp_path) is None
    assert not (tmp_path / "tls").exists()


def test_run_credentials_are_readable_by_the_run_user_only(tmp_path):
    security = make_security({}, tmp_path)
    assert security.require_encryption
    assert stat.S_IMODE((tmp_path / "tls").stat().st_mode) == 0o700
    for name in ("cert.pem", "key.pem"):
        assert stat.S_IMODE((tmp_path / "tls" / name).stat().st_mode) == 0o600
    assert security.get_tls_config_for_role("worker")["key"] == str(tmp_path / "tls" / "key.pem")
    if os.geteuid() == 0 and shutil.which("setpriv"):  # another Unix user cannot read the key
        other = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                                "cat", str(tmp_path / "tls" / "key.pem")], capture_output=True)
        assert other.returncode != 0 and b"Permission denied" in other.stderr


def test_batch_jobs_get_the_paths_of_the_credentials_not_their_content(tmp_path):
    cfg = load_config(None, ["cluster='slurm'"])
    deployment = deployment_from_config(cfg, tmp_path)
    script = deployment.job_script(POOLS[0])
    assert f"--tls-key {tmp_path / 'tls' / 'key.pem'}" in script
    assert f"--tls-ca-file {tmp_path / 'tls' / 'cert.pem'}" in script
    assert "--protocol tls://" in script and "BEGIN" not in script


async def attempt_connection(address: str, security: Security | None) -> None:
    """Open a comm to ``address`` as a client with ``security`` (bounded in time)."""
    args = security.get_connection_args("client") if security else {}
    comm = await asyncio.wait_for(connect(address, timeout="3s", **args), 20)
    await comm.close()


async def attempt_client(address: str, security: Security) -> None:
    async def start() -> None:
        async with Client(address, security=security, asynchronous=True, timeout="3s") as c:
            await c.submit(os.getpid)
    await asyncio.wait_for(start(), 20)


def first_bytes_after_handshake(address: str, ca_file: str,
                                 cert_and_key: tuple[str, str] | None) -> bytes:
    """Connect to ``address`` as a TLS 1.3 client that trusts ``ca_file`` (so it verifies the
    server itself: a server it does not trust fails the handshake here, on this side),
    presenting ``cert_and_key`` or no certificate, and read the server's first byte. In TLS 1.3
    the server checks the client's certificate after the client finished its handshake: a
    server that refuses it sends an alert, which the read raises (``ssl.SSLError``)."""
    context = ssl.create_default_context(cafile=ca_file)
    context.check_hostname = False  # the run's certificate names no host, as Dask's contexts
    context.verify_flags &= ~ssl.VERIFY_X509_STRICT
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    if cert_and_key is not None:
        context.load_cert_chain(*cert_and_key)
    with socket.create_connection(get_address_host_port(address), timeout=10) as raw, \
            context.wrap_socket(raw) as tls:
        return tls.recv(1)


def test_by_default_only_holders_of_the_run_credentials_reach_the_cluster(tmp_path):
    cfg = load_config(None, [f"runs_dir='{tmp_path}'"])
    deployment = deployment_from_config(cfg, tmp_path)
    with PoolCluster(POOLS, CostLedger(cfg.prices), deployment=deployment) as pc:
        scheduler = pc.client.scheduler.address
        workers = list(pc.client.scheduler_info(n_workers=-1)["workers"])
        assert scheduler.startswith("tls://127.0.0.1:")
        assert all(a.startswith("tls://127.0.0.1:") for a in workers)
        stranger = Security.temporary()  # valid TLS, but not the run's certificate
        other = tmp_path / "other"  # a certificate and key that are not the run's
        run_credentials(other)
        run_ca = str(tmp_path / "tls" / "cert.pem")
        for address in (scheduler, *workers):
            with pytest.raises(TypeError, match="TLS expects a `ssl_context` argument"):
                asyncio.run(attempt_connection(address, None))
            with pytest.raises(OSError):  # the stranger does not trust the run's server
                asyncio.run(attempt_connection(address, stranger))
            # a client that trusts the run's certificate is refused by the server, by an
            # alert, without a certificate or with another one; with the run's it is served
            for cert_and_key, alert in ((None, "TLSV13_ALERT_CERTIFICATE_REQUIRED"),
                                        ((str(other / "cert.pem"), str(other / "key.pem")),
                                         "TLSV1_ALERT_UNKNOWN_CA")):
                with pytest.raises(ssl.SSLError) as refused:
                    first_bytes_after_handshake(address, run_ca, cert_and_key)
                assert refused.value.reason == alert, refused.value
            served = (run_ca, str(tmp_path / "tls" / "key.pem"))
            assert len(first_bytes_after_handshake(address, run_ca, served)) == 1
        with pytest.raises(OSError):  # nor does a stranger's client that would submit work
            asyncio.run(attempt_client(scheduler, stranger))
        half = Security(tls_ca_file=run_ca, tls_client_cert=str(other / "cert.pem"),
                        tls_client_key=str(other / "key.pem"), require_encryption=True)
        with pytest.raises(OSError):  # and the server refuses one that trusts the run
            asyncio.run(attempt_client(scheduler, half))
        with Client(scheduler, security=deployment.security, timeout="10s") as owner:
            pid = owner.submit(os.getpid, resources={"GEN": 1}).result()
            assert pid != os.getpid()  # ran in a worker process


def test_the_opt_out_is_plain_tcp_and_open_to_any_local_client(tmp_path):
    cfg = load_config(None, ["security={enabled=false}"])
    with PoolCluster(POOLS, CostLedger(cfg.prices),
                     deployment=deployment_from_config(cfg, tmp_path)) as pc:
        assert pc.client.scheduler.address.startswith("tcp://127.0.0.1:")
        with Client(pc.client.scheduler.address, timeout="10s") as anyone:
            assert anyone.submit(sum, [1, 2], resources={"GEN": 1}).result() == 3


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed")
def test_tls_settings_pass_through_to_the_cluster(tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-keyout", str(key), "-out", str(cert), "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
                   check=True, capture_output=True)
    roles = {f"tls_{role}_{part}": str(path) for role in ("client", "scheduler", "worker")
             for part, path in (("cert", cert), ("key", key))}
    table = ", ".join([f"{k}='{v}'" for k, v in roles.items()]
                      + [f"tls_ca_file='{cert}'", "require_encryption=true"])
    cfg = load_config(None, [f"security={{{table}}}"])
    with PoolCluster(POOLS, CostLedger(cfg.prices),
                     deployment=deployment_from_config(cfg, tmp_path)) as pc:
        assert pc.client.scheduler.address.startswith("tls://127.0.0.1:")
        assert all(a.startswith("tls://") for a in pc.client.scheduler_info()["workers"])
        assert pc.client.submit(sum, [1, 2], resources={"GEN": 1}).result() == 3
        with pytest.raises((OSError, TypeError)):  # no TLS settings, no connection
            Client(pc.client.scheduler.address, timeout="2s")


def calls_and_imports(path: Path) -> tuple[set[str], set[str]]:
    """Names called (``eval(...)`` and ``x.eval(...)`` alike, ``re.compile`` aside) and
    top-level modules imported by the file at ``path``."""
    tree = ast.parse(path.read_text())
    calls = {node.func.id for node in ast.walk(tree)
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}
    calls |= {node.func.attr for node in ast.walk(tree)
              if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr != "compile"}
    imports = {a.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
               for a in node.names}
    imports |= {(node.module or "").split(".")[0] for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom)}
    return calls, imports


def test_rewards_never_evaluate_text_as_code(tmp_path):
    calls, imports = calls_and_imports(Path(reward.__file__))
    assert not calls & {"eval", "exec", "compile", "__import__", "sympify", "parse_expr"}
    assert not imports & {"pickle", "subprocess", "code"}
    # math-verify parses plain expressions with sympy only after a regex has reduced them to
    # digits and arithmetic operators; LaTeX goes through its grammar. Nothing runs:
    sentinel = tmp_path / "pwned"
    payload = f"__import__('pathlib').Path('{sentinel}').touch()"
    for text in (payload, f"\\boxed{{{payload}}}", f"The answer is {payload}",
                 f"= {payload}", f"$\\boxed{{{payload}}}$ = 3"):
        for fn in reward.VERIFIERS.values():
            fn(text, "3")
    assert not sentinel.exists()


def test_checkpoint_code_never_unpickles():
    for module in (checkpoint, zarr_state):
        tree = ast.parse(Path(module.__file__).read_text())
        dotted = {f"{node.func.value.id}.{node.func.attr}" for node in ast.walk(tree)
                  if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and isinstance(node.func.value, ast.Name)}
        calls, imports = calls_and_imports(Path(module.__file__))
        assert not imports & {"pickle", "dill", "cloudpickle", "joblib"}, module
        assert not dotted & {"torch.load", "np.load", "numpy.load"}, module
        assert not calls & {"eval", "exec"}, module
