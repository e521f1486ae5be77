"""Serving linattn models with vLLM (``linattn.serve``), end to end in the serving environment.

vLLM lives in a second environment, ``.venv-serve`` (``make serve-env``, which ``make test``
runs first; requirements-serve.lock). These tests build tiny models here, export them and
compute ``LM.generate``'s tokens, then hand the exports to ``.venv-serve``'s python: one
process runs a vLLM engine per model (``tests/_serve_driver.py``), another ``linattn serve``
(127.0.0.1, stopped at the end of the module). Every engine forces chunked prefill
(``max_num_batched_tokens`` below the longer prompts) and few sequences at a time
(``max_num_seqs=2``), so prompts continue from their state slots and slots are reused.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from _helpers import head_fields
from linattn.hf import save_pretrained_lm
from linattn.models import LM, LMConfig

ROOT = Path(__file__).resolve().parents[1]
SERVE_PYTHON = ROOT / ".venv-serve" / "bin" / "python"
DRIVER = Path(__file__).with_name("_serve_driver.py")

# every registered layer kind, a few to a model (each engine start costs seconds), and a hybrid of
# state and paged layers in the order of a real one
MODELS = {
    "gau": ["vq", "vq-fsq", "soft-vq", "gau-softmax"],
    "vq-rerope": ["vq:rerope=4", "vq-attn:rerope=4", "vq-attn:bias"],
    "kernel": ["linear:elu", "favor", "linear:hedgehog", "delta"],
    "gated": ["retnet", "gla", "gated-delta"],
    "softmax": ["softmax", "local:32", "local:32:rerope=5"],
    "hybrid": ["vq", "softmax", "gated-delta", "local:8:entropy", "softmax:entropy"],
}
PROMPT_LENGTHS = (1, 5, 40, 77, 13, 8)  # 40 and 77 arrive in chunks of at most 16 tokens
NEW_TOKENS = 10
ENGINE = dict(dtype="float32", enforce_eager=True, max_model_len=128, max_num_seqs=2, max_num_batched_tokens=16,
              enable_prefix_caching=False, kv_cache_memory_bytes=32 << 20, seed=0)


def _model(kinds: list[str]) -> LM:
    torch.manual_seed(0)
    config = LMConfig(d_model=64, n_layers=2 if len(kinds) == 1 else len(kinds), attention=kinds,
                      gau_d_k=32, codebook_size=16, block_size=8, favor_features=16, fsq_levels=(3, 3, 2),
                      init_std=0.1,  # logits far apart: no near-ties for float rounding to flip
                      **head_fields(kinds, n_heads=2))
    return LM(config).eval()


def _prompts(lengths, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=generator).tolist() for n in lengths]


def _greedy(lm: LM, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    return [list(lm.generate(prompt, new_tokens, temperature=0)) for prompt in prompts]


@pytest.fixture(scope="module")
def serve_python() -> Path:
    if not SERVE_PYTHON.exists():
        pytest.fail(f"the serving environment is missing ({SERVE_PYTHON}): `make serve-env` creates it "
                    "(`make test` does first)")
    return SERVE_PYTHON


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict:
    """Each model exported, with its prompts and ``LM.generate``'s greedy tokens."""
    root = tmp_path_factory.mktemp("serve")
    models = {}
    for name, kinds in MODELS.items():
        lm = _model(kinds)
        folder = save_pretrained_lm(lm, root / name)
        prompts = _prompts(PROMPT_LENGTHS, seed=1)
        models[name] = {"lm": lm, "path": str(folder), "prompts": prompts,
                        "expected": _greedy(lm, prompts, NEW_TOKENS)}
    return models


def _requests(prompts, max_tokens, **sampling) -> list[dict]:
    return [{"prompt_token_ids": prompt, "max_tokens": max_tokens, **sampling} for prompt in prompts]


@pytest.fixture(scope="module")
def served(exports, serve_python, tmp_path_factory) -> dict:
    """What the engines generated, by job name (see ``_serve_driver.py``)."""
    folder = tmp_path_factory.mktemp("driver")
    jobs = [{"name": name, "model": model["path"], "engine": ENGINE,
             "requests": _requests(model["prompts"], NEW_TOKENS)} for name, model in exports.items()]
    recurrent = exports["gated"]
    jobs.append({"name": "slot-reuse", "model": recurrent["path"],  # 2 state slots for 14 requests
                 "engine": {**ENGINE, "num_gpu_blocks_override": 3},
                 "requests": _requests(_prompts([1, 2, 3, 4, 5, 6, 1, 6, 2, 5, 3, 4, 1, 2], seed=2), 4)})
    # prompts that fit one step: vLLM 0.32's CPU runner fails on a seeded request whose prompt is split
    # into chunks (it rewinds the request's generator, and a CPU generator has no offset)
    sampled = [{"prompt_token_ids": prompt, "max_tokens": 12, "temperature": 1.0, "seed": seed}
               for prompt, seed in zip(_prompts([4], seed=3) * 3, (7, 7, 8))]
    jobs += [{"name": f"sampling-{run}", "model": exports["hybrid"]["path"], "engine": ENGINE, "requests": sampled}
             for run in (1, 2)]
    (folder / "jobs.json").write_text(json.dumps(jobs))
    run = subprocess.run([str(serve_python), str(DRIVER), str(folder / "jobs.json"), str(folder / "out.json")],
                         capture_output=True, text=True, timeout=900, env=_serve_env())
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads((folder / "out.json").read_text())


def _serve_env() -> dict:
    """The environment of the serving processes: one torch thread's worth of work each, no
    download attempts; the native VQ decoding step or an error (never the torch form after a
    warning: vLLM runs the model under ``torch.inference_mode``, which the step must survive)."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1", "LINATTN_VQ_STEP_IMPL": "native"}


def _tokens(served: dict, name: str) -> list:
    result = served[name]
    assert not isinstance(result, dict), f"the engine of {name!r} failed:\n{result['error'][-3000:]}"
    return result


@pytest.mark.parametrize("name", list(MODELS))
def test_served_greedy_tokens_equal_generate(served, exports, name):
    """Mixed prompt lengths, chunked prefill (16 tokens a step) and 2 sequences at a time: the
    tokens vLLM generates equal ``LM.generate``'s, for models holding every layer kind and a hybrid."""
    assert _tokens(served, name) == exports[name]["expected"]


def test_state_slots_are_reused_safely(served, exports):
    """14 short requests through 2 state slots (3 blocks, one of them vLLM's null block): every
    new sequence starts from no state, whatever its slot held before."""
    lm = exports["gated"]["lm"]
    prompts = _prompts([1, 2, 3, 4, 5, 6, 1, 6, 2, 5, 3, 4, 1, 2], seed=2)
    assert _tokens(served, "slot-reuse") == _greedy(lm, prompts, 4)


def test_seeded_sampling_is_reproducible(served):
    first, second = _tokens(served, "sampling-1"), _tokens(served, "sampling-2")
    assert first == second  # the same seeds in another engine
    assert first[0] == first[1]  # one prompt, one seed: the same tokens
    assert first[0] != first[2]  # another seed samples other tokens (temperature 1)


# -- the OpenAI-compatible server ------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def server(exports, serve_python):
    """``linattn serve`` on the hybrid export, 127.0.0.1, stopped (SIGTERM, then SIGKILL) at the end;
    as users start it: vLLM compiles the model around the state layers' custom ops (the engines
    above run eagerly)."""
    port = _free_port()
    linattn = serve_python.parent / "linattn"
    command = [str(linattn), "serve", exports["hybrid"]["path"], "--host", "127.0.0.1", "--port", str(port),
               "--max-model-len", "128", "--max-num-seqs", "2",
               "--vllm-args", "--max-num-batched-tokens 16 --kv-cache-memory-bytes 33554432"]  # compiled, as by default
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               env=_serve_env(), start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if process.poll() is not None:
                pytest.fail(f"linattn serve exited with {process.returncode}:\n{process.stderr.read()[-4000:]}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail("linattn serve did not answer /health within 300 s")
                time.sleep(1)
        yield url
    finally:
        _stop(process)


def _stop(process: subprocess.Popen) -> None:
    """End the server's process group: SIGTERM, and SIGKILL after 30 s."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)


def _post(url: str, body: dict):
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(request, timeout=120)


def test_server_completions_equal_generate(server, exports):
    model = exports["hybrid"]
    for prompt, expected in list(zip(model["prompts"], model["expected"]))[1:4]:
        body = {"model": model["path"], "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0,
                "return_token_ids": True}
        with _post(f"{server}/v1/completions", body) as response:
            answer = json.loads(response.read())
        assert answer["choices"][0]["token_ids"] == expected
        assert answer["usage"] == {**answer["usage"], "prompt_tokens": len(prompt), "completion_tokens": NEW_TOKENS}


def test_server_streams_completions(server, exports):
    model = exports["hybrid"]
    prompt, expected = model["prompts"][3], model["expected"][3]
    body = {"model": model["path"], "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0,
            "return_token_ids": True, "stream": True}
    tokens, events = [], 0
    with _post(f"{server}/v1/completions", body) as response:
        for line in response:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            events += 1
            for choice in json.loads(line[len("data: "):])["choices"]:
                tokens += choice.get("token_ids") or []
    assert tokens == expected
    assert events > 1  # streamed as the tokens come, not one answer


# -- the pinned vLLM version ------------------------------------------------------------------


_FAKE_VERSION = "import vllm; vllm.__version__ = '0.31.0'\n"


def test_another_vllm_version_is_refused_by_name(exports, serve_python):
    """Under another vLLM the plugin registers a refusal: loading a linattn model fails naming
    both versions; ``linattn serve`` says so as one error line."""
    script = _FAKE_VERSION + (
        "import os, sys\n"
        "os.environ['VLLM_ENABLE_V1_MULTIPROCESSING'] = '0'\n"
        "from vllm import LLM\n"
        "try:\n"
        f"    LLM(model={exports['gau']['path']!r}, dtype='float32', enforce_eager=True, max_model_len=64,\n"
        "        enable_prefix_caching=False, kv_cache_memory_bytes=1 << 24)\n"
        "except Exception as error:\n"
        "    print('REFUSED', error)\n")
    run = subprocess.run([str(serve_python), "-c", script], capture_output=True, text=True, timeout=300,
                         env=_serve_env())
    assert "REFUSED" in run.stdout, run.stderr[-3000:]
    assert "written against vLLM 0.32.0" in run.stdout and "vLLM 0.31.0 is installed" in run.stdout
    cli = subprocess.run([str(serve_python), "-c", _FAKE_VERSION + "import sys; from linattn.cli import main; "
                          f"sys.exit(main(['serve', {exports['gau']['path']!r}]))"],
                         capture_output=True, text=True, timeout=300, env=_serve_env())
    assert cli.returncode == 2
    assert cli.stderr.startswith("linattn: error: linattn's vLLM plugin is written against vLLM 0.32.0")
    assert "Traceback" not in cli.stderr


def test_serve_without_vllm_says_how_to_get_it(exports):
    """In the project's environment (no vLLM) ``linattn serve`` points to the serving one."""
    run = subprocess.run([sys.executable, "-m", "linattn.cli", "serve", exports["gau"]["path"]],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert "vLLM is not installed in this Python" in run.stderr and "make serve-env" in run.stderr


def test_serve_refuses_another_model_type(tmp_path, serve_python):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    run = subprocess.run([str(serve_python.parent / "linattn"), "serve", str(tmp_path)], capture_output=True,
                         text=True, timeout=300, env=_serve_env())
    assert run.returncode == 2
    assert "model_type='llama', not a linattn export" in run.stderr


def test_a_training_run_is_served_through_an_export(tmp_path, serve_python):
    """``linattn serve RUN`` exports the run first (in the serving environment, with its
    transformers): the export holds the run's model exactly; an export is served as it is."""
    from _helpers import english_like
    from test_train_cli import train_argv
    from transformers import AutoModelForCausalLM

    import linattn.hf  # noqa: F401 - registers the linattn Auto classes
    from linattn.cli import main
    from linattn.train import load_model

    corpus = tmp_path / "tiny.txt"
    corpus.write_text(english_like(4000), encoding="utf-8")
    run = tmp_path / "run"
    assert main(train_argv(corpus, run, steps=2)) == 0
    script = ("import sys; from pathlib import Path; from linattn.serve.cli import served_directory\n"
              "print(served_directory(sys.argv[1], Path(sys.argv[2])))\n"
              "print(served_directory(sys.argv[2], Path(sys.argv[2]) / 'unused'))\n")
    done = subprocess.run([str(serve_python), "-c", script, str(run), str(tmp_path / "export")], capture_output=True,
                          text=True, timeout=300, env=_serve_env())
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == [str(tmp_path / "export")] * 2
    lm, _ = load_model(run)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    ids = torch.tensor(_prompts([12, 12], seed=4))
    assert torch.equal(exported(ids).logits, lm(ids)[0])
