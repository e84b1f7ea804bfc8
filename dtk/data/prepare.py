"""`dtk data prepare`: a corpus (text files, .jsonl, .parquet, a `save_to_disk` dataset) read with `datasets` from
local files, tokenized once into train.bin / val.bin (uint16 or uint32 tokens) + meta.json + the tokenizer folder.

Everything is written into a hidden sibling folder first and renamed to DIR at the end: a failed or interrupted
prepare leaves nothing behind that a run could mistake for data.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Literal

import numpy as np

from dtk.data import vocab
from dtk.errors import DtkError

FORMAT = "dtk-tokens/1"
TEXT_SUFFIXES = (".txt", ".text", ".md")
SUFFIX_KIND = {**{s: "text" for s in TEXT_SUFFIXES}, ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
ACCEPTED = "text files (.txt, .md), .jsonl, .parquet, folders of them, or a folder datasets' save_to_disk wrote"
Kind = Literal["text", "json", "parquet", "saved"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Source:
    kind: Kind
    paths: tuple[Path, ...]


def token_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def _is_saved_dataset(p: Path) -> bool:
    return p.is_dir() and any((p / n).is_file() for n in ("dataset_dict.json", "state.json", "dataset_info.json"))


def resolve_sources(items: list[str], *, flag: str = "SRC") -> list[Source]:
    """Group the given files and folders by how `datasets` reads them; a missing or unreadable one is a user error."""
    if not items:
        raise DtkError(f"{flag}: missing; accepted: {ACCEPTED}")
    by_kind: dict[str, list[Path]] = {}
    saved: list[Source] = []
    for item in items:
        p = Path(item)
        if not p.exists():
            raise DtkError(f"{flag}: got {item!r}; no such file or folder; accepted: {ACCEPTED}")
        if _is_saved_dataset(p):
            saved.append(Source(kind="saved", paths=(p,)))
            continue
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in SUFFIX_KIND) if p.is_dir() else [p]
        if not files:
            raise DtkError(f"{flag}: got {item!r}; the folder holds no file dtk reads; accepted: {ACCEPTED}")
        for f in files:
            kind = SUFFIX_KIND.get(f.suffix.lower())
            if kind is None:
                raise DtkError(f"{flag}: got {str(f)!r}; unknown kind of file ({f.suffix or 'no suffix'}); "
                               f"accepted: {ACCEPTED}")
            by_kind.setdefault(kind, []).append(f)
    return [Source(kind=k, paths=tuple(v)) for k, v in by_kind.items()] + saved  # type: ignore[arg-type]


def _load(source: Source, *, field: str, cache_dir: str, num_proc: int, flag: str):
    """One `datasets.Dataset` with a `field` column of text; local files only."""
    import datasets

    datasets.disable_progress_bars()
    files = [str(p) for p in source.paths]
    if source.kind == "saved":
        ds = datasets.load_from_disk(files[0])
        if isinstance(ds, datasets.DatasetDict):
            ds = ds["train"] if "train" in ds else ds[next(iter(ds))]
    else:
        # a text file is one document; .jsonl / .parquet rows are documents
        extra = {"sample_by": "document"} if source.kind == "text" else {}
        ds = datasets.load_dataset(source.kind, data_files=files, split="train", cache_dir=cache_dir,
                                   # processes pay for themselves only on many files (forking one costs ~0.1 s)
                                   num_proc=num_proc if len(files) >= 64 and num_proc > 1 else None, **extra)
    column = "text" if source.kind == "text" else field
    if column not in ds.column_names:
        what = "column" if source.kind == "parquet" else "field"
        raise DtkError(f"--field: got {field!r}; {files[0]!r} has no {what} {field!r}; its {what}s: "
                       f"{', '.join(ds.column_names) or 'none'}")
    return ds.select_columns([column]).rename_column(column, "text") if column != "text" else ds.select_columns(["text"])


def _sources_hash(sources: list[Source]) -> str:
    h = hashlib.sha256()
    for s in sources:
        files = sorted(f for p in s.paths for f in ([p] if p.is_file() else p.rglob("*")) if f.is_file())
        for f in files:
            h.update(f.name.encode())
            with open(f, "rb") as fh:
                while chunk := fh.read(1 << 22):
                    h.update(chunk)
    return h.hexdigest()


class _Writer:
    """Appends token ids to a .bin file, with the end-of-text id after each document."""

    def __init__(self, path: Path, *, dtype: str, eot: int):
        self.f, self.dtype, self.eot = open(path, "wb"), np.dtype(dtype), eot
        self.tokens = self.documents = self.text_bytes = 0

    def add(self, texts: list[str], tokenizer) -> None:
        encoded = tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)
        ids = [np.asarray(e.ids + [self.eot], dtype=self.dtype) for e in encoded]
        if ids:
            block = np.concatenate(ids)
            block.tofile(self.f)
            self.tokens += len(block)
        self.documents += len(texts)
        self.text_bytes += sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)

    def close(self) -> None:
        self.f.close()


def _texts(datasets_: list, batch: int = 256) -> Iterator[list[str]]:
    for ds in datasets_:
        for rows in ds.iter(batch_size=batch):
            yield [t for t in rows["text"] if t]


def prepare(*, sources: list[str], out: str, tokenizer: str | None, train_tokenizer: int | None, field: str = "text",
            val_share: float = 0.005, val: list[str] | None = None, seq_len: int = 256, num_proc: int = 0,
            progress: bool = True) -> dict:
    """Tokenize `sources` into `out`; returns meta.json's content. User errors raise DtkError before `out` exists."""
    vocab._offline()
    if (tokenizer is None) == (train_tokenizer is None):
        raise DtkError("--tokenizer/--train-tokenizer: give exactly one: --tokenizer FOLDER (a local HF tokenizer) "
                       "or --train-tokenizer VOCAB (train a byte-level BPE on the corpus)")
    if train_tokenizer is not None and not 256 < train_tokenizer <= 1 << 20:
        raise DtkError(f"--train-tokenizer: got {train_tokenizer}; accepted: a vocabulary size in 257..{1 << 20}")
    if not 0 < val_share < 1:
        raise DtkError(f"--val-share: got {val_share:g}; accepted: a share in (0, 1), e.g. 0.005")
    if seq_len < 2:
        raise DtkError(f"--seq-len: got {seq_len}; accepted: 2 or more tokens")
    dest = Path(out)
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise DtkError(f"--out: got {out!r}; it exists and is not an empty folder; accepted: a new or empty folder")
    train_sources = resolve_sources(sources)
    val_sources = resolve_sources(val, flag="--val") if val else []
    tok = vocab.load_tokenizer(tokenizer) if tokenizer is not None else None
    eot = vocab.end_of_text_id(tok) if tok is not None else None
    if num_proc > 0:
        os.environ["RAYON_NUM_THREADS"] = str(num_proc)  # tokenizers' thread pool, before its first use
    procs = num_proc or os.cpu_count() or 1

    tmp = dest.parent / f".{dest.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    t0 = time.perf_counter()
    try:
        cache = str(tmp / "cache")
        train_ds = [_load(s, field=field, cache_dir=cache, num_proc=procs, flag="SRC") for s in train_sources]
        val_ds = [_load(s, field=field, cache_dir=cache, num_proc=procs, flag="--val") for s in val_sources]
        if tok is None:
            assert train_tokenizer is not None  # exactly one of the two, checked above
            tok = vocab.train_bpe((t for texts in _texts(train_ds) for t in texts), vocab_size=train_tokenizer)
            eot = vocab.end_of_text_id(tok)
        assert eot is not None  # set with tok, whichever way it came
        tok.save_pretrained(str(tmp / "tokenizer"))
        dtype = token_dtype(len(tok))
        total = sum(len(d) for d in train_ds + val_ds)
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        bar = Progress(TextColumn("[bold]tokenize"), BarColumn(), MofNCompleteColumn(), TextColumn("documents"),
                       TimeElapsedColumn(), console=Console(stderr=True), disable=not progress)
        counts = {}
        with bar:
            task = bar.add_task("", total=total)
            for split, group in (("train", train_ds), ("val", val_ds)):
                if split == "val" and not group:
                    continue
                w = _Writer(tmp / f"{split}.bin", dtype=dtype, eot=eot)
                for texts in _texts(group):
                    w.add(texts, tok)
                    bar.advance(task, len(texts))
                w.close()
                counts[split] = w
        train_tokens, text_bytes = counts["train"].tokens, sum(w.text_bytes for w in counts.values())
        if val_ds:
            val_tokens, how = counts["val"].tokens, "given (--val)"
        else:
            # the validation split is the corpus's last tokens: a share, at least one sequence of `seq_len` + 1
            val_tokens, how = max(math.ceil(val_share * train_tokens), seq_len + 1), f"last {val_share:g} of the tokens"
            _split_tail(tmp / "train.bin", tmp / "val.bin", dtype=dtype, tokens=val_tokens)
            train_tokens -= val_tokens
        for split, n in (("train", train_tokens), ("val", val_tokens)):
            if n < seq_len + 1:
                raise DtkError(f"{'SRC' if split == 'train' else '--val'}: the {split} split holds {n} tokens, fewer "
                               f"than --seq-len + 1 ({seq_len + 1}); accepted: more text, or a shorter --seq-len")
        seconds = time.perf_counter() - t0
        meta = {
            "format": FORMAT,
            "tokenizer": {"path": "tokenizer", "source": str(tokenizer) if tokenizer else
                          f"byte-level BPE trained on the corpus (vocab {train_tokenizer})",
                          "hash": vocab.tokenizer_hash(tok), "eot_id": eot},
            "vocab_size": len(tok),
            "dtype": dtype,
            "seq_len": seq_len,
            "train_tokens": train_tokens,
            "val_tokens": val_tokens,
            "documents": {k: w.documents for k, w in counts.items()},
            "text_bytes": text_bytes,
            "sources": [str(p) for s in train_sources for p in s.paths],
            "val_sources": [str(p) for s in val_sources for p in s.paths],
            "sources_hash": _sources_hash(train_sources + val_sources),
            "split": {"how": how, "val_share": None if val_ds else val_share},
            "prepare_seconds": seconds,
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
        shutil.rmtree(cache, ignore_errors=True)
        if dest.exists():
            dest.rmdir()  # checked empty above
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return meta


def _split_tail(train: Path, val: Path, *, dtype: str, tokens: int) -> None:
    """Move the last `tokens` tokens of `train` into `val` (a copy of the tail, then a truncation)."""
    item = np.dtype(dtype).itemsize
    size = train.stat().st_size
    cut = max(0, size - tokens * item)
    with open(train, "rb") as src, open(val, "wb") as dst:
        src.seek(cut)
        shutil.copyfileobj(src, dst)
    os.truncate(train, cut)


def summary_line(meta: dict, out: str) -> str:
    docs = sum(meta["documents"].values())
    mb_s = meta["text_bytes"] / 1e6 / meta["prepare_seconds"] if meta["prepare_seconds"] else 0.0
    return (f"prepared {out}: {docs:,} documents, {meta['train_tokens'] + meta['val_tokens']:,} tokens (train "
            f"{meta['train_tokens']:,}, val {meta['val_tokens']:,}), vocab {meta['vocab_size']:,} as {meta['dtype']}, "
            f"{mb_s:.1f} MB/s")
