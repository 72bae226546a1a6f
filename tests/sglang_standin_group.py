"""The STAND-IN server's weight-update group: a REAL torch.distributed group over gloo, joined exactly as
SGLang 0.5.23 joins its NCCL one, so that torch itself enforces membership and world size.

SGLang (paths under sglang/srt/ of the 0.5.23 wheel):
- `/init_weights_update_group` reaches every TP worker (managers/tp_worker.py), whose
  model_runner_components/weight_updater.py `init_weights_update_group` joins as rank
  `rank_offset + tp_rank` through utils/common.py `init_custom_process_group`: `rendezvous(tcp://
  master_address:master_port, rank, world_size)` (a TCPStore; rank 0, the learner, hosts it), then
  `PrefixStore(group_name, store)` and torch's `_new_process_group_helper(world_size, rank, [], backend,
  store, group_name=group_name)`, with torch's default timeout (`default_pg_timeout`, 30 minutes). The
  call blocks until every member joined; a failure answers 400 "Failed to initialize custom process
  group: ...". A second group of one name is refused by torch (distributed_c10d.py "has already been
  created");
- `/destroy_weights_update_group` pops the group and `torch.distributed.destroy_process_group(pg)`s it
  (local to this member); an unknown name is 400 "The group to be destroyed does not exist.";
- `/update_weights_from_distributed` (inside a begin/end session, scheduler_components/weight_updater.py)
  asserts the group exists ("Group X not in [...]. Please call `init_weights_update_group` first.",
  answered 400 "Failed to receive weights: ..."), allocates each announced tensor and receives it with
  `torch.distributed.broadcast(weight, src=0, group=...)` (receive_weights_from_distributed), then loads
  them all.

What differs, and why it does not loosen anything: torch's helper keys its store under
`{group_name}/{device}/` and registers the group in a per-process table (`_world`), which would forbid two
stand-ins of one test process from holding groups of one name; here the gloo backend is built on that
same key layout without the table (`_group_on_store`), so the wire protocol and torch's own checks
(every member present, the same world size, a broadcast received by every rank) are unchanged. The
backend is gloo whatever the request says: a request for nccl is refused (the stand-in has no GPU), and
the learner joins over gloo when it runs on CPU (async_april/weights/buckets.py `broadcast_backend`).
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import torch

TORCH_DEFAULT_PG_TIMEOUT_S = 1800.0
"""torch.distributed.distributed_c10d.default_pg_timeout: what SGLang's init_custom_process_group uses."""
INIT_OK = "Succeeded to initialize custom process group."
DESTROY_UNKNOWN = "The group to be destroyed does not exist."
ALREADY_CREATED = "The specified group name has already been created, please use a different group name"


def _group_on_store(master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
                    timeout_s: float):
    """One member of `init_custom_process_group(backend="gloo")`: the same TCPStore rendezvous and keys."""
    from torch.distributed.distributed_c10d import PrefixStore, ProcessGroupGloo, rendezvous

    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = next(rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size,
                                              timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)  # init_custom_process_group
    # _new_process_group_helper: PrefixStore(f"{group_name}/"), then one backend under f"{device}/" (gloo's
    # device map is cpu+cuda, one backend registered for both under the first, "cpu/").
    return ProcessGroupGloo(PrefixStore("cpu/", PrefixStore(f"{group_name}/", store)), rank, world_size, timeout)


class StandinGroups:
    """The weight-update groups of one stand-in server: name -> one gloo member per TP rank."""

    def __init__(self, tp_size: int, timeout_s: float = TORCH_DEFAULT_PG_TIMEOUT_S) -> None:
        self.tp_size, self.timeout_s = tp_size, timeout_s
        self.groups: dict[str, list] = {}
        self._lock = threading.Lock()
        self.received: list[tuple[str, int]] = []
        """(group name, world size) of every broadcast received, for tests."""

    def __iter__(self):
        return iter(list(self.groups))

    def __contains__(self, name: object) -> bool:
        return name in self.groups

    def world_size(self, name: str) -> int:
        return self.groups[name][0].size()

    def init(self, body: dict) -> tuple[bool, str]:
        """Blocking (run it off the event loop): every TP rank joins, as each TP worker does."""
        name = body.get("group_name", "weight_update_group")
        if body.get("backend", "nccl") != "gloo":
            return False, f"Failed to initialize custom process group: stand-in server: backend {body.get('backend', 'nccl')!r} needs GPUs; it forms gloo groups (the learner joins over gloo on CPU)."
        with self._lock:
            if name in self.groups:  # torch's refusal, distributed_c10d.py _new_process_group_helper
                return False, f"Failed to initialize custom process group: {ALREADY_CREATED}."
            self.groups[name] = []  # held while joining: a concurrent init of the name is refused too
        offset, world = int(body["rank_offset"]), int(body["world_size"])
        try:
            with ThreadPoolExecutor(self.tp_size) as pool:  # TP workers join concurrently
                members = list(pool.map(lambda k: _group_on_store(body["master_address"], int(body["master_port"]),
                                                                  offset + k, world, name, self.timeout_s),
                                        range(self.tp_size)))
        except Exception as e:  # noqa: BLE001 - weight_updater.py answers any failure with its message
            self.groups.pop(name, None)
            return False, f"Failed to initialize custom process group: {e}."
        self.groups[name] = members
        return True, INIT_OK

    def destroy(self, name: str) -> tuple[bool, str]:
        with self._lock:
            members = self.groups.pop(name, None)
        if not members:
            return False, DESTROY_UNKNOWN
        for pg in members:
            pg.shutdown()  # what destroy_process_group(pg) does to a subgroup (distributed_c10d.py): local
        return True, "Succeeded to destroy custom process group."

    def receive(self, name: str, names: list[str], dtypes: list[str], shapes: list[list[int]]) -> dict[str, torch.Tensor]:
        """Blocking: every TP rank receives every announced tensor by broadcast from rank 0; TP rank 0's copy
        is returned (all ranks hold full tensors here: the stand-in does not shard)."""
        from torch.distributed.distributed_c10d import BroadcastOptions

        if not self.groups.get(name):  # receive_weights_from_distributed's assertion
            raise RuntimeError(f"Group {name} not in {sorted(self.groups)}. Please call `init_weights_update_group` first.")

        def one_rank(pg) -> dict[str, torch.Tensor]:
            out = {}
            for n, dt, shape in zip(names, dtypes, shapes):
                t = torch.empty(shape, dtype=getattr(torch, dt))
                opts = BroadcastOptions()
                opts.rootRank, opts.rootTensor = 0, 0
                pg.broadcast([t], opts).wait()
                out[n] = t
            return out

        members = self.groups[name]
        with ThreadPoolExecutor(len(members)) as pool:
            got = list(pool.map(one_rank, members))
        self.received.append((name, members[0].size()))
        return got[0]
