"""Support for the canary tests (holds no tests): a minimal OpenAI-compatible HTTP server (no engine, no torch).

It generates deterministic "echo-ish" text (the prompt's first word, then words derived from a
hash of the prompt), counts a prompt's tokens as its words, keeps a KV-pool usage figure, and
exposes `/metrics` in kvguard, SGLang or vLLM style. Switches make it misbehave the ways a broken
engine does: leak the previous request's content, accept over-length prompts, hang, send
malformed bodies, send a 200 that carries an error, die mid-stream, hold pages after a disconnect,
bump safety counters, refuse the `seed` field.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import threading
from dataclasses import dataclass

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest


@dataclass
class Behaviour:
    context_length: int = 512
    pool_tokens: int = 2048
    metrics_style: str = "kvguard"  # kvguard | sglang | sglang_server_info | vllm | none
    weights_seed: str = "w1"  # a different value = a different model (baseline mismatch)
    token_delay: float = 0.004  # per streamed token
    prefill_delay_per_token: float = 0.0005
    leak_previous: bool = False  # a later request's output carries the previous prompt's first word
    accept_over_length: bool = False
    # Admission that checks the prompt against this many tokens and max_tokens alone against the
    # context, never their sum (None: prompt + max_tokens must fit the context).
    prompt_limit: int | None = None
    flat_errors: bool = False  # SGLang-style flat error body
    stream_error_frame_over_length: bool = False  # old SGLang: 200 then an SSE error frame
    hang_completions: bool = False
    malformed_completions: bool = False
    error_in_200: bool = False
    stream_dies_after: int | None = None
    nondeterministic: bool = False
    hold_pages_after_disconnect: float = 0.0  # seconds pages stay used after a client disconnect
    held_disconnects: int | None = None  # only the first N disconnects hold them (None: every one)
    # An engine that ignores aborts: a held generation runs on to max_tokens, counted as generated
    # (kvguard_generation_tokens_total) when its pages come back, as SGLang counts a finished request.
    runs_on_after_disconnect: bool = False
    bump_tag_violations: bool = False
    fail_models: bool = False
    hang_models: bool = False  # GET /v1/models accepts the connection and never answers
    usage_extra_tokens: int = 0  # usage.completion_tokens reports this many more than were generated
    # max_tokens not enforced: every answer has at least this many tokens; usage then is "true",
    # "none" (left out) or "capped" (min(generated, max_tokens), in the stream's last chunk too).
    tokens_at_least: int = 0
    usage_mode: str = "true"
    # A prompt list is answered (`n` choices per prompt); with crossed_list, prompt i's choices go
    # on, after their own first token, with the tokens of prompt i+1 (a batch whose rows are crossed).
    crossed_list: bool = False
    # With `n` > 1, a prompt's further choices go on, after their own first token, with the next
    # prompt's tokens (a fork that copied another sequence's KV); refuse_n: 400 for `n` > 1.
    crossed_forks: bool = False
    refuse_n: bool = False
    refuse_n_message: str = "n must be 1 when using greedy sampling"
    fail_forks: bool = False  # 500 kv_tag_violation for a prompt list with `n` > 1 (a fork read a stale page)
    prompt_tokens_drift: bool = False  # usage.prompt_tokens grows by one per request (counted from others)
    advertise_context: bool = True  # max_model_len in /v1/models (transformers serve sends none)
    serves_chat: bool = True  # False: no /v1/chat/completions route (HTTP 404), as on a completions-only server
    serves_completions: bool = True  # False: no /v1/completions route (a chat-only server)
    # A leak only one path shows: "stream" or "chat" answers open with the newest secret nonce
    # (16 hex characters) seen in another request's prompt; plain completions stay clean.
    leak_nonce_on: str | None = None
    empty_text: bool = False  # answers carry `text: null` / `content: null` (usage still counts tokens)
    # Plain (not streamed) answers given while at least this many generations are in flight carry
    # no text; usage and finish_reason stay (a proxy that loses bodies under load; outside probe).
    empty_when_busy: int | None = None
    empty_finish: str = "length"  # the finish_reason such an emptied answer says ("stop": as if it ended at once)
    empty_list_choice: bool = False  # a prompt list's first choice carries no text (finish_reason length)
    empty_choices: bool = False  # a single prompt's `n` > 1 choices all carry no text (finish_reason length)
    empty_plain_chat: bool = False  # plain chat answers carry content "" (usage counts tokens); streamed chat has text
    model_id: str = "fake-model"
    advertised_context: int | None = None  # max_model_len sent instead of context_length (a lying server)
    error_message: str | None = None  # every generation fails with HTTP 500 and this message
    # Requests that overlap get each other's answers (a server whose decode batch rows are crossed):
    # after its own first token, each answer goes on with the tokens generated for the next prompt
    # in flight. Alone, every answer is right.
    swap_concurrent: bool = False
    # With swap_concurrent, keep this share of the own tokens before going on with the other's
    # (None: only the first token, as a crossed decode batch after prefill).
    cross_after: float | None = None
    constant_text: str | None = None  # every prompt gets this answer (a server ignoring its prompt)
    # Prompts over this many tokens keep only their last ones, answered 200 with usage counting what
    # was kept (a server serving less context than it advertises, truncating silently).
    truncate_prompts_at: int | None = None
    # Answers cached by the prompt's first N characters: prompts sharing them get the first one's
    # answer (a prefix-cache hash collision).
    prefix_cache_chars: int | None = None
    # ...keyed per path (endpoint and streaming) as a response cache in front of a server is, and
    # never for a prompt list: the tenants, who take turns over the paths, never collide concurrently.
    cache_per_path: bool = False
    # With swap_concurrent, only requests in flight on the same path (endpoint and streaming) swap.
    swap_same_path: bool = False
    swap_only_chat: bool = False  # with swap_concurrent: only chat requests swap (plain completions stay right)
    # Requests in flight together report another's usage.prompt_tokens (their answers stay their own).
    usage_from_company: bool = False
    # A single prompt with `n` > 1 gets `n` choices (always); with crossed_single_forks every choice
    # after the first goes on, after its own first token, with another sequence's tokens.
    crossed_single_forks: bool = False
    crossed_stream_forks: bool = False  # the same, on streamed answers only (plain ones stay right)
    unfinished_stream_forks: bool = False  # streamed n > 1: the choices after the first never get a finish reason
    reverse_chat_stream: bool = False  # streamed chat sends the tokens in reverse order
    # Prompts of at least this many tokens are answered from the previous long prompt's KV (a leak
    # only long prompts show: B, short, never sees it).
    long_leak_tokens: int | None = None
    # Prompts of at least this many tokens get the answer of the request before them, whatever it
    # was (an outside probe's leaking proxy: only the longer long request showed it).
    previous_answer_tokens: int | None = None
    # A KV ring of this many token slots, filled in request order: a request whose prompt plus
    # max_tokens crosses its end reads the stale slots there, and gets the answer of the prompt
    # that wrote the ring's first slot last.
    wrap_ring_tokens: int | None = None
    # Prompts of at least this many tokens asked again are served from their first request's KV,
    # whose kernels break a near tie differently: every repeat ends in another last token than the
    # first (cold) answer, and the repeats agree (a healthy GPU engine with a prefix cache).
    cached_repeat_tokens: int | None = None
    # Every answer's text stays right, but the newest nonce of another request's prompt goes into a
    # field the text's reader does not see: "reasoning" (reasoning_content, as reasoning parsers
    # fill it), "tool_calls" (a call's arguments), "logprobs" (its tokens), "decoy_text" (chat:
    # the message carries it while a stray choice-level `text` is right). Chat only, but logprobs.
    leak_nonce_into: str | None = None
    leak_when_sampled: bool = False  # answers that sample (no temperature, or above 0) open with another's nonce
    # A prompt list's answer starts with an extra choice, index 0 again, carrying another's nonce.
    duplicate_list_choice: bool = False
    # The Nth generation request (from 1) is answered "429", "503" (Retry-After: 1) or has its
    # connection closed ("close"); every other request is served as usual.
    transient_at: int | None = None
    transient: str = "503"
    # A generation request carrying `seed` is refused, as by a server that does not support it:
    # "param" (400, OpenAI's shape: the error's param is "seed"), "message" (400, param null, the
    # message naming it; flat_errors respected) or "detail" (422, FastAPI's validation list);
    # "leaky": as "param", but the refusal names the newest nonce of another request's prompt.
    refuse_seed: str | None = None


class FakeEngine:
    def __init__(self, behaviour: Behaviour) -> None:
        self.b = behaviour
        self.used_tokens = 0
        self.previous_first_word: str | None = None
        self.nonces_seen: list[str] = []
        self.calls = 0
        self.serving = 0  # generations in flight (empty_when_busy)
        self.disconnects = 0  # client disconnects seen by a generation (held_disconnects)
        self.tag_violations = 0
        self.in_flight: list[tuple[str, tuple[bool, bool]]] = []  # (prompt, its path: chat, stream)
        self.arrivals = asyncio.Condition()  # swap_concurrent: a request waits here for a second one
        self.cached_prompts: dict[str, str] = {}  # prefix_cache_chars: start -> the prompt cached for it
        self.last_long_prompt: str | None = None  # long_leak_tokens
        self.previous_prompt: str | None = None  # previous_answer_tokens
        self.prefilled: set[tuple[str, bool, bool, int]] = set()  # cached_repeat_tokens: requests seen
        self.largest_prompt_bytes = 0  # of the prompts received (one prompt per request)
        self.generation_requests = 0  # transient_at counts them
        self.seeded_requests = 0  # generation requests whose body carried `seed`
        self.ring_cursor = 0  # wrap_ring_tokens: the next free slot
        self.ring_start_owner: str | None = None  # ...and the prompt that wrote slot 0 last
        self.registry = CollectorRegistry()
        self._capacity = Gauge("kvguard_kv_pool_capacity_tokens", "pool", ["role"], registry=self.registry)
        self._used = Gauge("kvguard_kv_pool_used_tokens", "used", ["role"], registry=self.registry)
        self._context = Gauge("kvguard_context_length_tokens", "ctx", registry=self.registry)
        self._violations = Counter("kvguard_tag_violations_total", "tags", registry=self.registry)
        self._checksum = Counter("kvguard_checksum_failures_total", "crc", registry=self.registry)
        self._stale = Counter("kvguard_stale_writes_dropped_total", "stale", registry=self.registry)
        self._generated = Counter("kvguard_generation_tokens_total", "tokens", registry=self.registry)

    # --- app -------------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        if self.b.serves_completions:
            app.router.add_post("/v1/completions", self.completions)
        if self.b.serves_chat:
            app.router.add_post("/v1/chat/completions", self.completions)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/server_info", self.server_info)
        app.router.add_get("/health", self.health)
        return app

    async def health(self, _request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def models(self, _request: web.Request) -> web.Response:
        if self.b.fail_models:
            return web.Response(status=500, text="internal error")
        if self.b.hang_models:
            await asyncio.Event().wait()  # a request that is never answered
        return web.json_response(
            {"object": "list", "data": [{"id": self.b.model_id, "object": "model",
                                         **({"max_model_len": self.b.advertised_context or self.b.context_length}
                                            if self.b.advertise_context else {})}]}
        )

    def generate(self, prompt: str, max_tokens: int, path: tuple[bool, bool] | None = None, cache: bool = True) -> list[str]:
        if self.b.constant_text is not None:
            return self.b.constant_text.split()[:max_tokens]
        if self.b.prefix_cache_chars is not None and cache:
            key = f"{path if self.b.cache_per_path else ''}|{prompt[: self.b.prefix_cache_chars]}"
            prompt = self.cached_prompts.setdefault(key, prompt)  # the first prompt with that start answers for all
        words = prompt.split() or [""]
        self.calls += 1
        salt = f"{self.calls}" if self.b.nondeterministic else ""
        out = [words[0]] + [
            hashlib.sha256(f"{self.b.weights_seed}|{prompt}|{i}|{salt}".encode()).hexdigest()[:5]
            for i in range(1, max_tokens)
        ]
        if self.b.leak_previous and self.previous_first_word is not None and len(out) > 1:
            out[-1] = self.previous_first_word
        self.previous_first_word = words[0]
        return out[:max_tokens]

    def error_response(self, status: int, message: str, code: str) -> web.Response:
        if self.b.flat_errors:
            body = {"object": "error", "message": message, "type": "BadRequestError", "param": None, "code": status}
        else:
            body = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}
        return web.json_response(body, status=status)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.generation_requests += 1
        if self.generation_requests == self.b.transient_at:
            return self._transient(request)
        if "seed" in body:
            self.seeded_requests += 1
            if self.b.refuse_seed is not None:
                words = body["messages"][-1]["content"] if "messages" in body else body["prompt"]
                return self._refuse_seed(body["seed"], words if isinstance(words, str) else " ".join(words))
        chat = "messages" in body
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        if isinstance(prompt, list):
            if int(body.get("n") or 1) > 1 and self.b.refuse_n:
                return self.error_response(400, self.b.refuse_n_message, "invalid_value")
            if int(body.get("n") or 1) > 1 and self.b.fail_forks:
                return self.error_response(500, "request r-1: KV page lease is stale (S1); request failed", "kv_tag_violation")
            return self._prompt_list(prompt, int(body.get("max_tokens") or 16), int(body.get("n") or 1))
        max_tokens = int(body.get("max_tokens") or 16)
        stream = bool(body.get("stream"))
        prompt_tokens = len(prompt.split())
        self.largest_prompt_bytes = max(self.largest_prompt_bytes, len(prompt.encode()))
        if self.b.hang_completions:
            await asyncio.Event().wait()  # a request that is never answered
        if self.b.malformed_completions:
            return web.Response(text="{not json", content_type="application/json")
        if self.b.error_in_200:
            return web.json_response({"error": {"message": "engine exploded", "type": "server_error"}})
        if self.b.error_message is not None:
            return web.json_response({"error": {"message": self.b.error_message}}, status=500)
        if self._over_length(prompt_tokens, max_tokens) and not self.b.accept_over_length:
            message = f"The input ({prompt_tokens} tokens) is longer than the model's context length ({self.b.context_length} tokens)."
            if stream and self.b.stream_error_frame_over_length:
                return await self._stream_error_frame(request, message)
            return self.error_response(400, message, "context_length_exceeded")
        if self.b.truncate_prompts_at is not None and prompt_tokens > self.b.truncate_prompts_at:
            prompt = " ".join(prompt.split()[-self.b.truncate_prompts_at:])
            prompt_tokens = self.b.truncate_prompts_at
        if self.b.bump_tag_violations:
            self._violations.inc()
        sampled = body.get("temperature") is None or float(body["temperature"]) > 0
        return await self._serve(request, prompt, prompt_tokens, max_tokens, stream, chat, int(body.get("n") or 1), sampled)

    def _refuse_seed(self, seed: object, prompt: str) -> web.Response:
        if self.b.refuse_seed == "leaky" and (foreign := self.foreign_nonce(prompt)) is not None:
            # Another tenant's words in the refusal itself (an error path that echoes a shared buffer).
            return self.error_response(400, f"Unrecognized request argument supplied: seed (last input: {foreign})",
                                       "invalid_request_error")  # fmt: skip
        if self.b.refuse_seed == "detail":
            entry = {"type": "extra_forbidden", "loc": ["body", "seed"], "msg": "Extra inputs are not permitted", "input": seed}
            return web.json_response({"detail": [entry]}, status=422)
        if self.b.refuse_seed == "message":
            return self.error_response(400, "Unrecognized request argument supplied: seed", "invalid_request_error")
        body = {"error": {"message": "Unsupported parameter: 'seed' is not supported with this model.",
                          "type": "invalid_request_error", "param": "seed", "code": "unsupported_parameter"}}  # fmt: skip
        return web.json_response(body, status=400)

    def _transient(self, request: web.Request) -> web.Response:
        if self.b.transient == "close":
            request.transport.close()  # type: ignore[union-attr]  # a proxy recycling a keep-alive connection
            return web.Response()
        status, code = (429, "rate_limit_exceeded") if self.b.transient == "429" else (503, "overloaded")
        return web.json_response({"error": {"message": "busy, retry", "type": "server_error", "code": code}},
                                 status=status, headers={"Retry-After": "1"})  # fmt: skip

    def _over_length(self, prompt_tokens: int, max_tokens: int) -> bool:
        if self.b.prompt_limit is not None:
            return prompt_tokens > self.b.prompt_limit or max_tokens > self.b.context_length
        return prompt_tokens + max_tokens > self.b.context_length

    def _prompt_list(self, prompts: list[str], max_tokens: int, n: int) -> web.Response:
        own = [self.generate(p, max_tokens, cache=not self.b.cache_per_path) for p in prompts]
        answers = [own[i] for i in range(len(prompts)) for _ in range(n)]  # choice k is prompt k // n's
        for k, answer in enumerate(answers):
            i, fork = divmod(k, n)
            if self.b.crossed_list or (self.b.crossed_forks and fork):
                answers[k] = answer[:1] + own[(i + 1) % len(own)][1:]
        choices = [{"index": i, "text": " ".join(a), "finish_reason": "length"} for i, a in enumerate(answers)]
        if self.b.empty_list_choice:
            choices[0]["text"] = ""
        if self.b.duplicate_list_choice and (nonce := self.foreign_nonce(" ".join(prompts))) is not None:
            choices.insert(0, {"index": 0, "text": f"{nonce} from another tenant", "finish_reason": "length"})
        usage = {"prompt_tokens": sum(len(p.split()) for p in prompts), "completion_tokens": sum(map(len, answers))}
        return web.json_response({"id": "x", "object": "text_completion", "choices": choices, "usage": usage})

    def foreign_nonce(self, prompt: str) -> str | None:
        """The newest nonce seen in another request's prompt; this prompt's are seen from now on."""
        mine = set(re.findall(r"\b[0-9a-f]{16}\b", prompt))
        others = [n for n in self.nonces_seen if n not in mine]
        self.nonces_seen += sorted(mine - set(self.nonces_seen))
        return others[-1] if others else None

    def leaked_nonce(self, foreign: str | None, stream: bool, chat: bool, sampled: bool) -> str | None:
        """`foreign`, when this path is the leaking one (leak_nonce_on, leak_when_sampled)."""
        leaking = ((self.b.leak_nonce_on == "stream" and stream) or (self.b.leak_nonce_on == "chat" and chat)
                   or (self.b.leak_nonce_on == "chat_stream" and chat and stream)
                   or (self.b.leak_when_sampled and sampled))  # fmt: skip
        return foreign if leaking else None

    async def _serve(self, request, prompt, prompt_tokens, max_tokens, stream, chat, n=1, sampled=False) -> web.StreamResponse:
        reserved = prompt_tokens + max_tokens
        self.used_tokens += reserved
        self.serving += 1
        disconnected = False
        try:
            await asyncio.sleep(prompt_tokens * self.b.prefill_delay_per_token)
            busy = self.b.empty_when_busy is not None and self.serving >= self.b.empty_when_busy
            tokens = self.generate(prompt, max(max_tokens, self.b.tokens_at_least), path=(chat, stream))
            if (owner := self._kv_owner(prompt, prompt_tokens, max_tokens)) != prompt:  # its own first token, then stale KV's
                tokens = tokens[:1] + self.generate(owner, max_tokens, path=(chat, stream))[1:]
            if (other := await self._crossed(prompt, (chat, stream))) != prompt and not self.b.usage_from_company:
                kept = 1 if self.b.cross_after is None else max(1, int(len(tokens) * self.b.cross_after))  # its own first token(s), then another's rows
                tokens = tokens[:kept] + self.generate(other, max_tokens, path=(chat, stream))[kept:]
            elif other != prompt:
                prompt_tokens = len(other.split())  # usage_from_company: billed another's prompt
            foreign = self.foreign_nonce(prompt)
            if (nonce := self.leaked_nonce(foreign, stream, chat, sampled)) is not None:
                tokens[0] = nonce
            hidden = foreign if self.b.leak_nonce_into else None
            if self.b.cached_repeat_tokens is not None and prompt_tokens >= self.b.cached_repeat_tokens:
                if (prompt, chat, stream, max_tokens) in self.prefilled and len(tokens) > 1:
                    tokens[-1] = hashlib.sha256(f"near tie|{prompt}".encode()).hexdigest()[:5]
                self.prefilled.add((prompt, chat, stream, max_tokens))
            # Fewer tokens than max_tokens (a constant_text shorter than it): stopped, not cut.
            finish = "length" if len(tokens) >= max_tokens else "stop"
            crossed = self.b.crossed_single_forks or (stream and self.b.crossed_stream_forks)
            forks = [tokens[:1] + self.generate(f"{prompt} fork {k}", max_tokens)[1:] if crossed else tokens
                     for k in range(1, n)]  # fmt: skip
            if not stream:
                lost = busy or (chat and self.b.empty_plain_chat) or (n > 1 and self.b.empty_choices)
                finish = self.b.empty_finish if busy else finish
                body = self._body(chat, "" if lost else " ".join(tokens), prompt_tokens, len(tokens), finish, max_tokens)
                self._hide(body["choices"][0], chat, hidden)
                body["choices"] += [{**body["choices"][0], "index": k + 1, **self._content(chat, "" if lost else " ".join(f))}
                                    for k, f in enumerate(forks)]  # fmt: skip
                return web.json_response(body)
            return await self._stream(request, [tokens, *forks], chat, finish, max_tokens, hidden)
        except (asyncio.CancelledError, ConnectionResetError):
            disconnected = True
            raise
        finally:
            self.serving -= 1
            if disconnected and self._holds_pages():
                ran_on = max_tokens if self.b.runs_on_after_disconnect else 0
                asyncio.get_running_loop().call_later(self.b.hold_pages_after_disconnect, self._release, reserved, ran_on)
            else:
                self._release(reserved)

    def _holds_pages(self) -> bool:
        """Whether this disconnect's pages stay used for `hold_pages_after_disconnect` seconds."""
        if not self.b.hold_pages_after_disconnect:
            return False
        self.disconnects += 1
        return self.b.held_disconnects is None or self.disconnects <= self.b.held_disconnects

    def _kv_owner(self, prompt: str, prompt_tokens: int, max_tokens: int) -> str:
        """The prompt whose KV this request reads: its own, unless long_leak_tokens or
        wrap_ring_tokens hand it another's."""
        owner = prompt
        if self.b.previous_answer_tokens is not None and prompt_tokens >= self.b.previous_answer_tokens:
            owner = self.previous_prompt or prompt
        self.previous_prompt = prompt
        if self.b.long_leak_tokens is not None and prompt_tokens >= self.b.long_leak_tokens:
            owner = self.last_long_prompt or prompt
            self.last_long_prompt = prompt
        if self.b.wrap_ring_tokens is not None:
            start, end = self.ring_cursor, self.ring_cursor + prompt_tokens + max_tokens
            if end > self.b.wrap_ring_tokens:
                owner = self.ring_start_owner or prompt
                self.ring_start_owner = prompt  # it wrapped: it wrote slot 0 now
            elif start == 0:
                self.ring_start_owner = prompt
            self.ring_cursor = end % self.b.wrap_ring_tokens
        return owner

    async def _crossed(self, prompt: str, path: tuple[bool, bool]) -> str:
        """The prompt whose answer this request gets: its own, unless swap_concurrent and another
        request is in flight with it (requests sent together; one sent alone waits at most half a
        second for company, then keeps its own answer)."""
        if not (self.b.swap_concurrent or self.b.usage_from_company) or (self.b.swap_only_chat and not path[0]):
            return prompt
        async with self.arrivals:
            me = (prompt, path)
            self.in_flight.append(me)
            self.arrivals.notify_all()
            try:
                async with asyncio.timeout(0.5):
                    await self.arrivals.wait_for(lambda: len(self._company(path)) >= 2)
            except TimeoutError:
                pass
            company = self._company(path)
            other = company[(company.index(me) + 1) % len(company)][0]
            self.in_flight.remove(me)
            return other

    def _company(self, path: tuple[bool, bool]) -> list[tuple[str, tuple[bool, bool]]]:
        """The requests in flight a swap may pair this one with."""
        return [f for f in self.in_flight if not self.b.swap_same_path or f[1] == path]

    def _release(self, tokens: int, generated: int = 0) -> None:
        self.used_tokens -= tokens
        self._generated.inc(generated)

    def _body(
        self, chat: bool, text: str, prompt_tokens: int, completion_tokens: int, finish: str = "length", max_tokens: int = 0
    ) -> dict:
        choice = {"index": 0, "finish_reason": finish, **self._content(chat, text)}
        drift = self.calls if self.b.prompt_tokens_drift else 0
        usage = {"prompt_tokens": prompt_tokens + drift, "completion_tokens": completion_tokens + self.b.usage_extra_tokens}
        if self.b.usage_mode == "capped":
            usage["completion_tokens"] = min(completion_tokens, max_tokens)
        if self.b.usage_mode == "none":
            return {"id": "x", "object": "text_completion", "choices": [choice]}
        return {"id": "x", "object": "text_completion", "choices": [choice], "usage": usage}

    def _content(self, chat: bool, text: str) -> dict:
        content = None if self.b.empty_text else text
        return {"message": {"role": "assistant", "content": content}} if chat else {"text": content}

    def _hide(self, choice: dict, chat: bool, nonce: str | None) -> None:
        """leak_nonce_into: `nonce` into one field of `choice` (a whole answer's, or a stream's first chunk)."""
        where, part = self.b.leak_nonce_into, choice.get("message", choice.get("delta"))
        if nonce is None or (where != "logprobs" and not chat):
            return
        if where == "reasoning":
            part["reasoning_content"] = f"the user before asked about {nonce}"
        elif where == "tool_calls":
            part["tool_calls"] = [{"index": 0, "id": "call_1", "type": "function",
                                   "function": {"name": "lookup", "arguments": json.dumps({"q": nonce})}}]  # fmt: skip
        elif where == "decoy_text":
            choice["text"], part["content"] = part["content"], f"{nonce} {part['content']}"
        elif where == "logprobs":
            choice["logprobs"] = ({"content": [{"token": nonce, "logprob": -0.1, "top_logprobs": []}]} if chat else
                                  {"tokens": [nonce], "token_logprobs": [-0.1], "top_logprobs": [{nonce: -0.1}]})  # fmt: skip

    async def _stream(
        self, request: web.Request, choices: list[list[str]], chat: bool, finish: str = "length", max_tokens: int = 0,
        hidden: str | None = None,
    ) -> web.StreamResponse:
        """Each choice's tokens (one list per choice), a chunk per token and choice, interleaved."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if chat and self.b.reverse_chat_stream:
            choices = [tokens[::-1] for tokens in choices]
        for i in range(len(choices[0])):
            if self.b.stream_dies_after is not None and i >= self.b.stream_dies_after:
                request.transport.close()  # type: ignore[union-attr]
                return resp
            for index, tokens in enumerate(choices):
                piece = None if self.b.empty_text else tokens[i] if i == 0 else " " + tokens[i]
                delta = {"delta": {"content": piece}} if chat else {"text": piece}
                frame = {"choices": [{"index": index, **delta, "finish_reason": None}]}
                if i == 0 and index == 0:
                    self._hide(frame["choices"][0], chat, hidden)
                await resp.write(f"data: {json.dumps(frame)}\n\n".encode())
            await asyncio.sleep(self.b.token_delay)
        # The OpenAI stream shape: a last chunk per choice carries its finish reason (and usage), then [DONE].
        for index in range(1, 1 if self.b.unfinished_stream_forks else len(choices)):
            last = {"choices": [{"index": index, **({"delta": {}} if chat else {"text": ""}), "finish_reason": finish}]}
            await resp.write(f"data: {json.dumps(last)}\n\n".encode())
        final = {"choices": [{"index": 0, **({"delta": {}} if chat else {"text": ""}), "finish_reason": finish}]}
        if self.b.usage_mode == "capped":  # a usage that lies within the budget
            final["usage"] = {"prompt_tokens": 1, "completion_tokens": min(len(choices[0]), max_tokens)}
        await resp.write(f"data: {json.dumps(final)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def _stream_error_frame(self, request: web.Request, message: str) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(f"data: {json.dumps({'error': {'message': message, 'code': 400}})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    # --- metrics ---------------------------------------------------------------------------
    async def metrics(self, _request: web.Request) -> web.Response:
        style = self.b.metrics_style
        if style == "none":
            return web.Response(status=404, text="not found")
        if style == "kvguard":
            self._capacity.labels(role="decode").set(self.b.pool_tokens)
            self._used.labels(role="decode").set(self.used_tokens)
            self._context.set(self.b.context_length)
            text = generate_latest(self.registry).decode()
        elif style in ("sglang", "sglang_server_info"):
            text = sglang_metrics(self.b.pool_tokens, self.used_tokens, with_capacity=style == "sglang")
        else:
            text = vllm_metrics(self.b.pool_tokens, self.used_tokens)
        return web.Response(text=text, content_type="text/plain")

    async def server_info(self, _request: web.Request) -> web.Response:
        if not self.b.metrics_style.startswith("sglang"):  # only SGLang has /server_info
            return web.Response(status=404, text="not found")
        return web.json_response(sglang_server_info(self.b.pool_tokens, self.b.context_length))


def sglang_metrics(pool: int, used: int, *, with_capacity: bool = True) -> str:
    """Exposition as SGLang 0.5.x writes it with --enable-metrics (TP0, one DP rank)."""
    labels = 'model_name="Qwen/Qwen3-8B",moe_ep_rank="0",pp_rank="0",tp_rank="0"'
    lines = []
    if with_capacity:
        lines += [
            "# HELP sglang:max_total_num_tokens Maximum total number of tokens in the KV cache pool.",
            "# TYPE sglang:max_total_num_tokens gauge",
            f"sglang:max_total_num_tokens{{{labels}}} {float(pool)}",
        ]
    lines += [
        "# HELP sglang:num_used_tokens The number of used tokens.",
        "# TYPE sglang:num_used_tokens gauge",
        f"sglang:num_used_tokens{{{labels}}} {float(used)}",
        "# HELP sglang:token_usage The token usage.",
        "# TYPE sglang:token_usage gauge",
        f"sglang:token_usage{{{labels}}} {used / pool:.4f}",
        "# HELP sglang:num_running_reqs The number of running requests.",
        "# TYPE sglang:num_running_reqs gauge",
        f"sglang:num_running_reqs{{{labels}}} 0.0",
        "# HELP sglang:cache_hit_rate The prefix cache hit rate.",
        "# TYPE sglang:cache_hit_rate gauge",
        f"sglang:cache_hit_rate{{{labels}}} 0.0",
        "# HELP sglang:num_transfer_failed_reqs_total The number of transfer failed requests.",
        "# TYPE sglang:num_transfer_failed_reqs_total counter",
        f"sglang:num_transfer_failed_reqs_total{{{labels}}} 0.0",
        "# HELP sglang:num_bootstrap_failed_reqs_total The number of bootstrap failed requests.",
        "# TYPE sglang:num_bootstrap_failed_reqs_total counter",
        f"sglang:num_bootstrap_failed_reqs_total{{{labels}}} 0.0",
    ]
    return "\n".join(lines) + "\n"


def sglang_server_info(pool: int, context: int) -> dict:
    return {
        "model_path": "Qwen/Qwen3-8B",
        "context_length": context,
        "page_size": 1,
        "status": "ready",
        "max_total_num_tokens": pool,
        "max_req_input_len": context - 1,
        "internal_states": [
            {
                "memory_usage": {"weight": 15.3, "kvcache": 0.28, "token_capacity": pool, "graph": 0.5},
                "effective_max_running_requests_per_dp": 48,
                "last_gen_throughput": 0.0,
            }
        ],
        "version": "0.5.6",
    }


def vllm_metrics(pool: int, used: int, block_size: int = 16, engines: int = 1) -> str:
    """Exposition as vLLM v1 writes it: cache_config_info carries CacheConfig as labels."""
    lines = [
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
        "# TYPE vllm:cache_config_info gauge",
    ]
    for engine in range(engines):
        lines.append(
            f'vllm:cache_config_info{{block_size="{block_size}",cache_dtype="auto",calculate_kv_scales="False",'
            f'enable_prefix_caching="True",engine="{engine}",gpu_memory_utilization="0.9",'
            f'num_cpu_blocks="None",num_gpu_blocks="{pool // block_size}",prefix_caching_hash_algo="sha256",'
            f'sliding_window="None",swap_space="4"}} 1.0'
        )
    lines += ["# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.", "# TYPE vllm:kv_cache_usage_perc gauge"]
    for engine in range(engines):
        lines.append(f'vllm:kv_cache_usage_perc{{engine="{engine}",model_name="meta-llama/Llama-3.1-8B"}} {used / pool / engines:.6f}')
    lines += [
        "# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.",
        "# TYPE vllm:num_preemptions_total counter",
        'vllm:num_preemptions_total{engine="0",model_name="meta-llama/Llama-3.1-8B"} 0.0',
        "# HELP vllm:num_requests_running Number of requests in model execution batches.",
        "# TYPE vllm:num_requests_running gauge",
        'vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B"} 0.0',
    ]
    return "\n".join(lines) + "\n"


class RunningServer:
    """The fake engine on a loopback port, in its own thread and event loop."""

    def __init__(self, behaviour: Behaviour) -> None:
        self.engine = FakeEngine(behaviour)
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, daemon=True)
        self.port = 0

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        runner = web.AppRunner(self.engine.app(), handler_cancellation=True)
        self._loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self._runner = runner
        self._ready.set()
        self._loop.run_forever()
        self._loop.run_until_complete(runner.cleanup())

    def __enter__(self) -> RunningServer:
        self._thread.start()
        assert self._ready.wait(60), "the fake engine did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"{self.url}/metrics"
