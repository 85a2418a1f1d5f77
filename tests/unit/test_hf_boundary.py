"""``model/hf_compat.py`` is the only module on transformers' and peft's internals: no other module of
``src/zcvae`` reads a private (``_``-prefixed) attribute of an object that is not its own, peft's
``base_layer`` / ``token_adapter``, or one of the HF internals below (as an attribute, through
``getattr``/``hasattr``/``setattr``, or as a class name matched by string). A hit means: add a named
function with its test to hf_compat, and call that."""

import ast
from pathlib import Path

import zcvae

ROOT = Path(zcvae.__file__).parent
HF_COMPAT = "model/hf_compat.py"
# peft's wrapper internals, and HF attributes whose meaning differs by architecture or version
HF_NAMES = frozenset({"base_layer", "token_adapter", "peft_config", "base_model", "attention_dropout",
                      "max_position_embeddings", "n_positions", "n_ctx"})
HF_CLASS_NAMES = frozenset({"TrainableTokensLayer", "TrainableTokensWrapper", "LoraLayer", "BaseTunerLayer"})
# (file, private name): zcvae's own objects or torch's, never HF/peft
ALLOWED = {
    ("data/task_family.py", "_bad_x"): "TaskFamily's own error helper",
    ("engines/fsdp2.py", "_parameters"): "torch's nn.Module registry (parameters_on_meta)",
    ("engines/local.py", "_sync_grads"): "the DDP hook state of zcvae's own LocalEngine",
    ("model/cvae.py", "_decoder"): "ZCVAE's own method, on the instance it builds",
    ("model/cvae.py", "_pending"): "ZCVAE's own state, on the instance it builds",
    ("model/cvae.py", "_built_sharded"): "ZCVAE's own state, on the instance it builds",
}
# argparse's parser internals: the reference generator walks zcvae's own CLI parsers, no HF/peft object
ALLOWED.update({("commands/docs_reference.py", name): "argparse's own parser internals"
                for name in ("_get_formatter", "_actions", "_HelpAction", "_expand_help", "_SubParsersAction",
                             "_choices_actions")})
ATTRIBUTE_CALLS = frozenset({"getattr", "hasattr", "setattr", "delattr"})


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _hits(source: str) -> list[tuple[int, str]]:
    """(line, name) of every access in ``source`` that belongs in hf_compat."""
    hits = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            own = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
            if (_private(node.attr) and not own) or node.attr in HF_NAMES:
                hits.append((node.lineno, node.attr))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ATTRIBUTE_CALLS:
            name = node.args[1] if len(node.args) > 1 else None
            if isinstance(name, ast.Constant) and isinstance(name.value, str) and (_private(name.value) or name.value in HF_NAMES):
                hits.append((node.lineno, name.value))
        elif isinstance(node, ast.Constant) and node.value in HF_CLASS_NAMES:
            hits.append((node.lineno, node.value))
    return sorted(set(hits))


def test_only_hf_compat_touches_hf_and_peft_internals():
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        if relative == HF_COMPAT:
            continue
        found += [f"{relative}:{line}: {name}" for line, name in _hits(path.read_text()) if (relative, name) not in ALLOWED]
    assert not found, "HF/peft internals outside model/hf_compat.py (give each a named function there):\n" + "\n".join(found)


def test_hf_compat_itself_is_seen_by_the_scan():
    assert _hits((ROOT / HF_COMPAT).read_text()), "the scan finds nothing in hf_compat: it is broken"


def test_every_allowed_entry_is_still_needed():
    stale = [f"{f}: {n}" for f, n in ALLOWED if (f, n) not in {(f, name) for _, name in _hits((ROOT / f).read_text())}]
    assert not stale, "remove from ALLOWED: " + ", ".join(stale)


def test_the_scan_finds_each_kind_of_access():
    source = (
        "def f(model, emb, m):\n"
        "    a = model._no_split_modules\n"
        "    b = getattr(emb, 'token_adapter', None).base_layer\n"
        "    if type(m).__name__ == 'TrainableTokensLayer':\n"
        "        return model.peft_config['default'], self._own, m.__class__\n"
    )
    assert _hits(source) == [(2, "_no_split_modules"), (3, "base_layer"), (3, "token_adapter"),
                             (4, "TrainableTokensLayer"), (5, "peft_config")]
