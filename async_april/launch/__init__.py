"""The launch layer: what wires the core, the actors and the learners into a run.

    controller.py    the training loop (store, generation actors, learner group, weight sync)
    evaluator.py     evaluation during training: one EvalActor, never waited for
    resolve.py       a config against the world (paths, model, data, rewards, resources), for check and train
    cli.py           `async-april` and its commands; eval_command.py (`eval`), export.py (`export`)

Nothing below this layer imports it (tests/test_layers.py).
"""
