"""run.pin_cpus: the core split, pinning every thread of a process, and a pinned run end to end."""

import os
import threading

import pytest

from async_april.hosts.cpu_pinning import cpu_plan, pin_process, process_cores

linux_only = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU affinity is Linux-only")


@linux_only
def test_plan_gives_each_engine_a_core_and_the_rest_to_everything_else():
    plan, why = cpu_plan(2, cores=[0, 1, 2, 3])
    assert why == "" and plan.engine_cores == (2, 3) and plan.other_cores == (0, 1)
    assert plan.engine_core(0) == 2 and plan.engine_core(1) == 3 and plan.engine_core(2) == 2  # replacements reuse cores
    plan, why = cpu_plan(2, cores=[0, 1])
    assert plan is None and "num_actors + 1 = 3 cores" in why and "allows 2" in why


@linux_only
def test_pin_process_pins_threads_that_already_exist():
    before = process_cores()
    seen = {}
    release = threading.Event()

    def worker():
        release.wait()
        seen["cores"] = os.sched_getaffinity(0)

    t = threading.Thread(target=worker)
    t.start()  # exists before pinning: sched_setaffinity(0) alone would leave it unpinned
    target = {min(before)}
    try:
        pin_process(target)
        release.set()
        t.join()
        assert seen["cores"] == target and os.sched_getaffinity(0) == target
    finally:
        pin_process(before)
    assert process_cores() == before


@linux_only
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 cores")
def test_pinned_run_puts_the_engine_alone_on_its_core(tmp_path):
    import ray

    from async_april.config import load_config
    from async_april.launch.controller import train

    before = process_cores()
    cores = sorted(before)
    seen = {}

    def on_step(step, batch, learner, pool):
        if step == 1:
            handle = pool.actors["gen0"]
            seen["engine"] = ray.get(handle.__ray_call__.remote(lambda self: sorted(os.sched_getaffinity(0))))
            seen["engine_threads"] = ray.get(handle.__ray_call__.remote(
                lambda self: sorted({c for t in os.listdir("/proc/self/task") for c in os.sched_getaffinity(int(t))})))
            seen["store"] = ray.get(pool.store.__ray_call__.remote(lambda self: sorted(os.sched_getaffinity(0))))
            seen["driver"] = sorted(os.sched_getaffinity(0))

    cfg = load_config(None, [f"run.dir={tmp_path}/run", "run.steps=2", "run.pin_cpus=true",
                             "rollout.batch_groups=2", "rollout.n_samples=2", "rollout.max_new_tokens=8", "logging.wandb=disabled"])
    train(cfg, on_step=on_step)
    assert seen["engine"] == [cores[-1]] and seen["engine_threads"] == [cores[-1]]  # the engine's thread too
    assert seen["store"] == cores[:-1] and seen["driver"] == cores[:-1]
    assert process_cores() == before  # the caller gets its cores back
