"""Decode throughput with KV page tags on vs off (S1/S5 checks), same engine, same run.

A random Llama bigger than the tiny test model (hidden 1024, 8 layers, 16 heads, 4 KV heads,
head_dim 64, intermediate 2816, vocab 8192: ~120M parameters, float32), so the measurement is
the model's decode step rather than Python overhead. Each round submits a fresh batch of
concurrent requests, prefills them (untimed), then times the decode steps to completion. Rounds
alternate on/off in ABBA order to cancel drift on a shared, noisy machine. The tags switch is
flipped between rounds when the pool is empty. Prints the median throughput of each mode and
their ratio, the ratio of the best round of each (noise on a shared machine only slows rounds
down), and the tag work per step timed in isolation; goal: tags cost < 1%.

    .venv/bin/python bench/tag_overhead.py [--rounds 6] [--batch 16] [--prompt 256] [--decode 32] [--model tiny]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

from kvguard.workers.config import EngineConfig
from kvguard.workers.device import synchronize
from kvguard.workers.engine import Engine, StepInputs
from kvguard.workers.request import RequestState, SamplingParams
from kvguard.workers.tiny import write_random_model

MODELS = {
    "large": {"hidden_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 4,
              "head_dim": 64, "intermediate_size": 2816, "vocab_size": 8192, "max_position_embeddings": 4096},
    "tiny": {},  # workers/tiny.py's shape: Python-bound, so the tags' share is an upper bound
}
VOCAB = 320


def decode_round(engine: Engine, tags: bool, batch: int, prompt: int, decode: int, tag: str) -> tuple[float, float, list[list[int]]]:
    """Tokens per wall second and per CPU second of this process over the decode steps of one
    batch; also the outputs (for a sanity check). CPU time is what other processes on a shared
    machine disturb least: it does not count the time this process waits for a core."""
    engine.pool.tags = tags
    gen = torch.Generator().manual_seed(0)
    requests = [
        engine.add_request(f"{tag}-{i}", torch.randint(0, VOCAB, (prompt,), generator=gen).tolist(),
                           SamplingParams(max_tokens=decode, temperature=0, ignore_eos=True))
        for i in range(batch)
    ]
    while any(r.state not in (RequestState.DECODING, RequestState.FINISHED) for r in requests):
        engine.step()  # (a request that finished before the last was admitted just decodes no more)
    synchronize(engine.device)
    decoded_before = sum(len(r.output_ids) for r in requests)
    start, cpu_start = time.perf_counter(), time.process_time()
    while engine.has_work():
        engine.step()
    synchronize(engine.device)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    tokens = sum(len(r.output_ids) for r in requests) - decoded_before
    assert all(r.state == RequestState.FINISHED for r in requests), "a request failed during the benchmark"
    return tokens / elapsed, tokens / cpu, [r.output_ids for r in requests]


def tag_work_per_step(engine: Engine, batch: int, prompt: int, iterations: int = 300) -> float:
    """Seconds of the extra work tags add to one decode step, timed in isolation on a real
    decoding batch: the granted-generations table, the S1 gather-and-compare, the write
    redirect, the S5 stamp and moving the verdicts to the host with the tokens (the calls
    `Engine._run_batch` makes for decode rows)."""
    engine.pool.tags = True
    gen = torch.Generator().manual_seed(1)
    # Long enough that the first admitted are still decoding when the last is admitted (a batch
    # over max_prefill_tokens takes several steps to admit; with 2 tokens, --batch 128 never ended).
    admit_steps = -(-batch * prompt // engine.config.max_prefill_tokens)
    requests = [engine.add_request(f"micro-{i}", torch.randint(0, VOCAB, (prompt,), generator=gen).tolist(),
                                   SamplingParams(max_tokens=admit_steps + 2, temperature=0, ignore_eos=True))
                for i in range(batch)]  # fmt: skip
    while any(r.state != RequestState.DECODING for r in requests):
        engine.step()
    pool = engine.pool
    step = StepInputs.build([], requests, pool.page_size, pool.scratch_page)
    tokens = torch.zeros(batch, dtype=torch.int64, device=engine.device)

    def with_tags() -> None:
        _, positions, slots, scratch_slots = engine._tensor(step.token_columns())
        _, read_tokens, _, _ = engine._tensor(step.row_columns())
        table, granted = engine._lease_tables(requests, step.row_pages, generations=True)
        assert granted is not None
        ok = pool.verify_reads(table, granted, None, read_tokens)
        torch.where(ok, slots, scratch_slots)
        engine._stamp(step, ok, has_prompts=False)
        torch.stack((tokens, ok.to(tokens.dtype))).tolist()  # as Engine._collect does

    def without_tags() -> None:
        engine._tensor(step.token_columns())
        engine._tensor(step.row_columns())
        engine._lease_tables(requests, step.row_pages, generations=False)
        tokens.tolist()

    def timed(fn) -> float:
        synchronize(engine.device)
        start = time.perf_counter()
        for _ in range(iterations):
            fn()
        synchronize(engine.device)
        return (time.perf_counter() - start) / iterations

    cost = statistics.median(timed(with_tags) - timed(without_tags) for _ in range(5))
    while engine.has_work():
        engine.step()
    return cost


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6, help="rounds per mode (ABBA order)")
    parser.add_argument("--batch", type=int, default=16, help="concurrent requests per round")
    parser.add_argument("--prompt", type=int, default=256, help="prompt tokens per request")
    parser.add_argument("--decode", type=int, default=32, help="tokens decoded per request")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--model", choices=sorted(MODELS), default="large",
                        help="large: ~120M params, compute-bound (the < 1%% goal); tiny: the Python-bound test model")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = parser.parse_args()
    global VOCAB
    VOCAB = MODELS[args.model].get("vocab_size", 320)
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        write_random_model(tmp, MODELS[args.model], seed=0)
        engine = Engine(EngineConfig(tmp, device=args.device, kv_pool_tokens=args.batch * (args.prompt + args.decode + 16),
                                     context_length=2048, max_running_requests=args.batch))
    throughput: dict[bool, list[float]] = {True: [], False: []}
    cpu_throughput: dict[bool, list[float]] = {True: [], False: []}
    outputs: dict[bool, list[list[int]]] = {}
    decode_round(engine, True, args.batch, args.prompt, 4, "warmup")
    for i in range(args.rounds):
        for tags in ((True, False) if i % 2 == 0 else (False, True)):
            tps, cpu_tps, out = decode_round(engine, tags, args.batch, args.prompt, args.decode, f"r{i}-{tags}")
            throughput[tags].append(tps)
            cpu_throughput[tags].append(cpu_tps)
            outputs.setdefault(tags, out)
    tag_seconds = tag_work_per_step(engine, args.batch, args.prompt)
    engine.check_integrity()
    on, off = statistics.median(throughput[True]), statistics.median(throughput[False])
    print(f"model: ~{sum(p.numel() for p in engine.model.parameters()) / 1e6:.0f}M params, {engine.dtype}, "
          f"{engine.device}; batch {args.batch}, prompt {args.prompt}, decode {args.decode}, rounds {args.rounds}/mode")
    print(f"tags on : {on:8.1f} tok/s  (rounds: {', '.join(f'{t:.1f}' for t in throughput[True])})")
    print(f"tags off: {off:8.1f} tok/s  (rounds: {', '.join(f'{t:.1f}' for t in throughput[False])})")
    best = max(throughput[True]) / max(throughput[False])
    print(f"ratio on/off: {on / off:.4f} median, {best:.4f} best-of  (tag cost {100 * (1 - on / off):+.2f}% / "
          f"{100 * (1 - best):+.2f}%, goal < 1%)")
    cpu_ratio = statistics.median(cpu_throughput[True]) / statistics.median(cpu_throughput[False])
    print(f"ratio on/off per CPU second: {cpu_ratio:.4f} median (tag cost {100 * (1 - cpu_ratio):+.2f}%, goal < 1%)")
    step_seconds = args.batch / off
    print(f"tag work per decode step (isolated): {tag_seconds * 1e6:.0f} us = "
          f"{100 * tag_seconds / step_seconds:.2f}% of a {step_seconds * 1e3:.1f} ms tags-off step")
    print(json.dumps({"tags_on_tok_s": round(on, 2), "tags_off_tok_s": round(off, 2), "ratio": round(on / off, 4), "ratio_best": round(best, 4),
                      "ratio_cpu": round(cpu_ratio, 4),
                      "tag_work_us_per_step": round(tag_seconds * 1e6, 1),
                      "same_outputs": outputs[True] == outputs[False],
                      "tag_violations": engine.metrics.tag_violations._value.get()}))


if __name__ == "__main__":
    main()
