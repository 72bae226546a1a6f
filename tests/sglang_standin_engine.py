"""The STAND-IN server's engine: the built-in torch engine plus what SGLang 0.5.23's scheduler does that
the torch engine does not (paths under sglang/srt/ of the 0.5.23 wheel):

- a prefix (radix) cache, on unless `--disable-radix-cache`: every prefilled input's KV is kept, and a
  later request whose input starts with a kept prefix reuses that KV (at most all but its last token,
  managers/schedule_batch.py `init_next_round_input`) whatever weights computed it, until a flush
  (mem_cache/radix_cache.py `match_prefix`; managers/scheduler.py `flush_cache` resets the tree; a
  weight load with `flush_cache: false` leaves it). Upstream also inserts finished outputs; the stand-in
  keeps inputs only, which is enough for every shared prompt to hit. `reprefill`-free, exact: cached keys
  sit at the same absolute positions, so the numbers are those of a forward over that mixed KV;
- an abort while paused in place only marks running requests (`req.to_finish`, scheduler.py
  `abort_request`): they return after `/continue_generation`, when the next decode step runs; requests
  in the waiting queue are aborted at once;
- a weight load applies each bucket when it arrives (model_runner_components/weight_updater.py
  `update_weights_from_tensor` loads the call's tensors), so a failure part way leaves mixed weights.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np
import torch

from actors.engines.torch_batch import left_padded
from actors.engines.torch_engine import TorchEngine

PREFIX_CACHE_ENTRIES = 512
"""Inputs kept (least recently used dropped first): the stand-in's stand-in for a KV pool's size."""


class StandinEngine(TorchEngine):
    def __init__(self, *args, radix_cache: bool = True, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.radix_cache = radix_cache
        self._prefixes: OrderedDict[tuple[int, ...], tuple[list, np.ndarray]] = OrderedDict()
        """input ids -> (per-layer (keys, values) [1, H, n, D], the weight version of each position)."""
        self._prefix_lock = threading.Lock()
        self.cached: dict[str, tuple[int, int]] = {}
        """request id -> (prefix tokens served from the cache, the oldest weight version among them)."""
        self._defer_aborts = False
        self._to_finish: set[int] = set()

    # ------------------------------------------------------------------ server controls
    def flush_prefix_cache(self) -> None:
        with self._prefix_lock:
            self._prefixes.clear()

    async def pause_mode(self, in_place: bool) -> None:
        """Paused in place, aborts of running requests wait for `resume()`; retracted they do not."""
        self._defer_aborts = in_place
        await self.pause()

    async def load_bucket(self, bucket: dict[str, torch.Tensor], version: int, keep_cache: bool) -> None:
        """One bucket now, over the current weights (the others as they are)."""
        full = dict(self.model.state_dict())
        unknown = sorted(set(bucket) - set(full))
        if unknown:
            raise KeyError(f"weight update: {unknown[0]!r} is not a parameter of the engine's model")
        full.update(bucket)
        await (self.update_weights_in_flight if keep_cache else self.update_weights)([full], version)

    # ------------------------------------------------------------------ worker thread
    def _abort(self, hit) -> None:
        if not (self._paused and self._defer_aborts):
            return super()._abort(hit)
        self._to_finish.update(id(r) for r in self._running if hit(r))
        running = {id(r) for r in self._running}
        super()._abort(lambda r: hit(r) and id(r) not in running)

    def _decode_step(self) -> None:
        if self._to_finish:  # aborts taken while paused in place land at the first step after continue
            marked, self._to_finish = self._to_finish, set()
            super()._abort(lambda r: id(r) in marked)
            if not self._running:
                return
        super()._decode_step()

    def _prefill(self, rows) -> None:
        if not self.radix_cache:
            return super()._prefill(rows)
        cold = []
        for r in rows:
            hit = self._match(np.asarray(r.req.input_ids, np.int64))
            if hit is None:
                cold.append(r)
            else:
                self._prefill_from_prefix(r, *hit)
        if cold:
            self._prefill_and_keep(cold)

    def _match(self, ids: np.ndarray):
        """The longest kept prefix of `ids`, at most len(ids) - 1 tokens: (tokens, kv, versions) or None."""
        best, best_n = None, 0
        with self._prefix_lock:
            for key, (kv, versions) in self._prefixes.items():
                n = min(len(key), len(ids) - 1)
                same = np.flatnonzero(np.asarray(key[:n], np.int64) != ids[:n])
                n = int(same[0]) if len(same) else n
                if n > best_n:
                    best, best_n = (key, kv, versions), n
            if best is None:
                return None
            self._prefixes.move_to_end(best[0])
        return best_n, best[1], best[2]

    def _keep(self, ids: np.ndarray, kv: list, versions: np.ndarray) -> None:
        with self._prefix_lock:
            self._prefixes[tuple(int(t) for t in ids)] = (kv, versions)
            while len(self._prefixes) > PREFIX_CACHE_ENTRIES:
                self._prefixes.popitem(last=False)

    def _prefill_and_keep(self, rows) -> None:
        """The torch engine's batched prefill (TorchEngine._prefill), keeping each row's input KV
        under the current version before the rows are merged and sampled."""
        from transformers import DynamicCache

        seqs = [np.asarray(r.req.input_ids, np.int64) for r in rows]
        ids, mask = left_padded(seqs, self.device)
        for r, x in zip(rows, seqs):
            r.length = len(x)
        cache = DynamicCache(config=self.model.config)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp_min(0),
                         use_cache=True, logits_to_keep=1, **{self._cache_kw: cache})
        self._stats.prefill_tokens += sum(len(x) for x in seqs)
        T = mask.shape[1]
        for i, x in enumerate(seqs):  # left-padded: a row's real positions are its last len(x) columns
            kv = [(layer.keys[i : i + 1, :, T - len(x) :].clone(), layer.values[i : i + 1, :, T - len(x) :].clone())
                  for layer in cache.layers]
            self._keep(x, kv, np.full(len(x), self._version))
        self._merge(rows, cache, mask)
        self._sample_and_finish(out.logits[:, -1, :], len(self._running) - len(rows))

    def _prefill_from_prefix(self, row, n: int, kv: list, versions: np.ndarray) -> None:
        """Prefill only input[n:] on top of the kept KV of input[:n] (computed by whichever weights)."""
        from transformers import DynamicCache

        ids = np.asarray(row.req.input_ids, np.int64)
        cache = DynamicCache(config=self.model.config)
        for layer_idx, (k, v) in enumerate(kv):
            cache.update(k[:, :, :n], v[:, :, :n], layer_idx)
        L = len(ids)
        suffix = torch.as_tensor(ids[n:], device=self.device)[None]
        mask = torch.ones(1, L, dtype=torch.long, device=self.device)
        pos = torch.arange(n, L, device=self.device)[None]
        out = self.model(input_ids=suffix, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1,
                         **{self._cache_kw: cache})
        self._stats.prefill_tokens += L - n
        self.cached[row.req.request_id] = (n, int(versions[:n].min()))
        row.length = L
        kept = [(layer.keys[:, :, :L].clone(), layer.values[:, :, :L].clone()) for layer in cache.layers]
        self._keep(ids, kept, np.concatenate([versions[:n], np.full(L - n, self._version)]))
        self._merge([row], cache, mask)
        self._sample_and_finish(out.logits[:, -1, :], len(self._running) - 1)
