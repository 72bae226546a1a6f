"""Multi-node rollout on real raylets of this machine (tests/multinode.py): throughput with 1, 2 and 4
generation nodes, and the steps/s lost to a node failure.

One cluster: a head (2 CPUs: driver, store, the simulated learner) and 4 worker nodes of 1 CPU each
declaring `gen`, so `placement.generation=resource:gen` with `spread` gives one generation actor per
node. The simulated engine (lognormal lengths, 4096-token cap, 0.03 real s per simulated s, 16
requests in flight per engine, so a batch of 16 x 8 responses takes 8 waves on one engine and 2 on
four) and learners/simulated.py's learner (2 simulated s per step) keep the runs rollout-bound.

  scaling: the sync preset with 1, 2 and 4 actors (= nodes), side by side, `--repeats` rounds
           interleaved; generated tokens/s over the steps after 2 warm-up steps, and scaling
           efficiency = tokens/s(k) / (k x tokens/s(1)).
  failure: the async preset (eta 2) on 4 nodes, `--fail-steps` steps; one generation node is killed
           after step fail_steps/2. Its actor is not replaced (no other node has room: the run goes on
           with 3, the replacement pending), so steps/s in the 10 steps after vs the 10 before
           measures what the lost node cost, detection included.

    nice -n 10 python benchmarks/multinode.py                  # ~6 min on 2 cores
    nice -n 10 python benchmarks/multinode.py --steps 8 --repeats 1 --fail-steps 16

The box has 2 cores: every node's actor, its raylet, the store and the driver share them, so the
ceiling is CPU (Ray's per-request bookkeeping), not the simulated GPUs. Say so next to the figures.
Prints a table and writes benchmarks/results/multinode.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import REPO, mode_config, read_rows, write_json

sys.path.insert(0, str(REPO))

from tests.multinode import LocalCluster  # noqa: E402

SIM = ["rollout.engine=simulated", "rollout.simulated_lengths=lognormal", "rollout.simulated_time_scale=0.03",
       "rollout.max_new_tokens=4096", "rollout.batch_groups=16", "rollout.n_samples=8", "rollout.concurrency=16",
       "run.pin_cpus=false", "placement.generation=resource:gen", "placement.learner=resource:head"]


def train_rows(cfg) -> list[dict]:
    from async_april.launch.controller import train
    from learners.simulated import SimulatedLearner

    train(cfg, learner_factory=lambda *_: SimulatedLearner(step_s=2.0, time_scale=0.03))
    return read_rows(cfg.run_dir)


def tokens_per_s(rows: list[dict], warmup: int = 2) -> float:
    rows = rows[warmup:]
    return sum(r["rollout/generated_tokens"] for r in rows) / sum(r["timing_s/step"] for r in rows)


def bench_scaling(cluster: LocalCluster, tmp: Path, steps: int, repeats: int) -> list[dict]:
    runs: dict[int, list[float]] = {1: [], 2: [], 4: []}
    for _ in range(repeats):
        for k in runs:  # interleaved: a slow phase of the shared box hits every k alike
            cfg = mode_config("sync", tmp, [*SIM, f"run.ray_address={cluster.address}", f"rollout.num_actors={k}",
                                            f"run.steps={steps}"])
            runs[k].append(tokens_per_s(train_rows(cfg)))
    base = statistics.median(runs[1])
    return [{"generation_nodes": k, "tokens_per_s": statistics.median(v), "runs": v,
             "speedup": statistics.median(v) / base, "scaling_efficiency": statistics.median(v) / (k * base)}
            for k, v in runs.items()]


def bench_failure(cluster: LocalCluster, tmp: Path, steps: int) -> dict:
    kill_after = steps // 2
    cfg = mode_config("async", tmp, [*SIM, f"run.ray_address={cluster.address}", "rollout.num_actors=4",
                                     f"run.steps={steps}", "async.max_staleness=2", "rollout.over_provision=3"])
    killed = {}

    def on_step(step, batch, learner, pool):
        if step == kill_after:
            node = cluster.workers[-1]
            killed["t"] = time.monotonic()
            cluster.remove(node)

    from async_april.launch.controller import train
    from learners.simulated import SimulatedLearner

    train(cfg, on_step=on_step, learner_factory=lambda *_: SimulatedLearner(step_s=2.0, time_scale=0.03))
    rows = read_rows(cfg.run_dir)
    window = min(10, kill_after - 1, steps - kill_after)
    before = rows[kill_after - window:kill_after]
    after = rows[kill_after:kill_after + window]

    def steps_per_s(rs):
        return len(rs) / sum(r["timing_s/step"] for r in rs)

    return {"steps": steps, "killed_after_step": kill_after, "window": window,
            "steps_per_s_before": steps_per_s(before), "steps_per_s_after": steps_per_s(after),
            "ratio_after_before": steps_per_s(after) / steps_per_s(before),
            "tokens_per_s_before": tokens_per_s(before, 0), "tokens_per_s_after": tokens_per_s(after, 0),
            "actors_before": before[-1]["rollout/actors_alive"], "actors_after": after[-1]["rollout/actors_alive"],
            "pending_after": after[-1]["rollout/actors_pending"],
            "first_step_after_s": after[0]["timing_s/step"], "staleness_max": max(r["staleness/max"] for r in rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--fail-steps", type=int, default=24)
    args = ap.parse_args()
    import ray

    t0 = time.monotonic()
    cluster = LocalCluster(head={"num_cpus": 2, "resources": {"head": 1}},
                           workers=[{"num_cpus": 1, "resources": {"gen": 1}} for _ in range(4)])
    try:
        with tempfile.TemporaryDirectory(prefix="aa-mn-bench-") as tmp:
            scaling = bench_scaling(cluster, Path(tmp), args.steps, args.repeats)
            failure = bench_failure(cluster, Path(tmp), args.fail_steps)
    finally:
        ray.shutdown()
        cluster.shutdown()
    print(f"\nrollout throughput, simulated engine, 1 actor per node (2-core box, contended; {args.repeats} rounds interleaved)")
    print(f"{'nodes':>5} {'tokens/s':>10} {'speedup':>8} {'efficiency':>10}")
    for s in scaling:
        print(f"{s['generation_nodes']:>5} {s['tokens_per_s']:>10.0f} {s['speedup']:>8.2f} {s['scaling_efficiency']:>10.2f}")
    f = failure
    print(f"\nnode failure after step {f['killed_after_step']} of {f['steps']} (4 -> {f['actors_after']} actors, "
          f"{f['pending_after']} pending): steps/s {f['steps_per_s_before']:.3f} before, {f['steps_per_s_after']:.3f} "
          f"after ({f['ratio_after_before']:.2f}x) over {f['window']} steps each; first step after the kill {f['first_step_after_s']:.1f} s")
    write_json("multinode.json", {"scaling": scaling, "failure": failure, "args": vars(args),
                                  "wall_s": time.monotonic() - t0, "note": "2-core box shared with other work: contended"})


if __name__ == "__main__":
    main()
