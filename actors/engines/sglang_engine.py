"""SGLang engine: an HTTP client for an SGLang 0.5.23 server (launched here, one per actor, or at a URL).

One client whose routes (generate, abort, pause, the weight-update session) share the update gate
and its error handling; server checks, HTTP helpers and the launched process are apart
(sglang_server.py, sglang_http.py, sglang_process.py).

Written against SGLang 0.5.23's source (paths under sglang/srt/); docs/engines.md has the per-route
conformance table (what is sent, what the server does, the test that shows it). In short:
/health (503 while starting) and /server_info (our port, tp size, seed handling, context limits and,
for rollout.on_weight_update=continue, the two launch flags it needs: sglang_server.py) at start;
/generate with input_ids and return_logprob, every reply validated (sglang_wire.py);
/abort_request {abort_all}; a weight update is gated by /pause_generation (retract, or in_place for
continue) ... /continue_generation around a /begin_weight_update ... /end_weight_update session, with
buckets through /update_weights_from_tensor (one entry per TP rank), /update_weights_from_disk or
/init_weights_update_group + /update_weights_from_distributed (NCCL); /update_weight_version tells an
attached server our starting version. HTTP and retries: sglang_http.py; ports and processes:
sglang_process.py.

Versions: 0.5.23 reports `meta_info.weight_versions`, spans [start, end) of output tokens and the
weight version that produced them; each token is tagged from its span. A reply whose spans do not
cover its tokens, or that reports a version change without spans, raises SGLangError.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import sys
import time
from contextlib import asynccontextmanager
from typing import Any, Iterable

import aiohttp
import numpy as np

from actors.engine import EngineStats, GenerateRequest, GenerateResult, WeightBucket
from actors.engines.sglang_http import SGLangHTTP
from actors.engines.sglang_process import LaunchedServer, claim_port, launch_module_error
from actors.engines.sglang_server import (IN_FLIGHT_FLAGS, ContextLimits, check_server_info, in_flight_problem,
                                          original_logprob_env_error)
from actors.engines.sglang_wire import SGLangError, json_object, parse_generate_response, serialize_named_tensors

__all__ = ["SGLangEngine", "SGLangError", "original_logprob_env_error"]


class SGLangEngine(SGLangHTTP):
    """`Engine` over SGLang's HTTP API. With `url=None`, `start()` launches `launch_module` on loopback
    on a port of its own from `port_range`."""

    def __init__(
        self,
        model_path: str | None = None,
        *,
        url: str | None = None,
        tp_size: int = 1,
        mem_fraction_static: float | None = None,
        extra_args: Iterable[str] = (),
        port_range: tuple[int, int] = (30000, 30999),
        deterministic: bool = True,
        rl_on_policy_target: str | None = None,
        launch_module: str = "sglang.launch_server",
        startup_timeout_s: float = 900.0,
        request_timeout_s: float = 3600.0,
        retries: int = 5,
        backoff_s: float = 0.5,
        weight_update_mode: str = "tensor",
        temperature: float = 1.0,
        sampling_overrides: dict[str, Any] | None = None,
        version: int = 0,
        in_flight_updates: bool = False,
    ) -> None:
        if url is None and model_path is None:
            raise ValueError("SGLangEngine needs url (a running server) or model_path (to launch one)")
        if weight_update_mode not in ("tensor", "disk", "distributed"):
            raise ValueError(f"weight_update_mode must be tensor, disk or distributed, got {weight_update_mode!r}")
        self.model_path, self.url = model_path, url.rstrip("/") if url else None
        self.tp_size, self.mem_fraction_static = tp_size, mem_fraction_static
        self.extra_args, self.port_range = list(extra_args), tuple(port_range)
        self.deterministic, self.launch_module = deterministic, launch_module
        self.rl_on_policy_target = rl_on_policy_target
        """model.parity: "fsdp", SGLang's own kernels switched to the trainer-matching ones (sglang_server.py)."""
        self.startup_timeout_s, self.request_timeout_s = startup_timeout_s, request_timeout_s
        self.retries, self.backoff_s = retries, backoff_s
        self.weight_update_mode, self.temperature = weight_update_mode, temperature
        self.sampling_overrides = dict(sampling_overrides or {})
        """Extra SGLang sampling_params sent with every request, e.g. {"ignore_eos": True}."""
        self._version = version
        self.port: int | None = None
        self._server: LaunchedServer | None = None
        """The server `start()` launched (url=None), else None."""
        self._session: aiohttp.ClientSession | None = None
        self._inflight: dict[str, asyncio.Task] = {}
        self._rid = itertools.count()
        self._stats = EngineStats()
        self._t_last = time.perf_counter()
        self._has_sessions: bool | None = None
        """Whether the server has /begin_weight_update (0.5.23); None until first asked."""
        self.startup_note = ""
        self.group_name = "async_april_weights"
        self._group_joined = False
        self.in_flight_updates = in_flight_updates
        """rollout.on_weight_update=continue: launch with IN_FLIGHT_FLAGS, and refuse a server without them."""
        self._server_info: dict | None = None
        self._limits: ContextLimits | None = None
        self._open = asyncio.Event()
        """Clear while this client updates the server's weights: new requests wait here, not at the server's
        pause gate, where an abort cannot reach them (tokenizer_manager.py: the gate is before the scheduler)."""
        self._open.set()
        self._aborts = 0
        """abort_all calls so far: a request still waiting at `_open` when one comes returns as aborted."""
        self._weights_unknown: str | None = None
        """Why the server's weights are unknown (a load failed part way; SGLang does not roll back), or None."""

    @property
    def version(self) -> int:
        return self._version

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        if self._session is not None:
            return
        why = original_logprob_env_error(self.temperature)
        if why is not None:
            raise SGLangError(why)
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.request_timeout_s))
        if self.url is None:
            self._launch()
        await self._wait_healthy()
        await self._check_server()

    def _launch(self) -> None:
        if why := launch_module_error(self.launch_module):
            raise SGLangError(why)
        self.port, port_lock = claim_port(*self.port_range)
        self._server = LaunchedServer(self.launch_command(self.port), self.port, port_lock)
        self.url = f"http://127.0.0.1:{self.port}"

    def launch_command(self, port: int) -> list[str]:
        """The server's command line (flag names from srt/server_args.py); loopback only."""
        cmd = [sys.executable, "-m", self.launch_module, "--model-path", str(self.model_path),
               "--host", "127.0.0.1", "--port", str(port), "--tp-size", str(self.tp_size),
               "--skip-tokenizer-init", "--weight-version", str(self._version)]
        if self.mem_fraction_static is not None:
            cmd += ["--mem-fraction-static", str(self.mem_fraction_static)]
        if self.deterministic:  # without it SGLang ignores sampling_seed
            cmd += ["--enable-deterministic-inference"]
        if self.rl_on_policy_target is not None:
            cmd += ["--rl-on-policy-target", self.rl_on_policy_target]
        if self.in_flight_updates:  # see IN_FLIGHT_FLAGS: what continue costs is in docs/async.md
            cmd += list(IN_FLIGHT_FLAGS)
        return cmd + self.extra_args

    async def _wait_healthy(self) -> None:
        """Poll /health until 200: 0.5.23 answers 503 while the server starts (http_server.py health_generate)."""
        t0 = time.monotonic()
        deadline = t0 + self.startup_timeout_s
        last_err = "no answer"
        while time.monotonic() < deadline:
            self.startup_note = f"SGLang at {self.url}: {time.monotonic() - t0:.0f}s of {self.startup_timeout_s:.0f}s ({last_err})"
            if self._server is not None and (code := self._server.exit_code()) is not None:
                raise SGLangError(f"SGLang server exited with code {code} during startup\n{self._log_tail()}")
            try:
                async with self._session.get(self.url + "/health", timeout=aiohttp.ClientTimeout(total=30)) as r:
                    if r.status == 200:
                        return
                    last_err = f"/health -> HTTP {r.status}"
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                last_err = f"/health -> {type(e).__name__}: {e}"
            await asyncio.sleep(0.5)
        raise SGLangError(
            f"SGLang server at {self.url} not healthy after {self.startup_timeout_s:.0f}s (last: {last_err}); "
            f"raise rollout.sglang.startup_timeout_s or check the server\n{self._log_tail()}"
        )

    async def _check_server(self) -> None:
        """The server answering is the one we mean: our own child (launched), with our tp size and
        seed handling; and it counts weight versions from ours."""
        if self._server is not None and (why := self._server.port_problem()):
            raise SGLangError(why)
        info = self._server_info = await self._get_json("/server_info", "/get_server_info")
        if info is not None:
            check_server_info(info, self.url, port=self.port if self._server is not None else None, tp_size=self.tp_size,
                              deterministic=self.deterministic, rl_on_policy_target=self.rl_on_policy_target)
        self._limits = ContextLimits.from_server_info(info)
        if self.in_flight_updates and (why := in_flight_problem(info, self.url)):
            raise SGLangError(why)
        model = await self._get_json("/model_info", "/get_model_info")
        if model is not None and model.get("weight_version") not in (None, str(self._version)):
            await self._post_ok("/update_weight_version", {"new_version": str(self._version), "abort_all_requests": False})

    def _log_tail(self) -> str:
        return self._server.log_tail() if self._server else "(no server log: the server was not launched by this engine)"

    async def shutdown(self) -> None:
        if self._session is None:
            return
        try:
            if self._inflight:
                await self.abort_all()
            if self._group_joined:  # a later run or a restarted actor joins a group of the same name
                await self.destroy_weights_update_group()
        finally:
            await self._session.close()
            self._session = None
            if self._server is not None:
                self._server.stop()
                self._server = None

    # ------------------------------------------------------------------ generation
    def _tick(self) -> None:
        """Account the time since the last tick as busy (requests were in flight) or idle."""
        now = time.perf_counter()
        if self._inflight:
            self._stats.busy_s += now - self._t_last
        else:
            self._stats.idle_s += now - self._t_last
        self._t_last = now

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        if self._weights_unknown:
            raise SGLangError(self._weights_unknown)
        aborts = self._aborts
        await self._open.wait()
        n_in = len(request.input_ids)
        max_new = int(request.sampling.max_new_tokens)
        if self._limits is not None:  # what the server would cap or refuse (sglang_server.ContextLimits)
            max_new = self._limits.max_new_tokens(n_in, request.prompt_len, max_new, self.url)
        if aborts != self._aborts or max_new == 0:  # aborted while waiting, or no room left: nothing to send
            return GenerateResult(request.request_id, np.zeros(0, np.int64), np.zeros(0, np.float32),
                                  np.zeros(0, np.int64), "abort" if aborts != self._aborts else "length", n_in)
        sp = request.sampling
        # SGLang's scheduler aborts by rid prefix: a fixed-width counter plus '#' is never a prefix of another live rid.
        rid = f"{request.request_id}@{next(self._rid):012d}#"
        params: dict[str, Any] = {
            "temperature": float(sp.temperature), "top_p": float(sp.top_p), "top_k": int(sp.top_k),
            "max_new_tokens": max_new, "stop_token_ids": [int(t) for t in sp.stop_token_ids] or None,
        }
        if sp.seed is not None and self.deterministic:
            params["sampling_seed"] = int(sp.seed)
        params.update(self.sampling_overrides)
        payload = {"input_ids": [int(t) for t in request.input_ids], "sampling_params": params,
                   "return_logprob": True, "rid": rid}
        version = self._version
        self._tick()
        self._inflight[rid] = asyncio.current_task()
        try:
            # No retry: a resent /generate would sample a second response for the same request.
            status, text = await self._post_raw("/generate", payload, retry=False)
        finally:
            self._tick()
            self._inflight.pop(rid, None)
        if status != 200:
            raise SGLangError(f"POST /generate -> HTTP {status}: {text[:500]}")
        res = parse_generate_response(request.request_id, json_object(text, "/generate"), version, self._version,
                                      len(request.input_ids))
        self._stats.generated_tokens += len(res.output_ids)
        self._stats.prefill_tokens += len(request.input_ids)
        return res

    async def abort_all(self) -> None:
        aborted = set(self._inflight)  # a request sent after this call is not aborted: never wait for it
        self._aborts += 1
        await self._post("/abort_request", {"abort_all": True})
        # Aborted /generate calls return with their partial output; wait until they have. Paused in place
        # (our update running), the server returns them only after /continue_generation (scheduler.py
        # abort_request marks running requests to_finish), so the 30 s count starts when we reopen.
        deadline = None
        while any(rid in self._inflight for rid in aborted):
            if self._open.is_set():
                deadline = deadline or time.monotonic() + 30
                if time.monotonic() > deadline:
                    break
            await asyncio.sleep(0.01)

    async def flush_cache(self) -> None:
        """Refused (400) by 0.5.23 while requests run or queue (scheduler.py flush_cache)."""
        await self._post("/flush_cache", {})

    # ------------------------------------------------------------------ weights
    @asynccontextmanager
    async def _update_gate(self, session: bool, in_flight: bool = False):
        """Pause so no request decodes between buckets; open a weight-update session for tensor/distributed
        loads; always close it and continue afterwards. `retract` (after an abort or drain) lets the final
        flush run; `in_place` (in_flight) keeps the running requests and their KV cache for after the load.
        Without in_flight, what this client still has running is aborted first (callers abort or drain anyway).
        A load that fails part way leaves the server's weights unknown: generate refuses until a full load."""
        if in_flight and (why := in_flight_problem(self._server_info, self.url)):
            raise SGLangError(why)
        self._open.clear()
        try:
            if self._inflight and not in_flight:
                await self.abort_all()
            await self._post_ok("/pause_generation", {"mode": "in_place" if in_flight else "retract"})
            opened = False
            try:
                if session:
                    opened = await self._begin_session()
                yield
                self._weights_unknown = None
            except BaseException as e:
                self._weights_unknown = (f"a weight load on {self.url} failed part way ({e}); SGLang keeps what it loaded "
                                         "(no rollback), so its weights are a mix of versions: load a full set again or "
                                         "restart the server")
                raise
            finally:
                try:
                    if opened:
                        await self._post_ok("/end_weight_update", {})
                finally:
                    await self._post_ok("/continue_generation", {})
        finally:
            self._open.set()

    async def _begin_session(self) -> bool:
        if self._has_sessions is False:
            return False
        status, text = await self._post_raw("/begin_weight_update", {})
        if status == 404:  # an older 0.5 server: updates run without a session there
            self._has_sessions = False
            return False
        if status != 200 or json_object(text, "/begin_weight_update").get("success") is False:
            raise SGLangError(f"POST /begin_weight_update -> HTTP {status}: {text[:500]}")
        self._has_sessions = True
        return True

    async def update_weights(self, buckets: Iterable[WeightBucket], version: int) -> None:
        """Push named full tensors through /update_weights_from_tensor (the default mode). Requests still
        running are aborted first, and the cache the old weights built is flushed after the last bucket."""
        await self._update_from_tensor(buckets, version, in_flight=False)

    async def update_weights_in_flight(self, buckets: Iterable[WeightBucket], version: int) -> None:
        """rollout.on_weight_update=continue: pause in place, load without a flush, continue; running
        requests keep their KV cache and their later tokens come from the new weights."""
        await self._update_from_tensor(buckets, version, in_flight=True)

    async def _update_from_tensor(self, buckets: Iterable[WeightBucket], version: int, in_flight: bool) -> None:
        if self.weight_update_mode == "disk":
            raise SGLangError("weight_update_mode=disk: call update_weights_from_disk(model_path, version)")
        if self.weight_update_mode == "distributed":
            raise SGLangError("weight_update_mode=distributed: call update_weights_from_distributed(...) per bucket")
        buckets = list(buckets)
        async with self._update_gate(session=True, in_flight=in_flight):
            for i, bucket in enumerate(buckets):
                last = i == len(buckets) - 1
                entry = serialize_named_tensors(bucket)
                await self._post_ok("/update_weights_from_tensor", {
                    "serialized_named_tensors": [entry] * self.tp_size,  # each TP rank reads its own entry
                    "load_format": None, "flush_cache": last and not in_flight,
                    "weight_version": str(version) if last else None,
                })
        self._version = version

    async def update_weights_from_disk(self, model_path: str, version: int, in_flight: bool = False) -> None:
        """The server reads the safetensors files itself; `in_flight` as in `update_weights_in_flight`."""
        async with self._update_gate(session=False, in_flight=in_flight):  # disk loads need no session (weight_updater.py)
            await self._post_ok("/update_weights_from_disk", {"model_path": model_path, "weight_version": str(version),
                                                              "flush_cache": not in_flight})
        self._version = version

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, backend: str = "nccl") -> None:
        """Step 1 of the NCCL path: the server's TP ranks join a process group with the learner (rank 0)
        as ranks rank_offset .. rank_offset + tp_size - 1. A group of our name left by an earlier run (a
        server at rollout.sglang.url outlives us) is destroyed first: torch refuses a second group of one
        name (distributed_c10d.py _new_process_group_helper)."""
        await self.destroy_weights_update_group()
        self._group_joined = True
        await self._post_ok("/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": self.group_name, "backend": backend,
        })

    async def destroy_weights_update_group(self) -> None:
        """Leave the weight group (on shutdown, before a join, and when the learner re-forms the group for
        a new set of engines). POST /destroy_weights_update_group (http_server.py; model_runner_components/weight_updater.py
        destroy_weights_update_group): 400 "does not exist" when there is none, 404 on servers before it."""
        status, text = await self._post_raw("/destroy_weights_update_group", {"group_name": self.group_name})
        self._group_joined = False
        if status not in (200, 404) and "does not exist" not in text:
            raise SGLangError(f"POST /destroy_weights_update_group -> HTTP {status}: {text[:500]}")

    async def update_weights_from_distributed(self, plan: list[tuple[list[str], list[str], list[list[int]]]], version: int,
                                              in_flight: bool = False) -> None:
        """Step 2: inside one gated session, announce each bucket (names, dtypes, shapes) while the
        learner broadcasts it over the group; the last bucket carries `version` (and the flush, unless
        `in_flight` as in `update_weights_in_flight`)."""
        async with self._update_gate(session=True, in_flight=in_flight):
            for i, (names, dtypes, shapes) in enumerate(plan):
                last = i == len(plan) - 1
                await self._post_ok("/update_weights_from_distributed", {
                    "names": names, "dtypes": dtypes, "shapes": shapes, "group_name": self.group_name,
                    "flush_cache": last and not in_flight, "weight_version": str(version) if last else None,
                })
        self._version = version

    def stats(self) -> EngineStats:
        s = self._stats
        return dataclasses.replace(s, extra=dict(s.extra))
