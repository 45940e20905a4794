"""An agent service over HTTP, for the tests of ``agent = "http://..."`` (agent_http.py).

``python agent_service.py`` serves on a free loopback port, which it prints as its first
line, until it is killed (``running_service`` starts it so for a test). Each POST is one
episode (``{"row", "base_url", "api_key", "model", "ca_pem", "timeout_s"}``), played with
the real ``openai`` client against the run's endpoint as a user's own service would, and
answered with its reward. The path picks the agent:

    /tally       the tool task's agent (``tally_agent``)
    /two-turns   ``openai_agents.two_turns``: two requests of one conversation
    /broken      answers 500 with {"error": ...}
    /nan         answers {"reward": NaN}
    /slow        answers after 30 s
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

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


@contextlib.contextmanager
def running_service() -> Iterator[str]:
    """This service in a process of its own while the block runs: its base URL."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    proc = subprocess.Popen([sys.executable, __file__], stdout=subprocess.PIPE, env=env)
    try:
        yield f"http://127.0.0.1:{int(proc.stdout.readline())}"
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()


if __name__ == "__main__":
    server = ThreadingHTTPServer(("127.0.0.1", 0), Episode)
    server.daemon_threads = True
    print(server.server_address[1], flush=True)
    sys.stdout.close()
    server.serve_forever()
