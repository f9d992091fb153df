"""The first minutes with the command line: --version, `kvguard operator` without a cluster, and
the Makefile's choice of torch build."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def kvguard(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-P", "-m", "kvguard", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, check=False)  # fmt: skip


def no_cluster_env(home: Path, **extra: str) -> dict[str, str]:
    """The environment of a machine with no cluster: no kubeconfig, not in a pod."""
    env = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT")}
    return {**env, "HOME": str(home), **extra}


def test_version_is_the_package_metadata() -> None:
    done = kvguard("--version")
    assert done.returncode == 0 and done.stdout.strip() == f"kvguard {version('kvguard')}"


def test_operator_without_a_cluster_prints_one_line_and_exits_1(tmp_path: Path) -> None:
    done = kvguard("operator", env=no_cluster_env(tmp_path))
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 1
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert lines[0].startswith("kvguard operator: no Kubernetes cluster") and "KUBECONFIG" in lines[0]


def test_operator_with_an_unreachable_api_server_says_where_it_looked(tmp_path: Path) -> None:
    config = tmp_path / "kubeconfig"
    config.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        "clusters: [{name: c, cluster: {server: 'http://127.0.0.1:1'}}]\n"  # port 1: nothing listens
        "users: [{name: u, user: {token: t}}]\ncontexts: [{name: c, context: {cluster: c, user: u}}]\n"
    )
    done = kvguard("operator", env=no_cluster_env(tmp_path, KUBECONFIG=str(config)))
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 1 and len(lines) == 1, done.stderr
    assert "cannot reach the Kubernetes API server at http://127.0.0.1:1" in lines[0]


def test_a_malformed_kubeconfig_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    config = tmp_path / "kubeconfig"
    config.write_text("garbage: [")
    env = no_cluster_env(tmp_path, KUBECONFIG=str(config))
    for args in (("operator",), ("status", "tiny")):
        done = kvguard(*args, env=env)
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        assert done.returncode == 1 and len(lines) == 1, (args, done.stderr)
        assert "kubeconfig" in lines[0] and "Traceback" not in done.stderr


def test_status_piped_into_a_reader_that_stops_early_exits_quietly(tmp_path: Path) -> None:
    """`kvguard status NAME | head -1`: the closed pipe is the reader's choice, not an error."""
    import json

    state = tmp_path / "state"
    state.mkdir()
    (state / "state.json").write_text(json.dumps({"version": 2, "uid": "local-1", "model": "tiny"}))
    reader = subprocess.Popen([sys.executable, "-P", "-m", "kvguard", "status", "tiny", "--local", "--state-dir", str(state)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    assert reader.stdout is not None
    reader.stdout.close()  # the reader is gone before status writes anything
    _, err = reader.communicate(timeout=120)
    assert b"BrokenPipeError" not in err and b"Traceback" not in err, err


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
@pytest.mark.parametrize(
    ("variables", "expected"),
    [
        ([], "pip install --progress-bar off 'torch==2.13.0'"),
        (["TORCH_INDEX=https://download.pytorch.org/whl/cpu"],
         "pip install --progress-bar off --index-url https://download.pytorch.org/whl/cpu 'torch==2.13.0'"),
        (["TORCH_SPEC=/wheels/torch-2.13.0+cpu-cp311-cp311-linux_x86_64.whl"],
         "pip install --progress-bar off '/wheels/torch-2.13.0+cpu-cp311-cp311-linux_x86_64.whl'"),
    ],
)  # fmt: skip
def test_make_installs_the_torch_build_the_variables_choose(variables: list[str], expected: str) -> None:
    """A dry run (-n) of the install step, as if the Makefile had just changed (-W): nothing runs."""
    done = subprocess.run(["make", "-n", "-W", "Makefile", ".venv/.installed", *variables], cwd=REPO,
                          capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
    torch_lines = [" ".join(line.split()) for line in done.stdout.splitlines() if "torch" in line and "pip install" in line]
    assert len(torch_lines) == 1 and torch_lines[0].endswith(expected), done.stdout


def test_the_demo_states_one_duration_everywhere() -> None:
    """README, `kvguard demo --help` and the demo's first line give the same figure (the issue
    found "~1 minute", "about a minute" and "well under two minutes" for one demo)."""
    from kvguard.commands.demo import DEMO_SECONDS
    from kvguard.demo import DURATION

    readme = " ".join((REPO / "README.md").read_text().split())
    assert f"`kvguard demo` tells the whole story on a laptop in about {DEMO_SECONDS} seconds" in readme
    assert "minute" not in readme.split("## Set up", 1)[1].split("## Commands", 1)[0].replace("a few minutes", "")
    assert f"About {DEMO_SECONDS} s on 2 CPU cores" in " ".join(kvguard("demo", "--help").stdout.split())
    assert f"in about {DEMO_SECONDS} s" in " ".join(kvguard("--help").stdout.split())  # the one-line help
    assert DURATION.startswith(f"about {DEMO_SECONDS} s on 2 CPU cores")


def test_an_early_ctrl_c_is_one_line_and_130(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # A SIGINT while the command still imports (before its own handler) was a traceback.
    from kvguard import cli

    def interrupted() -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", interrupted)
    assert cli.main(["canary", "--url", "http://127.0.0.1:1"]) == cli.EXIT_INTERRUPTED
    assert capsys.readouterr().err == "kvguard canary: interrupted\n"


@pytest.mark.parametrize(("argv", "missing", "extra"), [
    (["canary", "--url", "http://127.0.0.1:1/v1"], "aiohttp", "operator"),
    (["model", "tiny", "/nonexistent/kvguard-model"], "torch", "workers"),
    (["model", "tiny", "{tmp}/tiny"], "numpy", "workers"),  # safetensors writes through numpy, which the extra lacked
    (["status", "x"], "urllib3", "operator"),  # imported by the API client before kubernetes
])
def test_a_command_without_its_extra_names_what_to_install(argv: list[str], missing: str, extra: str, tmp_path: Path) -> None:
    """Outside probe: `kvguard canary` on an install without the operator extra was an ImportError
    traceback. Blocking the package (`sys.modules[name] = None`) is how Python reports it absent."""
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    script = f"import sys; sys.modules[{missing!r}] = None; from kvguard.cli import main; sys.exit(main({argv!r}))"
    out = subprocess.run([sys.executable, "-P", "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 2, out.stderr
    said = f"kvguard {argv[0]}: needs the Python package {missing}, which is not installed: pip install 'kvguard[{extra}]'\n"
    # (without numpy, torch's own import warns "Failed to initialize NumPy" first: not ours to quiet)
    assert out.stderr.endswith(said) if missing == "numpy" else out.stderr == said, out.stderr


def test_a_closed_stdout_ends_a_command_quietly() -> None:
    # `kvguard plan ... | head -1`: the reader leaves, and the rest must not be a BrokenPipeError traceback.
    plan = subprocess.Popen([sys.executable, "-P", "-m", "kvguard", "plan", "-f", str(REPO / "examples/incident.yaml")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    assert plan.stdout is not None and plan.stderr is not None
    plan.stdout.close()  # before it writes anything: its every write hits a closed pipe
    plan.wait(timeout=120)
    assert plan.stderr.read() == b""
    plan.stderr.close()


@pytest.mark.parametrize("args", [["plan", "-f", "-"], ["render", "-f", "-"], ["canary", "--url", "http://127.0.0.1:9/v1", "--spec", "-"]])
def test_standard_input_closed_or_not_utf8_is_one_line_and_exit_2(args: list[str]) -> None:
    """`-f -` with stdin closed (`<&-`: sys.stdin is None) was an AttributeError traceback and
    exit 1; bytes that are not UTF-8 got PyYAML's wording for a string it was handed (outside
    probe). Both are a file that cannot be read: one line, exit 2."""
    command = [sys.executable, "-P", "-m", "kvguard", *args]
    closed = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False,
                            preexec_fn=lambda: os.close(0))  # noqa: PLW1509 - the child's own stdin, before exec
    assert closed.returncode == 2 and "Traceback" not in closed.stderr, closed.stderr
    assert closed.stderr.strip().endswith("cannot read -: standard input is closed"), closed.stderr
    latin = subprocess.run(command, input=b"\xff\xfebad", capture_output=True, timeout=120, check=False)
    assert latin.returncode == 2 and latin.stderr.decode().strip().endswith("- is not UTF-8 text (byte 0)"), latin.stderr


@pytest.mark.parametrize("text", ['{"revisions": 5', "[]", "", '{"revisions": {"r1": {"workers": 3}}}'])
def test_status_of_an_unreadable_state_folder_is_one_line_and_exit_2(tmp_path: Path, text: str) -> None:
    """An outside probe: a truncated state.json gave a traceback and exit 1 ("cannot reach the cluster")."""
    state = tmp_path / "state"
    state.mkdir()
    (state / "state.json").write_text(text)
    done = kvguard("status", "tiny", "--local", "--state-dir", str(state))
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert "unreadable state" in lines[0] and "Traceback" not in done.stderr


def test_a_worker_on_a_busy_port_names_the_port_and_its_flag(tiny_model_dir: Path) -> None:
    """An outside probe: a restarted router's log said only "cannot listen on 127.0.0.1: Address
    already in use", so a user could not tell which port another process held."""
    import socket

    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        done = kvguard("worker", "--role", "router", "--model", str(tiny_model_dir), "--port", str(port),
                       "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2")  # fmt: skip
    assert done.returncode == 2 and f"cannot listen on 127.0.0.1:{port} (--port): " in done.stderr, done.stderr


def test_crds_with_an_empty_output_folder_writes_nothing(tmp_path: Path) -> None:
    """Outside probe: `-o ''` is Path("."): the CRD files landed in the current folder without a word."""
    done = subprocess.run([sys.executable, "-P", "-m", "kvguard", "crds", "-o", ""], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 2 and "name the folder to write" in done.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv, command", [
    (["serve", "--model", "m", "--kv-pool-tokns", "4096"], "serve"),
    (["plan", "-f", "examples/tiny-cpu.yaml", "--contxt-length", "5"], "plan"),
    (["canary", "--url", "http://127.0.0.1:1", "--metric-url", "x"], "canary"),
    (["model", "tiny", "/tmp/unused", "--bogus", "1"], "model tiny"),  # a command's command: the innermost
])
def test_a_mistyped_flag_is_refused_by_its_command_with_that_commands_usage(
    argv: list[str], command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A new user's report: argparse's top-level parser refused it as `kvguard: error:` with the
    top-level usage, naming no command, where a bad value names the command."""
    from kvguard.cli import main

    with pytest.raises(SystemExit) as exited:
        main(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2
    assert f"kvguard {command}: error: unrecognized arguments: {' '.join(argv[-2:])}" in err, err
    assert err.startswith(f"usage: kvguard {command} "), err


def test_a_workers_own_refusal_carries_no_pydantic_prefix(tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Outside probe: "kvguard worker: Value error, the router needs ..."."""
    from kvguard.cli import main

    assert main(["worker", "--role", "router", "--model", str(tiny_model_dir)]) == 2
    assert capsys.readouterr().err == "kvguard worker: the router needs at least one --prefill and one --decode URL\n"


@pytest.mark.parametrize(("flags", "named"), [
    (["--url", "notaurl"], "--url 'notaurl'"),
    (["--url", "ftp://127.0.0.1:1/v1"], "--url 'ftp://127.0.0.1:1/v1'"),
    (["--url", "http:///v1"], "--url 'http:///v1'"),
    (["--url", "http://127.0.0.1:99999/v1"], "--url 'http://127.0.0.1:99999/v1'"),
    (["--url", "http://127.0.0.1:1/v1", "--baseline-url", "localhost:8000"], "--baseline-url 'localhost:8000'"),
    (["--url", "http://127.0.0.1:1/v1", "--metrics-url", "http://127.0.0.1:1/metrics", "x"], "--metrics-url 'x'"),
])  # fmt: skip
def test_a_canary_url_that_is_not_http_with_a_host_is_refused_up_front(capsys: pytest.CaptureFixture[str], flags: list[str],
                                                                       named: str) -> None:  # fmt: skip
    """Outside probe: `--url notaurl` ran and failed as "InvalidUrlClientError: notaurl/v1/models"."""
    from kvguard.cli import main

    assert main(["canary", *flags]) == 2
    captured = capsys.readouterr()
    assert captured.err == f"kvguard canary: cannot run: {named} is not an http:// or https:// URL with a host (e.g. http://127.0.0.1:8000/v1)\n"
    assert captured.out == ""  # refused before the run's header


def test_an_unreachable_canary_target_is_one_plain_line(capsys: pytest.CaptureFixture[str]) -> None:
    """Outside probe: "ClientConnectorError: Cannot connect to host 127.0.0.1:9 ssl:default [Connect
    call failed ('127.0.0.1', 9)]". A bound socket that does not listen refuses every connection."""
    import socket

    from kvguard.cli import main

    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
        assert main(["canary", "--url", f"http://127.0.0.1:{port}/v1", "-o", "json"]) == 2
    err = capsys.readouterr().err
    assert err == f"kvguard canary: cannot run: target http://127.0.0.1:{port}: GET /v1/models: cannot connect to 127.0.0.1:{port}: connection refused\n"


def test_a_tls_failure_is_said_as_tls_not_as_an_os_error(capsys: pytest.CaptureFixture[str]) -> None:
    """A review: OpenSSL's errno (1) was read as the OS's: "operation not permitted" for an https
    URL at a server that speaks plain HTTP (or whose certificate does not verify)."""
    import socket
    import threading

    from kvguard.cli import main

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]

        def answer_in_plain_text() -> None:  # what an HTTP server says to a TLS hello
            for _ in range(4):  # the canary's client retries a connection
                try:
                    conn, _ = listener.accept()
                except OSError:
                    return
                with conn:
                    conn.recv(4096)
                    conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")

        threading.Thread(target=answer_in_plain_text, daemon=True).start()
        assert main(["canary", "--url", f"https://127.0.0.1:{port}/v1", "-o", "json", "--timeout", "5"]) == 2
    err = capsys.readouterr().err
    assert f"cannot connect to 127.0.0.1:{port}: TLS: " in err and "operation not permitted" not in err, err


def test_apply_delete_without_local_says_what_deletes_on_a_cluster(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Outside probe: `apply --delete` without --local said to `kubectl apply -f` the manifest."""
    from kvguard.cli import main

    assert main(["apply", "--delete", "--state-dir", str(tmp_path / "s")]) == 2
    assert capsys.readouterr().err == "kvguard apply: --delete needs --local; on a cluster, `kubectl delete inferencemodel NAME`\n"
    with pytest.raises(SystemExit):
        main(["apply", "--help"])
    assert "--delete (needs --local) stop every process" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize(("change", "said"), [
    (("kind", "InferenceModle"), "kind: 'InferenceModle', expected InferenceModel (or a CanarySpec, which has no kind)"),
    (("contextLenght", 4096), "spec.contextLenght: Extra inputs are not permitted"),
    (("canary", {"isolation": {"longRequestMaxTokens": 1_000_000}}), "spec.canary.isolation.longRequestMaxTokens: 1,000,000 leaves no room"),
])  # fmt: skip
def test_a_canary_spec_manifest_is_refused_as_plan_refuses_it(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                             change: tuple[str, object], said: str) -> None:  # fmt: skip
    """A new user's report: a manifest of another kind was read as a CanarySpec ("apiVersion: Extra
    inputs are not permitted; ..."), and one misspelling spec.contextLength ran the canary and
    passed, where `plan`, `render` and `apply` refuse both."""
    import yaml

    from kvguard.cli import main

    manifest = yaml.safe_load((Path(__file__).resolve().parent.parent / "examples" / "tiny-cpu.yaml").read_text())
    key, value = change
    (manifest if key == "kind" else manifest["spec"])[key] = value
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(manifest))
    assert main(["canary", "--url", "http://127.0.0.1:9/v1", "--spec", str(path)]) == 2
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err, err
