"""Sending the soak's requests: asyncio + httpx, a fixed number of concurrent clients, bounded in count and time.

C worker tasks pull specs in order from one queue, so the server sees C requests in flight (the batching the
greedy comparison relies on) until the specs or the time run out; after the deadline no new request starts and
the ones in flight finish (or hit the per-request timeout). Every request ends in exactly one outcome.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

from echo_vllm.soak.traffic import CHAT, RequestSpec

COMPLETED = "completed"
CLIENT_CANCELLED = "client_cancelled"
HOSTILE_4XX = "hostile_4xx"
ERROR = "error"

# The client drops an idle pooled connection long before the server would close it (SERVER_KEEPALIVE_S), so a
# request never goes out on a connection the server is closing: equal timeouts (httpx and vLLM both default to 5 s)
# race, and the client sees ReadError. Load balancers in front of vLLM need the same order of timeouts.
CLIENT_KEEPALIVE_S = 2.0
SERVER_KEEPALIVE_S = 75
# A transport error before any response byte (connect refused or reset, a reset read of the status line) is retried
# once, as OpenAI's SDK and most gateways do, and counted: `RequestResult.retries` and the report's "connection
# retries". CI saw 1 and 4 such resets in 160 warm-up requests (stops 24 and 25) that never reproduced here in
# 960; a second failure, any error after the status line, and timeouts stay errors.
CONNECTION_RETRIES = 1


@dataclass
class RequestResult:
    """What one request got back. `error` is a kind (e.g. "http 500", "ReadTimeout"); `detail` an excerpt."""

    index: int
    label: str
    outcome: str
    status: int | None
    latency_s: float
    texts: list[str] = field(default_factory=list)  # per choice index
    token_ids: list[list[int]] = field(default_factory=list)
    finish_reasons: list[str | None] = field(default_factory=list)
    chunks: int = 0
    error: str | None = None
    detail: str = ""
    retries: int = 0  # transport errors before any response byte, retried (CONNECTION_RETRIES)
    retried: list[str] = field(default_factory=list)  # what each retried attempt raised


@dataclass
class TrafficRun:
    results: list[RequestResult]
    not_sent: int  # specs left when the deadline passed
    wall_s: float


@dataclass
class _Choices:
    """Accumulates per-choice text / token ids / finish reasons from a response or from stream chunks."""

    texts: dict[int, str] = field(default_factory=dict)
    ids: dict[int, list[int]] = field(default_factory=dict)
    finish: dict[int, str | None] = field(default_factory=dict)

    def add(self, choice: dict[str, Any], chat: bool, stream: bool) -> None:
        i = int(choice.get("index", 0))
        if chat:
            part = (choice.get("delta") if stream else choice.get("message")) or {}
            text = part.get("content") or ""
        else:
            text = choice.get("text") or ""
        self.texts[i] = self.texts.get(i, "") + text
        self.ids.setdefault(i, []).extend(choice.get("token_ids") or [])
        if choice.get("finish_reason") is not None or i not in self.finish:
            self.finish[i] = choice.get("finish_reason")

    def fill(self, result: RequestResult) -> None:
        order = sorted(self.texts)
        result.texts = [self.texts[i] for i in order]
        result.token_ids = [self.ids.get(i, []) for i in order]
        result.finish_reasons = [self.finish.get(i) for i in order]


def error_message(body: bytes) -> str:
    """The `error.message` of an OpenAI-style error body, or '' if there is none."""
    try:
        data = json.loads(body)
    except ValueError:
        return ""
    err = data.get("error") if isinstance(data, dict) else None
    if isinstance(err, dict):
        return str(err.get("message") or "")
    return str(err or (data.get("message") if isinstance(data, dict) else "") or "")


def _judge_hostile(result: RequestResult, body: bytes) -> None:
    message = error_message(body)
    result.detail = (message or body.decode(errors="replace"))[:200]
    status = result.status or 0
    if 400 <= status < 500 and message:
        result.outcome = HOSTILE_4XX
    elif 400 <= status < 500:
        result.outcome, result.error = ERROR, f"hostile {status} without an error message"
    elif status == 200:
        result.outcome, result.error = ERROR, "hostile accepted (200)"
    else:
        result.outcome, result.error = ERROR, f"http {status}"


def _judge_complete(result: RequestResult, spec: RequestSpec) -> None:
    n = int(spec.body.get("n", 1))
    if len(result.texts) != n or any(f is None for f in result.finish_reasons):
        result.outcome, result.error = ERROR, "incomplete response"
        result.detail = f"{len(result.texts)} of {n} choices, finish_reasons={result.finish_reasons}"
    else:
        result.outcome = COMPLETED


async def _send_plain(http: Any, base_url: str, spec: RequestSpec, result: RequestResult) -> None:
    # Streamed, so `result.status` is set as soon as the status line arrives: what the retry rule reads.
    async with http.stream(
        "POST", base_url + spec.endpoint, content=spec.payload(), headers={"Content-Type": "application/json"}
    ) as resp:
        result.status = resp.status_code
        body = await resp.aread()
    if spec.hostile or result.status != 200:
        return _judge_error_status(result, spec, body)
    choices = _Choices()
    for choice in json.loads(body).get("choices", []):
        choices.add(choice, spec.endpoint == CHAT, stream=False)
    choices.fill(result)
    _judge_complete(result, spec)


async def _send_stream(http: Any, base_url: str, spec: RequestSpec, result: RequestResult) -> None:
    async with http.stream(
        "POST", base_url + spec.endpoint, content=spec.payload(), headers={"Content-Type": "application/json"}
    ) as resp:
        result.status = resp.status_code
        if spec.hostile or resp.status_code != 200:
            return _judge_error_status(result, spec, await resp.aread())
        choices, done = _Choices(), False
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if "error" in chunk:  # vLLM reports an engine failure mid-stream as a data event
                result.outcome, result.error = ERROR, "error event in stream"
                result.detail = error_message(data.encode())[:200]
                return None
            result.chunks += 1
            for choice in chunk.get("choices", []):
                choices.add(choice, spec.endpoint == CHAT, stream=True)
            if spec.disconnect_after and result.chunks >= spec.disconnect_after:
                break  # leaving the `async with` closes the connection mid-stream: the server must abort it
        choices.fill(result)
    if done:
        _judge_complete(result, spec)
    elif spec.disconnect_after:
        result.outcome = CLIENT_CANCELLED
    else:
        result.outcome, result.error = ERROR, "stream ended without [DONE]"
    return None


def _judge_error_status(result: RequestResult, spec: RequestSpec, body: bytes) -> None:
    if spec.hostile:
        _judge_hostile(result, body)
    else:
        result.outcome, result.error = ERROR, f"http {result.status}"
        result.detail = (error_message(body) or body.decode(errors="replace"))[:200]


def exception_chain(err: BaseException) -> str:
    """`ReadError <- ConnectionResetError: [Errno 104] ...`: httpx's own message is often empty, its cause is not."""
    parts: list[str] = []
    seen: set[int] = set()
    cur: BaseException | None = err
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        parts.append(f"{type(cur).__name__}: {cur}" if str(cur) else type(cur).__name__)
        cur = cur.__cause__ or cur.__context__
    return " <- ".join(parts)


async def _attempt(http: Any, base_url: str, spec: RequestSpec, result: RequestResult) -> BaseException | None:
    """One try; returns a transport error raised before any response byte (retryable), records every other error."""
    import httpx

    try:
        if spec.stream:
            await _send_stream(http, base_url, spec, result)
        else:
            await _send_plain(http, base_url, spec, result)
    except httpx.HTTPError as err:
        before_response = result.status is None and isinstance(err, httpx.TransportError)
        if before_response and not isinstance(err, httpx.TimeoutException):
            return err
        result.outcome, result.error, result.detail = ERROR, type(err).__name__, exception_chain(err)[:300]
    except ValueError as err:  # a body or chunk that is not JSON
        result.outcome, result.error, result.detail = ERROR, "bad json from server", str(err)[:200]
    return None


async def send_one(http: Any, base_url: str, spec: RequestSpec) -> RequestResult:
    t0 = time.monotonic()
    retried: list[str] = []
    while True:
        result = RequestResult(index=spec.index, label=spec.label, outcome=ERROR, status=None, latency_s=0.0)
        failed = await _attempt(http, base_url, spec, result)
        if failed is None:
            break
        result.error, result.detail = type(failed).__name__, exception_chain(failed)[:300]
        if len(retried) >= CONNECTION_RETRIES:
            break
        retried.append(result.detail)
    result.retries, result.retried = len(retried), retried
    result.latency_s = time.monotonic() - t0
    return result


async def run_traffic(
    base_url: str, specs: list[RequestSpec], *, concurrency: int, duration_s: float | None, request_timeout_s: float
) -> TrafficRun:
    import httpx

    queue: asyncio.Queue[RequestSpec] = asyncio.Queue()
    for spec in specs:
        queue.put_nowait(spec)
    t0 = time.monotonic()
    deadline = None if duration_s is None else t0 + duration_s
    results: list[RequestResult] = []
    # One client and one connection per worker, like C independent users: no connection is shared between workers,
    # so none sits idle in a shared pool where another task's clean-up can expire and close it after it was handed
    # out (httpcore's pool checks expiry on every assignment, and its close is not locked against a request).
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1, keepalive_expiry=CLIENT_KEEPALIVE_S)

    async def worker() -> None:
        async with httpx.AsyncClient(timeout=httpx.Timeout(request_timeout_s), limits=limits, trust_env=False) as http:
            while not queue.empty() and (deadline is None or time.monotonic() < deadline):
                results.append(await send_one(http, base_url, queue.get_nowait()))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    results.sort(key=lambda r: r.index)
    return TrafficRun(results=results, not_sent=queue.qsize(), wall_s=time.monotonic() - t0)


def run_traffic_sync(
    base_url: str,
    specs: list[RequestSpec],
    *,
    concurrency: int,
    duration_s: float | None = None,
    request_timeout_s: float = 300.0,
) -> TrafficRun:
    return asyncio.run(
        run_traffic(
            base_url, specs, concurrency=concurrency, duration_s=duration_s, request_timeout_s=request_timeout_s
        )
    )
