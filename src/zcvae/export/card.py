"""The README.md model card of an export directory (zcvae.export.export.export_run writes it).

Pure text: the run's resolved config, c_base, final metrics and how to load the export.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def model_card(*, cfg, record: dict[str, Any], meta: dict[str, Any], metrics_step: int | None, metrics: dict[str, float]) -> str:
    c_base = record.get("c_base") or {}
    mode = cfg.objective.reconstruction_loss_token_aggregation_mode
    unit = "nats/sequence" if mode == "sum" else "nats/token"  # token: per token of the whole validation set
    if cfg.model.latent_type == "discrete":
        latent = (f"a discrete latent with K = {cfg.model.num_latents} values: z is one of the learned tokens "
                  f"{', '.join(f'`<z_{k}>`' for k in range(min(cfg.model.num_latents, 8)))}{' ...' if cfg.model.num_latents > 8 else ''} "
                  f"(ids {meta['z_token_ids']}) in the z slot, trained with the exact expectation over all K")
    else:
        latent = (f"a Gaussian latent of dimension {cfg.model.latent_dim}, projected to {cfg.model.num_z_slots} soft-prompt offsets "
                  f"added to the `<znull>` slot embedding; prior {'learned p(z|x)' if cfg.model.learned_prior else 'N(0, I)'}")
    weights = {k: v for k, v in cfg.to_dict().items() if k.endswith("reconstruction_weight") and v}
    rows = "\n".join(f"| {k} | {v:.4g} |" for k, v in sorted(metrics.items())) or "| (no evaluation recorded) | |"
    c_base_line = (f"{c_base.get('value')} {unit} (mode `{c_base.get('mode')}`, source `{c_base.get('source')}`, "
                   f"fingerprint `{str(c_base.get('fingerprint'))[:16]}`)") if c_base else "not recorded"
    return f"""# zcvae export: {cfg.run.run_name or Path(meta['run_dir']).name}

A conditional VAE built by zcvae on the causal LM `{meta['backbone']}`.
The decoder reads

    <bos> <x> {{x}} </x> <z> {{z}} </z> <y> {{y}} </y> <eos>

and z is {latent}. A router reads the adapted model's final hidden state at `</y>` for the posterior
q(z|x,y) and at `</x>` for the prior p(z|x).

| | |
|---|---|
| latent | {cfg.model.latent_type}, {'K = ' + str(cfg.model.num_latents) if cfg.model.latent_type == 'discrete' else 'D = ' + str(cfg.model.latent_dim)} |
| reconstruction_loss_token_aggregation_mode | `{mode}` |
| reconstruction weights | {', '.join(f'{k} = {v:g}' for k, v in weights.items())} |
| c_base (z-free reference scale) | {c_base_line} |
| KL weight, schedule | {cfg.objective.kl_weight:g}, {cfg.objective.kl_schedule} |
| LoRA | r = {cfg.model.lora_r}, alpha = {cfg.model.lora_alpha} |
| checkpoint | step {meta['step']} of {cfg.optimization.max_steps} |

## Final metrics{f' (evaluation at step {metrics_step})' if metrics_step is not None else ''}

| metric | value |
|---|---|
{rows}

## Use it

With zcvae:

```bash
zcvae generate THIS_DIR --x "..." --all-latents       # one greedy y per latent
zcvae encode THIS_DIR --x "..." --y "..."             # q(z|x,y) and p(z|x)
```

```python
from zcvae.export.load import load_for_inference
model = load_for_inference("THIS_DIR")                # ZCVAE: tokenizer, router heads, adapter
```

With peft alone (the adapter and the z rows; the router heads are in `latent_heads.safetensors`).
The base must be the backbone resized to this tokenizer, with the rows of the tokens zcvae added
(template markers, z tokens) as trained:

```python
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

tokenizer = AutoTokenizer.from_pretrained("THIS_DIR")
base = AutoModelForCausalLM.from_pretrained("{meta['backbone']}")
if len(tokenizer) > base.get_input_embeddings().weight.shape[0]:
    base.resize_token_embeddings(len(tokenizer))
heads = load_file("THIS_DIR/latent_heads.safetensors")
ids = heads["added_token_ids"]
with torch.no_grad():  # without this the added rows keep resize_token_embeddings' random values
    base.get_input_embeddings().weight[ids] = heads["added_rows.input_embeddings"]
    if "added_rows.output_embeddings" in heads:
        base.get_output_embeddings().weight[ids] = heads["added_rows.output_embeddings"]
model = PeftModel.from_pretrained(base, "THIS_DIR")
```

(`zcvae.export.load.prepare_base(backbone, "THIS_DIR")` does the same.){' A merged full model (LoRA merged, z rows in the embedding) is in `merged/`: `AutoModelForCausalLM.from_pretrained("THIS_DIR/merged")`.' if meta.get('merged') else ''}

Files: `adapter_config.json` and `adapter_model.safetensors` (peft LoRA + the K z rows as peft's
trainable-token delta; no full embedding matrix), `latent_heads.safetensors` (z rows, router/prior
heads and their standardisation buffers, soft-prompt projection, added-token rows), the tokenizer,
`run_config.json` (the resolved training configuration and c_base), `zcvae_export.json`.
"""
