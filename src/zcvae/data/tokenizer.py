"""A word-level tokenizer over the built-in tasks' vocabulary.

Every word of every built-in task is one token; text is split on whitespace only, and decoding joins
tokens with single spaces (the `tokenizers` behaviour when no decoder is set), so
`decode(encode(text))` gives back `" ".join(text.split())` for in-vocabulary text. Words outside the
vocabulary (from a user's JSONL) become `<unk>`; callers count those.

Token ids are stable across runs and machines: the special tokens come first in a fixed order, then
the words sorted. No post-processor is set: `tokenizer(text)` returns only the word ids whether or not
`add_special_tokens` is passed, and callers add `<s>`, `</s>` and the template markers themselves.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from zcvae.data.tasks import TASKS
from zcvae.data.encoding import TemplateLayout

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

PAD, UNK, BOS, EOS = "<pad>", "<unk>", "<s>", "</s>"
# The template markers (defined by zcvae.data.encoding.TemplateLayout) get fixed ids right after these.
TEMPLATE_TOKENS = TemplateLayout.MARKERS
SPECIAL_TOKENS = (PAD, UNK, BOS, EOS, *TEMPLATE_TOKENS)


def task_vocabulary() -> list[str]:
    """The sorted union of the built-in task families' vocabularies."""
    return sorted({word for task in TASKS.values() for word in task.vocabulary()})


def build_tokenizer(*, extra_words: Iterable[str] = (), with_markers: bool = True) -> PreTrainedTokenizerFast:
    """A word-level PreTrainedTokenizerFast over the task vocabulary (plus `extra_words`).

    ids: <pad>=0, <unk>=1, <s>=2, </s>=3, the template markers 4-10, then the words sorted.
    ``with_markers=False`` leaves the markers out (the words follow </s>): the tokenizer of a
    random-weight benchmarking checkpoint (``zcvae.plan.shapes``), which must not pass as entangled.
    """
    # Imported here so that `import zcvae.data` (tasks, JSONL) stays fast: transformers takes seconds.
    from tokenizers import AddedToken, Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    extra = list(extra_words)
    for word in extra:
        if not isinstance(word, str) or not word or word != word.strip() or len(word.split()) != 1:
            raise ValueError(f"extra_words: {word!r} is not a single non-empty whitespace-free word")
    words = sorted(set(task_vocabulary()) | set(extra) - set(SPECIAL_TOKENS))
    specials = SPECIAL_TOKENS if with_markers else (PAD, UNK, BOS, EOS)
    vocab = {token: token_id for token_id, token in enumerate([*specials, *words])}

    backend = Tokenizer(WordLevel(vocab=vocab, unk_token=UNK))
    backend.pre_tokenizer = WhitespaceSplit()
    # Special tokens are matched before pre-tokenisation and dropped by skip_special_tokens.
    backend.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in specials])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        extra_special_tokens=list(TEMPLATE_TOKENS) if with_markers else [],
        # The default cleanup would glue words such as "." and "?" onto the previous word.
        clean_up_tokenization_spaces=False,
    )
