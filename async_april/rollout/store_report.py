"""What the rollout store reports: every prompt by state (`accounting`, and the check that none is lost
or counted twice) and its figures per step (`metrics`). Read-only views of `RolloutStore`'s state;
the state machine that changes it is async_april/rollout/store.py."""

from __future__ import annotations

from collections import Counter

# `store` below is a RolloutStore, unannotated: importing store.py here, even for typing, would make
# the two modules an import circle (tests/test_layers.py).


def accounting(store) -> dict[str, list[int]]:
    """Every prompt index taken from the dataset, by state; each appears exactly once."""
    in_flight, partial = [], []
    for p, g in store.open_groups.items():
        leased = any(s.uid in held for held in store.leases.values() for s in g.samples)
        has_partial = any(s.uid in store.partials for s in g.samples)
        (partial if has_partial and not leased else in_flight).append(p)
    return {
        "in_flight": sorted(in_flight),
        "partial": sorted(partial),
        "completed": sorted(g.prompt_index for g in store.completed),
        "trained": list(store.trained),
        "filtered": list(store.filtered),
        "dropped": list(store.dropped),
        "skipped": list(store.skipped),
    }


def check_accounting(store) -> None:
    """Raise if any prompt is lost, duplicated or trained twice."""
    states = accounting(store)
    seen = [p for ps in states.values() for p in ps]
    counts = Counter(seen)
    dup = sorted(p for p, c in counts.items() if c > 1)
    missing = sorted(set(range(store.cursor)) - set(counts))
    if dup or missing or len(seen) != store.cursor:
        raise AssertionError(f"rollout accounting broken: duplicated {dup[:10]}, missing {missing[:10]}, cursor {store.cursor}")


def metrics(store) -> dict[str, float]:
    """The store's figures per step: groups by fate, tokens aborted / reused / wasted, buffers, eta."""
    c = store.counters
    return {
        "rollout/groups_started": c.started_groups,
        "rollout/groups_filtered": c.filtered_groups,
        "rollout/groups_dropped_stale": c.dropped_groups,
        "rollout/groups_requeued_stale": c.requeued_groups,
        "rollout/partial_resumed": c.partial_resumed,
        "rollout/aborted_tokens": c.aborted_tokens,
        "rollout/aborted_tokens_reused": c.aborted_tokens_reused,
        "rollout/aborted_tokens_pending": sum(store.aborted_len.values()),
        "rollout/aborted_tokens_discarded": c.aborted_tokens_discarded,
        "rollout/stale_tokens_discarded": c.stale_tokens_discarded,
        "rollout/wasted_tokens": sum(c.wasted_tokens.values()),
        "rollout/wasted_tokens/stale": c.wasted_tokens["stale"],
        "rollout/wasted_tokens/filtered": c.wasted_tokens["filtered"],
        "rollout/groups_dropped_requeue_limit": c.requeue_limit_groups,
        "rollout/partial_buffer": len(store.partials),
        "rollout/completed_waiting": len(store.completed),
        "rollout/leased": sum(len(h) for h in store.leases.values()),
        "rollout/actor_failures": c.actor_failures,
        "rollout/samples_released": c.extra["samples_released"],
        "rollout/store_calls": c.extra["store_calls"],
        "rollout/groups_skipped_bad_step": c.skipped_groups,
        "async/eta": store.max_staleness,
        "async/over_provision": store.over_provision,
        "data/prompt_cursor": store.cursor,
        "data/rejected_long_prompts": store.dataset.rejected_long,
        "data/truncated_long_prompts": store.dataset.truncated_long,
        "data/bad_rows": store.dataset.bad_rows,
    }
