"""`kvguard apply --local` as a user runs it: a real `kvguard` process per apply, real workers.

A line per wait and each canary probe's row as it finishes; a replicas-only change resizes the
serving revision in place (no new revision, no canary, running workers keep their processes); a
rollback (exit 4) prints the probe table and where the full report is; and one exit-code table,
the same in the code, `--help` and README.md.

The process scenarios share one state folder and run in file order (first rollout, resize, faulty
build), as the e2e scenarios do: each apply starts worker processes, a minute or more on 2 cores.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

from kvguard.commands.apply import EXIT_CODES, _print_result
from kvguard.operator.canary.report import CanaryReport

REPO = Path(__file__).resolve().parent.parent
APPLY_TIMEOUT_S = 840  # under pytest's 900 s per test; a rollout takes about a minute on a quiet machine
FAULTY_BUILD = "unsafe_reject_path,no_tags"


def kvguard(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-P", "-m", "kvguard", *args], capture_output=True, text=True,
                          timeout=timeout, check=False)  # fmt: skip


# --- one exit-code table --------------------------------------------------------------------------


def readme_exit_rows() -> list[tuple[int, str]]:
    text = (REPO / "README.md").read_text()
    table = text.split("`kvguard apply` exit status", 1)[1].split("\n\n", 2)[1]
    rows = [line.strip("|").split("|") for line in table.splitlines()[2:]]
    return [(int(code), meaning.strip()) for code, meaning in rows]


def test_the_exit_codes_are_one_table_in_code_help_and_readme() -> None:
    assert readme_exit_rows() == list(EXIT_CODES)
    done = kvguard("apply", "--help")
    assert done.returncode == 0
    epilog = " ".join(done.stdout.split("exit status:", 1)[1].split())
    for code, meaning in EXIT_CODES:
        assert f"{code} {meaning}" in epilog, (code, epilog)
    from kvguard.commands import apply

    assert sorted(code for code, _ in EXIT_CODES) == sorted(
        {apply.EXIT_OK, apply.EXIT_ERROR, apply.EXIT_BAD_INPUT, apply.EXIT_BLOCKED, apply.EXIT_ROLLED_BACK,
         apply.EXIT_PAUSED, apply.EXIT_INTERRUPTED}
    )  # fmt: skip


def test_a_rollback_after_a_passed_canary_says_the_canary_passed_without_its_probe_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An outside probe: a candidate rolled back by the live analysis printed "canary of X: PASS"
    and the whole probe table, read as a contradiction. The table is for a canary that failed."""
    from types import SimpleNamespace

    from kvguard.operator.rollout import RolloutState

    passed = CanaryReport.model_validate({"verdict": "pass", "reason": "7 probe(s) passed", "target": {"url": "http://x"},
                                          "started_at": "2026-12-07T00:00:00Z"})  # fmt: skip
    result = SimpleNamespace(state=RolloutState.ROLLED_BACK, revision="cand", stable="old", roles_out_of_rotation=(),
                             status=SimpleNamespace(message="analysis failed at 10%: errorRatio 5 of 5", conditions=[]),
                             canary_reports={"cand": passed}, front_door_problem=None, serving_url="http://old")  # fmt: skip
    _print_result(result, tmp_path)
    out = capsys.readouterr().out.splitlines()
    assert "message: analysis failed at 10%: errorRatio 5 of 5" in out
    assert "canary of cand: PASS; the rollback came after it (message above)" in out
    assert not any(line.split()[:1] == ["PROBE"] for line in out), out
    assert out[-1] == "serving: http://old"


def test_what_the_rollout_says_beside_its_state_is_printed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An outside probe: a rollback-to naming no kept revision rolled the spec out, and apply
    printed only "revision ... is serving"; why was in `kvguard status` alone."""
    from types import SimpleNamespace

    from kvguard.operator.rollout import RolloutState

    said = "kvguard.io/rollback-to=deadbeef00: not a kept previous revision (kept: none); rolling out the spec"
    status = SimpleNamespace(message="revision r2 is serving", conditions=[
        SimpleNamespace(type="Ready", message="serving"), SimpleNamespace(type="Progressing", message=said)])  # fmt: skip
    result = SimpleNamespace(state=RolloutState.STABLE, revision="r2", stable="r2", roles_out_of_rotation=(), status=status,
                             canary_reports={}, front_door_problem=None, serving_url="http://r2", promoted=True)  # fmt: skip
    _print_result(result, tmp_path)
    out = capsys.readouterr().out.splitlines()
    assert f"progressing: {said}" in out and "message: revision r2 is serving" in out, out


def test_a_serving_revision_a_policy_no_longer_allows_is_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An outside probe: `apply --policy` with a policy the serving spec breaks printed only
    "revision ... is serving" (exit 0); PolicyCompliant=False was in `kvguard status` alone."""
    from types import SimpleNamespace

    from kvguard.operator.rollout import RolloutState

    said = "spec.contextLength: 1,024 exceeds the policy's maximum 512 (policy strict, rule maxContextLength)"
    status = SimpleNamespace(message="revision r2 is serving", conditions=[
        SimpleNamespace(type="PolicyCompliant", status="False", message=said),
        SimpleNamespace(type="Progressing", status="False", message="revision r2 is serving")])  # fmt: skip
    result = SimpleNamespace(state=RolloutState.STABLE, revision="r2", stable="r2", roles_out_of_rotation=(), status=status,
                             canary_reports={}, front_door_problem=None, serving_url="http://r2", promoted=True)  # fmt: skip
    _print_result(result, tmp_path)
    out = capsys.readouterr().out.splitlines()
    assert f"policy: not compliant (serving, but the next rollout is blocked): {said}" in out, out
    status.conditions[0] = SimpleNamespace(type="PolicyCompliant", status="True", message="")
    _print_result(result, tmp_path)
    assert not any(line.startswith("policy:") for line in capsys.readouterr().out.splitlines())


def test_a_blocked_plan_says_why_and_exits_3(tmp_path: Path) -> None:
    done = kvguard("apply", "-f", str(REPO / "examples" / "incident.yaml"), "--local", "--state-dir", str(tmp_path / "s"))
    assert done.returncode == 3, done.stdout + done.stderr
    out = lines(done.stdout)
    # the state, what the rollout says, then what serves (d63a4fc added the Progressing line between)
    assert out[-4].startswith("state: Blocked") and out[-3].startswith("message: ") and "KVPoolTooSmall" in done.stdout
    assert out[-2].startswith("progressing: ") and "Suggested fixes" in out[-2]
    assert any(line.startswith("plan (the same report: kvguard plan -f ") for line in out)  # the planner's whole report
    assert "verdict: BLOCKED" in out and "changes that pass (any one; each is complete, re-planned to check):" in out
    assert out[-1] == "serving: nothing" and "canary report" not in done.stdout  # no canary ran


@pytest.mark.parametrize("flags", [["--state-dir", "{file}"], ["--state-dir", "{file}/sub"], ["--timeout", "-1"], ["--timeout", "nan"]])
def test_an_unusable_state_dir_or_timeout_is_one_line_and_exit_2(tmp_path: Path, flags: list[str]) -> None:
    in_the_way = tmp_path / "a-file"
    in_the_way.write_text("")
    flags = [f.format(file=in_the_way) for f in flags]
    if "--state-dir" not in flags:
        flags += ["--state-dir", str(tmp_path / "s")]
    done = kvguard("apply", "-f", str(REPO / "examples" / "incident.yaml"), "--local", *flags)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("kvguard apply")]
    assert len(errors) == 1 and ("state folder" in errors[0] or "--timeout" in errors[0]), done.stderr  # argparse adds usage lines
    assert not (tmp_path / "s").exists()  # refused before anything was made


def test_the_manifests_namespace_is_the_one_policies_see_and_the_flag_may_only_repeat_it(tmp_path: Path, tiny_model_dir: Path) -> None:
    """The manifest's metadata.namespace was ignored: a policy scoped to team-a let team-a's model
    roll out (policies saw `default`). Both runs end before any worker starts."""
    manifest = yaml.safe_load((REPO / "examples" / "tiny-cpu.yaml").read_text())
    manifest["metadata"] = {"name": "tiny", "namespace": "team-a"}
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(manifest))
    policy = {"apiVersion": "kvguard.io/v1alpha1", "kind": "InferencePolicy", "metadata": {"name": "team-a-strict"},
              "spec": {"namespaces": ["team-a"], "minKVRatio": 64}}
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(policy))
    common = ["apply", "-f", str(tmp_path / "m.yaml"), "--local", "--policy", str(tmp_path / "p.yaml"), "--model-dir", str(tiny_model_dir)]
    try:
        blocked = kvguard(*common, "--state-dir", str(tmp_path / "s"), timeout=APPLY_TIMEOUT_S)
    finally:  # a regression rolls out and leaves workers running
        if (tmp_path / "s" / "state.json").exists():
            kvguard("apply", "--local", "--delete", "--state-dir", str(tmp_path / "s"))
    assert blocked.returncode == 3, blocked.stdout + blocked.stderr
    assert "team-a-strict" in blocked.stdout and "minKVRatio" in blocked.stdout
    other = kvguard(*common, "--namespace", "team-b", "--state-dir", str(tmp_path / "t"))
    assert other.returncode == 2 and "metadata.namespace is 'team-a', not 'team-b' (--namespace)" in other.stderr, other.stderr
    assert not (tmp_path / "t").exists()  # refused before anything was made


def test_a_folder_whose_state_json_went_missing_is_not_started_again_beside_its_processes(tmp_path: Path) -> None:
    """Outside probe: with state.json moved away (as the unreadable-state message advised), the
    folder read as empty: apply started a second deployment beside the first's processes, and
    --delete then stopped only the new one. A folder whose processes still run is refused, and
    --delete stops them by their logs."""
    from waiting import wait_for

    from kvguard.operator.backends.local import ProcessTable

    state = tmp_path / "s"
    state.mkdir()
    (state / "lock").write_text("")
    with open(state / "splitter.log", "wb") as log:  # the folder's splitter, its record lost
        splitter = subprocess.Popen([sys.executable, "-P", "-m", "kvguard", "splitter", "--table", str(state / "split.json"),
                                     "--port", "0", "--metrics-port", "0"], stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        wait_for(lambda: splitter.pid in ProcessTable.logging_into(state), "the splitter logging into the folder")
        done = kvguard("apply", "-f", str(REPO / "examples" / "tiny-cpu.yaml"), "--local", "--state-dir", str(state))
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        assert "state.json: missing, though 1 kvguard process(es) log into the folder" in done.stderr
        assert "kvguard apply --local --delete" in done.stderr and not (state / "state.json").exists()
        deleted = kvguard("apply", "--local", "--delete", "--state-dir", str(state))
        assert deleted.returncode == 0 and "stopped 1 process(es)" in deleted.stdout, deleted.stdout + deleted.stderr
        assert splitter.wait(timeout=60) is not None and not state.exists()
    finally:
        if splitter.poll() is None:
            splitter.kill()
            splitter.wait()


def test_delete_with_a_manifest_stops_only_the_model_it_names(tmp_path: Path) -> None:
    """Outside probe: `apply --delete -f other.yaml --state-dir D` stopped and removed the model D
    held, although applying other.yaml there is refused. With -f, the folder must hold that model."""
    from kvguard.operator.backends.local import LocalState, StateStore

    state = tmp_path / "s"
    with StateStore(state).locked() as store:
        store.save(LocalState(model="tiny-cpu", namespace="default"))
    other = yaml.safe_load((REPO / "examples" / "tiny-cpu.yaml").read_text())
    other["metadata"] = {"name": "other-model"}
    (tmp_path / "other.yaml").write_text(yaml.safe_dump(other))
    refused = kvguard("apply", "--local", "--delete", "-f", str(tmp_path / "other.yaml"), "--state-dir", str(state))
    assert refused.returncode == 2 and "holds model default/tiny-cpu, not default/other-model" in refused.stderr, refused.stderr
    assert (state / "state.json").exists()
    done = kvguard("apply", "--local", "--delete", "-f", str(REPO / "examples" / "tiny-cpu.yaml"), "--state-dir", str(state))
    assert done.returncode == 0 and not state.exists(), done.stdout + done.stderr


@pytest.mark.parametrize("annotation, value, said", [
    ("kvguard.io/pause", "yes", "'yes' is not \"true\""),
    ("kvguard.io/rollback-to", "XYZ", "'XYZ' is not a revision"),
])  # fmt: skip
def test_a_control_annotation_that_would_not_do_what_it_says_is_bad_input(tmp_path: Path, annotation: str, value: str,
                                                                           said: str) -> None:  # fmt: skip
    """`kvguard.io/pause: "yes"` was read as no pause and the rollout went on; `kvguard.io/rollback-to:
    XYZ` rolled the spec out with exit 0, saying nothing of it (outside probes). Both are refused as
    the admission webhook refuses them (rollout.annotation_problems), before anything starts."""
    manifest = yaml.safe_load((REPO / "examples" / "incident.yaml").read_text())
    manifest["metadata"]["annotations"] = {annotation: value}
    path = tmp_path / "annotated.yaml"
    path.write_text(yaml.safe_dump(manifest))
    done = kvguard("apply", "-f", str(path), "--local", "--state-dir", str(tmp_path / "s"))
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert f"metadata.annotations[{annotation}]: {said}" in done.stderr
    assert not (tmp_path / "s").exists()


def test_sigterm_stops_apply_as_ctrl_c_does(tmp_path: Path, tiny_model_dir: Path) -> None:
    """One line and exit 130 (not death by the signal), the state folder kept for a resume."""
    import signal

    body = yaml.safe_load((REPO / "examples" / "tiny-cpu.yaml").read_text())
    body["spec"]["model"]["source"] = {"pvc": {"claimName": "local", "path": str(tiny_model_dir)}}
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(body))
    state = tmp_path / "state"
    apply = subprocess.Popen([sys.executable, "-P", "-m", "kvguard", "apply", "-f", str(tmp_path / "m.yaml"), "--local",
                              "--state-dir", str(state)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert apply.stdout is not None and apply.stdout.readline().startswith("kvguard apply --local:")
        apply.send_signal(signal.SIGTERM)
        _, err = apply.communicate(timeout=120)
        assert apply.returncode == 130 and "interrupted" in err and "Traceback" not in err, err
    finally:
        if apply.poll() is None:
            apply.kill()
        kvguard("apply", "--local", "--delete", "--state-dir", str(state))


# --- real rollouts --------------------------------------------------------------------------------


class Story:
    def __init__(self, root: Path, model_dir: Path) -> None:
        self.root, self.state_dir, self.applies = root, root / "state", 0
        body = yaml.safe_load((REPO / "examples" / "tiny-cpu.yaml").read_text())
        body["spec"]["model"]["source"] = {"pvc": {"claimName": "local", "path": str(model_dir)}}
        self.body: dict[str, Any] = body

    def apply(self, body: dict[str, Any], *extra: str) -> subprocess.CompletedProcess[str]:
        self.applies += 1
        manifest = self.root / f"model-{self.applies}.yaml"
        manifest.write_text(yaml.safe_dump(body))
        done = kvguard("apply", "-f", str(manifest), "--local", "--state-dir", str(self.state_dir), *extra,
                       timeout=APPLY_TIMEOUT_S)  # fmt: skip
        print(f"$ kvguard apply (#{self.applies}) -> exit {done.returncode}\n{done.stdout}{done.stderr}")  # shown with -rA
        return done

    def state(self) -> dict[str, Any]:
        return json.loads((self.state_dir / "state.json").read_text())

    def api_base(self, revision: str) -> str:
        """The revision's own router (behind the splitter)."""
        router = next(w for w in self.state()["revisions"][revision]["workers"] if w["name"] == "router")
        return f"http://127.0.0.1:{router['port']}/v1"

    def serving_url(self) -> str:
        """The model's one URL: the splitter's, the same through every rollout."""
        return f"http://127.0.0.1:{self.state()['splitter']['port']}/v1"

    def pids(self, revision: str) -> dict[str, int | None]:
        return {w["name"]: w["pid"] for w in self.state()["revisions"][revision]["workers"]}


class _Traffic:
    """A client sending one short completion after another to the model's URL in a thread, from
    `with` until its end: (status, x-kvguard-revision) of every answer, errors included."""

    def __init__(self, url: str) -> None:
        import threading

        self.url, self.answers, self._stop = url, list[tuple[int, str | None]](), threading.Event()
        self._thread = threading.Thread(target=self._send, daemon=True)

    def _send(self) -> None:
        body = {"model": "kvguard/tiny-random", "prompt": "hello", "max_tokens": 4, "temperature": 0}
        while not self._stop.is_set():
            try:
                # 120 s as e2e/progressive.Traffic: a 4-token answer beside a starting worker on a loaded
                # machine is slow, and a client timeout here is recorded as a failed request.
                answer = requests.post(f"{self.url}/completions", json=body, timeout=120)
                self.answers.append((answer.status_code, answer.headers.get("x-kvguard-revision")))
            except requests.RequestException as exc:
                self.answers.append((0, type(exc).__name__))

    def __enter__(self) -> _Traffic:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=60)


@pytest.fixture(scope="module")
def story(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[Story]:
    story = Story(tmp_path_factory.mktemp("apply-cli"), tiny_model_dir)
    try:
        yield story
    finally:
        done = kvguard("apply", "--local", "--delete", "--state-dir", str(story.state_dir))
        assert done.returncode == 0, done.stdout + done.stderr


@pytest.fixture(scope="module")
def first(story: Story) -> subprocess.CompletedProcess[str]:
    done = story.apply(story.body)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def lines(out: str) -> list[str]:
    return [line.strip() for line in out.splitlines()]


def report_path(out: str) -> Path:
    found = [line.removeprefix("canary report: ") for line in lines(out) if line.startswith("canary report: ")]
    assert len(found) == 1, out
    return Path(found[0])


@pytest.mark.slow
def test_a_rollout_prints_a_line_per_wait_and_each_probe_as_it_finishes(story: Story, first: subprocess.CompletedProcess[str]) -> None:
    out = lines(first.stdout)
    revision = story.state()["status"]["revision"]
    # Worker processes cannot answer the instant they are spawned: the wait for them is always announced.
    assert any(line.startswith(f"... revision {revision}: waiting for ") for line in out), first.stdout
    assert f"... revision {revision}: canary suite running" in out
    assert any(re.fullmatch(r"\.\.\. \w+: waited \d+\.\d s", line) for line in out), first.stdout  # a wait's length
    header = out.index(next(line for line in out if line.startswith("PROBE") and "STATUS" in line))
    report = CanaryReport.model_validate_json(report_path(first.stdout).read_text())
    assert report.verdict.value == "pass" and report_path(first.stdout) == story.state_dir / "revisions" / revision / "canary.json"
    for probe in report.probes:  # each probe's row, printed under the header as it finished
        assert any(line.split()[:2] == [probe.name.value, probe.status.value] for line in out[header + 1:]), probe.name
    assert f"state: Stable  revision: {revision}  stable: {revision}" in out
    assert out[-1] == f"serving: {story.serving_url()}"
    assert story.state()["weights"] == {revision: 100}
    answer = requests.get(f"{story.serving_url()}/models", timeout=30)
    assert answer.status_code == 200 and answer.headers["x-kvguard-revision"] == revision


@pytest.mark.slow
def test_a_replicas_only_change_resizes_the_serving_revision_in_place(story: Story, first: subprocess.CompletedProcess[str]) -> None:
    revision = story.state()["status"]["revision"]
    before, revisions, url = story.pids(revision), set(story.state()["revisions"]), story.serving_url()
    router_url = story.api_base(revision)
    report = (story.state_dir / "revisions" / revision / "canary.json").read_text()
    body = copy.deepcopy(story.body)
    body["spec"]["roles"]["decode"]["replicas"] = 2
    with _Traffic(url) as traffic:  # a user all through the resize: never an error
        done = story.apply(body)
    assert done.returncode == 0, done.stdout + done.stderr
    assert traffic.answers and set(traffic.answers) == {(200, revision)}, traffic.answers
    out = lines(done.stdout)
    assert any("spec replicas changed (decode 1 -> 2): resizing it in place" in line for line in out), done.stdout
    assert f"revision {revision} resized in place (decode 1 -> 2 processes), every worker ready" in out
    assert not any(line.startswith("PROBE") for line in out), done.stdout  # no canary ran
    assert report_path(done.stdout).read_text() == report  # the report that admitted the revision, unchanged
    state = story.state()
    assert set(state["revisions"]) == revisions and state["status"]["revision"] == revision  # no new revision
    after = story.pids(revision)
    assert [after[w] for w in ("prefill-0", "decode-0")] == [before[w] for w in ("prefill-0", "decode-0")]
    assert after["decode-1"] is not None and after["router"] != before["router"]  # the router learns decode-1
    router = next(w for w in state["revisions"][revision]["workers"] if w["name"] == "router")
    assert sum(1 for arg in router["argv"] if arg == "--decode") == 2
    assert out[-1] == f"serving: {url}" and story.serving_url() == url
    # A new router on new ports took over once ready; the old one drained and stopped.
    assert story.api_base(revision) != router_url and state["revisions"][revision]["retiring"] == []
    assert json.loads((story.state_dir / "split.json").read_text())["backends"][0]["url"] == story.api_base(revision).removesuffix("/v1")
    assert not Path(f"/proc/{before['router']}").exists() or "kvguard" not in Path(f"/proc/{before['router']}/cmdline").read_text()
    story.body = body
    # Down to no decode worker in place: refused by field (it crashed the router's start), nothing changes.
    emptied = copy.deepcopy(body)
    emptied["spec"]["roles"]["decode"]["replicas"] = 0
    refused = story.apply(emptied)
    assert refused.returncode == 2 and "spec.roles.decode.replicas: 0 would leave the serving revision" in refused.stderr
    assert "Traceback" not in refused.stderr and story.pids(revision) == after
    # Back down to one: decode-1 serves the old router's requests until the new router takes over.
    story.body = copy.deepcopy(body)
    story.body["spec"]["roles"]["decode"]["replicas"] = 1
    with _Traffic(url) as traffic:
        shrunk = story.apply(story.body)
    assert shrunk.returncode == 0 and f"revision {revision} resized in place (decode 2 -> 1 processes), every worker ready" in \
        lines(shrunk.stdout), shrunk.stdout + shrunk.stderr
    assert traffic.answers and set(traffic.answers) == {(200, revision)}, traffic.answers
    assert set(story.pids(revision)) == {"prefill-0", "decode-0", "router"} and story.state()["revisions"][revision]["retiring"] == []
    assert not Path(f"/proc/{after['decode-1']}/cmdline").exists() or "kvguard" not in Path(f"/proc/{after['decode-1']}/cmdline").read_text()


@pytest.mark.slow
def test_a_rollback_prints_the_probe_table_and_the_reports_path(story: Story, first: subprocess.CompletedProcess[str]) -> None:
    stable = story.state()["status"]["revision"]
    serving = story.serving_url()
    body = copy.deepcopy(story.body)
    body["spec"]["engine"]["version"] = "0.2.0-incident-build"
    done = story.apply(body, "--faults", FAULTY_BUILD)
    assert done.returncode == 4, done.stdout + done.stderr
    assert "FAULT INJECTION" in done.stderr
    out = lines(done.stdout)
    candidate = story.state()["status"]["rollout"]["revision"]
    verdict = out.index(next(line for line in out if line.startswith(f"canary of {candidate}: FAIL")))
    assert out[verdict + 1].split()[:3] == ["PROBE", "STATUS", "TIME"]  # the whole table, after the verdict
    table = out[verdict + 1:]
    assert any(line.split()[:2] == ["over_length", "fail"] for line in table), done.stdout  # the incident's probe
    path = report_path(done.stdout)
    assert path == story.state_dir / "revisions" / candidate / "canary.json"
    report = CanaryReport.model_validate_json(path.read_text())
    assert report.verdict.value == "fail"
    assert f"state: RolledBack  revision: {candidate}  stable: {stable}" in out
    assert out[-1] == f"serving: {serving}"  # S8: the stable revision keeps serving
