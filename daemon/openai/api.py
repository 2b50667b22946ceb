"""The OpenAI-compatible HTTP API on aiohttp: completions, chat, models, health, metrics."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import orjson
from aiohttp import web

from daemon.engine.client import EngineClient, EngineDeadError
from daemon.engine.outputs import Delta
from daemon.openai.auth import API_KEY_NAME, access
from daemon.openai.choices import Choice, merged
from daemon.openai.errors import (
    OPENAI_FINISH_REASONS,
    RETRY_AFTER_S,
    body_limit,
    failure,
    json_errors,
    json_response,
)
from daemon.openai.extra_endpoints import ExtraEndpoints, read_json
from daemon.openai.generic_tools import GenericToolParser
from daemon.openai.lora import LoRAEndpoints
from daemon.openai.metrics import Metrics
from daemon.openai.options import APIOptions
from daemon.openai.overload import CapacityEstimate
from daemon.openai.peer_eof import ends_at_eof
from daemon.openai.protocol import (
    UNTIL_CONTEXT_ENDS,
    APIError,
    GenerationRequest,
    now,
    parse_messages,
    parse_request,
)
from daemon.openai.responses import ResponseBuilder
from daemon.openai.spec_metrics import spec_log_fields
from daemon.openai.structured_output import WARNING_HEADER, Constraint
from daemon.openai.tenancy import TENANT_HEADER, resolve_tenant
from daemon.openai.tenant_limits import TenantLimitError, TenantRateLimiter
from daemon.openai.tokenizing import Tokenizing
from daemon.openai.tool_parsers import ToolParser, load_tool_parser
from daemon.openai.tools import (
    ToolRequest,
    parse_output_rules,
    prepare_chat,
    rewrite_message,
    stream_tool_calls,
    template_renders_tools,
)
from daemon.openai.validation import ValidationError, choice_seed
from grammars import GrammarSpec
from scheduling import DEFAULT_TENANT, QueueFullError

log = logging.getLogger("headrace.api")


class APIServer:
    """Handlers over one EngineClient. `draining` makes new generation requests answer 503."""

    def __init__(
        self,
        engine: EngineClient,
        model_name: str,
        metrics: Metrics,
        options: APIOptions | None = None,
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        self.metrics = metrics
        self.options = options = options or APIOptions()
        self.draining = False
        # Generation handlers running now (a drain waits for them to write their endings).
        self.active = 0
        self.created = now()
        tokenizer = engine.tokenizer
        self.responses = ResponseBuilder(model_name, tokenizer)
        self.tokenizing = Tokenizing(tokenizer, options.offload_chars)
        self.capacity = CapacityEstimate()
        self.limiter = TenantRateLimiter(options.tenant_rate_limits)
        metrics.tenants.top_k = options.tenant_metrics_top_k
        # request id -> (tenant, tokens its rate bucket was charged), until it ends.
        self._tenant_of: dict[str, tuple[str, int]] = {}
        # Tool calls: whether the chat template shows tools, and how "auto" reads calls.
        self.renders_tools = tokenizer is not None and template_renders_tools(tokenizer)
        self.tool_parser: ToolParser = load_tool_parser(options.tool_parser)
        # `model` names the base or one of its LoRA adapters.
        self.lora = LoRAEndpoints(engine, model_name, self.model_card)

    def app(self) -> web.Application:
        opts = self.options
        app = web.Application(
            middlewares=[
                json_errors,
                access(
                    {**({opts.api_key: None} if opts.api_key else {}), **opts.api_keys},
                    opts.metrics_unix_only,
                ),
                body_limit(opts.max_request_bytes),
            ],
            client_max_size=opts.max_request_bytes,
        )
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics_handler)
        self.lora.register(app)
        ExtraEndpoints(
            self.lora.card,
            self.tokenizing,
            self.engine.info.vocab_size,
            self.engine.info.max_model_len,
        ).register(app)
        app.on_cleanup.append(self._cleanup)
        return app

    async def _cleanup(self, app: web.Application) -> None:
        self.tokenizing.close()

    # -- simple endpoints ----------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        if self.draining:
            return json_response({"status": "draining"}, 503)
        stats = self.engine.stats()
        if stats.failure is not None:
            return json_response({"status": "failed", "error": stats.failure}, 503)
        replicas = stats.replicas
        if not replicas:
            return json_response({"status": "ok"})
        # Data-parallel: serving while any replica serves; the body names the ones down.
        down = [r.index for r in replicas if not r.healthy]
        body = {"status": "ok", "replicas": len(replicas), "replicas_down": down}
        if len(down) == len(replicas):
            return json_response({**body, "status": "unavailable"}, 503)
        return json_response(body)

    def model_card(self) -> dict[str, Any]:
        return {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "headrace",
            "max_model_len": self.engine.info.max_model_len,
        }

    async def models(self, request: web.Request) -> web.Response:
        return json_response({"object": "list", "data": self.lora.cards()})

    async def metrics_handler(self, request: web.Request) -> web.Response:
        body = self.metrics.render(self.engine.stats())
        return web.Response(body=body, headers={"Content-Type": self.metrics.content_type})

    # -- generation ----------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        self.active += 1
        try:
            return await self._answer(request, chat)
        finally:
            self.active -= 1

    async def _answer(self, request: web.Request, chat: bool) -> web.StreamResponse:
        if self.draining:
            raise APIError(
                503,
                "the server is shutting down",
                kind="unavailable",
                headers={"Retry-After": RETRY_AFTER_S},
            )
        body = await read_json(request, self.options.body_timeout)
        req = parse_request(body, chat)
        lora = self.lora.resolve(req.model)
        try:
            header = request.headers.get(TENANT_HEADER)
            tenant = resolve_tenant(req.extra.get("user"), header, request.get(API_KEY_NAME))
        except ValueError as e:
            raise APIError(400, str(e), "user") from None
        constraint, tools = parse_output_rules(body, chat)
        if chat:
            messages, template_tools = prepare_chat(parse_messages(body), tools, self.renders_tools)
            prompts: list[list[int]] = [await self.tokenizing.chat(messages, template_tools)]
        else:
            prompts = await self.tokenizing.prompt_ids(req.prompts)
        if self.options.log_prompts:
            log.info("prompt: %s", body.get("messages") if chat else req.prompts)
        # Whose fair share of the grammar compilers the compile waits for: the tenant, or
        # without one the peer address.
        client = tenant if tenant != DEFAULT_TENANT else (request.remote or "unix")
        spec = constraint.spec if constraint else None
        choices = self._add(req, prompts, tenant, spec, lora, client)
        headers = _warning_headers(constraint)
        # A non-streamed answer writes nothing until its end: EOF from the client ends it.
        with ends_at_eof(request, applies=not req.stream):
            try:
                firsts = await asyncio.gather(*(anext(c.stream) for c in choices))
                for choice, first in zip(choices, firsts):
                    choice.add(first)
                    if first.bad_request is not None:
                        param = constraint.param if constraint else None
                        raise APIError(400, f"{param}: {first.bad_request}", param)
                    if first.finish_reason == "rejected":
                        self.metrics.tenants.rejected(tenant, "policy")
                        raise APIError(
                            503,
                            f"rejected: {first.stop_reason}",
                            kind="unavailable",
                            headers={"Retry-After": RETRY_AFTER_S},
                        )
                    if first.finished and first.finish_reason not in OPENAI_FINISH_REASONS:
                        # Nothing sent yet: a plain 500 beats a stream that opens with an error.
                        raise failure(first.stop_reason)
                check = self._output_check(constraint)
                if req.stream:
                    return await self._stream(
                        request, req, choices, firsts, chat, tools, headers, check
                    )
                async with contextlib.aclosing(merged(choices, [])) as deltas:
                    async for choice, delta in deltas:
                        choice.add(delta)
                failed = [c for c in choices if c.finish_reason not in OPENAI_FINISH_REASONS]
                if failed:
                    raise failure(failed[0].stop_reason)
                for choice in choices if check is not None else []:
                    if (problem := check(choice)) is not None:
                        raise APIError(500, problem, kind="server_error")
                out = self.responses.full_body(req, choices, chat)
                if tools is not None:
                    for item in out["choices"]:
                        rewrite_message(item, tools, self._tools_parser())
                return json_response(out, headers=headers)
            finally:
                for choice in choices:
                    choice.stream.close()
                    self._observe(choice)

    def _tools_parser(self) -> ToolParser:
        """The configured parser, or the generic JSON one when the template has no tools."""
        return self.tool_parser if self.renders_tools else GenericToolParser()

    def _output_check(self, constraint: Constraint | None) -> Callable[[Choice], str | None] | None:
        """The safety net for strict schemas (daemon/openai/output_check.py), counting failures."""
        if constraint is None or constraint.check is None:
            return None
        output_check = constraint.check

        def check(choice: Choice) -> str | None:
            failure = output_check.failure(choice.text, choice.finish_reason)
            if failure is not None:
                self.metrics.grammar_validation_failures.inc()
                log.error("strict output failed validation: %s", failure)
            return failure

        return check

    def _add(
        self,
        req: GenerationRequest,
        prompts: list[list[int]],
        tenant: str,
        grammar: GrammarSpec | None = None,
        lora: str | None = None,
        client: str = "",
    ) -> list[Choice]:
        max_len = self.engine.info.max_model_len
        max_waiting = self.engine.info.max_waiting
        if max_waiting and len(prompts) * req.n > max_waiting:
            raise APIError(
                400,
                f"prompt: {len(prompts)} prompts x n={req.n} exceed the waiting queue "
                f"(--max-waiting {max_waiting}); this request can never be queued",
                "prompt",
            )
        choices: list[Choice] = []
        try:
            for p_index, prompt in enumerate(prompts):
                ids = prompt
                params = req.params
                room = max_len - len(ids)
                # (A prompt with no room at all is refused by the scheduler, naming the limit.)
                if params.max_tokens > room > 0:
                    if params.max_tokens != UNTIL_CONTEXT_ENDS:
                        raise APIError(
                            400,
                            f"max_tokens: {len(ids)} prompt tokens + "
                            f"{params.max_tokens} exceed max_model_len {max_len}",
                            "max_tokens",
                        )
                    params = replace(params, max_tokens=room)
                for i in range(req.n):
                    charged = len(ids) + params.max_tokens if self.limiter else 0
                    self.limiter.take(tenant, charged)
                    try:
                        stream = self.engine.add_request(
                            ids,
                            replace(params, seed=choice_seed(params.seed, i)),
                            priority=req.priority,
                            slo=req.slo,
                            cache_salt=req.cache_salt,
                            grammar=grammar,
                            tenant=tenant,
                            lora=lora,
                            client=client,
                        )
                    except BaseException:
                        self.limiter.give_back(tenant, charged)
                        raise
                    self._tenant_of[stream.request_id] = (tenant, charged)
                    choices.append(Choice(p_index * req.n + i, stream, p_index))
        except TenantLimitError as e:
            self._close(choices)
            self.metrics.tenants.rejected(tenant, "rate_limit")
            raise APIError(
                429,
                str(e),
                kind="rate_limit_exceeded",
                headers={"Retry-After": str(e.retry_after_s)},
            ) from None
        except QueueFullError as e:
            self._close(choices)
            self.metrics.tenants.rejected(tenant, "queue_full")
            stats = self.engine.stats()
            self.metrics.absorb(stats)  # its once-only figures are not lost
            wait = self.capacity.retry_after(stats.waiting - max_waiting + len(prompts) * req.n)
            raise APIError(
                429, str(e), kind="rate_limit_exceeded", headers={"Retry-After": str(wait)}
            ) from None
        except ValidationError as e:
            self._close(choices)
            raise APIError(400, str(e), e.param) from None
        except EngineDeadError as e:
            self._close(choices)
            raise APIError(503, str(e), kind="unavailable") from None
        except LookupError as e:  # its adapter was unloaded since `resolve`
            self._close(choices)
            raise APIError(404, f"model: {e}", "model", kind="not_found_error") from None
        except ValueError as e:
            self._close(choices)
            param = str(e).split(":", 1)[0] if ":" in str(e) else None
            raise APIError(400, str(e), param) from None
        except BaseException:
            self._close(choices)
            raise
        return choices

    def _close(self, choices: list[Choice]) -> None:
        """Abandon choices queued before the request failed (their tokens go back)."""
        for choice in choices:
            choice.stream.close()
            tenant, charged = self._tenant_of.pop(choice.stream.request_id, (DEFAULT_TENANT, 0))
            self.limiter.give_back(tenant, charged)

    # -- responses -----------------------------------------------------------------------

    async def _stream(
        self,
        request: web.Request,
        req: GenerationRequest,
        choices: list[Choice],
        firsts: list[Delta],
        chat: bool,
        tools: ToolRequest | None = None,
        headers: dict[str, str] | None = None,
        check: Callable[[Choice], str | None] | None = None,
    ) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                **(headers or {}),
            }
        )
        await resp.prepare(request)
        timeout = self.options.stream_timeout
        base = self.responses.events(req, choices, firsts, chat, check)
        events = base if tools is None else stream_tool_calls(base, tools, self._tools_parser())
        try:
            async for payload in events:
                # A client that stops reading blocks this write once the socket buffer is
                # full; past the timeout the stream ends and its request is aborted.
                await asyncio.wait_for(
                    resp.write(b"data: " + orjson.dumps(payload) + b"\n\n"), timeout
                )
            await asyncio.wait_for(resp.write(b"data: [DONE]\n\n"), timeout)
            await resp.write_eof()
        except ConnectionResetError:
            pass  # the client left; the caller's `finally` aborts what still runs
        except TimeoutError:
            rid = choices[0].stream.request_id if choices else "-"
            log.warning("stream %s: client took no data for %.0fs; ending it", rid, timeout)
        finally:
            # Closed here, not whenever the collector finds them: merged()'s pump tasks
            # end with them, while this task still holds them (a client that left, or a
            # timeout, leaves the generators suspended at a yield).
            await events.aclose()
            await base.aclose()
        return resp

    def _observe(self, c: Choice) -> None:
        m = self.metrics
        tenant, charged = self._tenant_of.pop(c.stream.request_id, (DEFAULT_TENANT, 0))
        if c.finish_reason != "rejected":
            m.tenants.served(tenant, c.prompt_tokens, c.completion_tokens)
        # What it was charged for and did not generate goes back to its bucket.
        self.limiter.give_back(tenant, charged - c.prompt_tokens - c.completion_tokens)
        if c.finish_reason is not None:
            self.capacity.finished()
        if c.ttft is not None:
            m.ttft.observe(c.ttft)
        for gap in c.gaps:
            m.itl.observe(gap)
        elapsed = (c.last_token_time or c.arrival) - c.arrival
        if c.finish_reason is not None:
            m.e2e.observe(elapsed)
            m.prompt_tokens.inc(c.prompt_tokens)
        m.generation_tokens.inc(c.completion_tokens)
        reason = c.finish_reason or "abort"
        m.finished.labels(reason).inc()
        log.info(
            "request %s prompt=%d output=%d cached=%d ttft=%s e2e=%.0fms finish=%s%s",
            c.stream.request_id,
            c.prompt_tokens,
            c.completion_tokens,
            c.cached_tokens,
            f"{c.ttft * 1000:.0f}ms" if c.ttft is not None else "-",
            elapsed * 1000,
            reason,
            spec_log_fields(c.spec_stats),
        )


def _warning_headers(constraint: Constraint | None) -> dict[str, str] | None:
    """strict: false dropped schema keywords: say which, in one response header."""
    if constraint is None or not constraint.warnings:
        return None
    return {WARNING_HEADER: "; ".join(constraint.warnings)}
