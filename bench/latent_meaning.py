"""What does each discrete latent write? Decode every latent for each x of a labelled JSONL file, and count, per
latent, whose y it wrote: the strategy whose row for the same x has that y.

    python bench/latent_meaning.py RUN_OR_EXPORT_DIR examples/families/ambiguous-val.jsonl
    python bench/latent_meaning.py exports/a val.jsonl --max-inputs 50

A latent that means one strategy writes that strategy's y for every x (one column of its row). A latent
that writes one strategy's y for some x and another's for others has learned a per-x assignment of the
outputs, which the likelihood cannot tell from the strategy (docs/results/default.md, on `ambiguous`). Best
on a file that holds each x under every strategy (as the example families' val files do); a decode that
matches no row of its x counts as ``other``, and one that matches several (x a palindrome under copy and
reverse) as ``tie``.

Also prints, for each gold strategy, where argmax q(z|x,y) sends its rows and whether that latent's decode
is y: the posterior may be right about which latent writes y while disagreeing with the labels.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter, defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))

OTHER, TIE = "other", "tie"


def _norm(text: str) -> str:
    return " ".join(text.split())


def latent_writes(rows: list, decodes: dict[str, list[str]]) -> dict[int, Counter]:
    """{latent k: Counter(strategy -> number of x for which k decoded that strategy's y)}.

    ``rows``: labelled examples (zcvae.data.Example); ``decodes``: x -> the decoded y of each latent, in latent order."""
    ys_by_x: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for r in rows:
        ys_by_x[r.x][_norm(r.y)].add(r.strategy)
    writes: dict[int, Counter] = defaultdict(Counter)
    for x, outs in decodes.items():
        for k, y in enumerate(outs):
            owners = ys_by_x[x].get(_norm(y), set())
            writes[k][next(iter(owners)) if len(owners) == 1 else (TIE if owners else OTHER)] += 1
    return dict(writes)


def routing(rows: list, decodes: dict[str, list[str]], chosen: list[int]) -> Counter:
    """Counter((strategy, chosen latent, whether that latent's decode of x is y)) over ``rows``."""
    return Counter((r.strategy, k, _norm(decodes[r.x][k]) == _norm(r.y)) for r, k in zip(rows, chosen))


def _load_rows(path: Path) -> list:
    """The examples of a JSONL file as training reads it (zcvae.data.jsonl), each with its strategy."""
    from zcvae.data.jsonl import read_jsonl

    rows = read_jsonl(path)
    unlabelled = next((r for r in rows if r.strategy is None), None)
    if unlabelled is not None:
        raise ValueError(f"{path}: example id {unlabelled.id!r}: missing strategy: this script needs labelled rows")
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="an export directory (zcvae export) or a run directory")
    parser.add_argument("data", type=Path, help="a labelled JSONL file (fields x, y, strategy)")
    parser.add_argument("--max-inputs", type=int, default=None, help="the first N distinct x only")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    try:
        rows = _load_rows(args.data)
    except ValueError as err:
        print(f"latent_meaning: error: {err}", file=sys.stderr)
        return 2
    xs = list(dict.fromkeys(r.x for r in rows))[: args.max_inputs]
    kept = set(xs)
    rows = [r for r in rows if r.x in kept]

    import torch

    from zcvae.export.load import decode_greedy, encode_xy, load_for_inference

    model = load_for_inference(args.model, device="cpu")
    if model.config.latent_type != "discrete":
        print("latent_meaning: error: the model's z is Gaussian; this script decodes each of K discrete latents", file=sys.stderr)
        return 2
    K, tok = model.config.num_latents, model.tokenizer
    ids = lambda text: tuple(tok(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    decodes = {x: [tok.decode(o, skip_special_tokens=True) for o in
                   decode_greedy(model, ids(x), latent_index=torch.arange(K), max_new_tokens=args.max_new_tokens)]
               for x in xs}
    chosen = [int(encode_xy(model, ids(r.x), ids(r.y))["posterior"].argmax()) for r in rows]

    writes = latent_writes(rows, decodes)
    strategies = sorted({r.strategy for r in rows})
    columns = strategies + [TIE, OTHER]
    print(f"what each latent writes, over {len(xs)} x (number of x)\n")
    print("| latent | " + " | ".join(columns) + " |")
    print("|---|" + "---|" * len(columns))
    for k in range(K):
        print(f"| z{k} | " + " | ".join(str(writes.get(k, Counter())[c]) for c in columns) + " |")
    print(f"\nwhere argmax q(z|x,y) sends each strategy's rows ({len(rows)} rows), and whether that latent writes y\n")
    print("| strategy | latent | writes y | rows |")
    print("|---|---|---|---|")
    for (s, k, ok), n in sorted(routing(rows, decodes, chosen).items()):
        print(f"| {s} | z{k} | {'yes' if ok else 'no'} | {n} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
