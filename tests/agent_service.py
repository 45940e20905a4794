"""An agent service over HTTP, for the tests of ``agent = "http://..."`` (agent_http.py).

``python agent_service.py [CERT KEY]`` serves on a free loopback port, which it prints as its
first line, until it is killed (``running_service`` starts it so for a test); over HTTPS with
the PEM files ``CERT`` and ``KEY`` when given (``self_signed`` and
``signed_by_an_authority`` make a pair for 127.0.0.1).
Each POST is one episode (``{"row", "base_url", "api_key", "model", "ca_pem",
"timeout_s"}``), played with the real ``openai`` client against the run's endpoint as a
user's own service would, and answered with its reward. The path picks the agent:

    /tally       the tool task's agent (``tally_agent``)
    /two-turns   ``openai_agents.two_turns``: two requests of one conversation
    /broken      answers 500 with {"error": ...}
    /nan         answers {"reward": NaN}
    /slow        answers after 30 s
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import json
import os
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import openai
from openai_agents import two_turns

from rlhfless.ops.rollouts.agent_binding import agent_trust
from rlhfless.ops.toy.tinytool import tally_agent

AGENTS = {"/tally": tally_agent, "/two-turns": two_turns}


class Episode(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 (the handler's name is http.server's)
        job = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/broken":
            return self._answer(500, {"error": "the agent broke"})
        if self.path == "/nan":
            return self._answer(200, {"reward": float("nan")})
        if self.path == "/slow":
            time.sleep(30)
            return self._answer(200, {"reward": 1.0})
        verify = agent_trust(job["ca_pem"]) if job["ca_pem"] else True
        client = openai.OpenAI(base_url=job["base_url"], api_key=job["api_key"], max_retries=0,
                               timeout=job["timeout_s"], http_client=httpx.Client(verify=verify))
        try:
            reward = AGENTS[self.path](client, job["row"], job["model"])
        except Exception as err:  # the agent's own failure: said to the run
            return self._answer(500, {"error": f"{type(err).__name__}: {err}"})
        self._answer(200, {"reward": reward})

    def _answer(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        """Quiet: the test reads the run's records, not the service's log."""


def self_signed(directory: Path) -> tuple[Path, Path]:
    """A key and a self-signed certificate for the address 127.0.0.1, as PEM files (the
    certificate is its own authority)."""
    cert, key = _certificate("agent service", None)
    return _write(directory, "service", cert, key)


def signed_by_an_authority(directory: Path, name: str = "authority") -> tuple[Path, Path, Path]:
    """An authority's certificate (``<name>.pem``) and a key and certificate for the address
    127.0.0.1 that it signed, as PEM files: (authority, certificate, key)."""
    ca_cert, ca_key = _certificate(f"{name} CA", None)
    cert, key = _certificate("agent service", (ca_cert, ca_key))
    authority, _ = _write(directory, name, ca_cert, ca_key)
    return (authority, *_write(directory, f"{name}-service", cert, key))


def _certificate(common_name: str, issuer) -> tuple:
    """A certificate and its key; an authority of its own when ``issuer`` (certificate,
    key) is None, else one for 127.0.0.1 that ``issuer`` signed."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    issuer_name, issuer_key = (name, key) if issuer is None else (issuer[0].subject, issuer[1])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(issuer_name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .add_extension(x509.BasicConstraints(ca=issuer is None, path_length=None),
                           critical=True)
            .sign(issuer_key, hashes.SHA256()))
    return cert, key


def _write(directory: Path, stem: str, cert, key) -> tuple[Path, Path]:
    from cryptography.hazmat.primitives import serialization

    cert_file, key_file = directory / f"{stem}.pem", directory / f"{stem}.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_file, key_file


@contextlib.contextmanager
def running_service(tls: tuple[Path, Path] | None = None) -> Iterator[str]:
    """This service in a process of its own while the block runs, over HTTPS with ``tls``
    (certificate and key files) when given: its base URL."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    proc = subprocess.Popen([sys.executable, __file__, *map(str, tls or ())],
                            stdout=subprocess.PIPE, env=env)
    try:
        port = int(proc.stdout.readline())
        yield f"{'https' if tls else 'http'}://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()


if __name__ == "__main__":
    server = ThreadingHTTPServer(("127.0.0.1", 0), Episode)
    server.daemon_threads = True
    if len(sys.argv) == 3:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(sys.argv[1], sys.argv[2])
        server.socket = context.wrap_socket(server.socket, server_side=True)
    print(server.server_address[1], flush=True)
    sys.stdout.close()
    server.serve_forever()
