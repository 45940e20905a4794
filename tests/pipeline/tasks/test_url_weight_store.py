"""Versions through an fsspec URL store (``weight_store = "ftp://..."``), against a real FTP
server (pyftpdlib, in a process of its own) with fsspec's own FTP client: the trainer's
versions land on the server, each folder before the manifest that makes it whole, and only
the ``keep`` newest up to the one published stay (a version published again after a resume
drops newer ones and any half-written folder); a reader copies a version into its local
store. A run with such a store writes no version into the run directory, yet its generation
worker generates iteration 2 from v1, which it read from the server (its RETR is in the
server's log), with the credentials given to the workers as fsspec's environment variables.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

from rlhfless.ops.engine.engine_types import RemoteStore
from rlhfless.ops.engine.url_store import fetch, publish_files, published_versions
from rlhfless.pipeline.config import Config, ConfigError
from rlhfless.pipeline.tasks.weight_store import publish_version
from rlhfless.pipeline.train.loop import train

USER, PASSWORD = "trainer", "not-a-secret"
SERVER = textwrap.dedent("""
    import logging, sys
    from pyftpdlib.authorizers import DummyAuthorizer
    from pyftpdlib.handlers import FTPHandler
    from pyftpdlib.servers import FTPServer
    root, log, user, password = sys.argv[1:]
    logging.basicConfig(filename=log, level=logging.INFO, format="%(message)s")
    authorizer = DummyAuthorizer()
    authorizer.add_user(user, password, root, perm="elradfmw")
    FTPHandler.authorizer = authorizer
    server = FTPServer(("127.0.0.1", 0), FTPHandler)
    print(server.address[1], flush=True)
    server.serve_forever()
""")
STATE = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(3)}


@dataclass
class FtpServer:
    root: Path  # the server's files on this machine's disk
    port: int
    log: Path  # one line per command and transfer

    def url(self, path: str) -> str:
        return f"ftp://127.0.0.1:{self.port}/{path}"

    def transfers(self, command: str) -> list[str]:
        """The paths (as the client names them) of the completed ``STOR`` or ``RETR``
        commands, in order."""
        return [p.removeprefix(str(self.root)) for p in
                re.findall(rf"{command} (\S+) completed=1", self.log.read_text())]


@pytest.fixture
def ftp(tmp_path):
    root = tmp_path / "ftp"
    root.mkdir()
    log = tmp_path / "ftp.log"
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(root), str(log), USER,
                               PASSWORD], stdout=subprocess.PIPE, text=True)
    try:
        yield FtpServer(root, int(server.stdout.readline()), log)
    finally:
        server.terminate()
        server.wait(10)


def _shifted(version: int) -> dict[str, torch.Tensor]:
    return {k: v + version for k, v in STATE.items()}


def _listing(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir())


def test_versions_go_whole_to_the_server_and_the_newest_stay(ftp, tmp_path):
    store = RemoteStore(ftp.url("weights"), (("password", PASSWORD), ("username", USER)))
    refs = {v: publish_version(_shifted(v), store, v, keep=2) for v in (1, 2, 3)}
    on_disk = ftp.root / "weights"
    folders = {v: ref.path.split("/")[0] for v, ref in refs.items()}
    assert _listing(on_disk) == sorted(["v2.json", "v3.json", folders[2], folders[3]])
    assert sorted(published_versions(store)) == [2, 3]
    stored = ftp.transfers("STOR")  # each folder's file before the manifest that names it
    for v in (1, 2, 3):
        assert stored.index(f"/weights/{refs[v].path}") < stored.index(f"/weights/v{v}.json")

    local = fetch(refs[3], tmp_path / "local")
    assert Path(local.path) == tmp_path / "local" / "v3.safetensors"
    assert refs[3].nbytes == Path(local.path).stat().st_size  # the version's bytes published
    got = load_file(local.path)
    assert all(torch.equal(got[k], _shifted(3)[k]) for k in STATE)

    (on_disk / "v4.0badc0ffee0").mkdir()  # a publish cut off half way, no manifest
    again = publish_version(_shifted(2), store, 2, keep=2)  # a resume publishes v2 again
    assert again.path != refs[2].path  # a folder of its own: the old one was not overwritten
    assert _listing(on_disk) == sorted(["v2.json", again.path.split("/")[0]])
    with pytest.raises(FileNotFoundError, match=r"policy v3: .* is not in the weight store"):
        fetch(refs[3], tmp_path / "elsewhere")


def test_an_adapter_directory_goes_and_comes_whole(ftp, tmp_path):
    store = RemoteStore(ftp.url("lora"), (("password", PASSWORD), ("username", USER)))
    files = {"adapter_config.json": [b'{"r": 4}'], "adapter_model.safetensors": [b"ab", b"cd"]}
    ref = publish_files("v1", files, store, 1)
    local = Path(fetch(ref, tmp_path / "local").path)
    assert local == tmp_path / "local" / "v1" and _listing(local) == sorted(files)
    assert (local / "adapter_model.safetensors").read_bytes() == b"abcd"
    assert published_versions(store)[1]["files"] == {"adapter_config.json": 8,
                                                     "adapter_model.safetensors": 4}


def test_a_url_store_is_checked_in_one_line():
    assert Config(weight_store="ftp://host/weights").weight_store == "ftp://host/weights"
    with pytest.raises(ConfigError, match=r"weight_store = 's3' is not allowed; choose one "
                                          r"of \('run', 'cluster'\) or an fsspec URL"):
        Config(weight_store="s3")
    with pytest.raises(ConfigError, match=r"weight_store = 'nope://x': fsspec knows no "
                                          r"protocol 'nope'"):
        Config(weight_store="nope://x")
    with pytest.raises(ConfigError, match="memory file system lives in one process"):
        Config(weight_store="memory://x")
    with pytest.raises(ConfigError, match=r"weight_store_options = .* weight_store = 'run' "
                                          "takes none"):
        Config(weight_store_options={"anon": True})


def test_a_run_trains_through_the_server_with_no_version_on_disk(tiny_model_dir, tmp_path,
                                                                 ftp, monkeypatch):
    # credentials as fsspec reads them in every process (fsspec.config): not in config.json
    monkeypatch.setenv("FSSPEC_FTP_USERNAME", USER)
    monkeypatch.setenv("FSSPEC_FTP_PASSWORD", PASSWORD)
    cfg = Config(model=str(tiny_model_dir), runs_dir=str(tmp_path / "runs"), name="ftp",
                 iterations=2, batch_prompts=2, n_samples=2, max_new_tokens=8,
                 heldout_prompts=2, eval_every=100, gen_workers=1, train_threads=1,
                 weight_store=ftp.url("weights"))
    run = train(cfg, progress=False, log=lambda *_: None)
    assert not run.weights.exists() or _listing(run.weights) == []
    assert PASSWORD not in (run.path / "config.json").read_text()
    iterations = [m for m in run.metrics() if m.get("event") == "iteration"]
    # iteration 1 generated from the model itself; iteration 2's worker copied v1 first
    assert iterations[0]["weight_fetch_s"] == 0 < iterations[1]["weight_fetch_s"]
    table = {i: pq.read_table(run.path / "rollouts" / f"iter-{i:05d}.parquet") for i in (1, 2)}
    assert [set(table[i].column("policy_version").to_pylist()) for i in (1, 2)] == [{0}, {1}]
    manifests = {v: json.loads((ftp.root / "weights" / f"v{v}.json").read_text())
                 for v in (1, 2)}  # the trainer published v1 and v2 there
    v1 = f"/weights/{manifests[1]['folder']}/v1.safetensors"
    assert v1 in ftp.transfers("STOR") and v1 in ftp.transfers("RETR")  # read from the server
