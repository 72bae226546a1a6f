"""STAND-IN for an SGLang 0.5.x HTTP server, for CPU tests. It is NOT SGLang.

A real SGLang server needs a GPU. This loopback aiohttp server speaks the same
request/response JSON for the endpoints `actors/engines/sglang_engine.py`
uses, backed by the built-in TORCH engine, so outputs are real model samples
with exact logprobs:

  /health, /get_model_info, /generate (input_ids, sampling_params, return_logprob, rid),
  /abort_request ({abort_all} or {rid}: prefix match, as SGLang does),
  /pause_generation ({mode}: abort | retract | in_place), /continue_generation, /flush_cache,
  /update_weights_from_disk, /update_weights_from_tensor (buckets accumulate until the one
  carrying weight_version), /init_weights_update_group and /update_weights_from_distributed
  (answer success=false: NCCL needs GPUs).

Run standalone: `python tests/sglang_standin.py MODEL_DIR [PORT]`; tests start it
in a background thread with `StandinServer(model_dir).start()`.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from pathlib import Path

import numpy as np
import torch
from aiohttp import web

from actors.engine import GenerateRequest, SamplingParams
from actors.engines.sglang_engine import deserialize_named_tensors
from actors.engines.torch_engine import TorchEngine


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


def build_app(engine: TorchEngine, model_path: str) -> web.Application:
    pending_buckets: list[dict] = []

    async def health(_):
        return web.Response(text="")

    async def model_info(_):
        return web.json_response({"model_path": model_path, "is_generation": True, "weight_version": str(engine.version)})

    async def generate(req: web.Request):
        body = await req.json()
        sp = body.get("sampling_params") or {}
        if "input_ids" not in body:
            return web.json_response({"error": "stand-in needs input_ids (no tokenizer)"}, status=400)
        params = SamplingParams(
            max_new_tokens=int(sp.get("max_new_tokens", 128)),
            temperature=float(sp.get("temperature", 1.0)),
            top_p=float(sp.get("top_p", 1.0)),
            top_k=int(sp.get("top_k", -1)),
            stop_token_ids=tuple(sp.get("stop_token_ids") or ()) or ((-1,) if sp.get("ignore_eos") else ()),
            seed=sp.get("sampling_seed"),
        )
        rid = body.get("rid") or f"standin-{id(body)}#"
        res = await engine.generate(GenerateRequest(rid, np.asarray(body["input_ids"], np.int64), params))
        reason = {"type": res.finish_reason}
        if res.finish_reason == "length":
            reason["length"] = len(res.output_ids)
        elif res.finish_reason == "stop":
            reason["matched"] = int(res.output_ids[-1])
        else:
            reason["message"] = "Abort before prefill" if len(res.output_ids) == 0 else "Abort in waiting queue"
        lps = body.get("return_logprob")
        meta = {
            "id": rid, "finish_reason": reason, "prompt_tokens": res.prompt_tokens,
            "completion_tokens": len(res.output_ids), "cached_tokens": 0,
            "weight_version": str(int(res.versions[-1]) if len(res.versions) else engine.version),
        }
        if lps:
            meta["output_token_logprobs"] = [[float(lp), int(t), None] for lp, t in zip(res.logprobs, res.output_ids)]
        return web.json_response({"text": "", "output_ids": res.output_ids.tolist(), "meta_info": meta})

    async def abort_request(req: web.Request):
        body = await req.json()
        if body.get("abort_all"):
            await engine.abort_all()
        else:
            await engine.abort_requests(body.get("rid", ""))
        return web.Response(text="")

    async def pause(req: web.Request):
        body = await req.json() if req.can_read_body else {}
        if body.get("mode", "abort") == "abort":
            await engine.abort_all()
        await engine.pause()
        return web.json_response({"success": True})

    async def cont(_):
        await engine.resume()
        return web.json_response({"success": True})

    async def flush(_):
        return web.Response(text="Cache flushed.")

    async def from_disk(req: web.Request):
        body = await req.json()
        from transformers import AutoModelForCausalLM

        sd = AutoModelForCausalLM.from_pretrained(body["model_path"], dtype=torch.float32).state_dict()
        try:
            await engine.update_weights([sd], int(body.get("weight_version") or engine.version + 1))
        except (KeyError, ValueError) as e:
            return web.json_response({"success": False, "message": str(e)})
        return web.json_response({"success": True, "message": "Succeeded to update model weights."})

    async def from_tensor(req: web.Request):
        body = await req.json()
        pending_buckets.append(dict(deserialize_named_tensors(body["serialized_named_tensors"][0])))
        if body.get("weight_version") is not None:
            buckets = list(pending_buckets)
            pending_buckets.clear()
            try:
                await engine.update_weights(buckets, int(body["weight_version"]))
            except (KeyError, ValueError) as e:
                return web.json_response({"success": False, "message": str(e)})
        return web.json_response({"success": True, "message": "Succeeded to update model weights."})

    async def no_nccl(_):
        return web.json_response({"success": False, "message": "stand-in server: NCCL weight updates need GPUs"})

    app = web.Application(client_max_size=1 << 30)
    app.add_routes([
        web.get("/health", health), web.get("/get_model_info", model_info), web.post("/generate", generate),
        web.post("/abort_request", abort_request), web.post("/pause_generation", pause),
        web.post("/continue_generation", cont), web.post("/flush_cache", flush),
        web.post("/update_weights_from_disk", from_disk), web.post("/update_weights_from_tensor", from_tensor),
        web.post("/init_weights_update_group", no_nccl), web.post("/update_weights_from_distributed", no_nccl),
    ])
    return app


class StandinServer:
    """Runs the stand-in on 127.0.0.1 (a free port) in a background thread with its own event loop."""

    def __init__(self, model_path: str | Path, port: int = 0, **engine_kwargs) -> None:
        self.model_path, self.port = str(model_path), port
        self.engine = TorchEngine(self.model_path, **engine_kwargs)
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.url = ""

    def start(self, timeout_s: float = 60.0) -> str:
        self._thread = threading.Thread(target=self._main, name="sglang-standin", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s) or self._error:
            raise RuntimeError(f"stand-in server did not start: {self._error!r}")
        return self.url

    def _main(self) -> None:
        self.loop = asyncio.new_event_loop()
        try:
            self.loop.run_until_complete(self._serve())
        except BaseException as e:  # noqa: BLE001 - reported by start()
            self._error = e
            self._ready.set()

    async def _serve(self) -> None:
        await self.engine.start()
        self._runner = web.AppRunner(build_app(self.engine, self.model_path))
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._stopped = asyncio.Event()
        self._ready.set()
        await self._stopped.wait()
        await self._runner.cleanup()
        await self.engine.shutdown()

    def stop(self) -> None:
        if getattr(self, "_stopped", None) is not None:
            self.loop.call_soon_threadsafe(self._stopped.set)
            self._thread.join(30)


if __name__ == "__main__":
    srv = StandinServer(sys.argv[1], port=int(sys.argv[2]) if len(sys.argv) > 2 else 30000)
    print("SGLang stand-in (torch engine) at", srv.start(), flush=True)
    threading.Event().wait()
