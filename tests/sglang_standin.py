"""STAND-IN for an SGLang 0.5.23 HTTP server, for CPU tests. It is NOT SGLang.

A real SGLang server needs a GPU. This loopback aiohttp server speaks the same
request/response JSON for the routes `actors/engines/sglang_engine.py` uses,
backed by the built-in TORCH engine (real samples, exact logprobs), and is at
least as strict as 0.5.23 wherever the client relies on it. Each behaviour
cites the SGLang file it follows (paths under sglang/):

- every /generate body is checked with SGLang's own generated JSON contract,
  `api/v1/api_types.py` (vendored verbatim as tests/sglang_api_types.py), as
  srt/entrypoints/api_contract.py does: unknown sampling_params keys and a
  float where an int goes are 400 with SGLang's own message;
- /health is 503 until the model is loaded and warmed up (srt/entrypoints/http_server.py
  health_generate); /model_info and /server_info answer earlier;
- tensor and distributed weight updates outside a begin/end_weight_update
  session are 400 with SGLang's message; a second begin, or an end without a
  begin, is 400 (srt/managers/scheduler_components/weight_updater.py);
- a weight update naming a tensor the model does not have is 400, where SGLang skips it
  (srt/models/qwen2.py _legacy_load_weights): stricter, so LoRA adapter factors (`<w>.lora_A/B`) sent
  to these routes fail instead of being dropped silently (SGLang gets merged weights, docs/learner.md);
- `serialized_named_tensors` must hold one entry per TP rank (srt/managers/tp_worker.py
  deserialize_own_rank indexes it by rank);
- a flush (/flush_cache, or flush_cache=true on an update) is refused while requests run or
  queue, unless paused with mode=retract (srt/managers/scheduler.py flush_cache, is_fully_idle);
  a refused post-update flush fails the update after the weights changed (weight_updater.py);
- /abort_request by rid acts only when that exact rid is live, then aborts every live rid it
  prefixes (srt/managers/tokenizer_manager.py abort_request; the scheduler matches startswith);
- paused (retract / in_place) nothing decodes and new requests wait until /continue_generation
  (tokenizer_manager.py pause_generation, scheduler.py);
- a weight load while paused with mode=retract recomputes the running requests' KV cache with the
  new weights (retract_all frees it; they are prefilled again after /continue_generation); paused
  in_place, or not paused, they keep the KV the old weights built and decode on with the new
  weights (scheduler.py pause_generation: in_place leaves running_batch untouched); the stand-in
  counts the recomputed tokens in its engine's `reprefill_tokens`;
- replies carry `weight_version` and `weight_versions` spans [start, end) of output tokens
  (srt/utils/weight_versions.py compute_weight_version_spans / add_weight_versions_to_meta_info);
- sampling_params pass `SamplingParams.verify`'s range checks (top_k -1 or >= 1, top_p in (0, 1],
  temperature >= 0, ...: srt/sampling/sampling_params.py), and input length against the context:
  input >= context_len and input + max_new_tokens > context_len are 400 (tokenizer_manager.py
  _validate_one_request), max_new_tokens is capped at context_len - input - 2 (scheduler.py
  init_req_max_new_tokens), input >= context_len - 6 is 400 (managers/utils.py validate_input_length);
  the ported rules are tests/sglang_rules.py;
- the overlap scheduler's one-step lag (on unless --disable-overlap-schedule): a load while paused in
  place (or not paused) records each running request's version change one token short, and none for a
  request with no processed output yet (scheduler.py event_loop_overlap, pause_generation;
  utils/weight_versions.py record_weight_version_events);
- a prefix (radix) cache (on unless --disable-radix-cache) that keeps serving KV computed by older
  weights until a flush (tests/sglang_standin_engine.py); replies carry `cached_tokens`;
- an abort while paused in place returns the running requests only after /continue_generation, and
  requests held at the pause gate are not aborted at all (scheduler.py abort_request: `to_finish`;
  tokenizer_manager.py: the gate is before the scheduler); a pause with mode=abort aborts everything
  and stays paused until /continue_generation (tokenizer_manager.py pause_generation);
- every bucket loads when it arrives, so a failed bucket leaves the earlier ones applied: mixed
  weights, no rollback (weight_updater.py update_weights_from_tensor); payloads are unpickled with
  SGLang's allow-list (srt/utils/common.py SafeUnpickler); a str field given an int (e.g.
  `weight_version: 3`) is 400 (managers/io_struct.py; http_server.py validation_exception_handler);
- /init_weights_update_group forms a REAL torch.distributed group (over gloo: no GPU here) with SGLang's
  rendezvous, each TP rank a member (rank_offset + tp_rank), blocking until the whole world_size has
  joined; it refuses a group name it already holds, as torch does ("has already been created",
  torch/distributed/distributed_c10d.py _new_process_group_helper), until /destroy_weights_update_group;
  /update_weights_from_distributed receives every announced tensor by broadcast on that group and loads
  it; a group it does not hold is 400 (model_runner_components/weight_updater.py; the rules and the
  store layout are tests/sglang_standin_group.py);
- sampling_seed is honoured only with --enable-deterministic-inference (srt/server_args.py);
  --rl-on-policy-target takes only `fsdp` (srt/arg_groups/choices.py RL_ON_POLICY_TARGET_CHOICES) and turns
  deterministic inference on (srt/arg_groups/attention_hook.py handle_deterministic_inference); with it on,
  an --attention-backend outside DETERMINISTIC_ATTENTION_BACKEND_CHOICES stops the server at start with
  the real one's ValueError (srt/arg_groups/overrides.py _deterministic_attention_backend); /server_info
  reports both;
- it is launched the way the client launches SGLang: `python -m tests.sglang_standin --model-path
  DIR --host 127.0.0.1 --port P --tp-size N ...`, and an occupied port makes it exit.

Tests also start it in a background thread: `StandinServer(model_dir).start()`, or as a client's
launch command would (`server_from_command`). Over ~400 lines because this list is its spec, each rule
beside its upstream file; the rules themselves are tests/sglang_rules.py, the engine's additions
tests/sglang_standin_engine.py, and this module keeps only the routes.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch
from aiohttp import web

from actors.engine import GenerateRequest, SamplingParams
from async_april.weights.lora import is_adapter_name
from tests.sglang_api_types import GenerateRequest as ContractRequest
from tests.sglang_api_types import JsonContractError
from tests.sglang_rules import (DETERMINISTIC_ATTENTION_BACKEND_CHOICES, RL_ON_POLICY_TARGET_CHOICES, check_lengths,
                                control_body_error, reported_spans, safe_loads, verify_sampling_params)
from tests.sglang_standin_engine import StandinEngine
from tests.sglang_standin_group import TORCH_DEFAULT_PG_TIMEOUT_S, StandinGroups

SESSION_MSG = "{} must run between begin_weight_update() and end_weight_update()"
FLUSH_REFUSED_MSG = ("Weights were updated, but the cache was not flushed because requests are still running or "
                     "queued. Retract or finish them, then call /flush_cache.")


def make_test_model_dir(out_dir: Path, seed: int = 0) -> Path:
    """A tiny random causal LM dir: the project's builder if present, else a 2-layer Qwen2 (vocab 32, eos 2)."""
    out_dir = Path(out_dir)
    if (out_dir / "config.json").exists():
        return out_dir
    try:
        from async_april.models.tiny import build_random_tiny_model

        return Path(build_random_tiny_model(out_dir, seed=seed, max_position_embeddings=4096))
    except ImportError:
        from transformers import Qwen2Config, Qwen2ForCausalLM

        torch.manual_seed(seed)
        cfg = Qwen2Config(vocab_size=32, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, intermediate_size=128, max_position_embeddings=1024,
                          eos_token_id=2, bos_token_id=1, pad_token_id=0, tie_word_embeddings=True)
        Qwen2ForCausalLM(cfg).save_pretrained(out_dir)
        return out_dir


class StandinState:
    """What the real server keeps across requests: readiness, live rids, pause mode, the weight-update session."""

    def __init__(self, engine: StandinEngine, model_path: str, port: int, tp_size: int, deterministic: bool,
                 overlap: bool, context_len: int, group_timeout_s: float = TORCH_DEFAULT_PG_TIMEOUT_S) -> None:
        self.engine, self.model_path, self.port = engine, model_path, port
        self.tp_size, self.deterministic = tp_size, deterministic
        self.overlap, self.context_len = overlap, context_len
        self.lagged: set[int] = set()
        """Versions whose change was recorded with the overlap scheduler's one-token lag."""
        self.groups = StandinGroups(tp_size, group_timeout_s)
        """Weight-update groups initialised and not destroyed (real gloo members, one per TP rank)."""
        self.ready = False
        self.live: set[str] = set()
        self.paused: str | None = None
        self.unpaused = asyncio.Event()
        self.unpaused.set()
        self.session = False
        self.hold_sessions = threading.Event()
        """Tests clear it to hold /begin_weight_update open (a slow load): only timing, never the protocol."""
        self.hold_sessions.set()
        self.weight_version = str(engine.version)
        self.requests: list[dict] = []
        """Every /generate body received (tests read what the client sent)."""
        self.control: list[tuple[str, dict]] = []
        """Every other POST as (path, body without the serialized tensors), in arrival order."""

    def idle_for_flush(self) -> bool:
        # retract moves running requests to the waiting queue, which a paused flush ignores (scheduler.py).
        return not self.live or self.paused == "retract"


def build_app(state: StandinState, sessions: bool = True) -> web.Application:
    """sessions=False: an older 0.5 server, without /begin_weight_update and /end_weight_update (404) and
    without the session check."""
    engine = state.engine

    def error(status: int, message: str) -> web.Response:
        return web.json_response({"success": False, "message": message}, status=status)

    async def health(_):
        return web.Response(status=200 if state.ready else 503)

    async def model_info(_):
        return web.json_response({"model_path": state.model_path, "is_generation": True,
                                  "weight_version": state.weight_version})

    async def server_info(_):
        # utils/common.py build_server_info: the resolved server args plus the scheduler's limits
        return web.json_response({"model_path": state.model_path, "host": "127.0.0.1", "port": state.port,
                                  "tp_size": state.tp_size, "enable_deterministic_inference": state.deterministic,
                                  "rl_on_policy_target": state.rl_on_policy_target, "attention_backend": state.attention_backend,
                                  "skip_tokenizer_init": True, "disable_overlap_schedule": not state.overlap,
                                  "disable_radix_cache": not engine.radix_cache, "context_length": state.context_len,
                                  "max_req_input_len": state.context_len - 6, "version": "0.5.23-standin"})

    async def generate(req: web.Request):
        try:
            body = await req.json()
            ContractRequest.from_json_value(body)  # api_contract.py: the schema's own 400
        except JsonContractError as e:
            return web.json_response({"error": str(e)}, status=400)
        except ValueError as e:
            return web.json_response({"error": f"invalid JSON: {e}"}, status=400)
        if not state.ready:
            return web.json_response({"error": "server is starting"}, status=503)
        if body.get("input_ids") is None:
            return web.json_response({"error": "--skip-tokenizer-init: send input_ids"}, status=400)
        state.requests.append(body)
        sp = body.get("sampling_params") or {}
        _, why = verify_sampling_params(sp, engine.model.config.vocab_size)
        max_new, why = (0, why) if why else check_lengths(len(body["input_ids"]), sp.get("max_new_tokens", 128),
                                                          state.context_len)
        if why:  # tokenizer_manager.py: a ValueError is a 400 (http_server.py _create_error_response)
            return web.json_response({"error": {"message": why}}, status=400)
        params = SamplingParams(
            max_new_tokens=max_new,
            temperature=sp.get("temperature", 1.0),
            top_p=sp.get("top_p", 1.0),
            top_k=sp.get("top_k", -1),
            stop_token_ids=tuple(sp.get("stop_token_ids") or ()) or ((-1,) if sp.get("ignore_eos") else ()),
            seed=sp.get("sampling_seed") if state.deterministic else None,  # ignored without the flag
        )
        rid = body.get("rid") or f"standin-{id(body)}"
        state.live.add(rid)
        try:
            await state.unpaused.wait()  # a paused server queues new requests
            res = await engine.generate(GenerateRequest(rid, np.asarray(body["input_ids"], np.int64), params))
        finally:
            state.live.discard(rid)
        reason = {"type": res.finish_reason}
        if res.finish_reason == "length":
            reason["length"] = len(res.output_ids)
        elif res.finish_reason == "stop":
            reason["matched"] = int(res.output_ids[-1])
        else:
            reason["message"] = "Abort before prefill" if len(res.output_ids) == 0 else "Abort in waiting queue"
        spans = (reported_spans(res.versions, state.lagged if state.overlap else set())
                 or [{"version": state.weight_version, "start": 0, "end": 0}])
        cached, _ = engine.cached.pop(res.request_id, (0, 0))
        meta = {"id": rid, "finish_reason": reason, "prompt_tokens": res.prompt_tokens,
                "completion_tokens": len(res.output_ids), "cached_tokens": cached,
                "weight_version": spans[-1]["version"], "weight_versions": spans}
        if body.get("return_logprob"):
            meta["output_token_logprobs"] = [[float(lp), int(t), None] for lp, t in zip(res.logprobs, res.output_ids)]
        return web.json_response({"text": "", "output_ids": res.output_ids.tolist(), "meta_info": meta})

    async def abort_request(req: web.Request):
        body = await req.json()
        if body.get("abort_all"):
            await engine.abort_all()
        elif body.get("rid") and body["rid"] in state.live:  # tokenizer_manager: exact live rid, else ignored
            await engine.abort_requests(body["rid"])  # scheduler: every rid it prefixes
        return web.Response(status=200)

    async def pause(req: web.Request):
        body = await req.json()
        mode = body.get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            return web.json_response({"error": f"mode {mode!r}"}, status=400)
        state.paused = mode
        state.unpaused.clear()  # every mode closes the gate until /continue_generation
        if mode == "abort":  # the scheduler is not paused; everything it holds is aborted
            await engine.abort_all()
        else:
            await engine.pause_mode(in_place=mode == "in_place")
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def cont(_):
        state.paused = None
        await engine.resume()
        state.unpaused.set()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def flush(_):
        if not state.idle_for_flush():
            return web.Response(status=400, text="Flush cache failed.\n")
        engine.flush_prefix_cache()  # scheduler.py flush_cache: tree_cache.reset()
        return web.Response(text="Cache flushed.\n")

    async def begin(_):
        if state.session:
            return error(400, "a weight-update session is already open; call end_weight_update() first")
        state.session = True
        await asyncio.to_thread(state.hold_sessions.wait)
        return web.json_response({"success": True, "message": "Success"})

    async def end(_):
        if not state.session:
            return error(400, "no weight-update session is open; call begin_weight_update() first")
        state.session = False
        return web.json_response({"success": True, "message": "Success"})

    async def load(buckets: list[dict], version: str | None, flush_cache: bool) -> web.Response:
        # SGLang's weight routes load full tensors by the model's parameter names; a name it does not know
        # is skipped (srt/models/qwen2.py _legacy_load_weights: `continue`, or a "not found in params_dict"
        # warning), so LoRA factors sent there would be dropped silently. The torch engine behind this
        # stand-in would merge them (its own adapter path): refuse them instead, stricter than SGLang.
        adapters = [n for b in buckets for n in b if is_adapter_name(n)]
        if adapters:
            return error(400, f"LoRA adapter tensors ({adapters[0]!r}, ...) are not parameters of the model; "
                              "SGLang's weight routes take full weights (send merged weights)")
        # Retracted requests get their KV recomputed under the new weights; in place they keep the old KV.
        # Each bucket is applied as it comes: one that fails leaves the earlier ones in place (no rollback).
        old = engine.version
        try:
            for bucket in buckets:
                await engine.load_bucket(bucket, engine.version, keep_cache=state.paused != "retract")
        except (KeyError, ValueError) as e:
            return error(400, str(e))
        if version is not None:
            await engine.load_bucket({}, int(version), keep_cache=True)  # the version only (no weights, no re-prefill)
            state.weight_version = version
            if state.overlap and state.paused != "retract" and int(version) != old:
                state.lagged.add(int(version))  # retract processes the launched batch first (scheduler.py)
        if flush_cache:
            if not state.idle_for_flush():
                return error(400, FLUSH_REFUSED_MSG)
            engine.flush_prefix_cache()
        return web.json_response({"success": True, "message": "Success"})

    async def from_tensor(req: web.Request):
        body = await req.json()
        if sessions and not state.session:
            return error(400, SESSION_MSG.format("update_weights_from_tensor"))
        entries = body.get("serialized_named_tensors")
        if not isinstance(entries, list) or len(entries) != state.tp_size:
            return error(400, f"serialized_named_tensors needs one entry per TP rank ({state.tp_size}), got "
                              f"{len(entries) if isinstance(entries, list) else entries!r}")
        try:  # tp_worker.py deserialize_own_rank -> MultiprocessingSerializer.deserialize (SafeUnpickler)
            bucket = dict(safe_loads(base64.b64decode(entries[0], validate=True)))
        except Exception as e:  # noqa: BLE001 - the server answers any failure to read the payload with 400
            return error(400, f"Failed to deserialize serialized_named_tensors: {e}")
        return await load([bucket], body.get("weight_version"), body.get("flush_cache", True))

    async def from_disk(req: web.Request):
        body = await req.json()
        from safetensors.torch import load_file

        # DefaultModelLoader reads every *.safetensors file of the directory (srt/model_loader/loader.py)
        files = sorted(Path(body["model_path"]).glob("*.safetensors"))
        if not files:
            return error(400, f"no *.safetensors files in {body['model_path']}")
        return await load([load_file(str(f)) for f in files], body.get("weight_version"), body.get("flush_cache", True))

    async def init_group(req: web.Request):
        ok, message = await asyncio.to_thread(state.groups.init, await req.json())  # blocks until all joined
        return web.json_response({"success": ok, "message": message}, status=200 if ok else 400)

    async def destroy_group(req: web.Request):
        ok, message = state.groups.destroy((await req.json()).get("group_name", "weight_update_group"))
        return web.json_response({"success": ok, "message": message}, status=200 if ok else 400)

    async def from_distributed(req: web.Request):
        body = await req.json()
        if sessions and not state.session:
            return error(400, SESSION_MSG.format("update_weights_from_distributed"))
        try:
            bucket = await asyncio.to_thread(state.groups.receive, body.get("group_name", "weight_update_group"),
                                             body["names"], body["dtypes"], body["shapes"])
        except Exception as e:  # noqa: BLE001 - scheduler_components/weight_updater.py: any failure is a 400
            return error(400, f"Failed to receive weights: {e}")
        return await load([bucket], body.get("weight_version"), body.get("flush_cache", True))

    async def set_version(req: web.Request):
        body = await req.json()
        state.weight_version = str(body["new_version"])
        return web.json_response({"success": True, "message": f"Weight version updated to {body['new_version']}"})

    @web.middleware
    async def record_control(req: web.Request, handler):
        if req.method == "POST" and req.path != "/generate":
            try:
                body = await req.json() if req.can_read_body else {}
            except ValueError:
                body = {}
            if isinstance(body, dict):
                body = {k: v for k, v in body.items() if k != "serialized_named_tensors"}
                why = control_body_error(req.path, body)
                if why:  # the struct's own validation, a 400 in ErrorResponse's shape
                    return web.json_response({"object": "error", "message": why, "type": "Bad Request", "code": 400},
                                             status=400)
            state.control.append((req.path, body))
        return await handler(req)

    app = web.Application(client_max_size=1 << 30, middlewares=[record_control])
    app.add_routes([
        web.get("/health", health), web.get("/health_generate", health),
        web.get("/model_info", model_info), web.get("/get_model_info", model_info),
        web.get("/server_info", server_info), web.get("/get_server_info", server_info),
        web.post("/generate", generate), web.post("/abort_request", abort_request),
        web.post("/pause_generation", pause), web.post("/continue_generation", cont),
        web.post("/flush_cache", flush), web.get("/flush_cache", flush),
        web.post("/update_weights_from_disk", from_disk), web.post("/update_weights_from_tensor", from_tensor),
        web.post("/init_weights_update_group", init_group), web.post("/destroy_weights_update_group", destroy_group),
        web.post("/update_weights_from_distributed", from_distributed),
        web.post("/update_weight_version", set_version),
    ])
    if sessions:
        app.add_routes([web.post("/begin_weight_update", begin), web.post("/end_weight_update", end)])
    return app


class StandinServer:
    """Runs the stand-in on 127.0.0.1 (a free port unless given) in a background thread with its own event loop."""

    def __init__(self, model_path: str | Path, port: int = 0, *, tp_size: int = 1, deterministic: bool = True,
                 warmup_s: float = 0.0, weight_version: int = 0, sessions: bool = True,
                 disable_overlap_schedule: bool = False, disable_radix_cache: bool = False,
                 context_length: int | None = None, group_timeout_s: float = TORCH_DEFAULT_PG_TIMEOUT_S,
                 **engine_kwargs) -> None:
        """Defaults as 0.5.23's: the overlap scheduler and the radix cache on; the context length the
        model's config gives (`--context-length` overrides it, srt/configs/model_config.py); the weight
        group's timeout torch's default (tests shorten it: a member that never comes fails in seconds)."""
        self.model_path, self.port, self.sessions = str(model_path), port, sessions
        self.tp_size, self.deterministic, self.warmup_s = tp_size, deterministic, warmup_s
        self.overlap = not disable_overlap_schedule
        self.rl_on_policy_target: str | None = None
        self.attention_backend: str | None = None
        """As launched (`server_from_args`); /server_info reports them."""
        self.engine = StandinEngine(self.model_path, version=weight_version, radix_cache=not disable_radix_cache,
                                    **engine_kwargs)
        if context_length is None:
            from transformers import AutoConfig

            context_length = AutoConfig.from_pretrained(self.model_path).max_position_embeddings
        self.context_length, self.group_timeout_s = context_length, group_timeout_s
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.url = ""

    @property
    def state(self) -> StandinState:
        return self._state

    def start(self, timeout_s: float = 60.0) -> str:
        """Start serving; returns the URL once the socket listens (/health may still be 503)."""
        self._thread = threading.Thread(target=self._main, name="sglang-standin", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s) or self._error:
            raise RuntimeError(f"stand-in server did not start: {self._error!r}")
        return self.url

    def wait_ready(self, timeout_s: float = 60.0) -> "StandinServer":
        """Until /health would answer 200. Loading a model in this process meanwhile is not safe: while
        transformers builds one on the meta device, another thread's from_pretrained breaks."""
        t0 = time.monotonic()
        while not self._state.ready and time.monotonic() - t0 < timeout_s:
            if self._error is not None:
                raise RuntimeError(f"stand-in server failed: {self._error!r}")
            time.sleep(0.05)
        return self

    def _main(self) -> None:
        self.loop = asyncio.new_event_loop()
        try:
            self.loop.run_until_complete(self.serve())
        except BaseException as e:  # noqa: BLE001 - reported by start()
            self._error = e
            self._ready.set()

    async def serve(self) -> None:
        self._state = StandinState(self.engine, self.model_path, self.port, self.tp_size, self.deterministic,
                                   self.overlap, self.context_length, self.group_timeout_s)
        self._state.rl_on_policy_target, self._state.attention_backend = self.rl_on_policy_target, self.attention_backend
        self._runner = web.AppRunner(build_app(self._state, self.sessions))
        await self._runner.setup()
        # SO_REUSEADDR, as uvicorn (SGLang's HTTP server) sets it: a server restarted on its port must
        # bind while the old connections sit in TIME_WAIT. On Linux it never lets two servers listen
        # on one port, so a neighbour on our port is still refused.
        site = web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True)
        await site.start()
        self.port = self._state.port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._stopped = asyncio.Event()
        self._ready.set()
        await self.engine.start()  # loading the model: /health answers 503 meanwhile
        await asyncio.sleep(self.warmup_s)
        self._state.ready = True
        await self._stopped.wait()
        await self._runner.cleanup()
        await self.engine.shutdown()

    def stop(self) -> None:
        if getattr(self, "_stopped", None) is not None:
            self.loop.call_soon_threadsafe(self._stopped.set)
            self._thread.join(30)


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The flags the client passes `sglang.launch_server` (srt/server_args.py names: field names with
    dashes, arg_groups/arg_utils.py); any other flag is an error, as it is there."""
    ap = argparse.ArgumentParser(prog="sglang_standin")
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--tp-size", type=int, default=1)
    ap.add_argument("--mem-fraction-static", type=float)
    ap.add_argument("--skip-tokenizer-init", action="store_true")
    ap.add_argument("--weight-version", default="default")
    ap.add_argument("--enable-deterministic-inference", action="store_true")
    ap.add_argument("--rl-on-policy-target", choices=RL_ON_POLICY_TARGET_CHOICES)
    ap.add_argument("--attention-backend")
    ap.add_argument("--disable-overlap-schedule", action="store_true")  # arg_groups/fields/schedule.py
    ap.add_argument("--disable-radix-cache", action="store_true")  # arg_groups/fields/memory.py
    ap.add_argument("--context-length", type=int)
    ap.add_argument("--warmup-s", type=float, default=0.0, help="stand-in only: seconds /health stays 503 after loading")
    return ap.parse_args(argv)


def server_from_args(a: argparse.Namespace, **engine_kwargs) -> StandinServer:
    version = int(a.weight_version) if a.weight_version.isdigit() else 0
    deterministic = a.enable_deterministic_inference or a.rl_on_policy_target is not None
    if deterministic and a.attention_backend is not None and a.attention_backend not in DETERMINISTIC_ATTENTION_BACKEND_CHOICES:
        raise ValueError(f"Currently only {DETERMINISTIC_ATTENTION_BACKEND_CHOICES} attention backends are supported for "
                         f"deterministic inference, but you explicitly specified '{a.attention_backend}'.")
    srv = StandinServer(a.model_path, a.port, tp_size=a.tp_size, deterministic=deterministic,
                         warmup_s=a.warmup_s, weight_version=version, disable_overlap_schedule=a.disable_overlap_schedule,
                         disable_radix_cache=a.disable_radix_cache, context_length=a.context_length, **engine_kwargs)
    srv.rl_on_policy_target, srv.attention_backend = a.rl_on_policy_target, a.attention_backend
    return srv


def server_from_command(cmd: list[str], **engine_kwargs) -> StandinServer:
    """The stand-in a client's `launch_command` would start (`python -m MODULE FLAGS...`), served in this
    process on a free port, so a test reads its state."""
    a = parse_args(cmd[cmd.index("-m") + 2:])
    a.port = 0
    return server_from_args(a, **engine_kwargs)


def main(argv: list[str] | None = None) -> None:
    """`python -m tests.sglang_standin` with SGLang's flags (see `parse_args`)."""
    a = parse_args(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(1)
    srv = server_from_args(a, max_batch_tokens=4096)
    try:
        asyncio.run(srv.serve())
    except OSError as e:  # the port is taken: the real server exits too
        print(f"stand-in: cannot serve on port {a.port}: {e}", file=sys.stderr, flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
