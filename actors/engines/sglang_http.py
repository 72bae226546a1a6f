"""HTTP to an SGLang server: control POSTs with retries and backoff on connection errors, JSON GETs;
every non-200 answer is an SGLangError naming the route (the base of actors/engines/sglang_engine.py)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp

from actors.engines.sglang_wire import SGLangError, json_object


class SGLangHTTP:
    """Needs `url`, `retries`, `backoff_s` and an open `_session` (aiohttp.ClientSession)."""

    url: str | None
    retries: int
    backoff_s: float
    _session: aiohttp.ClientSession | None

    async def _get_json(self, *paths: str) -> dict | None:
        """The first of `paths` that answers 200 with a JSON object; None when none exists (404)."""
        for path in paths:
            async with self._session.get(self.url + path) as r:
                if r.status == 404:
                    continue
                text = await r.text()
                if r.status != 200:
                    raise SGLangError(f"GET {path} -> HTTP {r.status}: {text[:500]}")
                return json_object(text, f"GET {path}")
        return None

    async def _post(self, path: str, payload: dict | None = None, *, retry: bool = True) -> Any:
        """POST and return the parsed JSON (or the text of a non-JSON 200); SGLangError on any other status."""
        status, text = await self._post_raw(path, payload, retry=retry)
        if status != 200:
            raise SGLangError(f"POST {path} -> HTTP {status}: {text[:500]}")
        try:
            return json.loads(text)
        except ValueError:
            return text

    async def _post_ok(self, path: str, payload: dict | None = None) -> dict:
        """POST a control call; its JSON reply must not say success=false."""
        out = await self._post(path, payload)
        if isinstance(out, dict) and out.get("success") is False:
            raise SGLangError(f"POST {path} failed on the server: {out.get('message', out)}")
        return out if isinstance(out, dict) else {}

    async def _post_raw(self, path: str, payload: dict | None, *, retry: bool = True) -> tuple[int, str]:
        if self._session is None:
            raise RuntimeError(f"SGLangEngine.start() must be awaited before {path}")
        attempts = self.retries + 1 if retry else 1
        for attempt in range(attempts):
            try:
                async with self._session.post(self.url + path, json=payload or {}) as r:
                    return r.status, await r.text()
            except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as e:
                if attempt + 1 >= attempts:
                    raise SGLangError(f"POST {self.url}{path} failed after {attempts} attempts: {type(e).__name__}: {e}") from e
                await asyncio.sleep(self.backoff_s * 2**attempt)
        raise AssertionError("unreachable")
