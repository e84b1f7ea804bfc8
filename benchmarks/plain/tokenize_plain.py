"""The plain way to tokenize a corpus: read the files, HF `tokenizers` batch-encode, end-of-text between documents,
uint16 ids to one file. What `dtk data prepare` is measured against (benchmarks/data.py).

    python benchmarks/plain/tokenize_plain.py FILE... --tokenizer DIR/tokenizer.json --out ids.bin
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer


def tokenize(files: list[Path], *, tokenizer_json: Path, out: Path, eot: str = "<|endoftext|>") -> dict:
    t0 = time.perf_counter()
    tok = Tokenizer.from_file(str(tokenizer_json))
    texts = [f.read_text(encoding="utf-8") for f in files]
    eot_id = tok.token_to_id(eot)
    encoded = tok.encode_batch(texts, add_special_tokens=False)
    ids = np.concatenate([np.asarray(e.ids + [eot_id], dtype=np.uint16) for e in encoded])
    ids.tofile(out)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "tokens": int(len(ids)), "text_bytes": sum(len(t.encode()) for t in texts)}


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--tokenizer", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    print(tokenize(a.files, tokenizer_json=a.tokenizer, out=a.out))
