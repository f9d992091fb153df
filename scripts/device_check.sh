"${PY:-python3}" -P -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "${SITE:-/tmp/site}" ${WHL:-.whl}/*.whl && export PYTHONPATH="${SITE:-/tmp/site}:/tmp/kvg" || exit 1
# One-shot CUDA check of the kvguard engine (run from the repo root; whole script < 9 min).
#   GPU:   bash scripts/device_check.sh                       (OUT is set by the device tool)
#   local: DEVICE=cpu PY=.venv/bin/python3 WHL=/tmp/whl311 SITE=/tmp/site-local OUT=/tmp/devcheck-out bash scripts/device_check.sh
# Notes:
# - `-P` everywhere: the repo root holds operator/, which shadows the standard library's `operator`
#   (so `python3 -m pip` run in the repo root without -P dies at import), and PYTHONPATH=$PWD breaks
#   too. kvguard is mapped by pyproject's package-dir (kvguard.workers = workers/), so it is made
#   importable through a symlink tree in /tmp/kvg instead.
# - Missing on the GPU machine, carried in .whl/: pydantic, pydantic-core, annotated-types,
#   typing-inspection, typing-extensions (>=4.16 for pydantic-core), cryptography, cffi, pycparser,
#   pytest-asyncio (step 6), openai with httpx2, httpcore2, truststore, jiter, sniffio (step 5).
#   Fetch them once (versions as in .venv; .whl/ is git-ignored through .git/info/exclude):
#     for p in pydantic pydantic_core annotated_types typing_inspection typing_extensions cryptography cffi \
#              pycparser pytest_asyncio openai httpx2 httpcore2 truststore jiter sniffio; do
#       python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#         --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#         -d .whl "$p==$(.venv/bin/pip show "$p" | sed -n 's/^Version: //p')"; done
# - SKIP="2 3a ..." leaves steps out (a second call after a first); BUDGET caps all steps' seconds.
set -o pipefail
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
DEVICE=${DEVICE:-cuda}
OUT=${OUT:-/tmp/devcheck-out}
BUDGET=${BUDGET:-510}          # seconds for all steps together (the device call allows 600)
mkdir -p "$OUT"
LOG=$OUT/device_check.log
: >"$LOG"
REPO=$PWD
WORK=$(mktemp -d /tmp/devcheck.XXXXXX)

rm -rf /tmp/kvg && mkdir -p /tmp/kvg/kvguard
for f in "$REPO"/kvguard/*; do ln -s "$f" /tmp/kvg/kvguard/; done
ln -s "$REPO/workers" /tmp/kvg/kvguard/workers
ln -s "$REPO/operator" /tmp/kvg/kvguard/operator

START=$SECONDS
SUMMARY=()
log() { echo "$*" | tee -a "$LOG"; }
# step NAME LIMIT_S CMD...: time-boxed by the step's limit and what is left of BUDGET; never stops the script.
# SKIP="2 3a 4": step ids (a name's first word) not to run, e.g. on a second call after a first.
step() {
  local name=$1 limit=$2; shift 2
  if [[ " ${SKIP:-} " == *" ${name%% *} "* ]]; then log "=== [$name] SKIPPED (SKIP)"; return; fi
  local left=$((BUDGET - (SECONDS - START)))
  if ((left < 20)); then log "=== [$name] SKIPPED: ${left}s of the budget left"; SUMMARY+=("$name: skipped (time)"); return; fi
  ((limit > left)) && limit=$left
  log "=== [$name] start $(date +%T), limit ${limit}s"
  local t0=$SECONDS
  timeout -k 5 "$limit" "$@" 2>&1 | tee -a "$LOG"
  local rc=$?
  ((rc == 124 || rc == 137)) && log "=== [$name] TIMED OUT"
  log "=== [$name] rc=$rc in $((SECONDS - t0))s"
  SUMMARY+=("$name: rc=$rc $((SECONDS - t0))s")
}

log "device_check: DEVICE=$DEVICE PY=$PY PYTHONPATH=$PYTHONPATH repo=$REPO $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null) $(date -u +%FT%TZ)"

# ------------------------------------------------------------------ 1. the machine
step "1 nvidia-smi" 20 nvidia-smi -L
step "1 torch" 60 "$PY" -P -c "
import torch, pydantic, cryptography, kvguard.workers.engine as e
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())
print('device', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none')
print('pydantic', pydantic.VERSION, 'cryptography', cryptography.__version__, 'kvguard', e.__file__)"

# ------------------------------------------------------------------ 2. engine correctness on DEVICE
cat >"$WORK/engine_check.py" <<'EOF'
"""Greedy parity DEVICE float32 vs cpu float32, bfloat16 runs, and the S1/S3/S5 tag checks on DEVICE."""
import os
import sys
import tempfile
import time

import torch

from kvguard.workers.config import EngineConfig
from kvguard.workers.engine import Engine
from kvguard.workers.kv_pool import KVPool, StaleLeaseError
from kvguard.workers.request import KVNotWritten, RequestState, SamplingParams, TagViolation
from kvguard.workers.tiny import write_tiny_model

DEV = os.environ.get("DEVICE", "cuda")
PROMPTS = ["The quick brown fox", "Hello", "A much longer prompt that spans a few pages of the pool",
           "abc", "secret nonce 12345", "kvguard on a GPU " * 6]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
failures: list[str] = []


def check(name: str, ok: bool, detail: object = "") -> None:
    print(f"{'PASS' if ok else 'FAIL'} {name} {detail}", flush=True)
    if not ok:
        failures.append(name)


def info(name: str, detail: object) -> None:
    print(f"INFO {name} {detail}", flush=True)


def guarded(name: str, fn, *args) -> None:
    try:
        fn(*args)
    except Exception as exc:  # one broken check must not hide the others
        import traceback
        traceback.print_exc()
        check(f"{name} raised", False, repr(exc))


model_dir = write_tiny_model(tempfile.mkdtemp(prefix="kvg-tiny-"), seed=0)


def engine(device: str, dtype: str = "float32", **kw) -> Engine:
    return Engine(EngineConfig(model_dir, device=device, dtype=dtype,
                               **{"kv_pool_tokens": 1024, "page_size": 8, "context_length": 256, **kw}))


def run(e: Engine) -> None:
    while e.has_work():
        e.step()


def first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


t0 = time.perf_counter()
ref = engine("cpu")
ids = [ref.tokenizer.encode(p) for p in PROMPTS]
ref_out = [ref.generate([p], GREEDY)[0].output_ids for p in ids]


def parity(dtype: str) -> None:
    e = engine(DEV, dtype)
    info(f"[{dtype}] engine", f"device={e.device} dtype={e.dtype} pool={e.pool.kv.device}/{e.pool.kv.dtype}")
    check(f"[{dtype}] runs on {DEV}", e.device.type == torch.device(DEV).type and e.pool.kv.device.type == e.device.type)
    solo = [e.generate([p], GREEDY)[0].output_ids for p in ids]
    batched = [r.output_ids for r in e.generate(ids, GREEDY)]
    same = [s == r for s, r in zip(solo, ref_out)]
    tokens = sum(first_diff(s, r) for s, r in zip(solo, ref_out))
    detail = f"{sum(same)}/{len(same)} prompts equal, {tokens}/{sum(map(len, ref_out))} tokens before first divergence"
    if dtype == "float32":
        check(f"[{dtype}] {DEV} greedy == cpu float32 greedy", all(same), detail)
        for i, ok in enumerate(same):
            if not ok:
                info(f"  prompt {i} diverges at token {first_diff(solo[i], ref_out[i])}", (solo[i], ref_out[i]))
        check(f"[{dtype}] batched == solo on {DEV}", batched == solo)
    else:  # bf16 need not equal fp32; reported, not judged
        info(f"[{dtype}] {DEV} greedy vs cpu float32", detail)
        bsame = [b == s for b, s in zip(batched, solo)]
        (check if DEV == "cpu" else info)(f"[{dtype}] batched == solo on {DEV}", all(bsame) if DEV == "cpu" else f"{sum(bsame)}/{len(bsame)}")
    params = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, top_k=50, seed=11, ignore_eos=True)
    sp_ids = ref.tokenizer.encode("sample me")
    alone = e.generate([sp_ids], params)[0].output_ids
    mixed = e.generate([ref.tokenizer.encode("other"), sp_ids], [SamplingParams(max_tokens=20, temperature=1.0, seed=3), params])
    check(f"[{dtype}] seeded sampling reproducible in a batch on {DEV}", mixed[1].output_ids == alone)
    e.check_integrity()
    check(f"[{dtype}] pool empty after runs", e.pool.used_pages == 0)


def s1_stale_lease(dtype: str) -> None:
    """tests/test_engine.py::test_s1_stale_lease_fails_only_its_request on DEV."""
    e = engine(DEV, dtype, kv_pool_tokens=256, page_size=8)
    prompts = [e.tokenizer.encode(p) for p in PROMPTS[:3]]
    victim_prompt = e.tokenizer.encode(PROMPTS[4])
    solo = [e.generate([p], GREEDY)[0].output_ids for p in prompts + [victim_prompt]]
    reqs = [e.add_request(f"r{i}", p, GREEDY) for i, p in enumerate(prompts)]
    e.step(), e.step(), e.step()
    check(f"[{dtype}] S1 setup: all decoding", all(r.state == RequestState.DECODING for r in reqs))
    e.pool.free(reqs[1].lease)  # the bug: r1's pages go back while r1 still decodes
    intruder = e.add_request("intruder", victim_prompt, GREEDY)
    e.step()
    check(f"[{dtype}] S1 setup: intruder got r1's pages", bool(set(intruder.lease.page_ids) & set(reqs[1].lease.page_ids)))
    run(e)
    check(f"[{dtype}] S1 stale reader aborted with TagViolation on {DEV}",
          reqs[1].state == RequestState.ABORTED and isinstance(reqs[1].error, TagViolation), f"{reqs[1].state} {reqs[1].error!r}")
    check(f"[{dtype}] S1 others unchanged", [reqs[0].output_ids, reqs[2].output_ids, intruder.output_ids] == [solo[0], solo[2], solo[3]])
    check(f"[{dtype}] S1 tag_violations metric == 1", e.metrics.tag_violations._value.get() == 1, e.metrics.tag_violations._value.get())
    check(f"[{dtype}] S1 pool empty", e.pool.used_pages == 0)
    e.check_integrity()


def no_tags_control(dtype: str) -> None:
    """test_without_tags_the_same_bug_reads_another_requests_kv: with tags off the bug goes unseen."""
    e = engine(DEV, dtype, kv_pool_tokens=128, page_size=8, tags=False)
    prompt = e.tokenizer.encode(PROMPTS[1])
    solo = e.generate([prompt], GREEDY)[0].output_ids
    victim = e.add_request("victim", prompt, GREEDY)
    e.step(), e.step()
    e.pool.free(victim.lease)
    e.add_request("intruder", e.tokenizer.encode(PROMPTS[4] * 3), GREEDY)
    run(e)
    check(f"[{dtype}] control: tags off, stale reader finishes with corrupted output",
          victim.state == RequestState.FINISHED and victim.output_ids != solo, victim.state)


def unsafe_start(dtype: str) -> None:
    """test_s3_... and test_s1_unsafe_start_is_still_caught_at_read_time on DEV."""
    decode = engine(DEV, dtype)
    decode.generate([decode.tokenizer.encode(PROMPTS[2])], GREEDY)  # pages hold an earlier request's KV
    other = decode.add_request("other", decode.tokenizer.encode(PROMPTS[0]), GREEDY)
    decode.step()
    d_req = decode.add_decode_request("unsafe", decode.tokenizer.encode(PROMPTS[2]), GREEDY)
    decode.step()
    try:
        decode.start_decode("unsafe", 65)
        check(f"[{dtype}] S3 start on unwritten pages refused", False, "no KVNotWritten")
    except KVNotWritten:
        check(f"[{dtype}] S3 start on unwritten pages refused", True)
    run(decode)
    d2 = decode.add_decode_request("unsafe2", decode.tokenizer.encode(PROMPTS[2]), GREEDY)
    other2 = decode.add_request("other2", decode.tokenizer.encode(PROMPTS[0]), GREEDY)
    decode.step()
    decode.start_decode("unsafe2", 65, require_written=False)
    run(decode)
    check(f"[{dtype}] S1 unsafe start caught at read time on {DEV}",
          isinstance(d2.error, TagViolation) and other2.state == RequestState.FINISHED and other.state == RequestState.FINISHED,
          f"{d2.state} {d2.error!r}")
    check(f"[{dtype}] pool empty after unsafe start", decode.pool.used_pages == 0)


def pool_tags(dtype: str) -> None:
    """tests/test_kv_pool.py's S1/S5 core on a DEV pool."""
    dev, td = torch.device(DEV), getattr(torch, dtype)
    page = 4
    pool = KVPool(num_layers=2, num_kv_heads=2, head_dim=3, page_size=page, num_pages=8, dtype=td, device=dev)

    def stamp(lease, start, end):
        pages = list(range(start // page, (end - 1) // page + 1))
        first = torch.tensor([max(start - p * page, 0) for p in pages], device=dev)
        last = torch.tensor([min(end - p * page, page) for p in pages], device=dev)
        return pool.stamp_written(lease.page_ids_t[pages], lease.generations_t[pages], first, last)

    def reads_ok(leases, n):
        pages = [pool.pages_for(max(k, 1)) for k in n]
        width = max(pages)
        table = torch.tensor([list(l.page_ids[:p]) + [0] * (width - p) for l, p in zip(leases, pages)], device=dev)
        granted = torch.tensor([list(l.generations[:p]) + [0] * (width - p) for l, p in zip(leases, pages)], device=dev)
        return pool.verify_reads(table, granted, torch.tensor(pages, device=dev), torch.tensor(n, device=dev)).tolist()

    a, b = pool.allocate("a", 8), pool.allocate("b", 8)
    check(f"[{dtype}] pool S1 unwritten read refused", reads_ok([a], [6]) == [False])
    stamp(a, 0, 8), stamp(b, 0, 8)
    check(f"[{dtype}] pool S1 written read allowed", reads_ok([a, b], [8, 8]) == [True, True])
    pool.free(a)
    c = pool.allocate("c", 8)
    check(f"[{dtype}] pool reuse hands a's pages to c", set(c.page_ids) == set(a.page_ids))
    stamp(c, 0, 8)
    check(f"[{dtype}] pool S1 stale lease refused per request on {DEV}", reads_ok([a, b, c], [8, 8, 8]) == [False, True, True])
    pool.free(c)
    d = pool.allocate("d", 8)
    check(f"[{dtype}] pool S5 late write of a stale lease not applied", stamp(c, 0, 8).tolist() == [False, False])
    check(f"[{dtype}] pool S5 d not marked written by c's write", reads_ok([d], [8]) == [False])
    before = pool.kv.view(torch.uint8).clone()  # bytes: never-handed-out pages are uninitialised (NaN != NaN)
    data = torch.full((2, 2, 2, page, 2, 3), 5.0, dtype=td)
    res = pool.import_pages(c, c.page_ids, c.generations, data)
    check(f"[{dtype}] pool S5 import for a stale lease dropped", (not res.applied) and pool.stale_writes_dropped == 1
          and torch.equal(pool.kv.view(torch.uint8), before),
          f"applied={res.applied} dropped={pool.stale_writes_dropped} kv_untouched={torch.equal(pool.kv.view(torch.uint8), before)}")
    try:
        pool.export_pages(c)
        check(f"[{dtype}] pool export of a stale lease refused", False)
    except StaleLeaseError:
        check(f"[{dtype}] pool export of a stale lease refused", True)
    res = pool.import_pages(d, d.page_ids, d.generations, data, pool.valid_tokens(d, d.page_ids, 8))
    check(f"[{dtype}] pool import for the current lease applied", res.applied and pool.lease_written(d, 8))
    pool.check_integrity()


for dtype in ("float32", "bfloat16"):
    for name, fn in (("parity", parity), ("s1_stale_lease", s1_stale_lease), ("no_tags_control", no_tags_control),
                     ("unsafe_start", unsafe_start), ("pool_tags", pool_tags)):
        guarded(f"[{dtype}] {name}", fn, dtype)
if DEV.startswith("cuda"):
    torch.cuda.synchronize()
    info("cuda max memory allocated MiB", round(torch.cuda.max_memory_allocated() / 2**20, 1))
print(f"engine check: {len(failures)} failures in {time.perf_counter() - t0:.1f}s: {failures}")
sys.exit(1 if failures else 0)
EOF
step "2 engine correctness ($DEVICE)" 120 env DEVICE="$DEVICE" "$PY" -P "$WORK/engine_check.py"

# ------------------------------------------------------------------ 3. tag overhead (the < 1% goal)
if [[ $DEVICE == cpu ]]; then
  TAG_A=(--model tiny --rounds 2 --batch 4 --prompt 32 --decode 8)
  TAG_B=(--model tiny --rounds 2 --batch 8 --prompt 32 --decode 8)
else
  TAG_A=(--model large --rounds 6 --batch 16 --prompt 256 --decode 128)
  TAG_B=(--model large --rounds 2 --batch 128 --prompt 256 --decode 64)
fi
step "3a tag_overhead batch ${TAG_A[5]}" 90 "$PY" -P bench/tag_overhead.py --device "$DEVICE" "${TAG_A[@]}"

# ------------------------------------------------------------------ 4. kvguard serve on DEVICE vs on cpu
cat >"$WORK/serve_check.py" <<'EOF'
"""`kvguard serve --device DEVICE` and `--device cpu` side by side: greedy completions must match."""
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

from kvguard.workers.tiny import write_tiny_model

DEV, OUT = os.environ.get("DEVICE", "cuda"), Path(os.environ["OUT"])
signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the step's timeout: still stop the servers
model_dir = write_tiny_model(Path(tempfile.mkdtemp(prefix="kvg-serve-")) / "tiny", seed=0)
failures: list[str] = []


def check(name: str, ok: bool, detail: object = "") -> None:
    print(f"{'PASS' if ok else 'FAIL'} {name} {detail}", flush=True)
    if not ok:
        failures.append(name)


def start(device: str) -> subprocess.Popen:
    log = open(OUT / f"serve_{device.replace(':', '')}.log", "w")
    return subprocess.Popen([sys.executable, "-P", "-m", "kvguard", "serve", "--model", str(model_dir), "--model-name", "tiny",
                             "--device", device, "--kv-pool-tokens", "8192", "--context-length", "1024"],
                            stdout=subprocess.PIPE, stderr=log, text=True)  # in the step's process group: timeout reaches it


def tree(root: int) -> list[int]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                kids.setdefault(int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1]), []).append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += kids.get(pid, [])
    return out


def stop(p: subprocess.Popen) -> None:
    pids = tree(p.pid)
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pass
    for pid in pids:  # only the serve process and its own workers
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


servers = {}
try:
    t0 = time.perf_counter()
    servers = {DEV: start(DEV)} if DEV == "cpu" else {DEV: start(DEV), "cpu": start("cpu")}
    urls = {}
    for name, p in servers.items():
        line = p.stdout.readline()
        if not line:
            raise RuntimeError(f"serve --device {name} exited with {p.wait()} before it was ready (see serve_{name}.log)")
        urls[name] = json.loads(line)
        with open(os.environ["PIDS"], "a") as f:  # the script's last resort if this driver is killed
            f.write(" ".join(map(str, tree(p.pid))) + "\n")
        print(f"serve --device {name} ready after {time.perf_counter() - t0:.1f}s: {urls[name]['router']}", flush=True)
    bodies = [{"prompt": p, "max_tokens": n} for p, n in
              (("The quick brown fox", 24), ("Hello", 16), ("A much longer prompt that spans a few pages " * 4, 32),
               ("abc", 8), ("secret nonce 12345", 24))]
    bodies.append({"prompt": [256, 72, 105, 33], "max_tokens": 16})  # token ids (BOS + "Hi!")

    def complete(name: str, body: dict) -> tuple[int, str]:
        r = requests.post(f"{urls[name]['router']}/completions", json={"model": "tiny", "temperature": 0, **body}, timeout=60)
        return r.status_code, (r.json()["choices"][0]["text"] if r.status_code == 200 else r.text[:300])

    def stream(name: str, body: dict) -> tuple[int, str]:
        r = requests.post(f"{urls[name]['router']}/completions", json={"model": "tiny", "temperature": 0, "stream": True, **body},
                          timeout=60, stream=True)
        text = ""
        for raw in r.iter_lines():
            if raw.startswith(b"data: ") and raw != b"data: [DONE]":
                text += json.loads(raw[6:])["choices"][0]["text"]
        return r.status_code, text

    t1 = time.perf_counter()
    got = {name: [complete(name, b) for b in bodies] + [stream(name, bodies[0])] for name in urls}
    print(f"{len(bodies) + 1} requests per server in {time.perf_counter() - t1:.2f}s", flush=True)
    for name, answers in got.items():
        check(f"serve --device {name}: every request 200", all(s == 200 for s, _ in answers), [s for s, _ in answers])
    ref = got["cpu"]
    for i, ((s, text), (_, want)) in enumerate(zip(got[DEV], ref)):
        check(f"serve --device {DEV} request {i} text == cpu serve's", s == 200 and text == want, repr(text[:60]))
    check(f"serve --device {DEV}: streamed text == non-streamed", got[DEV][-1][1] == got[DEV][0][1])
    metrics = requests.get(urls[DEV]["metrics"]["decode"], timeout=10).text
    lines = [l for l in metrics.splitlines() if l.startswith(("kvguard_tag_violations_total", "kvguard_generation_tokens_total"))]
    print("decode metrics:", lines, flush=True)
    check("decode tag violations == 0", all(float(l.split()[-1]) == 0 for l in lines if l.startswith("kvguard_tag_violations_total")))
finally:
    for p in servers.values():
        stop(p)
print(f"serve check: {len(failures)} failures: {failures}")
sys.exit(1 if failures else 0)
EOF
step "4 kvguard serve ($DEVICE vs cpu)" 120 env DEVICE="$DEVICE" OUT="$OUT" PIDS="$WORK/serve.pids" "$PY" -P "$WORK/serve_check.py"
for pid in $(cat "$WORK/serve.pids" 2>/dev/null); do  # only our serve processes and their workers, if any survived
  grep -qa kvguard "/proc/$pid/cmdline" 2>/dev/null && { log "killing leftover serve process $pid"; kill -9 "$pid"; }
done

# ------------------------------------------------------------------ 4b. kvguard serve with every default
# No --kv-pool-tokens: prefill and decode size their pools from the one device they share (--device-share).
cat >"$WORK/serve_default.py" <<'PYEOF'
import json, os, subprocess, sys, tempfile, time, requests
from pathlib import Path
from kvguard.workers.tiny import write_tiny_model
model = write_tiny_model(Path(tempfile.mkdtemp()) / "tiny", seed=0)
t0 = time.perf_counter()
proc = subprocess.Popen([sys.executable, "-P", "-m", "kvguard", "serve", "--model", str(model), "--device", os.environ["DEVICE"]],
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
line = proc.stdout.readline()
if not line:
    print("serve exited", proc.wait(), proc.stderr.read()[-4000:]); sys.exit(1)
ready = json.loads(line)
print(f"ready after {time.perf_counter() - t0:.1f}s")
for role, url in ready["metrics"].items():
    if role in ("prefill", "decode"):
        cap = [l for l in requests.get(url, timeout=10).text.splitlines() if l.startswith("kvguard_kv_pool_capacity_tokens")]
        print(role, cap)
r = requests.post(ready["router"] + "/completions", json={"model": model.name, "prompt": [1, 65, 66], "max_tokens": 8}, timeout=60)
print("completion", r.status_code, r.text[:200])
proc.terminate(); proc.wait(30)
sys.exit(0 if r.status_code == 200 else 1)
PYEOF
step "4b kvguard serve --device $DEVICE, default pool" 90 env DEVICE="$DEVICE" "$PY" -P "$WORK/serve_default.py"

# ------------------------------------------------------------------ 6. the engine's own tests on DEVICE
# Only where the tests take their device from KVGUARD_TEST_DEVICE (tests/engine_device.py). tests/conftest.py
# imports the operator harness (kopf, kmock, kubernetes: not on the GPU machine), so it is replaced by a
# plugin with its engine fixtures; plugin autoload is off (only pytest-asyncio, carried, is loaded).
if [[ -f tests/engine_device.py ]]; then
  mkdir -p "$WORK/pt"
  cat >"$WORK/pt/devcheck_fixtures.py" <<'PYEOF'
"""tests/conftest.py's engine fixtures without its operator harness (kopf, kmock, kubernetes)."""
import pytest
from hypothesis import settings

settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.load_profile("ci")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from kvguard.workers.tiny import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny-model"), seed=0)
PYEOF
  TESTS=$(grep -l "engine_device import" tests/test_*.py | grep -v "test_pd_" | tr '\n' ' ')
  step "6 pytest on $DEVICE: $TESTS" 90 env KVGUARD_TEST_DEVICE="$DEVICE" PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 \
    PYTHONPATH="$PYTHONPATH:$WORK/pt" "$PY" -P -m pytest --noconftest -p devcheck_fixtures -p pytest_asyncio.plugin \
    -p no:cacheprovider -q -rfE --durations=5 $TESTS
else
  log "=== [6 pytest] SKIPPED: tests/engine_device.py (KVGUARD_TEST_DEVICE) is not in this tree"
fi

# ------------------------------------------------------------------ 5: serving, then 3b if time remains
# Issue 14's benchmark: HF generate() (the parity reference), the in-process engine and `kvguard serve`
# over HTTP with the official openai client (carried in .whl), first on DEVICE, then on this machine's
# CPUs, where (unlike the 2-core dev machine) every server process and the client get a core of their own.
step "5a bench/serving.py --quick --device $DEVICE" 170 "$PY" -P bench/serving.py --quick --backends hf,engine,http \
  --device "$DEVICE" --json-out "$OUT/serving_${DEVICE%%:*}.json"
if [[ $DEVICE != cpu ]]; then
  step "5b bench/serving.py --quick --device cpu ($(nproc) cores)" 200 "$PY" -P bench/serving.py --quick \
    --backends hf,engine,http,http-raw --scenarios closed-1,closed-16 --device cpu --json-out "$OUT/serving_cpu.json"
fi
step "3b tag_overhead batch ${TAG_B[5]}" 120 "$PY" -P bench/tag_overhead.py --device "$DEVICE" "${TAG_B[@]}"
step "3c tag_overhead tiny model" 60 "$PY" -P bench/tag_overhead.py --device "$DEVICE" --model tiny --rounds 4 --batch 16 --prompt 128 --decode 64

log "=== summary (total $((SECONDS - START))s)"
for s in "${SUMMARY[@]}"; do log "  $s"; done
rm -rf "$WORK"
