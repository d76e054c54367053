"""Around a run, not inside a step: `train.py` and `eval.py` use these and hand the step what it needs.

- `config.py`: train.py's flags, presets and run configs merged, each value checked before any work.
- `launch.py`: a run's setup and end (the policy, the sampler's copy, the data, the reward
  function, checkpoints and resume, the step's log lines, final/).
- `checkpoints.py`: models read and written (directory, hub id, GGUF, the bundled model).
- `memory_plan.py`: each rank's memory, term by term, before the weights load (`--plan-only`).
- `metrics.py`: step 6, the step's metrics summed over ranks; the warnings of a run that learns nothing.
- `evaluation.py`: pass@1, avg@k, pass@k, maj@k, for eval.py and training's held-out evaluation.
- `runs.py`, `tracking.py`: the run directory (logs, atomic checkpoints, plots); `--report-to`.
- `distributed.py`, `sharding.py`: ranks under torchrun, sums reduced in one call; `--fsdp`.
"""
