"""`kvguard splitter`'s refusals: one line naming the flag, exit 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvguard.cli import main


def test_a_busy_splitter_port_names_its_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Which of the two ports is taken, by its flag."""
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["splitter", "--table", str(tmp_path / "split.json"), "--port", "0", "--metrics-port", str(port)]) == 2
    assert capsys.readouterr().err.startswith(f"kvguard splitter: --metrics-port {port}: cannot listen on 127.0.0.1:{port}: ")
