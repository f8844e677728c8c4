"""The trainer's run configuration: one module per concern, each name imported from its owner.

- `sections.py`: the sections' dataclasses `TrainConfig`, `OptimConfig`, `LogConfig`, and
  `JobConfig`, which gathers every section (`model`, `data`, `train`, `optim`, `parallel`,
  `checkpoint`, `log`, `auth`).
- `parallel.py`: `ParallelConfig`, the `parallel` section (layout, pipeline, recompute).
- `checks.py`: the checks across sections (`check_fp8`, `check_experts`, ...) that `JobConfig`
  runs when it is built.
- `load.py`: building a job from defaults, a TOML file and the command line (`load_config`),
  `replace`, `config_help`, and the keys of removed options.
- `flags.py`: the command line: `--config FILE`, `--section.key=value` and Megatron-LM aliases.
- `megatron.py`: the Megatron-LM flags that map onto no key: accepted without effect or refused.
- `megatron_defaults.py`: Megatron-LM's defaults where they differ from meshtrain's, which a
  Megatron-LM command line takes for what it leaves out, and the rule that tells such a line.

The architecture (`ModelConfig`) lives in `meshtrain.services.common.model_config`, the data and
checkpoint sections with their services, and the typed-dataclass and TOML machinery in
`meshtrain.services.common.config`.
"""
