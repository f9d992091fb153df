"""`kvguard serve` as a user runs it: one JSON line first, a working API, and SIGTERM/SIGINT stop
all three processes."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from waiting import wait_for

from kvguard.cli import build_parser
from kvguard.workers.args import WorkerArgs


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_serve_prints_its_urls_and_stops_every_process_on_a_signal(tiny_model_dir: Path, signum: int) -> None:
    with _serving(tiny_model_dir) as (serve, urls):
        assert set(urls["metrics"]) == {"router", "prefill", "decode"}
        assert set(urls["internal"]) == {"prefill", "decode"}
        _assert_one_audience_per_port(urls)
        model = requests.get(f"{urls['router']}/models", timeout=30).json()["data"][0]["id"]
        answer = requests.post(f"{urls['router']}/completions", json={"model": model, "prompt": "hi", "max_tokens": 3}, timeout=30)
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 3
        workers = _children(serve.pid)
        assert len(workers) == 3
        serve.send_signal(signum)
        assert serve.wait(timeout=120) == 0
        wait_for(lambda: not [pid for pid in workers if Path(f"/proc/{pid}").exists()], "every worker process gone",
                 detail=lambda: [pid for pid in workers if Path(f"/proc/{pid}").exists()])  # fmt: skip


@contextlib.contextmanager
def _serving(model_dir: Path) -> Iterator[tuple[subprocess.Popen[str], dict]]:
    """`kvguard serve` as a user starts it, and the URLs of its first output line; killed at the end
    if the test left it running."""
    serve = subprocess.Popen(
        [sys.executable, "-P", "-m", "kvguard", "serve", "--model", str(model_dir),
         "--kv-pool-tokens", "2048", "--context-length", "512"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        assert serve.stdout is not None
        yield serve, json.loads(serve.stdout.readline())
    finally:
        if serve.poll() is None:
            serve.kill()


def test_workers_stop_by_themselves_when_serve_is_killed(tiny_model_dir: Path) -> None:
    """SIGKILL (or the OOM killer) gives serve no chance to stop its workers: they must notice
    (the lifeline pipe) and stop, not keep serving and holding every port."""
    with _serving(tiny_model_dir) as (serve, urls):
        workers = _children(serve.pid)
        assert len(workers) == 3
        serve.kill()
        serve.wait(timeout=30)
        wait_for(lambda: not [pid for pid in workers if _running(pid)], "every orphaned worker stopped",
                 timeout=60, detail=lambda: [pid for pid in workers if _running(pid)])  # fmt: skip
        with pytest.raises(requests.ConnectionError):
            requests.get(f"{urls['router']}/models", timeout=30)


def test_serve_stopped_while_it_starts_prints_no_ready_line_and_leaves_nothing(tiny_model_dir: Path) -> None:
    """Outside probe: a SIGTERM during start-up was only read once every worker was ready; serve
    then printed its "ready" line for a server already stopping, and exited 0. One worker is held
    (SIGSTOP) as soon as it exists, so serve is certainly still starting when the signal comes."""
    serve = subprocess.Popen([sys.executable, "-P", "-m", "kvguard", "serve", "--model", str(tiny_model_dir),
                              "--kv-pool-tokens", "2048", "--context-length", "512"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    held: list[int] = []
    try:
        held = wait_for(lambda: _workers(serve.pid)[:1], "a worker started", interval=0.005)
        os.kill(held[0], signal.SIGSTOP)  # it cannot become healthy: the start cannot complete
        workers = wait_for(lambda: len(found := _workers(serve.pid)) == 3 and found, "every worker started")
        serve.send_signal(signal.SIGTERM)
        os.kill(held[0], signal.SIGCONT)  # so that it can stop on serve's own signal
        out, err = serve.communicate(timeout=120)
    finally:
        if held:
            with contextlib.suppress(ProcessLookupError):
                os.kill(held[0], signal.SIGCONT)
        if serve.poll() is None:
            serve.kill()
            serve.wait()
    assert serve.returncode == 0 and out == "", (serve.returncode, out)
    assert "kvguard serve: stopped during start-up" in err and "Traceback" not in err, err
    wait_for(lambda: not [pid for pid in workers if _running(pid)], "every worker process gone",
             detail=lambda: [pid for pid in workers if _running(pid)])  # fmt: skip


def _workers(pid: int) -> list[int]:
    """The worker processes among `pid`'s children (under load, an import may run a short-lived
    helper process first: stopped by mistake, it stayed a fourth child for ever)."""
    found = []
    for child in _children(pid):
        with contextlib.suppress(OSError):
            if b"\0kvguard\0worker\0" in Path(f"/proc/{child}/cmdline").read_bytes():
                found.append(child)
    return found


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie waits for init to reap it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _assert_one_audience_per_port(urls: dict) -> None:
    """S9: the metrics listener serves /metrics and /health only; the internal control API serves
    /internal/* only, and only to the router (signed calls); the public API serves neither."""
    api = urls["router"].removesuffix("/v1")
    for role, metrics_url in urls["metrics"].items():
        metrics_base = metrics_url.removesuffix("/metrics")
        assert requests.get(metrics_url, timeout=30).status_code == 200
        assert requests.get(f"{metrics_base}/health", timeout=30).status_code == 200
        for path in ("/internal/info", "/internal/abort", "/internal/decode", "/internal/prefill", "/v1/models"):
            assert requests.post(f"{metrics_base}{path}", json={}, timeout=30).status_code in (404, 405), (role, path)
    for internal in urls["internal"].values():
        refused = requests.get(f"{internal}/internal/info", timeout=30)  # not signed by the router
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "unauthenticated"
        assert requests.get(f"{internal}/metrics", timeout=30).status_code == 404
    assert requests.get(f"{api}/metrics", timeout=30).status_code == 404
    assert requests.get(f"{api}/internal/info", timeout=30).status_code == 404


def _run_serve(*flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-P", "-m", "kvguard", "serve", *flags], capture_output=True, text=True, timeout=120)


def test_serve_refuses_a_pool_below_twice_the_context_before_starting_anything(tiny_model_dir: Path) -> None:
    """The incident's sizing (#13): refused with exit 3 and the fix, unless --allow-small-pool."""
    done = _run_serve("--model", str(tiny_model_dir), "--kv-pool-tokens", "512", "--context-length", "1024")
    assert done.returncode == 3 and done.stdout == ""
    assert "0.50x the context length" in done.stderr and "--kv-pool-tokens to at least 2048" in done.stderr


def test_serve_pool_advice_counts_whole_pages_and_never_rounds_up_to_the_ratio(tiny_model_dir: Path) -> None:
    done = _run_serve("--model", str(tiny_model_dir), "--kv-pool-tokens", "2047", "--context-length", "1024", "--page-size", "1")
    assert done.returncode == 3 and "1.99x the context length" in done.stderr
    # 2048 tokens in pages of 1000 is a pool of 2000, and a 1024-token request takes 2 pages: the
    # advice names the whole pages that hold two such requests (4, not the 3 that 2,048 tokens fill).
    done = _run_serve("--model", str(tiny_model_dir), "--kv-pool-tokens", "2048", "--context-length", "1024", "--page-size", "1000")
    assert done.returncode == 3 and "pool (2000 tokens)" in done.stderr and "at least 4000" in done.stderr


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--port", "99999"], "--port: must be a TCP port 0..65535"),
        (["--transfer-port", "-1"], "--transfer-port: must be a TCP port 0..65535"),
        (["--kv-pool-tokens", "-5", "--context-length", "10"], "--kv-pool-tokens: must be at least 1"),
        (["--context-length", "8192"], "--context-length 8192 exceeds the model's maximum 4096"),
        (["--device", "tpu"], "kvguard serve: --device: must be auto, cpu, cuda or cuda:N, got 'tpu'\n"),
        (["--transfer-timeout", "nan"], "kvguard serve: --transfer-timeout: must be a finite number > 0, got nan\n"),
        (["--request-timeout", "inf"], "kvguard serve: --request-timeout: must be a finite number > 0 and <= 86400, got inf\n"),
        (["--port", "23999", "--metrics-port", "23999"], "--port and --metrics-port both ask for port 23999"),
        (["--model-name", ""], "--model-name: String should have at least 1 character"),
    ],
)
def test_serve_bad_flags_exit_2_with_one_line_before_any_worker_starts(tiny_model_dir: Path, flags: list[str], message: str) -> None:
    done = _run_serve("--model", str(tiny_model_dir), *flags)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr and "Traceback" not in done.stderr and "listening on" not in done.stderr


@pytest.mark.parametrize(("model", "said"), [
    ("{tmp}/nonexistent", "does not exist"), ("{tmp}/a-file", "is not a folder"), ("{tmp}", "has no config.json"),
    ("{tmp}/broken", "has a config.json that is not JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1))"),
    ("{tmp}/listed", "has a config.json that is not a JSON object (a list)"),
    ("{tmp}/unweighted", "has no *.safetensors weights (nor a model.safetensors.index.json naming them)"),
    ("{tmp}/bom", "has a config.json that is not JSON (Unexpected UTF-8 BOM (decode using utf-8-sig): line 1 column 1 (char 0))"),
])  # fmt: skip
def test_serve_says_what_is_wrong_with_the_model_folder(tmp_path: Path, model: str, said: str) -> None:
    """Outside probe: `--model /nonexistent` said the folder "has no config.json". A new user's
    report: a config.json that is not JSON, or no weights, was a worker failing to start (exit 1,
    the error printed by each worker), not bad input."""
    (tmp_path / "a-file").write_text("")
    for folder, config in (("broken", "{bad"), ("listed", "[]"), ("unweighted", "{}"), ("bom", "\ufeff{}")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "config.json").write_text(config)
    model = model.format(tmp=tmp_path)
    done = _run_serve("--model", model)
    assert done.returncode == 2 and done.stderr == f"kvguard serve: --model {model} {said}\n"


def test_serve_reports_a_busy_port_at_once_naming_its_flag(tiny_model_dir: Path) -> None:
    from kvguard.workers.args import bind_listener

    busy = bind_listener("127.0.0.1", 0)
    try:
        port = busy.getsockname()[1]
        done = _run_serve("--model", str(tiny_model_dir), "--decode-port", str(port))
        assert done.returncode == 2 and f"127.0.0.1:{port} (--decode-port)" in done.stderr
        assert "in use" in done.stderr
        assert "listening on" not in done.stderr and "worker ready" not in done.stderr  # found before any worker started
    finally:
        busy.close()


def test_the_served_name_is_the_model_folders_even_as_a_relative_path(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvguard.workers.args import WorkerArgs

    monkeypatch.chdir(tiny_model_dir)
    assert WorkerArgs(role="prefill", model=Path(".")).served_model_name() == tiny_model_dir.resolve().name  # not ""
    assert WorkerArgs(role="prefill", model=Path("."), model_name="m-1").served_model_name() == "m-1"


def test_worker_args_round_trip_through_the_command_line() -> None:
    """One type for every worker command line (renderer, local backend, launcher): what to_argv
    writes, `kvguard worker` parses back to the same value."""
    from kvguard.workers.args import Listen, WorkerArgs, parse_argv

    decode = WorkerArgs(role="decode", model=Path("/m"), port=Listen(fd=5), metrics_port=Listen(port=9001),
                        transfer_port=Listen(port=0), kv_pool_tokens=4096, advertise_host="$(POD_IP)")  # fmt: skip
    router = WorkerArgs(role="router", model=Path("/m"), prefill=("http://p:8000",), decode=("http://d1", "http://d2"))
    for args in (decode, router):
        assert parse_argv(args.to_argv()) == args
    with pytest.raises(ValueError, match="router needs"):
        WorkerArgs(role="router", model=Path("/m"))
    with pytest.raises(ValueError, match="fd:N"):
        Listen.parse("eighty")


def _children(pid: int) -> list[int]:
    """Direct children of `pid`, from /proc (Linux)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def test_bootstrap_timeout_is_an_engine_flag(tmp_path: Path) -> None:
    from kvguard.workers.args import WorkerArgs, parse_argv

    for role in ("prefill", "decode"):
        args = WorkerArgs(role=role, model=tmp_path, bootstrap_timeout=5)
        assert parse_argv(args.to_argv()) == args
    with pytest.raises(ValueError, match="--bootstrap-timeout is a prefill and decode flag"):
        parse_argv(["--role", "router", "--model", str(tmp_path), "--prefill", "http://p", "--decode", "http://d",
                    "--bootstrap-timeout", "5"])  # fmt: skip


@pytest.mark.parametrize("command", ["serve", "worker"])
def test_help_states_the_default_of_every_flag_that_has_one(command: str) -> None:
    """README: every command's flags, defaults included, are in `--help`. An outside probe found
    seventeen worker flags and five serve flags whose defaults were not said (the worker's live on
    WorkerArgs, its parser's are None so that a flag not given stays unset)."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    defaults = {name: f.default for name, f in WorkerArgs.model_fields.items()}
    for action in sub._actions:
        if not action.option_strings or action.help in (None, argparse.SUPPRESS) or action.dest == "help":
            continue
        default = action.default if command == "serve" else defaults.get(action.dest)
        if default in (None, False, 0, ()) or not isinstance(default, int | float | str):
            continue  # nothing to state (a port 0 is "a free one", said in the description)
        assert "default" in action.help, (action.option_strings, action.help)


@pytest.mark.parametrize(
    ("broken", "message"),
    [
        ("config", "config.json num_attention_heads: is required"),
        ("type", "config.json num_hidden_layers: must be an integer, got 'x'"),
        ("weights", "not a readable safetensors file"),
        ("zero", "config.json num_attention_heads: must be above 0, got 0"),
        ("rope", "config.json rope_scaling: must be an object, got ['x']"),
        ("shape", "weights do not match config.json"),
    ],
)
def test_a_broken_model_folder_is_one_line_naming_what_is_wrong_not_a_traceback(
    tiny_model_dir: Path, tmp_path: Path, broken: str, message: str
) -> None:
    """Outside probe: a config.json missing a field, or a corrupt weights file, made every worker
    print a 59-line traceback ending in KeyError or SafetensorError, naming neither field nor file
    (an audit added a zero, a list for an object, and a tensor of the wrong shape)."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    if broken == "config":
        del config["num_attention_heads"]
    elif broken == "type":
        config["num_hidden_layers"] = "x"
    elif broken == "zero":
        config["num_attention_heads"] = 0
    elif broken == "rope":
        config["rope_scaling"] = ["x"]
    elif broken == "shape":  # a valid file whose tensor is not the shape config.json gives it
        from safetensors.torch import load_file, save_file

        tensors = load_file(str(model / "model.safetensors"))
        tensors["model.norm.weight"] = tensors["model.norm.weight"][:-1].clone()
        save_file(tensors, str(model / "model.safetensors"))
    else:
        (model / "model.safetensors").write_bytes(bytes(range(100)))
    (model / "config.json").write_text(json.dumps(config))
    done = _run_serve("--model", str(model))
    assert done.returncode != 0 and message in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_serve_the_launcher_and_the_router_take_the_workers_defaults() -> None:
    """One default per setting: `kvguard serve`'s flags, the launcher's config and the router's
    config are the workers' own (review: the values were written out four times, free to drift)."""
    from kvguard.workers.launcher import LocalServeConfig
    from kvguard.workers.router import RouterConfig

    flags = build_parser().parse_args(["serve", "--model", "m"])
    config = LocalServeConfig(model_dir=Path("m"))
    router = RouterConfig(prefill_urls=("http://p",), decode_urls=("http://d",), model_name="m")
    defaults = WorkerArgs.model_fields
    for name in ("page_size", "device", "max_transfer_batch", "transfer_timeout", "request_timeout", "max_inflight_choices",
                 "transfer_encryption", "stream_interval", "token_channel"):  # fmt: skip
        assert getattr(flags, name) == defaults[name].default, name
    for name in ("page_size", "device", "max_transfer_batch", "transfer_timeout", "transfer_encryption", "stream_interval",
                 "max_running_requests", "request_timeout", "max_inflight_choices", "write_timeout"):  # fmt: skip
        assert getattr(config, name if hasattr(config, name) else f"{name}_s") == defaults[name].default, name
    for name in ("request_timeout", "body_timeout", "write_timeout", "max_body_bytes", "max_body_memory", "max_inflight_choices"):
        assert getattr(router, name if hasattr(router, name) else f"{name}_s") == defaults[name].default, name
    from kvguard.workers.splitter import SplitterConfig

    splitter = SplitterConfig(table_path=Path("split.json"))
    for name in ("body_timeout", "write_timeout", "max_body_bytes", "max_body_memory"):  # as the router it stands in front of
        assert getattr(splitter, name if hasattr(splitter, name) else f"{name}_s") == defaults[name].default, name


def test_a_stop_signal_sent_while_a_worker_initialises_python_ends_it_with_one_line() -> None:
    """The launcher starts each worker with SIGINT held, and `kvguard.cli.main` takes it: a stop
    during start-up reached a worker still initialising Python, which died with "Fatal Python
    error: init_sys_streams" and a traceback on serve's stderr (CI under load)."""
    from kvguard.workers.launcher import popen_holding_sigint

    mask = popen_holding_sigint([sys.executable, "-c", "print(open('/proc/self/status').read())"], stdout=subprocess.PIPE, text=True)
    status = mask.communicate(timeout=60)[0]
    blocked = int(next(line for line in status.splitlines() if line.startswith("SigBlk:")).split()[1], 16)
    assert blocked & (1 << (signal.SIGINT - 1)), status  # the child starts with it held
    assert not signal.pthread_sigmask(signal.SIG_BLOCK, set()) & {signal.SIGINT}  # and the caller is as it was

    # The signal comes before the interpreter starts, whatever the machine's load: a wrapper, held
    # as the launcher holds a worker, signals itself and then execs kvguard (a pending signal
    # survives exec). It also sets SIGINT's action to the default: a process started with it
    # ignored (a background job) keeps it ignored, rightly (test_interrupts).
    signalled_first = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                       "os.kill(os.getpid(), signal.SIGINT); os.execv(sys.executable, sys.argv[1:])")  # fmt: skip
    child = popen_holding_sigint([sys.executable, "-c", signalled_first, sys.executable, "-P", "-m", "kvguard", "plan", "--help"],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    out, err = child.communicate(timeout=120)
    assert (child.returncode, out, err) == (130, "", "kvguard plan: interrupted\n")


def test_the_router_holds_at_least_one_largest_body_at_once() -> None:
    """--max-body-memory below --max-body-bytes would refuse every largest body; a router says so
    at start. Prefill and decode take neither limit's meaning from the other."""
    with pytest.raises(ValueError, match=r"--max-body-memory \(1048576\) must be at least --max-body-bytes \(2097152\)"):
        WorkerArgs(role="router", model=Path("/m"), prefill=("http://p",), decode=("http://d",),
                   max_body_bytes=2 * 1024 * 1024, max_body_memory=1024 * 1024)  # fmt: skip
    assert WorkerArgs(role="prefill", model=Path("/m"), max_body_bytes=300_000_000).max_body_memory < 300_000_000


def test_weights_named_by_an_index_pass_serves_folder_check(tmp_path: Path) -> None:
    """A review: weights sharded into a subfolder, named by model.safetensors.index.json, load in
    the engine (`model._read_state_dict`) but serve refused the folder for having no *.safetensors."""
    from kvguard.commands.serve import _model_folder_problem

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": {"w": "shards/part-1.safetensors", "v": "shards/part-2.safetensors"}}')
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "part-1.safetensors").write_bytes(b"")
    # A half-downloaded snapshot: a file its index names is not there (a review).
    assert _model_folder_problem(tmp_path) == "lacks 1 weight file(s) its index names, e.g. shards/part-2.safetensors"
    (tmp_path / "shards" / "part-2.safetensors").write_bytes(b"")
    assert _model_folder_problem(tmp_path) is None
    (tmp_path / "model.safetensors.index.json").write_text("[]")
    assert (_model_folder_problem(tmp_path) or "").startswith("has a model.safetensors.index.json that is not an index of weights")
    for weight_map in ({}, {"w": None}):  # names nothing: the engine found no weights (a review)
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
        assert _model_folder_problem(tmp_path) == "has a model.safetensors.index.json whose weight_map names no file, or not by name"
