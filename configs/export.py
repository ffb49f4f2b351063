"""Export a distilled draft model to a standalone HF-format directory.

  python experiments/export.py --config.out=/tmp/smollm2-draft
  python experiments/export.py --config.checkpoint=/tmp/specjax_train/draft_model_full \
      --config.out=/tmp/draft-hf --config.dtype=bfloat16

The directory (config.json + model.safetensors, full embedding) loads with
transformers' LlamaForCausalLM or as `--config.draft_model=<out>`.
"""

import ml_collections


def get_config(arg=None):
  del arg
  c = ml_collections.ConfigDict()
  c.model = "smollm2-135m"  # the target the draft model was distilled from
  c.checkpoint = ""  # '' = the shipped distilled draft model
  c.out = ""
  c.dtype = ""  # '' = the target's load dtype (float32)
  c.overwrite = False
  return c
