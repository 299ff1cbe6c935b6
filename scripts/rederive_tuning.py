"""Derive a tuning file's rules again from its own evidence with this tree's regime edges (CPU): see
kdagen_dev/retune.py. Prints, per file, the measured cases whose first-ranked choice changes.

    python scripts/rederive_tuning.py kdagen/tuning_data/*.json            # report only
    python scripts/rederive_tuning.py --write --note "..." kdagen/tuning_data/*.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kdagen_dev.retune import main

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--write", action="store_true", help="rewrite the files (default: report only)")
    ap.add_argument("--note", default="rules re-derived from its evidence by scripts/rederive_tuning.py",
                    help="added to the file's made_by")
    a = ap.parse_args()
    raise SystemExit(main(a.files, a.note, a.write))
