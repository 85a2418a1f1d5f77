"""How strongly can the z slot move a backbone's predictions of y? Measured on the backbone before any CVAE
training, with ``<znull>`` in the slot as the stage saw it.

    python bench/z_channel.py BACKBONE_DIR --task add
    python bench/z_channel.py BACKBONE_DIR --data examples/families/late-val.jsonl --num-examples 32

For each example it takes the z-conditioned prompt ``<bos> <x> {x} </x> <z> <znull> </z> <y> {y} </y>`` and
the gradient of log p(y_t | ...) with respect to the slot's input embedding, for every y token t, as a
fraction of the ``<znull>`` row's norm (``sensitivity``: the change in log p per unit of relative change in
the slot row). It prints the mean and the median over examples of

- ``first``: the sensitivity of the first y token (where a marker family names its strategy);
- ``decision``: the sensitivities averaged with weights b_t / sum b_t, b_t = -log p(y_t) of the z-free
  template: how much the slot can move the tokens where the data is uncertain given x, which is where a
  strategy is decided (seed 002), without knowing where that is;
- ``attention``: per layer, the mean attention (over heads) from the position that predicts the first y
  token to the slot.

Why: a discrete z enters the decoder only as a trainable row in this slot. An entangled stage that learned
to ignore the slot (it carried only ``<znull>``) gives the CVAE's decoder a channel it must first open
through LoRA; where that takes longer than the KL delay, q can find the strategies (it did on ``add``) while
decoding ignores z, and the KL then collapses q. docs/results/default.md has the measurements.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))


def _examples(args) -> list:
    from zcvae.data.jsonl import read_jsonl
    from zcvae.data.tasks import make_examples

    if args.data:
        return read_jsonl(args.data)[: args.num_examples]
    return make_examples(args.task, seed=0, split="val", num_examples=args.num_examples)


def _tokens(tokenizer):
    """The template's ids in the backbone's tokenizer (a stage knows every marker but no z_k)."""
    from zcvae.data.encoding import template_tokens

    try:
        return template_tokens(tokenizer, num_latents=0)
    except ValueError as err:
        raise SystemExit(f"the backbone's tokenizer lacks the template markers ({err}): run zcvae pretrain on it first") from None


def channel(model, tokenizer, examples) -> dict:
    """{"first", "decision": per-example sensitivities, "attention": per-layer means}; see the module docstring."""
    import torch

    from zcvae.data.encoding import IGNORE_INDEX, TemplateLayout, encode_examples

    tokens, layout = _tokens(tokenizer), TemplateLayout(1)
    emb = model.get_input_embeddings()
    znull_norm = emb.weight[tokens.znull].norm().item()
    first, decision, attention = [], [], []
    # training's encoder (its skips and x truncation), bounded only by the model's positions
    max_length = getattr(model.config, "max_position_embeddings", None) or 1024
    encoded, _ = encode_examples(examples, tokenizer, tokens, max_length=max_length, num_z_slots=1)
    for enc in encoded:
        slot = layout.z_slot_start(len(enc.x_ids))
        with torch.no_grad():  # b_t: the z-free template's surprisal of each supervised token
            ids, labels = layout.zfree_sequence(enc, tokens)
            logp = model(input_ids=torch.tensor([ids])).logits[0, :-1].log_softmax(-1)
            target = torch.tensor(labels[1:])
            keep = target != IGNORE_INDEX
            b_t = -logp[keep].gather(1, target[keep, None])[:, 0]
        ids, labels = layout.zcond_sequence(enc, tokens, [tokens.znull])
        inputs = emb(torch.tensor([ids])).detach().requires_grad_(True)
        out = model(inputs_embeds=inputs, output_attentions=True)
        logp = out.logits[0, :-1].log_softmax(-1)
        target = torch.tensor(labels[1:])
        where = (target != IGNORE_INDEX).nonzero()[:, 0]
        sens = []
        for i, t in enumerate(where.tolist()):
            (grad,) = torch.autograd.grad(logp[t, target[t]], inputs, retain_graph=i < len(where) - 1)
            sens.append(grad[0, slot].norm().item() / znull_norm)
        sens_t = torch.tensor(sens)
        first.append(sens[0])
        decision.append(float((sens_t * b_t).sum() / b_t.sum().clamp_min(1e-12)))
        if out.attentions is not None and out.attentions[0] is not None:
            attention.append([a[0, :, where[0], slot].mean().item() for a in out.attentions])
    layers = [statistics.fmean(col) for col in zip(*attention)] if attention else []
    return {"first": first, "decision": decision, "attention": layers}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("backbone", help="a Hugging Face directory that knows the template (an entangled stage)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--task", help="a built-in task (its validation split)")
    src.add_argument("--data", help="a JSONL file of x/y rows")
    p.add_argument("--num-examples", type=int, default=64)
    args = p.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.backbone, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(args.backbone, local_files_only=True, use_safetensors=True,
                                                 attn_implementation="eager").eval()
    result = channel(model, tokenizer, _examples(args))
    n = len(result["first"])
    print(f"{args.backbone} on {args.task or args.data} ({n} examples)")
    print(f"  first y token: sensitivity {statistics.fmean(result['first']):.4f} (median {statistics.median(result['first']):.4f})")
    print(f"  b-weighted:    sensitivity {statistics.fmean(result['decision']):.4f} (median {statistics.median(result['decision']):.4f})")
    if result["attention"]:
        print("  attention to the slot from the first y token's position, per layer: "
              + " ".join(f"{a:.3f}" for a in result["attention"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
