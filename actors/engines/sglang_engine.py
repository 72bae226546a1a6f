"""SGLang engine: an HTTP client for an SGLang 0.5.x server (launched here or pointed at a URL).

Endpoints used (request JSON as SGLang 0.5.x expects it):
  POST /generate                        {input_ids, sampling_params{temperature, top_p, top_k, max_new_tokens,
                                         stop_token_ids, sampling_seed}, return_logprob: true, rid}
                                        -> {output_ids, meta_info{finish_reason{type}, output_token_logprobs
                                            [[logprob, token_id, text], ...], prompt_tokens, ...}}
  POST /abort_request                   {abort_all: true}  (or {rid}: matched by PREFIX, so our rids end in '#')
  POST /pause_generation {mode}, /continue_generation, /flush_cache
  POST /update_weights_from_disk        {model_path, weight_version}
  POST /update_weights_from_tensor      {serialized_named_tensors, load_format, flush_cache, weight_version}
  POST /init_weights_update_group       {master_address, master_port, rank_offset, world_size, group_name, backend}
  POST /update_weights_from_distributed {names, dtypes, shapes, group_name, flush_cache, weight_version}
  GET  /health, /get_model_info

Versions: a response comes back whole, so the client cannot see where inside
it the weights changed. `update_weights` therefore aborts whatever is still in
flight first (callers normally abort or drain before updating anyway); those
requests return `abort` with their tokens tagged with the old version and are
resumed by the caller, and every later token carries the new version.
"""

from __future__ import annotations

import asyncio
import base64
import io
import itertools
import os
import pickle
import subprocess
import sys
import tempfile
import time
from collections import deque
from typing import Any, Iterable

import aiohttp
import numpy as np

from actors.engine import EngineStats, GenerateRequest, GenerateResult, WeightBucket


class SGLangError(RuntimeError):
    """The SGLang server answered with an error, or could not be reached within the retry limit."""


class SGLangEngine:
    """`Engine` over SGLang's HTTP API. With `url=None`, `start()` launches `sglang.launch_server` on loopback."""

    def __init__(
        self,
        model_path: str | None = None,
        *,
        url: str | None = None,
        port: int = 30000,
        launch_args: Iterable[str] = (),
        startup_timeout_s: float = 600.0,
        request_timeout_s: float = 3600.0,
        retries: int = 5,
        backoff_s: float = 0.5,
        weight_update_mode: str = "tensor",
        tp_size: int = 1,
        sampling_overrides: dict[str, Any] | None = None,
        version: int = 0,
    ) -> None:
        if url is None and model_path is None:
            raise ValueError("SGLangEngine needs url (a running server) or model_path (to launch one)")
        if weight_update_mode not in ("tensor", "disk", "distributed"):
            raise ValueError(f"weight_update_mode must be tensor, disk or distributed, got {weight_update_mode!r}")
        self.model_path, self.url, self.port = model_path, url.rstrip("/") if url else None, port
        self.launch_args = list(launch_args)
        self.startup_timeout_s, self.request_timeout_s = startup_timeout_s, request_timeout_s
        self.retries, self.backoff_s = retries, backoff_s
        self.weight_update_mode, self.tp_size = weight_update_mode, tp_size
        self.sampling_overrides = dict(sampling_overrides or {})
        """Extra SGLang sampling_params sent with every request, e.g. {"ignore_eos": True}."""
        self._version = version
        self._proc: subprocess.Popen | None = None
        self._log_path: str | None = None
        self._session: aiohttp.ClientSession | None = None
        self._inflight: dict[str, asyncio.Task] = {}
        self._rid = itertools.count()
        self._stats = EngineStats()
        self._t_busy: float | None = None
        self._t_last = time.perf_counter()
        self.group_name = "async_april_weights"

    @property
    def version(self) -> int:
        return self._version

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        if self._session is not None:
            return
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.request_timeout_s))
        if self.url is None:
            self._launch()
        await self._wait_healthy()

    def _launch(self) -> None:
        fd, self._log_path = tempfile.mkstemp(prefix="sglang-", suffix=".log")
        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(self.model_path),
               "--host", "127.0.0.1", "--port", str(self.port), *self.launch_args]
        self._proc = subprocess.Popen(cmd, stdout=fd, stderr=subprocess.STDOUT, start_new_session=True)
        os.close(fd)
        self.url = f"http://127.0.0.1:{self.port}"

    async def _wait_healthy(self) -> None:
        t0 = time.monotonic()
        deadline = t0 + self.startup_timeout_s
        last_err = "no answer"
        while time.monotonic() < deadline:
            self.startup_note = f"SGLang at {self.url}: {time.monotonic() - t0:.0f}s of {self.startup_timeout_s:.0f}s ({last_err})"
            if self._proc is not None and self._proc.poll() is not None:
                raise SGLangError(f"SGLang server exited with code {self._proc.returncode} during startup\n{self._log_tail()}")
            for path in ("/health", "/get_model_info"):
                try:
                    async with self._session.get(self.url + path, timeout=aiohttp.ClientTimeout(total=5)) as r:
                        if r.status == 200:
                            return
                        last_err = f"{path} -> HTTP {r.status}"
                except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                    last_err = f"{path} -> {type(e).__name__}: {e}"
            await asyncio.sleep(1.0)
        raise SGLangError(
            f"SGLang server at {self.url} not healthy after {self.startup_timeout_s:.0f}s (last: {last_err}); "
            f"raise startup_timeout_s or check the server\n{self._log_tail()}"
        )

    def _log_tail(self, n: int = 30) -> str:
        if not self._log_path or not os.path.exists(self._log_path):
            return "(no server log: the server was not launched by this engine)"
        with open(self._log_path, errors="replace") as f:
            return "last server log lines:\n" + "".join(deque(f, n))

    async def shutdown(self) -> None:
        if self._session is None:
            return
        try:
            if self._inflight:
                await self.abort_all()
        finally:
            await self._session.close()
            self._session = None
            if self._proc is not None:
                self._proc.terminate()
                try:
                    self._proc.wait(30)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
                self._proc = None

    # ------------------------------------------------------------------ HTTP with retries
    async def _post(self, path: str, payload: dict | None = None, *, retry: bool = True) -> Any:
        if self._session is None:
            raise RuntimeError(f"SGLangEngine.start() must be awaited before {path}")
        attempts = self.retries + 1 if retry else 1
        for attempt in range(attempts):
            try:
                async with self._session.post(self.url + path, json=payload or {}) as r:
                    text = await r.text()
                    if r.status != 200:
                        raise SGLangError(f"POST {path} -> HTTP {r.status}: {text[:500]}")
                    try:
                        return await r.json(content_type=None)
                    except ValueError:
                        return text
            except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as e:
                if attempt + 1 >= attempts:
                    raise SGLangError(f"POST {self.url}{path} failed after {attempts} attempts: {type(e).__name__}: {e}") from e
                await asyncio.sleep(self.backoff_s * 2**attempt)

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
        sp = request.sampling
        # SGLang aborts by rid prefix: a fixed-width counter plus '#' is never a prefix of another live rid.
        rid = f"{request.request_id}@{next(self._rid):012d}#"
        params: dict[str, Any] = {
            "temperature": sp.temperature, "top_p": sp.top_p, "top_k": sp.top_k,
            "max_new_tokens": sp.max_new_tokens, "stop_token_ids": list(sp.stop_token_ids) or None,
        }
        if sp.seed is not None:
            params["sampling_seed"] = int(sp.seed)
        params.update(self.sampling_overrides)
        payload = {"input_ids": [int(t) for t in request.input_ids], "sampling_params": params,
                   "return_logprob": True, "rid": rid}
        version = self._version
        self._tick()
        task = asyncio.current_task()
        self._inflight[rid] = task
        try:
            # No retry: a resent /generate would sample a second response for the same request.
            out = await self._post("/generate", payload, retry=False)
        finally:
            self._tick()
            self._inflight.pop(rid, None)
        res = parse_generate_response(request.request_id, out, version, len(request.input_ids))
        self._stats.generated_tokens += len(res.output_ids)
        self._stats.prefill_tokens += len(request.input_ids)
        return res

    async def abort_all(self) -> None:
        aborted = set(self._inflight)  # a request sent after this call is not aborted: never wait for it
        await self._post("/abort_request", {"abort_all": True})
        # Aborted /generate calls return with their partial output; wait until they have.
        deadline = time.monotonic() + 30
        while any(rid in self._inflight for rid in aborted) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    async def pause(self, mode: str = "in_place") -> None:
        await self._post("/pause_generation", {"mode": mode})

    async def resume(self) -> None:
        await self._post("/continue_generation", {})

    async def flush_cache(self) -> None:
        await self._post("/flush_cache", {})

    # ------------------------------------------------------------------ weights
    async def update_weights(self, buckets: Iterable[WeightBucket], version: int) -> None:
        """Push named full tensors through /update_weights_from_tensor (the default mode)."""
        if self._inflight:
            await self.abort_all()
        if self.weight_update_mode == "disk":
            raise SGLangError("weight_update_mode=disk: call update_weights_from_disk(model_path, version)")
        if self.weight_update_mode == "distributed":
            raise SGLangError("weight_update_mode=distributed: call update_weights_from_distributed(...) per bucket")
        buckets = list(buckets)
        for i, bucket in enumerate(buckets):
            last = i == len(buckets) - 1
            await self._check(await self._post("/update_weights_from_tensor", {
                "serialized_named_tensors": [serialize_named_tensors(bucket)] * self.tp_size,  # one per TP rank
                "load_format": None, "flush_cache": last,
                "weight_version": str(version) if last else None,
            }), "update_weights_from_tensor")
        self._version = version

    async def update_weights_from_disk(self, model_path: str, version: int) -> None:
        if self._inflight:
            await self.abort_all()
        await self._check(await self._post("/update_weights_from_disk",
                                           {"model_path": model_path, "weight_version": str(version)}),
                          "update_weights_from_disk")
        self._version = version

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, backend: str = "nccl") -> None:
        """Step 1 of the NCCL path: the server's ranks join a process group with the learner (rank 0)."""
        await self._check(await self._post("/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": self.group_name, "backend": backend,
        }), "init_weights_update_group")

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                              version: int | None, flush_cache: bool = True) -> None:
        """Step 2, per bucket: tell the server what to receive; the learner then broadcasts each tensor
        (in `names` order) over the group. Pass `version` on the last bucket only."""
        if self._inflight:
            await self.abort_all()
        await self._check(await self._post("/update_weights_from_distributed", {
            "names": names, "dtypes": dtypes, "shapes": shapes, "group_name": self.group_name,
            "flush_cache": flush_cache, "weight_version": None if version is None else str(version),
        }), "update_weights_from_distributed")
        if version is not None:
            self._version = version

    @staticmethod
    async def _check(out: Any, what: str) -> None:
        if isinstance(out, dict) and out.get("success") is False:
            raise SGLangError(f"{what} failed on the server: {out.get('message', out)}")

    def stats(self) -> EngineStats:
        s = self._stats
        return EngineStats(s.busy_s, s.idle_s, s.generated_tokens, s.prefill_tokens, dict(s.extra))


def parse_generate_response(request_id: str, out: dict, version: int, prompt_tokens: int) -> GenerateResult:
    """SGLang /generate JSON -> GenerateResult (all tokens tagged with `version`)."""
    meta = out.get("meta_info", {})
    lps = meta.get("output_token_logprobs") or []
    ids = out.get("output_ids")
    if ids is None:
        ids = [t[1] for t in lps]
    if len(lps) != len(ids):
        raise SGLangError(f"{request_id}: {len(ids)} output_ids but {len(lps)} output_token_logprobs; "
                          "was the request sent with return_logprob=true?")
    reason = (meta.get("finish_reason") or {}).get("type", "abort")
    if reason not in ("stop", "length", "abort"):
        raise SGLangError(f"{request_id}: unexpected finish_reason {meta.get('finish_reason')!r}")
    return GenerateResult(
        request_id=request_id,
        output_ids=np.asarray(ids, np.int64),
        logprobs=np.asarray([t[0] for t in lps], np.float32),
        versions=np.full(len(ids), version, np.int64),
        finish_reason=reason,
        prompt_tokens=int(meta.get("prompt_tokens", prompt_tokens)),
    )


def serialize_named_tensors(bucket: WeightBucket) -> str:
    """One bucket as SGLang's `serialized_named_tensors` entry: base64 of the pickled [(name, tensor)] list.

    SGLang itself pickles with its MultiprocessingSerializer (shared-memory handles, same host only);
    plain CPU tensors pickled by value work through the same unpickler and across hosts.
    """
    buf = io.BytesIO()
    pickle.dump([(n, t.detach().cpu().contiguous()) for n, t in bucket.items()], buf)
    return base64.b64encode(buf.getvalue()).decode()


def deserialize_named_tensors(data: str) -> list[tuple[str, Any]]:
    return pickle.loads(base64.b64decode(data))
