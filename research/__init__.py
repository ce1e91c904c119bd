"""The research apparatus: evaluation (evaluate, harness, ruler), timing (bench), the analysis
scripts (analysis/), research recipes (configs/), the GPU scripts and the lab log. Run a script here
as a module from the repository root: python -m research.evaluate --help."""
