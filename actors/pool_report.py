"""What the generation actors' pool reports: its figures per step (engine counters summed over every
actor the run has had; actors running, pending and restarted), which actors missed a weight version,
and the lines that explain a failure."""

from __future__ import annotations

from async_april.config import Config

TOTAL_KEYS = ("perf/engine_busy_s", "perf/engine_idle_s", "perf/engine_generated_tokens", "rollout/inflight", "rollout/reward_errors",
              "rollout/reprefill_tokens", "perf/engine_batch_rows", "perf/engine_batch_capacity",
              "perf/engine_kv_slots", "perf/engine_kv_pad_slots")


def engine_totals(last: dict[str, dict[str, float]]) -> dict[str, float]:
    """The sum of each actor's last counters (a dead actor's last figures stay in the sum)."""
    keys = TOTAL_KEYS + tuple(sorted({k for m in last.values() for k in m if k.startswith("agent/")}))
    return {k: float(sum(m.get(k, 0.0) for m in last.values())) for k in keys}


def pool_metrics(restarts: int, alive: int, pending: int) -> dict[str, float]:
    """rollout/actors_alive: running (engine up, generating); rollout/actors: what the pool holds now,
    running or starting (alive + pending: replacements waiting for room, elastic joiners loading)."""
    return {"rollout/actor_restarts": restarts, "rollout/actors_alive": alive,
            "rollout/actors": alive + pending, "rollout/actors_pending": pending}



def not_at_version(actors: dict, version: int) -> list[str]:
    """The actors whose engine does not report `version` (after a failed push); unreachable counts as not."""
    import ray

    refs = {i: a.version.remote() for i, a in actors.items()}
    out = []
    for i, r in refs.items():
        try:
            if ray.get(r, timeout=60) != version:
                out.append(i)
        except Exception:  # noqa: BLE001 - unreachable counts as failed
            out.append(i)
    return out

def no_room(cfg: Config, actor_ids: list[str]) -> str:
    """Why a start stopped: which actors found no room, what each needs, what is free."""
    from async_april.hosts.placement import free_resources_line

    gpus = f", GPU {cfg.rollout.gpus_per_actor:g}" if cfg.rollout.gpus_per_actor else ""
    return (f"{len(actor_ids)} generation actor(s) ({', '.join(actor_ids)}) found no room on the cluster in "
            f"run.placement_timeout_s={cfg.run.placement_timeout_s:g} s (each needs CPU 1{gpus}, "
            f"placement.generation={cfg.placement.generation}; {free_resources_line()}); add or free nodes, "
            "or lower rollout.num_actors")


def startup_notes(handles: list) -> str:
    """What the starting engines say they are waiting for (an SGLang server can take minutes)."""
    import ray

    notes = []
    for h in handles:
        try:
            notes.append(ray.get(h.startup_note.remote(), timeout=5))
        except Exception:  # noqa: BLE001 - a failed start is reported by its own ref
            pass
    return "; ".join(n for n in notes if n)


def short(e: BaseException) -> str:
    """An exception in one line: its type and the last line of its message (Ray's carry a traceback)."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[-1] if text else ''}"[:300]
