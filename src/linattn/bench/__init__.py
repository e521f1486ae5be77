"""Speed and memory benchmarks (``linattn bench ...``) and the harness they share."""
