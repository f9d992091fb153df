"""The local backend's pieces: command lines, refusals, the state folder, processes by PID, the
status record, `kvguard apply` input errors, and healing a killed worker (real processes)."""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import pytest
import requests
import yaml
from waiting import wait_for

from kvguard.cli import main
from kvguard.operator.api import InferenceModel
from kvguard.operator.backends.local import (
    FAULTS_ENV,
    MAX_LOCAL_WORKERS,
    TRANSFER_KEY_ENV,
    FrontDoorDown,
    LocalBackend,
    LocalBackendError,
    LocalState,
    LocalWorker,
    ProcessTable,
    StateStore,
    model_dir_for,
    runnable_problems,
    worker_argvs,
    worker_env,
)
from kvguard.operator.backends.restart_backoff import RestartBackoff
from kvguard.operator.planner import plan
from kvguard.operator.revision import revision_of

REPO = Path(__file__).resolve().parent.parent


def tiny_body(path: str = "/models/tiny") -> dict[str, Any]:
    body = yaml.safe_load((REPO / "examples" / "tiny-cpu.yaml").read_text())
    body["spec"]["model"]["source"] = {"pvc": {"claimName": "models", "path": path}}
    return body


def spec_of(body: dict[str, Any]) -> Any:
    return InferenceModel.model_validate(body).spec


def test_worker_command_lines_follow_the_plan() -> None:
    body = tiny_body()
    body["spec"]["roles"]["decode"]["dataParallel"] = 2
    body["spec"]["weights"] = {"quantization": "bf16"}
    spec = spec_of(body)
    kv_plan = plan(spec)
    ports = {"prefill-0": (1001, 3001, None), "decode-0": (1002, 3002, 2002), "decode-1": (1003, 3003, 2003), "router": (1004, 3004, None)}
    workers = {w.name: w for w in worker_argvs(spec, kv_plan, Path("/models/tiny"), ports)}
    assert list(workers) == ["prefill-0", "decode-0", "decode-1", "router"]
    decode = workers["decode-1"].argv
    assert decode[:5] == [sys.executable, "-P", "-m", "kvguard", "worker"]  # -P: operator/ never shadows the stdlib
    assert decode[decode.index("--kv-pool-tokens") + 1] == str(kv_plan.roles["decode"].pool_tokens)
    assert decode[decode.index("--transfer-port") + 1] == "2003"
    assert decode[decode.index("--metrics-port") + 1] == "3003" and workers["decode-1"].metrics_url == "http://127.0.0.1:3003/metrics"
    assert decode[decode.index("--dtype") + 1] == "bfloat16"
    router = workers["router"].argv
    assert router.count("--decode") == 2 and "http://127.0.0.1:1003" in router
    assert "--kv-pool-tokens" not in router
    assert "--stream-interval" not in decode  # unset: the engine's default, 1


def test_stream_interval_reaches_the_local_decode_workers_only() -> None:
    body = tiny_body()
    body["spec"].setdefault("engine", {})["streamInterval"] = 5
    spec = spec_of(body)
    ports = {"prefill-0": (1001, 3001, None), "decode-0": (1002, 3002, 2002), "router": (1004, 3004, None)}
    workers = {w.name: w.argv for w in worker_argvs(spec, plan(spec), Path("/models/tiny"), ports)}
    assert workers["decode-0"][workers["decode-0"].index("--stream-interval") + 1] == "5"
    assert "--stream-interval" not in workers["prefill-0"] and "--stream-interval" not in workers["router"]


@pytest.mark.parametrize(
    ("path", "value", "field"),
    [
        (("engine", "kind"), "sglang", "spec.engine.kind"),
        (("weights",), {"quantization": "awq"}, "spec.weights.quantization"),
        (("roles", "prefill", "tensorParallel"), 2, "spec.roles.prefill.tensorParallel"),
        # More worker processes than one machine is for (MAX_LOCAL_WORKERS): fine on a cluster
        (("roles", "decode", "dataParallel"), 65536, "spec.roles.decode.dataParallel"),
        (("roles", "prefill", "replicas"), 64, "spec.roles.prefill.replicas"),  # 65 with decode's one
        # Canary numbers admission refuses (an outside review: such a spec reached Stable locally)
        (("canary", "capacity"), {"minRatio": 3.0}, "spec.canary.capacity.minRatio"),
        (("canary", "golden"), {"prompts": [{"prompt": "x", "maxTokens": 2000}]}, "spec.canary.golden.prompts[0].maxTokens"),
    ],
)
def test_specs_the_local_backend_cannot_run_are_refused_by_field(path: tuple[str, ...], value: Any, field: str) -> None:
    body = tiny_body()
    node = body["spec"]
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = value
    problems = runnable_problems(spec_of(body))
    assert len(problems) == 1 and problems[0].startswith(field + ":")


def test_as_many_workers_as_the_local_bound_still_run() -> None:
    """MAX_LOCAL_WORKERS is a bound on both roles' processes together, not a refusal of scale-out."""
    body = tiny_body()
    body["spec"]["roles"]["prefill"].update(replicas=2, dataParallel=16)
    body["spec"]["roles"]["decode"].update(replicas=4, dataParallel=8)
    assert runnable_problems(spec_of(body)) == []
    assert MAX_LOCAL_WORKERS == 64


def test_model_dir_is_the_pvc_path_under_the_models_root(tmp_path: Path) -> None:
    assert model_dir_for(spec_of(tiny_body("tiny")), tmp_path) == tmp_path / "tiny"
    assert model_dir_for(spec_of(tiny_body("/abs/tiny")), tmp_path) == Path("/abs/tiny")
    body = tiny_body()
    del body["spec"]["model"]["source"]
    with pytest.raises(LocalBackendError, match="spec.model.source.pvc: .* pass it with --model-dir DIR"):  # the one-flag fix (outside probe: unnamed)
        model_dir_for(spec_of(body), tmp_path)


def test_worker_env_carries_only_the_revisions_own_faults_and_key() -> None:
    env = worker_env({"PATH": "/bin", FAULTS_ENV: "no_tags", TRANSFER_KEY_ENV: "parent"}, "k" * 64, "")
    assert FAULTS_ENV not in env and env[TRANSFER_KEY_ENV] == "k" * 64 and env["PATH"] == "/bin"
    assert worker_env({}, "k", "unsafe_reject_path")[FAULTS_ENV] == "unsafe_reject_path"


def test_state_folder_lock_key_and_atomic_save(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "state")
    with store.locked():
        with pytest.raises(LocalBackendError, match="another kvguard apply"):
            with StateStore(tmp_path / "state").locked():
                pass
        key = store.transfer_key("abc")
        assert store.transfer_key("abc") == key and len(key) == 64  # generated once (S3)
        mode = (tmp_path / "state" / "revisions" / "abc" / "transfer.key").stat().st_mode
        assert stat.S_IMODE(mode) == 0o600
        state = store.load()
        state.serving = "abc"
        store.save(state)
    assert StateStore(tmp_path / "state").load().serving == "abc"
    assert not list((tmp_path / "state").glob(".*.tmp"))


def test_one_model_per_state_folder(tmp_path: Path) -> None:
    with LocalBackend(tmp_path) as backend:
        backend.claim("a")
        with pytest.raises(LocalBackendError, match="holds InferenceModel 'default/a', not 'default/b'"):
            backend.claim("b")
        # The same name in another namespace is another InferenceModel (it replaced the first's revisions).
        with pytest.raises(LocalBackendError, match="holds InferenceModel 'default/a', not 'team-b/a'"):
            backend.claim("a", "team-b")
        backend.state.namespace = None  # a folder written before namespaces were recorded holds default's
        backend.claim("a")
        assert backend.state.namespace == "default"


def test_an_interrupted_rollout_says_so_in_its_status(tmp_path: Path) -> None:
    """An outside probe: after Ctrl-C, `kvguard status` said "CanaryRunning: canary suite running"
    with Progressing True, with nothing running. `kvguard apply` marks the conditions the last
    pass left unfinished; the next apply writes its own."""
    from kvguard.operator.backends.local_rollout import mark_interrupted

    running = "revision abc: canary suite running"
    conditions = [
        {"type": "Progressing", "status": "True", "reason": "CanaryRunning", "message": running,
         "lastTransitionTime": "2026-12-07T00:00:00Z", "observedGeneration": 2},
        {"type": "CanaryPassed", "status": "Unknown", "reason": "CanaryRunning", "message": running,
         "lastTransitionTime": "2026-12-07T00:00:00Z", "observedGeneration": 2},
        {"type": "KVPoolSufficient", "status": "True", "reason": "PoolsMeetRatio", "message": "ok",
         "lastTransitionTime": "2026-12-07T00:00:00Z"},
    ]  # fmt: skip
    with LocalBackend(tmp_path) as backend:
        backend.state.status = {"phase": "CanaryVerifying", "message": running, "conditions": conditions}
        version = backend.state.status_version
        mark_interrupted(backend)
        after = {c["type"]: c for c in backend.state.status["conditions"]}
        assert after["Progressing"]["status"] == "False" and after["Progressing"]["reason"] == "Interrupted"
        assert after["Progressing"]["message"] == f"kvguard apply was interrupted (CanaryRunning: {running}); run it again to resume"
        assert after["CanaryPassed"]["status"] == "Unknown" and after["CanaryPassed"]["reason"] == "Interrupted"
        assert after["KVPoolSufficient"] == conditions[2] and backend.state.status_version == version + 1
        assert backend.state.status["message"] == f"kvguard apply was interrupted ({running}); run it again to resume"
        assert backend.state.status["phase"] == "CanaryVerifying"  # where it stopped
        mark_interrupted(backend)  # nothing unfinished left: nothing written
        assert backend.state.status_version == version + 1


def test_process_table_signals_only_the_recorded_command_line(tmp_path: Path) -> None:
    table = ProcessTable()
    worker = LocalWorker(name="w", role="router", port=1, metrics_port=2, argv=[sys.executable, "-c", "import time; time.sleep(60)"])
    worker.pid = table.spawn(worker, os.environ, tmp_path / "w.log")
    try:
        assert table.alive(worker)
        stranger = ProcessTable()  # another driver: adopts by /proc cmdline, not by bare PID
        # Right after the fork the kernel may still show the parent's command line.
        wait_for(lambda: stranger.alive(worker), "the child's command line in /proc")
        impostor = worker.model_copy(update={"argv": [sys.executable, "-c", "other"]})
        assert not stranger.alive(impostor)  # a reused PID running something else is not ours
        table.stop([worker])
        assert worker.pid is None
    finally:
        if worker.pid:
            os.kill(worker.pid, signal.SIGKILL)


def test_apply_input_errors_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    manifest = tmp_path / "m.yaml"
    manifest.write_text(yaml.safe_dump(tiny_body(str(tmp_path / "missing"))))
    assert main(["apply", "-f", str(manifest)]) == 2  # no --local
    assert main(["apply", "-f", str(manifest), "--local", "--faults", "no_such_fault"]) == 2
    assert main(["apply", "-f", str(manifest), "--local", "--state-dir", str(tmp_path / "s")]) == 2
    err = capsys.readouterr().err
    assert "only --local" in err and "unknown fault switch" in err and "has no config.json" in err
    assert not (tmp_path / "s" / "revisions").exists()  # refused before anything started


def test_apply_of_a_spec_refused_by_field_exits_2_at_once(tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """GPUs asked for on a cpu spec: refused by field before anything starts, never waited on."""
    body = tiny_body(str(tiny_model_dir))
    body["spec"]["roles"]["decode"]["gpuCount"] = 1
    manifest = tmp_path / "m.yaml"
    manifest.write_text(yaml.safe_dump(body))
    assert main(["apply", "-f", str(manifest), "--local", "--state-dir", str(tmp_path / "s")]) == 2
    assert "spec.roles.decode.gpuCount: hardware.device is cpu" in capsys.readouterr().err
    assert not (tmp_path / "s" / "revisions").exists()


def test_apply_of_more_workers_than_the_local_backend_runs_exits_2_naming_the_field(
        tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    """Outside probe: dataParallel 65536 (admitted: fine for a cluster) tried to bind ~196k loopback
    ports, then exit 1 naming no field. Now refused before anything starts or is recorded."""
    body = tiny_body(str(tiny_model_dir))
    body["spec"]["roles"]["decode"]["dataParallel"] = 65536
    manifest = tmp_path / "m.yaml"
    manifest.write_text(yaml.safe_dump(body))
    assert main(["apply", "-f", str(manifest), "--local", "--state-dir", str(tmp_path / "s")]) == 2
    err = capsys.readouterr().err
    assert "kvguard apply: spec.roles.decode.dataParallel: 1 replicas x dataParallel 65,536 = 65,536 decode worker " in err
    assert "the local backend starts at most 64 in all" in err
    assert not (tmp_path / "s" / "revisions").exists() and not (tmp_path / "s" / "state.json").exists()


def test_apply_of_a_context_beyond_the_models_own_limit_exits_2_at_once(tmp_path: Path, tiny_model_dir: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    """Outside probe: contextLength 8192 on the tiny model (max_position_embeddings 4096 in its
    config.json, not in the spec) planned PASS and then crash-looped every worker until --timeout."""
    body = tiny_body(str(tiny_model_dir))
    body["spec"].update(contextLength=8192, kvPoolTokens=16384)
    manifest = tmp_path / "m.yaml"
    manifest.write_text(yaml.safe_dump(body))
    assert main(["apply", "-f", str(manifest), "--local", "--state-dir", str(tmp_path / "s")]) == 2
    assert "spec.contextLength: 8,192 exceeds the model's maximum 4,096 (max_position_embeddings in" in capsys.readouterr().err
    assert not (tmp_path / "s" / "revisions").exists()


def test_apply_blocked_plan_exits_3_and_starts_nothing(tmp_path: Path) -> None:
    state = tmp_path / "state"
    assert main(["apply", "-f", str(REPO / "examples" / "incident.yaml"), "--local", "--state-dir", str(state)]) == 3
    assert not (state / "revisions").exists()


@contextmanager
def serving_tiny(tmp_path: Path, model_dir: Path) -> Iterator[tuple[LocalBackend, str]]:
    """The tiny model's revision deployed by a local backend and ready; every process stopped after."""
    spec = spec_of(tiny_body(str(model_dir)))
    revision = revision_of(spec)
    with LocalBackend(tmp_path / "state") as backend:
        try:
            backend.claim("tiny")
            backend.deploy(revision, spec, plan(spec))
            wait_ready(backend, revision)
            yield backend, revision
        finally:
            backend.stop_all()


def test_a_killed_worker_is_restarted_on_its_ports(tmp_path: Path, tiny_model_dir: Path) -> None:
    """A Deployment replaces a dead pod; the local backend restarts a dead worker when it looks."""
    with serving_tiny(tmp_path, tiny_model_dir) as (backend, revision):
        decode = backend.state.revisions[revision].worker("decode-0")
        port, pid = decode.port, decode.pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        wait_ready(backend, revision)
        assert decode.port == port and decode.pid != pid and decode.restarts == 1
        backend.scale(revision, 0)
        assert backend.views()[revision].scaled_to_zero  # type: ignore[attr-defined]
        assert all(w.pid is None for w in backend.state.revisions[revision].workers)


def test_a_revision_taken_out_of_traffic_finishes_its_streams_before_it_stops(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Outside probe: a candidate superseded mid-shift was stopped at once, and the requests it was
    still streaming broke with 502. Deleting (or scaling to zero) a revision now stops its router
    first with SIGTERM: it takes no new request and finishes those it has, whose prefill and decode
    still serve them (servers.Drain); only then do the workers stop."""
    with serving_tiny(tmp_path, tiny_model_dir) as (backend, revision):
        base = f"http://127.0.0.1:{backend.state.revisions[revision].worker('router').port}/v1"
        url, model = f"{base}/completions", requests.get(f"{base}/models", timeout=30).json()["data"][0]["id"]
        lines: list[bytes] = []
        first = threading.Event()

        def stream() -> None:
            body = {"model": model, "prompt": "a long answer", "max_tokens": 800, "ignore_eos": True, "stream": True}
            with requests.post(url, json=body, stream=True, timeout=120) as response:
                for line in response.iter_lines():
                    if line:
                        lines.append(line)
                        first.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert first.wait(120), "the stream's first chunk"
        backend.delete(revision)
        reader.join(120)
        assert lines[-1] == b"data: [DONE]" and not any(b'"error"' in line for line in lines)
        finish = json.loads(lines[-2].removeprefix(b"data: "))["choices"][0]["finish_reason"]
        assert finish == "length" and len(lines) > 2
        assert revision not in backend.state.revisions
        with pytest.raises(requests.ConnectionError):  # stopped once its streams were done
            requests.post(url, json={"model": model, "prompt": "x", "max_tokens": 1}, timeout=5)


def wait_ready(backend: LocalBackend, revision: str, timeout_s: float = 180.0) -> None:
    """Worker processes import torch and load the model first: seconds, many more on a loaded machine."""
    wait_for(lambda: backend.views()[revision].ready, f"revision {revision} ready", timeout_s, 0.2,  # type: ignore[attr-defined]
             detail=lambda: backend.views()[revision])  # fmt: skip


def test_scaling_a_revision_up_keeps_running_workers_and_restarts_only_the_router(tmp_path: Path, tiny_model_dir: Path) -> None:
    """canary -> full, as a Deployment's scale: prefill-0 and decode-0 keep their processes."""
    body = tiny_body(str(tiny_model_dir))
    body["spec"]["roles"]["decode"]["replicas"] = 2
    spec = spec_of(body)
    revision = revision_of(spec)
    with LocalBackend(tmp_path / "state") as backend:
        try:
            backend.claim("tiny")
            backend.deploy(revision, spec, plan(spec), scale="canary")
            wait_ready(backend, revision)
            record = backend.state.revisions[revision]
            assert [w.name for w in record.workers] == ["prefill-0", "decode-0", "router"]
            before = {w.name: w.pid for w in record.workers}
            backend.deploy(revision, spec, plan(spec), scale="full")
            wait_ready(backend, revision)
            view = backend.views()[revision]
            assert view.scale == "full" and view.worker_replicas == 3  # type: ignore[attr-defined]
            after = {w.name: w.pid for w in record.workers}
            assert after["prefill-0"] == before["prefill-0"] and after["decode-0"] == before["decode-0"]
            assert after["router"] != before["router"] and after["decode-1"] is not None
            router = record.worker("router").argv
            assert sum(1 for a in router if a == "--decode") == 2
        finally:
            backend.stop_all()


def test_a_worker_started_but_never_recorded_is_found_by_its_command_line() -> None:
    """A driver killed between starting a worker and saving its PID leaves it running on the
    worker's ports; the next driver adopts it instead of starting a second one that cannot bind."""
    argv = [sys.executable, "-c", "import time; time.sleep(60)", "--port", str(os.getpid())]
    orphan = subprocess.Popen(argv)  # noqa: S603 - our own argv
    try:
        worker = LocalWorker(name="prefill-0", role="prefill", port=1, metrics_port=2, argv=argv)
        table = ProcessTable()
        wait_for(lambda: table.find(worker) is not None, "the orphan's command line in /proc")
        assert table.find(worker) == orphan.pid
        assert table.find(LocalWorker(name="x", role="prefill", port=1, metrics_port=2, argv=[*argv, "other"])) is None
    finally:
        orphan.kill()
        orphan.wait()


def _bind_client_on(port: int) -> None:
    """What an outgoing connection does when the kernel gives it `port` as its ephemeral port."""
    with socket.socket() as client:
        client.bind(("127.0.0.1", port))


def test_the_ports_of_one_revision_are_all_distinct_and_held_until_handed_down() -> None:
    """Free ports are found by binding port 0, and each stays bound until its process has it:
    else the kernel may return one twice, or give it to an outgoing connection as its ephemeral
    port, which keeps the worker's listener off it even with SO_REUSEADDR (a router restarted in
    CrashLoopBackOff on "Address already in use" for a whole rollout, seen in CI)."""
    from kvguard.operator.backends.local import HeldPorts, allocate_ports

    held = HeldPorts()
    try:
        for _ in range(50):
            ports = allocate_ports([f"prefill-{i}" for i in range(4)] + [f"decode-{i}" for i in range(4)] + ["router"], held)
            numbers = [p for triple in ports.values() for p in triple if p is not None]
            assert len(numbers) == len(set(numbers)) == 4 * 2 + 4 * 3 + 2
        router_port = ports["router"][0]
        with pytest.raises(OSError) as taken:
            _bind_client_on(router_port)
        assert taken.value.errno == errno.EADDRINUSE
        handed = held.take([router_port])
        assert list(handed) == [router_port]
        assert held.take([router_port])[router_port] is not handed[router_port]  # bound afresh: a restart
    finally:
        held.close()


def test_a_worker_listens_on_the_socket_held_for_its_port(tmp_path: Path) -> None:
    """The splitter (a real `kvguard splitter`) started with its held sockets serves on them; the
    port was never free from the choice on, so no stray client socket could take it meanwhile."""
    from kvguard.operator.backends.local import HeldPorts

    held, table = HeldPorts(), ProcessTable()
    port, metrics_port = held.new(), held.new()
    argv = [sys.executable, "-P", "-m", "kvguard", "splitter", "--table", str(tmp_path / "split.json"),
            "--port", str(port), "--metrics-port", str(metrics_port)]  # fmt: skip
    worker = LocalWorker(name="splitter", role="splitter", port=port, metrics_port=metrics_port, argv=argv)
    listeners = held.take([port, metrics_port])
    try:
        worker.pid = table.spawn(worker, os.environ, tmp_path / "splitter.log", listeners)
    finally:
        for sock in listeners.values():
            sock.close()
    try:
        with pytest.raises(OSError):
            _bind_client_on(port)  # the child holds it now
        for listening in (port, metrics_port):  # 503: no split table yet, but an answer from the splitter
            wait_for(lambda p=listening: _health(p) == 503, f"the splitter's /health on the socket handed down for {listening}",
                     detail=lambda: (tmp_path / "splitter.log").read_text())  # fmt: skip
    finally:
        table.stop([worker])
        held.close()


def _health(port: int) -> int | None:
    try:
        return requests.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code
    except requests.RequestException:
        return None


def test_open_listener_adopts_only_the_socket_handed_down_for_its_port() -> None:
    from kvguard.workers.args import INHERITED_LISTENERS_ENV, open_listener, reserve_port

    with reserve_port("127.0.0.1", 0) as parent_copy:
        port = parent_copy.getsockname()[1]
        child_fd = os.dup(parent_copy.fileno())  # what the child inherits
        sock = open_listener("127.0.0.1", port, {INHERITED_LISTENERS_ENV: f"{port}:{child_fd}"})
        with sock, socket.create_connection(("127.0.0.1", port), timeout=5):
            assert sock.fileno() == child_fd  # adopted and listening, not a second bind
        with reserve_port("127.0.0.1", 0) as other:
            other_fd = os.dup(other.fileno())
            try:  # a descriptor bound elsewhere is never taken for this port
                with pytest.raises(OSError, match="not 1"):
                    open_listener("127.0.0.1", 1, {INHERITED_LISTENERS_ENV: f"1:{other_fd}"})
            finally:
                os.close(other_fd)
    with pytest.raises(OSError, match=INHERITED_LISTENERS_ENV):
        open_listener("127.0.0.1", 1, {INHERITED_LISTENERS_ENV: "1:x"})


# -- CrashLoopBackOff -------------------------------------------------------------------------------


def test_restart_backoff_follows_the_kubelet_after_an_immediate_first_restart() -> None:
    backoff = RestartBackoff()
    assert [backoff.delay_s(n) for n in range(1, 9)] == [0, 10, 20, 40, 80, 160, 300, 300]
    assert backoff.streak(0, ran_for_s=None) == 1  # adopted, or recorded by an older version
    assert backoff.streak(3, ran_for_s=5.0) == 4  # died soon after starting: the streak goes on
    assert backoff.streak(6, ran_for_s=600.0) == 1  # ran 10 minutes: a fresh start


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def test_a_worker_that_keeps_dying_is_restarted_with_crash_loop_backoff(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Real processes, a controlled clock: killed once, decode is back at once; killed again soon
    after, it waits 10 s, then 20 s, and the revision says why; after 10 minutes of running, a
    death is restarted at once again."""
    spec = spec_of(tiny_body(str(tiny_model_dir)))
    revision = revision_of(spec)
    clock = Clock()
    with LocalBackend(tmp_path / "state", clock=clock) as backend:
        try:
            backend.claim("tiny")
            backend.deploy(revision, spec, plan(spec))
            decode = backend.state.revisions[revision].worker("decode-0")

            def kill() -> int:
                pid = decode.pid
                assert pid is not None and backend.processes.alive(decode)
                os.kill(pid, signal.SIGKILL)
                wait_for(lambda: not backend.processes.alive(decode), "the killed worker gone", 30.0, 0.05)
                return pid

            def view() -> Any:
                return backend.views()[revision]

            killed = kill()
            view()
            assert decode.pid != killed and backend.processes.alive(decode) and decode.restarts == 1

            for delay in (10, 20):
                clock.now += 5  # dies 5 s after its start: the streak goes on
                killed = kill()
                waiting = view().waiting
                assert decode.pid == killed and not backend.processes.alive(decode), "restarted without back-off"
                assert any("decode-0 in CrashLoopBackOff" in w and f"restarting in {delay} s" in w for w in waiting), waiting
                clock.now += delay - 1
                view()
                assert not backend.processes.alive(decode), "restarted before its back-off ran out"
                on_disk = StateStore(tmp_path / "state").load().revisions[revision].worker("decode-0")
                assert on_disk.restart_at == clock.now + 1  # a new driver would wait it out too
                clock.now += 1
                view()
                assert backend.processes.alive(decode) and decode.pid != killed

            clock.now += 600  # ran 10 minutes: the next death starts a new streak
            killed = kill()
            view()
            assert backend.processes.alive(decode) and decode.pid != killed
            assert decode.restarts == 4 and decode.deaths_in_a_row == 1

            clock.now += 1  # dies again at once, but its command line changed meanwhile: a new pod
            killed = kill()
            decode.argv = [*decode.argv, "--header-timeout", "29"]
            view()
            assert backend.processes.alive(decode) and decode.pid != killed and decode.deaths_in_a_row == 1
        finally:
            backend.stop_all()


def _kill_splitter(backend: LocalBackend) -> int:
    """SIGKILL the folder's splitter and wait until it is gone; its PID."""
    splitter = backend.state.splitter
    assert splitter is not None and splitter.pid is not None
    pid = splitter.pid
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not backend.processes.alive(splitter), "the killed splitter gone", 30.0, 0.05)
    return pid


def test_traffic_waits_out_the_splitters_back_off_instead_of_failing(tmp_path: Path) -> None:
    """The splitter killed twice in a row is in CrashLoopBackOff: a split (an apply, a rollback)
    waits for its restart and succeeds, rather than saying it "did not start listening" at once."""
    backoff = RestartBackoff(initial_s=1.0, cap_s=1.0)
    with LocalBackend(tmp_path / "state", backoff=backoff) as backend:
        backend.claim("tiny")
        try:
            backend.split([])
            splitter = backend.state.splitter
            assert splitter is not None
            for _ in range(2):
                pid = _kill_splitter(backend)
                backend.split([])  # restarted at once the first time, after its 1 s back-off the second
                assert backend.processes.alive(splitter) and splitter.pid != pid
            assert splitter.deaths_in_a_row == 2
        finally:
            backend.processes.stop([splitter] if (splitter := backend.state.splitter) else [])


def test_the_models_url_is_not_called_serving_while_nothing_of_ours_answers_there(tmp_path: Path) -> None:
    """An outside probe: `kvguard apply` printed `serving: URL` and exited 0 with the splitter in
    CrashLoopBackOff (nothing listening) or its port held by another process (clients reached
    that process). The front door is now waited for, and a taken port is named."""
    backoff = RestartBackoff(initial_s=1.0, cap_s=1.0)
    with LocalBackend(tmp_path / "state", backoff=backoff) as backend:
        backend.claim("tiny")
        try:
            backend.split([])
            splitter = backend.state.splitter
            assert splitter is not None
            backend.state.serving = "r1"  # what a promotion records
            for _ in range(2):  # the second death waits out a back-off: still serving once it ends
                _kill_splitter(backend)
                assert backend.front_door_problem() is None
                assert backend.processes.alive(splitter) and _health(splitter.port) == 503  # ours, no backend yet
            _kill_splitter(backend)
            with socket.socket() as squatter:
                squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                squatter.bind(("127.0.0.1", splitter.port))
                squatter.listen()
                problem = backend.front_door_problem()
                # Mid-rollout, writing a split: the front door's own error (apply: exit 1, not bad input)
                with pytest.raises(FrontDoorDown, match="the model's URL, is taken by another process"):
                    backend.split([])
            assert problem is not None and f"port {splitter.port}, the model's URL, is taken by another process" in problem
            assert not backend.processes.alive(splitter)  # not started into a port it cannot have
        finally:
            backend.processes.stop([splitter] if (splitter := backend.state.splitter) else [])


def test_apply_says_not_serving_and_exits_1_when_the_front_door_fails_mid_rollout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:  # fmt: skip
    """Outside probe: the splitter's port taken while a rollout wrote its split (resuming a shift)
    exited 2, bad input, with no `not serving:` line; at rest the same exited 1, as documented."""
    from kvguard.cli import main
    from kvguard.operator.backends import local_rollout

    async def front_door_down(*_: object, **__: object) -> None:
        raise FrontDoorDown("port 1, the model's URL, is taken by another process (pid 2); free it")

    monkeypatch.setattr(local_rollout, "roll_out", front_door_down)
    manifest = tmp_path / "model.yaml"
    manifest.write_text((Path(__file__).resolve().parent.parent / "examples" / "tiny-cpu.yaml").read_text())
    assert main(["apply", "-f", str(manifest), "--local", "--state-dir", str(tmp_path / "state")]) == 1
    assert "not serving: port 1, the model's URL, is taken by another process" in capsys.readouterr().out


def test_a_state_file_kvguard_did_not_write_is_refused(tmp_path: Path) -> None:
    """An outside probe: `{}` was read as an empty state, and the next apply started a second
    deployment beside the first one's untracked processes."""
    from kvguard.operator.backends.local import UnreadableState

    (tmp_path / "state.json").write_text("{}")
    with pytest.raises(UnreadableState, match="no version: not written by kvguard"):
        StateStore(tmp_path).load()
    for version in (1, 2):  # a later probe: a version alone was read as an empty state, with the same leak
        (tmp_path / "state.json").write_text(json.dumps({"version": version}))
        with pytest.raises(UnreadableState, match="no uid: not written by kvguard"):
            StateStore(tmp_path).load()
    store = StateStore(tmp_path)
    store.save(LocalState())  # what kvguard writes, however empty, reads back
    assert store.load() == LocalState.model_validate_json((tmp_path / "state.json").read_text())


def test_delete_refuses_a_folder_kvguard_never_drove(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Outside probe: `apply --delete --state-dir` removed any folder it was given (a typo naming the
    model folder, or `.`), and would have signalled whatever logged into it. Only a folder holding
    kvguard's state.json or lock is emptied; anything else is exit 2 with nothing touched."""
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("important")
    assert main(["apply", "--delete", "--local", "--state-dir", str(precious)]) == 2
    assert "not a kvguard state folder" in capsys.readouterr().err and (precious / "notes.txt").read_text() == "important"
    a_file = tmp_path / "file"
    a_file.write_text("x")
    assert main(["apply", "--delete", "--local", "--state-dir", str(a_file)]) == 2 and a_file.exists()
    drove = tmp_path / "drove"
    drove.mkdir()
    (drove / "lock").touch()  # an apply that stopped before its first state.json
    assert main(["apply", "--delete", "--local", "--state-dir", str(drove)]) == 0 and not drove.exists()


def _idle_process(log: IO[bytes], *argv_tail: str) -> subprocess.Popen[bytes]:
    """A process that logs into `log` and does nothing until its stdin closes or it is signalled;
    `argv_tail` makes its command line look like another's (python -c ... ARGS)."""
    return subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()", *argv_tail], stdin=subprocess.PIPE,
                            stdout=log, stderr=subprocess.STDOUT)  # fmt: skip


def test_delete_of_an_unreadable_state_folder_stops_what_logs_into_it(tmp_path: Path) -> None:
    """An outside probe: `apply --delete` refused a truncated state.json, and its advice (move it
    away) left the workers running with no command to stop them. Every process a folder starts
    logs into it: those are stopped, and the folder removed."""
    state = tmp_path / "state"
    (state / "revisions" / "r1").mkdir(parents=True)
    (state / "state.json").write_text('{"version": 2, "revisions": {"r1": ')  # truncated
    with open(state / "revisions" / "r1" / "router.log", "ab") as log:
        worker = _idle_process(log, "-m", "kvguard", "worker")  # a command line like the workers'
    try:
        assert main(["apply", "--delete", "--local", "--state-dir", str(state)]) == 0
        assert worker.wait(timeout=30) is not None and not state.exists()
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()


def test_delete_of_a_folder_whose_state_json_is_not_kvguards_touches_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Outside probe: any folder holding a file named state.json passed the check, and with it
    unreadable, `apply --delete` killed every process logging into the folder (kvguard's or not)
    and removed the folder with the user's files."""
    folder = tmp_path / "someones"
    (folder / "sub").mkdir(parents=True)
    (folder / "state.json").write_text('{"x": 1}')
    (folder / "sub" / "data.bin").write_bytes(b"keep")
    with open(folder / "app.log", "ab") as log:
        app = _idle_process(log)
    try:
        assert main(["apply", "--delete", "--local", "--state-dir", str(folder)]) == 2
        assert app.poll() is None and (folder / "sub" / "data.bin").read_bytes() == b"keep"
        said = capsys.readouterr().err
        assert "nothing stopped or removed" in said and "--delete stops" not in said
        # Nothing left behind either: a `lock` file made here would pass the next --delete's check
        # (an audit: moving state.json away as told, a second --delete removed the folder).
        (folder / "state.json").rename(tmp_path / "moved.json")
        assert main(["apply", "--delete", "--local", "--state-dir", str(folder)]) == 2
        assert (folder / "sub" / "data.bin").read_bytes() == b"keep"
    finally:
        app.kill()
        app.wait()


def test_the_local_driver_runs_no_continuous_canary_and_says_so() -> None:
    """Outside probe: `apply --local` recorded the continuous canary's schedule in the status, and
    `kvguard status --local` showed it, though nothing runs it locally (the operator does)."""
    from kvguard.operator.backends.local_rollout import _say_what_is_for_a_cluster, _without_continuous_canary
    from kvguard.operator.revision import revision_of

    body = yaml.safe_load((Path(__file__).resolve().parent.parent / "examples" / "tiny-cpu.yaml").read_text())
    body["spec"]["canary"] = {"continuous": {"intervalSeconds": 60, "action": "rollback"}}
    spec = InferenceModel.model_validate(body).spec
    said: list[str] = []
    _say_what_is_for_a_cluster(spec, said.append)
    assert any(line.startswith("spec.canary.continuous: every 60 s is for a cluster") for line in said), said
    local = _without_continuous_canary(spec)
    assert local.canary.continuous.interval_seconds is None and revision_of(local) == revision_of(spec)


def test_a_hand_over_stopped_between_its_two_steps_names_the_new_router_on_the_next_pass(
    tmp_path: Path, tiny_model_dir: Path
) -> None:  # fmt: skip
    """Outside probe: a driver killed after recording the hand-over and before writing the split
    left split.json naming the old router, which the next pass stopped: every request 503'd for
    good while `apply` exited 0. Finishing a hand-over writes the split first, every time."""
    from kvguard.operator.backends.local import healthy
    from kvguard.workers.splitter import SPLIT_FILE, SplitTable

    with serving_tiny(tmp_path, tiny_model_dir) as (backend, revision):
        backend.route(revision)
        body = tiny_body(str(tiny_model_dir))
        body["spec"]["roles"]["decode"]["replicas"] = 2
        spec = spec_of(body)
        backend.deploy(revision, spec, plan(spec))
        record = backend.state.revisions[revision]
        old_router = record.front
        wait_for(lambda: backend.processes.alive(record.router) and healthy(record.router), "the new router ready", 180.0, 0.2)
        record.handed_over = True  # what a driver killed right after recording the hand-over leaves
        backend.save()
        backend.views()
        table = SplitTable.model_validate_json((backend.store.root / SPLIT_FILE).read_text())
        assert [b.url for b in table.backends] == [record.router.url] != [old_router.url]
        assert record.retiring == [] and not backend.processes.alive(old_router)
