"""The data section's checks before any rank starts (dtk validate, dtk train): data.target importable, a tokens
folder whole, a pretrained model reading the ids of its own tokenizer, eval.every only on data with a validation
split. Each problem is one line naming the field."""
from __future__ import annotations

from pathlib import Path

from dtk.data import vocab
from dtk.data.tokens import read_meta
from dtk.errors import DtkError
from dtk.targets import target_problem


def data_problems(r) -> list[str]:
    """data.target, data.name tokens and eval.every: what the ranks would refuse, found before they start."""
    d, lines = r.data, []
    if d.target is not None:
        return [line for line in [target_problem("data.target", d.target)] if line]  # whether it has a validation split is known once a rank builds it
    if d.name == "tokens":
        if not d.path:
            return ["data.path: missing; data 'tokens' needs the folder `dtk data prepare` wrote"]
        if not Path(d.path).is_dir():
            return [f"data.path: got {d.path!r}; no such folder; accepted: a folder `dtk data prepare` wrote"]
        try:
            meta = read_meta(d.path)
        except DtkError as e:
            return e.lines
        if r.model.hf is not None and r.model.hf.path is not None:
            lines += _tokenizer_lines(r.model.hf.path, meta, d.path)
    if r.eval.every and r.strategy.name.startswith("gcpsl"):
        lines.append(f"eval.every: got {r.eval.every}; strategy.name {r.strategy.name!r} measures its own held-out "
                     f"accuracy; accepted: eval.every: 0 with it, or ddp, fsdp, zero1, zero2, zero3")
    elif r.eval.every:
        split = {"synthetic": None, "digits": "data.held_out > 0" if not d.held_out else "",
                 "text": "data.held_out > 0" if not d.held_out else "", "cifar10": "", "tokens": ""}[d.name]
        if split != "":
            accepted = f"set {split}, or eval.every: 0" if split else "eval.every: 0 (synthetic data has none)"
            lines.append(f"eval.every: got {r.eval.every}; data {d.name!r} has no validation split here; "
                         f"accepted: {accepted}")
    return lines


def _tokenizer_lines(model_path: str, meta: dict, data_path: str) -> list[str]:
    """A pretrained model reads the ids its own tokenizer makes: the data's tokenizer must be the same one."""
    if not vocab.has_tokenizer(model_path):
        return []  # nothing to compare with; the vocabulary size is checked against the model's config
    try:
        theirs = vocab.load_tokenizer(model_path, flag="model.hf.path")
    except DtkError as e:
        return e.lines
    ours = meta.get("tokenizer", {}).get("hash")
    if vocab.tokenizer_hash(theirs) != ours:
        return [f"data.path: {data_path!r} was tokenized by another tokenizer than model.hf.path {model_path!r}'s "
                f"(vocab {meta.get('vocab_size')} vs {len(theirs)}, hash {str(ours)[:12]} vs "
                f"{vocab.tokenizer_hash(theirs)[:12]}); accepted: data prepared with --tokenizer {model_path}"]
    return []
