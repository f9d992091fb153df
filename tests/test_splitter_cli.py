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


@pytest.mark.parametrize("flag", ["--port", "--metrics-port"])
@pytest.mark.parametrize("value", ["99999", "-5", "x"])
def test_a_port_out_of_range_is_bad_input_naming_its_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str, value: str) -> None:
    """Outside probe: `--port 99999` was a traceback (OverflowError from bind) and exit 1."""
    ports = {"--port": "0", "--metrics-port": "0", flag: value}
    with pytest.raises(SystemExit) as exited:
        main(["splitter", "--table", str(tmp_path / "split.json"), *(x for kv in ports.items() for x in kv)])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}" in err and "Traceback" not in err
