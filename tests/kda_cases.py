"""Moved to kdagen/cases.py (the case builder and comparison every target, `kdagen verify`, the
benchmarks and the scripts share); this re-export keeps branches written against the old path
importing until they move."""

from kdagen.cases import *  # noqa: F401,F403
from kdagen.cases import GATE_SCENARIOS, make_case, run_and_compare  # noqa: F401
