"""`kvguard status NAME` (and `kubectl kvguard status NAME`): the rollout as a tree.

Cluster: an InferenceModel with a status on kmock, read through the real client (kube.py) by the
command run in-process. Local: a state folder whose revision's workers are real `kvguard`
processes on loopback (the `serving` deployment), scraped by the command for real; the kubectl
plugin test runs the real kubectl, which finds `kubectl-kvguard` on PATH.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from kmock_api import ApiServer, client_configuration, declare_kvguard_resources
from operator_harness import EXAMPLES, http

from kvguard.cli import main
from kvguard.commands.status import EXIT_NOT_FOUND, EXIT_OK, EXIT_UNREACHABLE
from kvguard.operator.api import InferenceModelSpec
from kvguard.operator.backends.local import LocalRevision, LocalState, LocalWorker, StateStore
from kvguard.status_tree import render
from kvguard.workers.launcher import LocalDeployment

BIN = Path(sys.executable).parent
STATUS: dict[str, Any] = {
    "phase": "Progressing", "revision": "aaa111", "targetRevision": "bbb222", "message": "analysing step 2",
    "conditions": [{"type": "Ready", "status": "True", "reason": "StableRevisionServing", "message": "revision aaa111 is serving",
                    "lastTransitionTime": "2026-01-01T00:00:00Z"},
                   {"type": "Degraded", "status": "True", "reason": "PodKVPoolTooSmall", "message": "pod tiny-aaa111-decode-b too small",
                    "lastTransitionTime": "2026-01-01T00:00:00Z"},
                   {"type": "Progressing", "status": "True", "reason": "AnalysisInconclusive", "message": "3 candidate requests ended",
                    "lastTransitionTime": "2026-01-01T00:00:00Z"}],
    "history": [{"revision": "bbb222", "state": "Candidate", "since": "2026-01-01T00:00:00Z"},
                {"revision": "aaa111", "state": "Stable", "since": "2026-01-01T00:00:00Z"}],
    "rollout": {"state": "CanaryVerifying", "revision": "bbb222", "reason": "AnalysisRunning", "message": "step 2 of 3",
                "step": 1, "weight": 50,  # from 0 in the status: the second of the spec's three steps
                "analysis": [{"name": "errorRatio", "result": "Successful", "value": 0.01, "threshold": 0.05}],
                "canary": {"revision": "bbb222", "verdict": "fail", "reason": "failed: isolation", "failedProbes": ["isolation"],
                           "durationSeconds": 3.5}},
    "continuous": {"intervalSeconds": 300, "action": "rollback", "revision": "aaa111", "nextRunAt": "2026-01-01T00:10:00Z",
                   "lastRun": {"revision": "aaa111", "attempt": "2026-01-01T00:05:00Z", "verdict": "fail", "finishedAt": "2026-01-01T00:05:09Z",
                               "reason": "failed: over_length", "failedProbes": ["over_length"]},
                   "rollback": {"toRevision": "zzz000", "fromRevision": "aaa111", "at": "2026-01-01T00:05:09Z"}},
    "pools": [{"pod": "tiny-aaa111-decode-a", "node": "node-80gb", "revision": "aaa111", "role": "decode", "poolTokens": 4096,
               "contextLength": 1024, "requiredRatio": 2.0, "required": 2048, "verified": True, "reason": "KVPoolVerified",
               "message": "ok"},
              {"pod": "tiny-aaa111-decode-b", "node": "node-40gb", "revision": "aaa111", "role": "decode", "poolTokens": 1536,
               "contextLength": 1024, "requiredRatio": 2.0, "required": 2048, "verified": False, "reason": "KVPoolTooSmall",
               "message": "pod tiny-aaa111-decode-b on node node-40gb: 1536 < 2048"},
              {"bogus": "an entry of another operator version is skipped"}],
}  # fmt: skip


def test_the_tree_shows_revisions_step_weight_analysis_canary_and_every_pods_pool() -> None:
    from kvguard.commands.status import _pools

    text = render("tiny", "models", STATUS, _pools(STATUS["pools"]), steps=3)
    lines = text.splitlines()
    assert lines[0] == "tiny  (namespace models)  Progressing  stable aaa111  target bbb222  - analysing step 2"
    assert "├── conditions  Progressing=True  Ready=True  Degraded=True" in lines
    assert "│   ├── Progressing: AnalysisInconclusive: 3 candidate requests ended" in lines  # why the step holds
    assert "│   └── Degraded: PodKVPoolTooSmall: pod tiny-aaa111-decode-b too small" in lines
    assert any("rollout  CanaryVerifying  (revision bbb222)  AnalysisRunning: step 2 of 3" in line for line in lines)
    assert "│   ├── step 2/3  weight 50%" in lines
    assert "│   ├── analysis errorRatio  Successful  value=0.01  threshold=0.05" in lines
    assert "│   └── canary fail  3.5 s  failed: isolation" in lines and "│       └── probe isolation: fail" in lines
    assert "├── continuous canary  every 300 s  action rollback  last fail at 2026-01-01T00:05:09Z on aaa111" in lines
    assert "│   ├── probe over_length: fail" in lines
    assert any("rolled back to zzz000 (from aaa111" in line for line in lines)
    stable = lines.index("├── revision aaa111  Stable, stable, serving")
    assert lines.index("└── revision bbb222  Candidate, target") > stable
    assert lines[stable + 1] == ("│   ├── pod tiny-aaa111-decode-a  decode  node node-80gb  pool 4096 / 2048 tokens (4.00x vs 2x)"
                                 "  verified")  # fmt: skip
    assert lines[stable + 2].startswith("│   └── pod tiny-aaa111-decode-b  decode  node node-40gb  pool 1536 / 2048 tokens (1.50x vs 2x)"
                                        "  TOO SMALL: out of rotation")  # fmt: skip
    assert lines[stable + 3] == "│       └── pod tiny-aaa111-decode-b on node node-40gb: 1536 < 2048"


def test_a_rollout_of_an_earlier_revision_is_not_shown_as_the_targets() -> None:
    """An outside probe: a new target paused before its rollout started showed the previous
    revision's step (with the new spec's step count), analyses and canary pass as if they were
    the target's."""
    earlier = {**STATUS, "targetRevision": "ccc333"}
    lines = render("tiny", "models", earlier, [], steps=3).splitlines()
    assert "│   ├── of revision bbb222, not the target ccc333: the target's rollout has not started" in lines, lines
    assert "│   ├── step 2  weight 50%" in lines  # not "2/3": the 3 steps are the target's spec's


def test_a_rollback_is_not_shown_as_a_target_not_yet_started() -> None:
    """A review: a kvguard.io/rollback-to pins the rollout to a kept revision, which is not the
    spec's target for as long as it stays: that read 'the target's rollout has not started'."""
    rolled_back = {**STATUS, "targetRevision": "ccc333",
                   "rollout": {"state": "Stable", "revision": "aaa111", "rollback": True, "reason": "RolloutComplete"}}  # fmt: skip
    text = render("tiny", "models", rolled_back, [], steps=3)
    assert "a rollback to revision aaa111 (kvguard.io/rollback-to): the target ccc333 waits" in text, text
    assert "has not started" not in text


@pytest.mark.kmock(cls=ApiServer)
async def test_status_reads_the_model_from_the_cluster(kmock: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.kube/config: the process default (kmock) is used
    url = declare_kvguard_resources(kmock)
    from operator_harness import EMULATOR_URL

    EMULATOR_URL.append(url)
    client_configuration(url, make_default=True)
    try:
        body = yaml.safe_load((EXAMPLES / "tiny-cpu.yaml").read_text())
        body["metadata"] = {"name": "tiny", "namespace": "models"}
        await http("POST", "/apis/kvguard.io/v1alpha1/namespaces/models/inferencemodels", body)
        await http("PATCH", "/apis/kvguard.io/v1alpha1/namespaces/models/inferencemodels/tiny/status", {"status": STATUS},
                   "application/merge-patch+json")  # fmt: skip
        import asyncio

        code = await asyncio.to_thread(main, ["status", "tiny", "-n", "models"])
        out = capsys.readouterr().out
        assert code == EXIT_OK, out
        assert out.startswith("tiny  (namespace models)  Progressing  stable aaa111")
        assert "pod tiny-aaa111-decode-b  decode  node node-40gb  pool 1536 / 2048 tokens" in out
        code = await asyncio.to_thread(main, ["status", "nope", "-n", "models"])
        assert code == EXIT_NOT_FOUND and "InferenceModel models/nope not found" in capsys.readouterr().err
    finally:
        EMULATOR_URL.pop()
        import kubernetes

        kubernetes.client.ApiClient.set_default(None)


def local_state(folder: Path, serving: LocalDeployment) -> Path:
    """A state folder as `kvguard apply --local` leaves it, its revision's workers the real processes."""
    body = yaml.safe_load((EXAMPLES / "tiny-cpu.yaml").read_text())
    spec = InferenceModelSpec.model_validate(body["spec"]).to_wire()
    workers = [LocalWorker(name=f"{role}-0", role=role, port=serving.ports[role], metrics_port=serving.ports[f"{role}-metrics"], argv=[])
               for role in ("prefill", "decode")] + [LocalWorker(name="router", role="router", port=serving.ports["router"],
                                                                  metrics_port=serving.ports["router-metrics"], argv=[])]  # fmt: skip
    splitter = LocalWorker(name="splitter", role="splitter", port=41234, metrics_port=41235, argv=[])
    state = LocalState(model="tiny", serving="ccc333", spec=spec, splitter=splitter, weights={"ccc333": 100}, revisions={
        "ccc333": LocalRevision(revision="ccc333", model_dir="m", created_at="2026-01-01T00:00:00Z", workers=workers),
        "ddd444": LocalRevision(revision="ddd444", model_dir="m", created_at="2026-01-01T00:00:00Z", scaled_to_zero=True),
    }, status={"phase": "Ready", "revision": "ccc333", "targetRevision": "ccc333",
               "history": [{"revision": "ccc333", "state": "Stable", "since": "2026-01-01T00:00:00Z"},
                           {"revision": "ddd444", "state": "Superseded", "since": "2026-01-01T00:00:00Z"}]})  # fmt: skip
    StateStore(folder).save(state)
    return folder


def test_status_local_scrapes_every_running_worker(serving: LocalDeployment, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = local_state(tmp_path / "state", serving)
    assert main(["status", "tiny", "--local", "--state-dir", str(folder)]) == EXIT_OK
    out = capsys.readouterr().out
    # The state names a splitter that is not running (this test starts none): said, not shown as serving.
    assert ("revision ccc333  Stable, stable, serving  (100% of traffic at http://127.0.0.1:41234/v1; the splitter is "
            "not running: that URL refuses connections until the next apply)") in out  # fmt: skip
    # A worker is named by the port its router addresses it by (and its PID, when recorded) in place of a node.
    decode, prefill = serving.ports["decode"], serving.ports["prefill"]
    assert f"pod tiny-ccc333-decode-0  decode  node local:{decode}  pool 4096 / 2048 tokens (4.00x vs 2x)  verified" in out
    assert f"pod tiny-ccc333-prefill-0  prefill  node local:{prefill}  pool 4096 / 2048 tokens (4.00x vs 2x)  verified" in out
    # Nothing runs for the state's splitter and router (recorded without a process): the model's URL
    # does not answer, so it is Degraded for that (an outside probe saw Ready); every pool meets the
    # ratio, so the pool gate adds nothing.
    assert "Degraded: NotListening: the splitter (port 41234, the model's URL) is not running; revision ccc333's router" in out
    assert "out of rotation" not in out
    assert "revision ddd444  Superseded  (scaled to zero)" in out
    assert main(["status", "other", "--local", "--state-dir", str(folder)]) == EXIT_NOT_FOUND
    assert main(["status", "tiny", "--local", "--state-dir", str(folder / "state.json")]) == 2  # a file, not a folder
    # The folder holds default/tiny (recorded before namespaces were): another namespace's tiny is not it.
    assert main(["status", "tiny", "-n", "team-b", "--local", "--state-dir", str(folder)]) == EXIT_NOT_FOUND
    assert "holds model default/tiny, not team-b/tiny" in capsys.readouterr().err
    assert main(["status", "tiny", "-n", "default", "--local", "--state-dir", str(folder)]) == EXIT_OK


def test_kubectl_kvguard_status_watch_redraws(serving: LocalDeployment, tmp_path: Path) -> None:
    kubectl = shutil.which("kubectl", path=str(BIN)) or shutil.which("kubectl")
    if kubectl is None or not (BIN / "kubectl-kvguard").exists():
        pytest.skip("kubectl or the kubectl-kvguard console script is not installed (make .venv/.installed)")
    folder = local_state(tmp_path / "state", serving)
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    proc = subprocess.Popen([kubectl, "kvguard", "status", "tiny", "--local", "--state-dir", str(folder), "--watch", "--interval", "0.2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
    try:
        frames = 0
        assert proc.stdout is not None
        for line in proc.stdout:  # blocks until a line comes; the test's timeout bounds it
            frames += line.startswith("tiny  (namespace default, local)")
            if frames == 2:
                break
        assert frames == 2, proc.stderr.read() if proc.stderr else ""
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.parametrize("local", [[], ["--local"]])
def test_a_name_no_inferencemodel_can_have_is_bad_input(local: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", "BAD_NAME!", *local]) == 2  # not "unreachable" (1) or "not found" (3)
    assert "metadata.name: 'BAD_NAME!' must be lowercase letters" in capsys.readouterr().err


def test_a_namespace_no_model_can_be_in_is_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    """Outside probe: `-n Bad_NS` asked the cluster and said "not found" (3); `kvguard render` says 2."""
    assert main(["status", "tiny", "-n", "Bad_NS"]) == 2
    assert "--namespace: must be a DNS-1123 label" in capsys.readouterr().err


@pytest.mark.parametrize("status", [{"rollout": 5}, {"revision": {"a": 1}, "phase": ["x"], "history": 3, "conditions": "x"},
                                    {"rollout": {"canary": {"durationSeconds": "x"}}}, {"continuous": {"lastRun": 3}}, "x"])  # fmt: skip
def test_a_status_of_another_shape_renders_what_it_can(status: Any) -> None:
    """Outside probe: `rollout: 5` (a status kmock, or another version, stored) ended in a traceback
    and exit 1 ("cannot reach the cluster"); a mapping as the stable revision was printed as one."""
    lines = render("tiny", "models", status, []).splitlines()
    assert lines[0] == "tiny  (namespace models)  Unknown  stable -  target -"
    assert all("{" not in line and "['x']" not in line for line in lines)
    assert all(line.endswith(("conditions  ",)) or "unreadable here" in line or "rollout  ?" in line for line in lines[1:]), lines


@pytest.mark.parametrize("interval", ["0", "-1", "nan", "inf", "1e308"])
def test_an_interval_time_cannot_sleep_is_bad_input(interval: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Outside probe: nan, inf and 1e308 ended in a traceback (time.sleep raised), 0 and -1 in one line."""
    assert main(["status", "tiny", "--local", "--watch", "--interval", interval]) == 2
    assert "--interval must be > 0" in capsys.readouterr().err


def test_status_local_says_when_the_serving_revision_has_no_worker_of_a_role(serving: LocalDeployment, tmp_path: Path,
                                                                            capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    """An outside probe: with the stable's only decode worker killed, every request got a 503 while
    `kvguard status --local` said Ready. The state here names a decode worker nothing listens for."""
    folder = local_state(tmp_path / "state", serving)
    state = StateStore(folder).load()
    dead = serving.ports["decode"] + 1  # a port nothing of this deployment listens on
    for worker in state.revisions["ccc333"].workers:
        if worker.role == "decode":
            worker.metrics_port = dead
    state.namespace = "models"  # applied with --namespace models: the heading says so (it said "local")
    StateStore(folder).save(state)
    assert main(["status", "tiny", "--local", "--state-dir", str(folder)]) == EXIT_OK
    out = capsys.readouterr().out
    assert out.startswith("tiny  (namespace models, local)  Degraded"), out
    assert "conditions  Ready=False  Degraded=True" in out
    assert "revision ccc333 has no decode worker in rotation, so it answers 503" in out


def test_no_kubeconfig_is_one_line_naming_what_is_missing(tmp_path: Path) -> None:
    """A real process (no kmock default in it): no service account, no KUBECONFIG, no ~/.kube/config."""
    env = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST")}
    env["HOME"] = str(tmp_path)
    done = subprocess.run([sys.executable, "-P", "-m", "kvguard", "status", "tiny"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == EXIT_UNREACHABLE and done.stdout == ""
    assert done.stderr == ("kvguard status: no Kubernetes cluster configured: not in a pod, KUBECONFIG is unset and "
                           "~/.kube/config does not exist; set KUBECONFIG or create ~/.kube/config\n")  # no warning, no traceback
