#!/usr/bin/env python3
"""What TRL makes of a recipe: `trl grpo`'s own parser (TrlParser over GRPOScriptArguments,
GRPOConfig, ModelConfig, DatasetMixtureConfig) reads the YAML, fills every default and runs
GRPOConfig's checks; the resolved fields are printed as one JSON object. `grpo-cli import-trl`'s
test compares them with the translated config's values (TRL_PYTHON).

    pip install trl==1.16.0
    python3 scripts/trl_recipe_values.py recipe.yaml
"""
import dataclasses
import json
import sys

from trl import DatasetMixtureConfig, GRPOConfig, ModelConfig, TrlParser
from trl.scripts.grpo import GRPOScriptArguments


def main():
    parser = TrlParser((GRPOScriptArguments, GRPOConfig, ModelConfig, DatasetMixtureConfig))
    # On a machine without a GPU, TrainingArguments refuses bf16 unless it trains on the CPU.
    args = ["--config", sys.argv[1], "--use_cpu", "true"]
    script, training, model, _ = parser.parse_args_and_config(args=args)
    out = {}
    for obj in (script, training, model):
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            if hasattr(v, "value"):  # enums (lr_scheduler_type, save_strategy, ...)
                v = v.value
            try:
                json.dumps(v)
            except TypeError:
                v = str(v)
            out[f.name] = v
    print(json.dumps(out))


if __name__ == "__main__":
    main()
