"""kdagen's developer tools, apart from what a user imports (nothing in `kdagen` imports this).

- sass: read the machine code of built CUDA fatbins without a GPU
- ncu_phases: per-phase tables of an ncu source-page export
- ab: compile one variant with experimental -D flags (A/B builds for scripts/fatbin_ab.py)
- artifacts: the built CUDA variants and their fatbins
- mutate, mutations: the mutation check of the test suite (scripts/mutate.py)
- error_table: the measured errors of a test run (KDAGEN_ERRORS) per variant kind and output
"""
