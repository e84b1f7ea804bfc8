"""Tokenizers for `dtk data prepare`: load a local HuggingFace tokenizer, train a byte-level BPE offline, and the hash
that tells whether two tokenizers split text the same way (meta.json's, and a pretrained model folder's)."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Iterable

from dtk.errors import DtkError

EOT = "<|endoftext|>"
# tokenizer.json keys that change how a batch is padded or cut, not how text becomes tokens
_RUNTIME_KEYS = ("truncation", "padding")


def _offline() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        import transformers  # noqa: F401  (tokenizer folders are saved and loaded through it)
    except ImportError:
        raise DtkError('--tokenizer: tokenizers are saved and loaded through transformers, which is not installed; '
                       'install the hf extra: pip install -e ".[hf]"') from None


def tokenizer_hash(tokenizer) -> str:
    """sha256 of the fast tokenizer's canonical JSON (vocabulary, merges, normalizer, pre-tokenizer, added tokens)."""
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    for k in _RUNTIME_KEYS:
        spec.pop(k, None)
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


def has_tokenizer(folder: str | Path) -> bool:
    """Whether a folder holds what AutoTokenizer reads (a fast tokenizer.json, or a slow one's vocabulary files)."""
    names = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model", "vocab.txt")
    return any((Path(folder) / n).is_file() for n in names)


def load_tokenizer(folder: str | Path, *, flag: str = "--tokenizer"):
    """A local fast tokenizer (never the hub); a user error names `flag` when the folder holds none."""
    _offline()
    p = Path(folder)
    if not p.is_dir():
        raise DtkError(f"{flag}: got {str(folder)!r}; no such folder; accepted: a local tokenizer folder (tokenizer.json, "
                       f"as save_pretrained writes it)")
    if not has_tokenizer(p):
        raise DtkError(f"{flag}: got {str(folder)!r}; it holds no tokenizer (no tokenizer.json, tokenizer_config.json, "
                       f"vocab.json or tokenizer.model); accepted: a folder save_pretrained wrote, or --train-tokenizer")
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise DtkError(f"{flag}: got {str(folder)!r}; transformers cannot load a tokenizer from it ({first})") from None
    if not getattr(tok, "is_fast", False):
        raise DtkError(f"{flag}: got {str(folder)!r}; it loads as a slow (Python) tokenizer; accepted: a fast one "
                       f"(tokenizer.json)")
    return tok


def end_of_text_id(tokenizer, *, flag: str = "--tokenizer") -> int:
    """The token that joins documents: the tokenizer's eos token, else <|endoftext|> if its vocabulary has it."""
    for token in (tokenizer.eos_token, EOT):
        if token is not None:
            tid = tokenizer.convert_tokens_to_ids(token)
            if isinstance(tid, int) and tid != tokenizer.unk_token_id:
                return tid
    raise DtkError(f"{flag}: the tokenizer has no end-of-text token (no eos_token, no {EOT!r} in its vocabulary); "
                   f"accepted: a tokenizer with an eos_token, or --train-tokenizer")


def train_bpe(texts: Iterable[str], *, vocab_size: int):
    """A byte-level BPE (GPT-2's scheme) trained on `texts`, offline, with <|endoftext|> as its eos token."""
    _offline()
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOT, bos_token=EOT, unk_token=None)
