#!/usr/bin/env python3
"""What TRL makes of a recipe: the parser of `trl grpo` (TrlParser over GRPOScriptArguments,
GRPOConfig, ModelConfig, DatasetMixtureConfig), of `trl rloo` (RLOOConfig), `trl sft`
(SFTConfig), `trl dpo` (DPOConfig), `trl kto` (KTOConfig) or `trl reward`
(RewardConfig) reads the YAML, fills every default and runs the config's checks; the resolved
fields are printed as one JSON object. `grpo-cli import-trl`'s test compares them with the
translated config's values (TRL_PYTHON).

    pip install trl==1.16.0
    python3 scripts/trl_recipe_values.py [--trainer grpo|rloo|sft|dpo|kto|reward] recipe.yaml
"""
import dataclasses
import json
import sys

from trl import DPOConfig, DatasetMixtureConfig, GRPOConfig, ModelConfig, ScriptArguments, SFTConfig, TrlParser
from trl import KTOConfig, RewardConfig, RLOOConfig
from trl.scripts.grpo import GRPOScriptArguments
from trl.scripts.rloo import RLOOScriptArguments


def main():
    trainer, recipe = ("grpo", sys.argv[1]) if sys.argv[1] != "--trainer" else (sys.argv[2], sys.argv[3])
    script_type, config_type = {
        "grpo": (GRPOScriptArguments, GRPOConfig),
        "rloo": (RLOOScriptArguments, RLOOConfig),
        "sft": (ScriptArguments, SFTConfig),
        "dpo": (ScriptArguments, DPOConfig),
        "kto": (ScriptArguments, KTOConfig),
        "reward": (ScriptArguments, RewardConfig),
    }[trainer]
    parser = TrlParser((script_type, config_type, ModelConfig, DatasetMixtureConfig))
    # On a machine without a GPU, TrainingArguments refuses bf16 unless it trains on the CPU.
    args = ["--config", recipe, "--use_cpu", "true"]
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
