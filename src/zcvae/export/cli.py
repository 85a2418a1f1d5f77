"""The command lines of an export: ``zcvae export``, ``zcvae generate`` and ``zcvae encode``.

    zcvae export runs/a --out exports/a [--merge] [--checkpoint runs/a/checkpoints/step_00000300]
    zcvae generate exports/a --x "3 1 4 1" --all-latents
    zcvae generate exports/a --x "3 1 4 1" --z 1 --max-new-tokens 20
    zcvae encode exports/a --x "3 1 4 1" --y "fwd 3 1 4 1 ."

``generate`` and ``encode`` take an export directory or a run directory (``zcvae.export.load``). User
errors print one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch

from zcvae.export.export import export_run
from zcvae.export.load import decode_greedy, encode_xy, load_for_inference

__all__ = ["encode_main", "export_main", "generate_main", "one_line"]


def _common_load_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", help="An export directory (zcvae export) or a run directory.")
    parser.add_argument("--backbone", help="Backbone directory or .gguf file, if it moved since training (same config required).")
    parser.add_argument("--checkpoint", help="Run directories only: this checkpoint instead of the newest.")
    parser.add_argument("--trust-remote-code", action="store_true", help="Let the backbone's own modelling code run.")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda when available).")


def _device(name: str | None) -> str:
    if name is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise ValueError(f"--device {name!r} is not a device (cpu, cuda, cuda:1 ...): {err}") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {name!r}: this torch has no usable CUDA (torch {torch.__version__}); use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"--device {name!r}: only {torch.cuda.device_count()} CUDA device(s) are visible")
    return name


def _run(command: str, fn, argv) -> int:
    from zcvae.console import use_stderr

    use_stderr()  # stdout carries the command's result (generated text, q and p) alone
    try:
        return fn(argv)
    except ValueError as err:
        print(f"zcvae {command}: error: {err}", file=sys.stderr)
        return 2


def export_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="zcvae export", description="Export a run's LoRA adapter, z rows, latent heads and tokenizer.")
    parser.add_argument("run_dir")
    parser.add_argument("--out", required=True, help="Export directory (written to OUT.tmp, then renamed).")
    parser.add_argument("--merge", action="store_true", help="Also write OUT/merged: a full HF model with LoRA and the z rows merged.")
    parser.add_argument("--checkpoint", help="A checkpoint directory (default: the run's newest complete one).")
    parser.add_argument("--overwrite", action="store_true", help="Replace an existing non-empty OUT.")
    parser.add_argument("--backbone", help="Backbone directory or .gguf file, if it moved since training.")
    parser.add_argument("--trust-remote-code", action="store_true", help="Let the backbone's own modelling code run.")

    def go(argv) -> int:
        args = parser.parse_args(argv)
        out = export_run(args.run_dir, out=args.out, checkpoint=args.checkpoint, merge=args.merge, overwrite=args.overwrite,
                         backbone=args.backbone, trust_remote_code=args.trust_remote_code)
        print(f"exported {args.run_dir} to {out}")
        return 0

    return _run("export", go, argv)


def one_line(text: str) -> str:
    """``text`` with backslashes, newlines, carriage returns and tabs escaped (``\\n`` ...).

    Why: ``generate --all-latents`` prints one ``label<TAB>y`` line per latent, and a real LM's y can
    hold newlines (SmolLM2 often starts with one), which would break that format for a reader.
    """
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t")


def _text_ids(model, text: str, *, what: str) -> tuple[int, ...]:
    from zcvae.data.encoding import user_text_reserved_ids

    if not text.strip():
        # training rejects an empty x or y (zcvae.data.jsonl): the model never saw one
        raise ValueError(f"--{what} must not be empty")
    ids = tuple(model.tokenizer(text, add_special_tokens=False)["input_ids"])
    reserved = user_text_reserved_ids(model.tokenizer, model.tokens)
    hit = next((i for i in ids if i in reserved), None)
    if hit is not None:
        raise ValueError(f"--{what} contains the special token {reserved[hit]!r} (id {hit}), which training refuses in user text: {text!r}")
    unk = getattr(model.tokenizer, "unk_token_id", None)
    unk_text = getattr(model.tokenizer, "unk_token", None)
    if unk is not None and unk_text and unk_text in text:
        # the literal marker, not an unknown word: a special token like the others (docs/guide/errors-and-recovery.md, "Refused, and why")
        raise ValueError(f"--{what} contains the special token {unk_text!r} (id {unk}), which is refused in user text: {text!r}")
    if unk is not None and unk in ids:
        print(f"warning: --{what} has {ids.count(unk)} word(s) outside the vocabulary", file=sys.stderr)
    return ids


def _fit_x(model, x_ids: tuple[int, ...], *, y_len: int) -> tuple[int, ...]:
    """x under the training length policy (zcvae.data.encoding.encode_examples): truncated from the left so
    that the z-conditioned sequence with ``y_len`` y tokens fits the run's ``max_length``; says so."""
    from zcvae.data.encoding import TemplateLayout

    max_length = int(model.run_record["config"].get("max_length", 64))
    room = TemplateLayout(model.config.num_z_slots).room_for_x(max_length, y_len)
    if room < 0:
        raise ValueError(f"--y has {y_len} tokens and cannot fit in the run's max_length={max_length}")
    if len(x_ids) > room:
        print(f"warning: --x has {len(x_ids)} tokens; kept its last {room} to fit the run's max_length={max_length} "
              f"(x is truncated from the left, as in training)", file=sys.stderr)
        x_ids = x_ids[len(x_ids) - room:] if room > 0 else ()
    return x_ids


def generate_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="zcvae generate", description="Greedy-decode y for x with a chosen latent.")
    _common_load_args(parser)
    parser.add_argument("--x", required=True, help="The input text.")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--z", help="Discrete: a latent index 0..K-1. Gaussian: D comma-separated floats.")
    which.add_argument("--sample-prior", action="store_true", help="Draw z from p(z|x).")
    which.add_argument("--all-latents", action="store_true", help="Discrete: one line per latent, z=k<TAB>y (backslashes, newlines and tabs in y escaped as \\\\, \\n, \\t).")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="Default: the run's max_length.")
    parser.add_argument("--seed", type=int, default=0, help="Seed of --sample-prior.")

    def go(argv) -> int:
        args = parser.parse_args(argv)
        model = load_for_inference(args.path, backbone=args.backbone, checkpoint=args.checkpoint,
                                   trust_remote_code=args.trust_remote_code, device=_device(args.device))
        cfg = model.run_record["config"]
        max_new = args.max_new_tokens if args.max_new_tokens is not None else int(cfg.get("max_length", 64))
        if max_new < 1:
            raise ValueError(f"--max-new-tokens must be >= 1, got {max_new}")
        # room for at least one y token: the longest x a kept training example can have
        x_ids = _fit_x(model, _text_ids(model, args.x, what="x"), y_len=1)
        generator = torch.Generator().manual_seed(args.seed)
        discrete = model.config.latent_type == "discrete"
        K, D = model.config.num_latents, model.config.latent_dim
        labels: list[str]
        if discrete:
            if args.all_latents:
                index = torch.arange(K)
            elif args.z is not None:
                try:
                    k = int(args.z)
                except ValueError:
                    raise ValueError(f"--z must be a latent index 0..{K - 1}, got {args.z!r}") from None
                if not 0 <= k < K:
                    raise ValueError(f"--z must be in 0..{K - 1}, got {k}")
                index = torch.tensor([k])
            else:
                prior = encode_xy(model, x_ids)["prior"]
                k = int(torch.multinomial(prior, 1, generator=generator)) if args.sample_prior else int(prior.argmax())
                print(f"[z] {'sampled' if args.sample_prior else 'most probable'} z = {k} under p(z|x) = {prior[k]:.4f}", file=sys.stderr)
                index = torch.tensor([k])
            ys = decode_greedy(model, x_ids, latent_index=index, max_new_tokens=max_new)
            labels = [f"z={k}" for k in index.tolist()]
        else:
            if args.all_latents:
                raise ValueError("--all-latents needs a discrete latent; this model's z is Gaussian (use --z or --sample-prior)")
            if args.z is not None:
                try:
                    values = [float(v) for v in args.z.split(",")]
                except ValueError:
                    raise ValueError(f"--z must be {D} comma-separated floats, got {args.z!r}") from None
                if len(values) != D or not all(math.isfinite(v) for v in values):
                    raise ValueError(f"--z must be {D} finite comma-separated floats, got {len(values)}")
                z = torch.tensor([values])
            else:
                prior = encode_xy(model, x_ids)
                eps = torch.randn(prior["prior_mu"].shape, generator=generator) if args.sample_prior else 0.0
                z = (prior["prior_mu"] + prior["prior_sigma"] * eps)[None]
            ys = decode_greedy(model, x_ids, z=z, max_new_tokens=max_new)
            labels = ["z=" + ",".join(f"{v:.3f}" for v in z[0].tolist())]
        for label, y in zip(labels, ys):
            text = model.tokenizer.decode(y, skip_special_tokens=False)
            print(f"{label}\t{one_line(text)}" if len(ys) > 1 else text)
        return 0

    return _run("generate", go, argv)


def encode_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="zcvae encode", description="Print the posterior q(z|x,y) and the prior p(z|x).")
    _common_load_args(parser)
    parser.add_argument("--x", required=True)
    parser.add_argument("--y", required=True)

    def go(argv) -> int:
        args = parser.parse_args(argv)
        model = load_for_inference(args.path, backbone=args.backbone, checkpoint=args.checkpoint,
                                   trust_remote_code=args.trust_remote_code, device=_device(args.device))
        x_ids, y_ids = _text_ids(model, args.x, what="x"), _text_ids(model, args.y, what="y")
        x_ids = _fit_x(model, x_ids, y_len=len(y_ids))
        r = encode_xy(model, x_ids, y_ids)

        def vec(t: torch.Tensor) -> str:
            return " ".join(f"{v:.4f}" for v in t.tolist())

        if "posterior" in r:
            print("q(z|x,y)\t" + "  ".join(f"z={k}:{p:.4f}" for k, p in enumerate(r["posterior"].tolist())))
            print("p(z|x)\t" + "  ".join(f"z={k}:{p:.4f}" for k, p in enumerate(r["prior"].tolist())))
        else:
            print(f"q(z|x,y)\tmu=[{vec(r['mu'])}]\tsigma=[{vec(r['sigma'])}]")
            print(f"p(z|x)\tmu=[{vec(r['prior_mu'])}]\tsigma=[{vec(r['prior_sigma'])}]")
        print(f"KL(q||p)\t{float(r['kl']):.4f} nats")
        return 0

    return _run("encode", go, argv)
