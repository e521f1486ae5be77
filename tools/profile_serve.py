"""Where a served linattn model's time goes: ``linattn bench serve``'s case under cProfile.

Run with the serving environment's python: ``.venv-serve/bin/python tools/profile_serve.py SPEC
[PROMPT_LENGTH]`` (default ``vq 1024``). It exports ``bench serve``'s model of ``SPEC``, serves its
requests once in this process, and prints the timed call's share in the linattn state layers and
how many one-token calls each layer call made (sequences at positions a layer cannot batch
together are decoded in separate calls)."""

import cProfile
import os
import pstats
import sys
import tempfile
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

from linattn.bench.serve import ServeBenchConfig, export_model, serve_case  # noqa: E402


def _stat(stats: pstats.Stats, file_suffix: str, function: str) -> tuple[int, float]:
    """(calls, cumulative seconds) of ``function`` in the file ending with ``file_suffix``."""
    for (file, _, name), (_, calls, _, cumulative, _) in stats.stats.items():
        if file.endswith(file_suffix) and name == function:
            return calls, cumulative
    raise LookupError(f"{function} of {file_suffix} was not called")


def main() -> None:
    spec = sys.argv[1] if len(sys.argv) > 1 else "vq"
    prompt_length = int(sys.argv[2]) if len(sys.argv) > 2 else 1024
    config = ServeBenchConfig()
    with tempfile.TemporaryDirectory() as folder:
        export_model(spec, config, Path(folder))
        profile = cProfile.Profile()
        profile.enable()
        measured = serve_case(folder, prompt_length, config)
        profile.disable()
    stats = pstats.Stats(profile)
    _, generate = _stat(stats, "vllm/entrypoints/llm.py", "generate")
    layer_calls, layers = _stat(stats, "linattn/serve/model.py", "run")
    decode_calls, _ = _stat(stats, "linattn/serve/model.py", "_decode")
    print(f"{spec} at {prompt_length}: {measured['output_tokens_per_s']:.1f} output tokens/s; "
          f"LLM.generate (warm-up and timed) {generate:.2f} s, of which the linattn state layers "
          f"{layers:.2f} s ({layers / generate:.0%}); {layer_calls} state-layer calls, "
          f"{layers / layer_calls * 1e3:.2f} ms each, {decode_calls / layer_calls:.2f} one-token calls per layer call")


if __name__ == "__main__":
    main()
