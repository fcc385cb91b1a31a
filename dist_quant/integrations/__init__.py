"""dist-quant inside other frameworks' training loops.

- `hooks.quantize_forward(model, recipe=...)`: a model's forward inside `dq.autocast` without
  touching the loop (Hugging Face, Ray Train, any trainer that calls `model(...)`);
- `torchtitan`: torchtitan 0.3's model-config converter, exact activation checkpointing and a
  Hugging Face state-dict adapter (imports torchtitan: import it only where torchtitan is
  installed).
"""
