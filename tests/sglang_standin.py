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
- sampling_seed is honoured only with --enable-deterministic-inference (srt/server_args.py);
- it is launched the way the client launches SGLang: `python -m tests.sglang_standin --model-path
  DIR --host 127.0.0.1 --port P --tp-size N ...`, and an occupied port makes it exit.

Tests also start it in a background thread: `StandinServer(model_dir).start()`.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import threading
from pathlib import Path

import numpy as np
import torch
from aiohttp import web

from actors.engine import GenerateRequest, SamplingParams
from async_april.lora_weights import is_adapter_name
from actors.engines.sglang_wire import deserialize_named_tensors
from actors.engines.torch_engine import TorchEngine
from tests.sglang_api_types import GenerateRequest as ContractRequest
from tests.sglang_api_types import JsonContractError

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


def spans_of(versions: np.ndarray) -> list[dict]:
    """Per-token versions as 0.5.23's weight_versions spans (srt/utils/weight_versions.py)."""
    spans: list[dict] = []
    for i, v in enumerate(versions.tolist()):
        if spans and spans[-1]["version"] == str(v):
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": str(v), "start": i, "end": i + 1})
    return spans


class StandinState:
    """What the real server keeps across requests: readiness, live rids, pause mode, the weight-update session."""

    def __init__(self, engine: TorchEngine, model_path: str, port: int, tp_size: int, deterministic: bool) -> None:
        self.engine, self.model_path, self.port = engine, model_path, port
        self.tp_size, self.deterministic = tp_size, deterministic
        self.ready = False
        self.live: set[str] = set()
        self.paused: str | None = None
        self.unpaused = asyncio.Event()
        self.unpaused.set()
        self.session = False
        self.pending_buckets: list[dict] = []
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
        return web.json_response({"model_path": state.model_path, "host": "127.0.0.1", "port": state.port,
                                  "tp_size": state.tp_size, "enable_deterministic_inference": state.deterministic,
                                  "skip_tokenizer_init": True, "version": "0.5.23-standin"})

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
        params = SamplingParams(
            max_new_tokens=sp.get("max_new_tokens", 128),
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
        spans = spans_of(res.versions) or [{"version": state.weight_version, "start": 0, "end": 0}]
        meta = {"id": rid, "finish_reason": reason, "prompt_tokens": res.prompt_tokens,
                "completion_tokens": len(res.output_ids), "cached_tokens": 0,
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
        if mode == "abort":
            await engine.abort_all()
        else:
            state.paused = mode
            state.unpaused.clear()
            await engine.pause()
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def cont(_):
        state.paused = None
        await engine.resume()
        state.unpaused.set()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def flush(_):
        if not state.idle_for_flush():
            return web.Response(status=400, text="Flush cache failed.\n")
        return web.Response(text="Cache flushed.\n")

    async def begin(_):
        if state.session:
            return error(400, "a weight-update session is already open; call end_weight_update() first")
        state.session = True
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
        update = engine.update_weights if state.paused == "retract" else engine.update_weights_in_flight
        try:
            await update(buckets, int(version) if version is not None else engine.version)
        except (KeyError, ValueError) as e:
            return error(400, str(e))
        if version is not None:
            state.weight_version = version
        if flush_cache and not state.idle_for_flush():
            return error(400, FLUSH_REFUSED_MSG)
        return web.json_response({"success": True, "message": "Success"})

    async def from_tensor(req: web.Request):
        body = await req.json()
        if sessions and not state.session:
            return error(400, SESSION_MSG.format("update_weights_from_tensor"))
        entries = body.get("serialized_named_tensors")
        if not isinstance(entries, list) or len(entries) != state.tp_size:
            return error(400, f"serialized_named_tensors needs one entry per TP rank ({state.tp_size}), got "
                              f"{len(entries) if isinstance(entries, list) else entries!r}")
        state.pending_buckets.append(dict(deserialize_named_tensors(entries[0])))
        if body.get("weight_version") is None and not body.get("flush_cache", True):
            return web.json_response({"success": True, "message": "Success"})  # the torch engine loads whole sets
        buckets, state.pending_buckets = state.pending_buckets, []
        return await load(buckets, body.get("weight_version"), body.get("flush_cache", True))

    async def from_disk(req: web.Request):
        body = await req.json()
        from safetensors.torch import load_file

        # DefaultModelLoader reads every *.safetensors file of the directory (srt/model_loader/loader.py)
        files = sorted(Path(body["model_path"]).glob("*.safetensors"))
        if not files:
            return error(400, f"no *.safetensors files in {body['model_path']}")
        return await load([load_file(str(f)) for f in files], body.get("weight_version"), body.get("flush_cache", True))

    async def init_group(_):
        return error(400, "stand-in server: NCCL weight updates need GPUs")

    async def from_distributed(_):
        if sessions and not state.session:
            return error(400, SESSION_MSG.format("update_weights_from_distributed"))
        return error(400, "stand-in server: NCCL weight updates need GPUs")

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
        web.post("/init_weights_update_group", init_group), web.post("/update_weights_from_distributed", from_distributed),
        web.post("/update_weight_version", set_version),
    ])
    if sessions:
        app.add_routes([web.post("/begin_weight_update", begin), web.post("/end_weight_update", end)])
    return app


class StandinServer:
    """Runs the stand-in on 127.0.0.1 (a free port unless given) in a background thread with its own event loop."""

    def __init__(self, model_path: str | Path, port: int = 0, *, tp_size: int = 1, deterministic: bool = True,
                 warmup_s: float = 0.0, weight_version: int = 0, sessions: bool = True, **engine_kwargs) -> None:
        self.model_path, self.port, self.sessions = str(model_path), port, sessions
        self.tp_size, self.deterministic, self.warmup_s = tp_size, deterministic, warmup_s
        self.engine = TorchEngine(self.model_path, version=weight_version, **engine_kwargs)
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

    def _main(self) -> None:
        self.loop = asyncio.new_event_loop()
        try:
            self.loop.run_until_complete(self.serve())
        except BaseException as e:  # noqa: BLE001 - reported by start()
            self._error = e
            self._ready.set()

    async def serve(self) -> None:
        self._state = StandinState(self.engine, self.model_path, self.port, self.tp_size, self.deterministic)
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


def main(argv: list[str] | None = None) -> None:
    """`python -m tests.sglang_standin` with the flags the client passes `sglang.launch_server`
    (srt/server_args.py names); any other flag is an error, as it is there."""
    ap = argparse.ArgumentParser(prog="sglang_standin")
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--tp-size", type=int, default=1)
    ap.add_argument("--mem-fraction-static", type=float)
    ap.add_argument("--skip-tokenizer-init", action="store_true")
    ap.add_argument("--weight-version", default="default")
    ap.add_argument("--enable-deterministic-inference", action="store_true")
    ap.add_argument("--warmup-s", type=float, default=0.0, help="stand-in only: seconds /health stays 503 after loading")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    version = int(a.weight_version) if a.weight_version.isdigit() else 0
    srv = StandinServer(a.model_path, a.port, tp_size=a.tp_size, deterministic=a.enable_deterministic_inference,
                        warmup_s=a.warmup_s, weight_version=version, max_batch_tokens=4096)
    try:
        asyncio.run(srv.serve())
    except OSError as e:  # the port is taken: the real server exits too
        print(f"stand-in: cannot serve on port {a.port}: {e}", file=sys.stderr, flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
