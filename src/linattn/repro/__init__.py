"""Reproductions of the seed papers' experiments at CPU scale (``linattn repro ...``).

``framework``: the experiment protocol every reproduction follows (spec, shared flags,
seeds, result files), with ``grids`` (the runs of an invocation and the worker pool),
``journal`` (the run journal ``runs.jsonl``) and ``spread`` (the spread over seeds, the
resolved rule, the Differences matrix); ``query_task``:
training and scoring a model on a synthetic task scored at query positions only (``mqar``,
``long_range``). The experiments:
``fwp_retrieval`` (+ ``fwp_model``, ``fwp_report``): the synthetic associative-retrieval
experiments of "Linear Transformers Are Secretly Fast Weight Programmers" (seed 001),
Setting 1 (capacity) and Setting 2 (update rules); ``mqar`` (+ ``mqar_report``):
multi-query associative recall (Zoology); ``lm_quality``: byte-level language-model quality
per mechanism; ``length_extrapolation``: test bpb at evaluation contexts longer than the
training one (entropy-invariant scale, NoPE, window + global hybrid; seed 003);
``long_range`` (+ ``long_range_report``): recall of facts d tokens before their question, d
past the training distance (the efficient-attention survey's claim, seed 004); ``demo``:
the ``make demo`` model at several seeds; ``linearize`` (+ ``linearize_teacher``,
``linearize_report``): a trained Llama converted to linear-time layers (Transformer-VQ with ReRoPE or
the bias, Gated DeltaNet, Hedgehog, a hybrid) against training them from scratch (seed 004,
LoLCATs). ``cli``: the ``repro`` command group, one
subcommand per experiment.
"""
