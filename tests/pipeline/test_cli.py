from __future__ import annotations

import shutil

import pytest

from rlhfless.pipeline.cli import main


@pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz 'dot' is not installed")
def test_graph_writes_a_png(tmp_path):
    out = tmp_path / "iteration.png"
    assert main(["graph", "--set", "gen_workers=3", "-o", str(out)]) == 0
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5_000


def test_bad_override_is_one_line_and_exit_code_2(capsys):
    assert main(["train", "--set", "temprature=0.5"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rlhfless: config error: unknown config key 'temprature'")
    assert "\n" not in err
