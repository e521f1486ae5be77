"""Reproductions of the seed papers' experiments at CPU scale (``linattn repro ...``).

``fwp_retrieval``: the synthetic associative-retrieval experiments of "Linear Transformers
Are Secretly Fast Weight Programmers" (seed 001), Setting 1 (capacity) and Setting 2
(update rules). ``cli``: the ``repro`` command group, one subcommand per module.
"""
