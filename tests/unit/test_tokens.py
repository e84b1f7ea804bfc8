"""Token data without processes: `dtk data prepare` (in process, on the shipped sonnets), the memory-mapped windows
(an epoch covers every window once), data.target, and every user mistake as one line and exit 2."""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from dtk import cli
from dtk.data import build_dataset, has_validation
from dtk.data.prepare import prepare, token_dtype
from dtk.data.tokens import TokenFile, WindowOrder
from dtk.recipe import build

ROOT = Path(__file__).resolve().parents[2]
SONNETS = ROOT / "recipes" / "data" / "sonnets.txt"
SHIPPED = ROOT / "recipes" / "data" / "sonnets-tokens"
QUICKSTART = ROOT / "recipes" / "quickstart.yaml"
CORPUS = ROOT / "recipes" / "corpus.yaml"


def dtk(monkeypatch, capsys, *args) -> tuple[int, list[str]]:
    """The real CLI entry, in this process: (exit code, stderr lines)."""
    monkeypatch.setattr(sys, "argv", ["dtk", *map(str, args)])
    with pytest.raises(SystemExit) as exit_:
        cli.main()
    return exit_.value.code, capsys.readouterr().err.strip().splitlines()


def bins(folder: Path) -> tuple[bytes, bytes]:
    return (folder / "train.bin").read_bytes(), (folder / "val.bin").read_bytes()


def test_a_trained_bpe_and_the_saved_tokenizer_make_the_shipped_files(tmp_path):
    """The shipped recipes/data/sonnets-tokens is what prepare makes, by training the BPE or by reading its folder."""
    trained = prepare(sources=[str(SONNETS)], out=str(tmp_path / "trained"), tokenizer=None, train_tokenizer=512,
                      val_share=0.1, seq_len=32, progress=False)
    saved = prepare(sources=[str(SONNETS)], out=str(tmp_path / "saved"), tokenizer=str(SHIPPED / "tokenizer"),
                    train_tokenizer=None, val_share=0.1, seq_len=32, progress=False)
    shipped = json.loads((SHIPPED / "meta.json").read_text())
    assert bins(tmp_path / "trained") == bins(tmp_path / "saved") == bins(SHIPPED)
    assert trained["tokenizer"]["hash"] == saved["tokenizer"]["hash"] == shipped["tokenizer"]["hash"]
    assert (trained["vocab_size"], trained["dtype"], trained["train_tokens"] + trained["val_tokens"]) == \
        (512, "uint16", shipped["train_tokens"] + shipped["val_tokens"])
    assert trained["val_tokens"] >= 33 and not list(tmp_path.glob(".*partial*"))
    from transformers import AutoTokenizer  # the folder loads as issue 23's export expects: DIR/tokenizer

    tok = AutoTokenizer.from_pretrained(str(tmp_path / "trained" / "tokenizer"))
    ids = np.fromfile(tmp_path / "trained" / "train.bin", dtype=np.uint16)
    assert tok.decode(ids[:200].tolist()) == SONNETS.read_text()[:len(tok.decode(ids[:200].tolist()))]
    assert int(np.fromfile(tmp_path / "trained" / "val.bin", dtype=np.uint16)[-1]) == tok.eos_token_id


def test_jsonl_parquet_and_a_saved_dataset_are_documents_joined_by_end_of_text(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = [f"Sonnet {i}: shall I compare thee to a summer's day?" for i in range(9)]
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.jsonl").write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs[:3])))
    pq.write_table(pa.table({"text": docs[3:6]}), src / "b.parquet")
    datasets.Dataset.from_dict({"text": docs[6:]}).save_to_disk(str(tmp_path / "saved"))
    meta = prepare(sources=[str(src), str(tmp_path / "saved")], out=str(tmp_path / "out"),
                   tokenizer=str(SHIPPED / "tokenizer"), train_tokenizer=None, val=[str(src / "a.jsonl")],
                   seq_len=4, progress=False)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(SHIPPED / "tokenizer"))
    expected = sum(len(tok(d, add_special_tokens=False)["input_ids"]) + 1 for d in docs)
    assert meta["documents"] == {"train": 9, "val": 3} and meta["train_tokens"] == expected
    assert meta["split"]["how"] == "given (--val)"
    ids = np.fromfile(tmp_path / "out" / "train.bin", dtype=np.uint16)
    assert (ids == tok.eos_token_id).sum() == 9


def test_an_epoch_covers_every_window_once_and_batches_follow_seed_step_rank_micro():
    data = TokenFile(path=str(SHIPPED), seq_len=8, seed=3, world=2, grad_accum=2)
    per_step = 2 * 2 * 5
    seen = np.concatenate([data.train_windows(step=s, rank=r, micro=m, size=5)
                           for s in range(data.windows // per_step + 2) for m in range(2) for r in range(2)])
    w = data.windows
    assert sorted(seen[:w].tolist()) == list(range(w))  # epoch 0: each window once
    assert len(set(seen[w:2 * w].tolist())) == len(seen[w:2 * w])  # epoch 1, as far as drawn: no window twice
    assert seen[:w].tolist() != seen[w:2 * w].tolist()[:w]  # epoch 1 is another order
    x, y = data.batch(step=7, rank=1, micro=1, size=4)
    again = TokenFile(path=str(SHIPPED), seq_len=8, seed=3, world=2, grad_accum=2).batch(step=7, rank=1, micro=1, size=4)
    assert x.shape == (4, 8) and bool((x[:, 1:] == y[:, :-1]).all())
    assert bool((x == again[0]).all()) and bool((y == again[1]).all())
    vx, vy = data.val_batch(index=0, size=2)
    assert vx.shape == (2, 8) and bool((vx[:, 1:] == vy[:, :-1]).all())
    assert data.spec.vocab_size == 512 and TokenFile(path=str(SHIPPED), seq_len=None, seed=0).spec.seq_len == 32


@pytest.mark.parametrize("n", [1, 2, 3, 5, 64, 1000, 4099])
def test_window_order_is_a_permutation(n):
    order = WindowOrder(n, seed=0, epoch=1)(np.arange(n))
    assert sorted(order.tolist()) == list(range(n))
    if n > 64:
        assert order.tolist() != WindowOrder(n, seed=0, epoch=2)(np.arange(n)).tolist()


def test_token_dtype_follows_the_vocabulary():
    assert token_dtype(65_536) == "uint16" and token_dtype(65_537) == "uint32"


def test_data_target_and_the_validation_splits():
    r = build({"data": {"target": "tests.fixtures.data_target:counting", "kwargs": {"vocab": 16}},
               "eval": {"every": 2}})
    data = build_dataset(r.data, seed=0)
    assert data.spec.vocab_size == 16 and has_validation(data)
    x, y = data.batch(step=1, rank=0, micro=0, size=3)
    assert bool(((x + 1) % 16 == y).all())
    assert not has_validation(build_dataset(build({"data": {"name": "digits"}, "model": {"name": "mlp"}}).data, seed=0))
    assert has_validation(build_dataset(build({"data": {"name": "digits", "held_out": 0.2},
                                               "model": {"name": "mlp"}}).data, seed=0))


@pytest.fixture
def bad_inputs(tmp_path):
    (tmp_path / "rows.jsonl").write_text('{"body": "no text field here"}\n')
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": ["no text column"]}), tmp_path / "rows.parquet")
    (tmp_path / "empty").mkdir()
    shutil.copytree(SHIPPED, tmp_path / "short")
    with open(tmp_path / "short" / "train.bin", "r+b") as f:
        f.truncate(100)
    return tmp_path


PREPARE_CASES = [
    ("missing_src", ["{t}/no-such-corpus", "--train-tokenizer", "300"], ["SRC", "no-such-corpus", "no such file"]),
    ("jsonl_without_field", ["{t}/rows.jsonl", "--train-tokenizer", "300"], ["--field", "'text'", "body"]),
    ("parquet_without_column", ["{t}/rows.parquet", "--train-tokenizer", "300"], ["--field", "column", "content"]),
    ("folder_without_tokenizer", [str(SONNETS), "--tokenizer", "{t}/empty"], ["--tokenizer", "empty", "no tokenizer"]),
]


@pytest.mark.parametrize("case, args, words", PREPARE_CASES, ids=[c[0] for c in PREPARE_CASES])
def test_prepare_mistakes_are_one_line_exit_2_and_nothing_written(monkeypatch, capsys, bad_inputs, case, args, words):
    out = bad_inputs / "out"
    code, err = dtk(monkeypatch, capsys, "data", "prepare", *[a.replace("{t}", str(bad_inputs)) for a in args], "--out", out,
                    "--no-progress")
    assert code == 2 and len(err) == 1 and err[0].startswith("error: "), err
    assert all(w in err[0] for w in words), err
    assert not out.exists() and not list(bad_inputs.glob(".out.partial*"))


RECIPE_CASES = [
    ("path_without_meta", QUICKSTART, ["data.name=tokens", "data.path={t}/empty"], ["data.path", "meta.json"]),
    ("size_not_meta", QUICKSTART, ["data.name=tokens", "data.path={t}/short"], ["data.path", "train.bin", "100 bytes"]),
    ("vocab_above_model", CORPUS, [f"data.path={SHIPPED}", "model.hf.model_type=gpt2",
                                   "model.hf.config={n_layer: 1, n_embd: 32, n_head: 2, vocab_size: 100}"],
     ["model.hf.config.vocab_size", "100", "512"]),
    ("eval_without_split", QUICKSTART, ["eval.every=5"], ["eval.every", "'synthetic'"]),
    ("eval_digits_without_held_out", QUICKSTART, ["data.name=digits", "model.name=mlp", "eval.every=5"],
     ["eval.every", "data.held_out"]),
    ("target_not_importable", QUICKSTART, ["data.target=no_such_pkg.mod:fn"], ["data.target", "no_such_pkg"]),
]


@pytest.mark.parametrize("case, recipe, args, words", RECIPE_CASES, ids=[c[0] for c in RECIPE_CASES])
def test_recipe_mistakes_on_token_data_are_one_line_exit_2(monkeypatch, capsys, bad_inputs, case, recipe, args, words):
    code, err = dtk(monkeypatch, capsys, "validate", recipe, *[a.replace("{t}", str(bad_inputs)) for a in args])
    assert code == 2 and len(err) == 1 and err[0].startswith("error: "), err
    assert all(w in err[0] for w in words), err


def test_a_pretrained_model_must_read_the_data_of_its_own_tokenizer(monkeypatch, capsys, tmp_path):
    """model.hf.path with a tokenizer: the data's tokenizer hash must be its; `dtk validate` says so in one line."""
    from transformers import AutoTokenizer, GPT2Config

    model = tmp_path / "model"
    GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=512, n_positions=64).save_pretrained(model)
    other = prepare(sources=[str(SONNETS)], out=str(tmp_path / "other"), tokenizer=None, train_tokenizer=300,
                    val_share=0.1, seq_len=32, progress=False)
    AutoTokenizer.from_pretrained(str(tmp_path / "other" / "tokenizer")).save_pretrained(model)
    code, err = dtk(monkeypatch, capsys, "validate", CORPUS, f"data.path={SHIPPED}", f"model.hf.path={model}")
    assert code == 2 and len(err) == 1 and "another tokenizer" in err[0] and "model.hf.path" in err[0], err
    assert other["vocab_size"] == 300
    shutil.rmtree(model / "tokenizer.json", ignore_errors=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (model / f).unlink(missing_ok=True)
    AutoTokenizer.from_pretrained(str(SHIPPED / "tokenizer")).save_pretrained(model)  # the data's own: accepted
    code, err = dtk(monkeypatch, capsys, "validate", CORPUS, f"data.path={SHIPPED}", f"model.hf.path={model}")
    assert code == 0, err
