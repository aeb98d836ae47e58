"""Refresh the planner's packaged control-plane figures
(megaresil/plan/profiles/control_plane.yaml) from the simulator's results
(bench/results/control_plane.json, which bench/control_plane.py writes):
`megaresil plan` reads that copy from an installed package, where bench/ is not.

    python bench/control_plane_profile.py"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import yaml

from megaresil.plan.control_plane import DEFAULT_CONTROL_PLANE, packaged

RESULTS = Path(__file__).parent / "results" / "control_plane.json"
HEADER = ("# The control plane's recovery latencies, simulated (megaresil/plan/control_plane.py\n"
          "# reads them). Written by bench/control_plane_profile.py from the file named in\n"
          "# source: refresh it there, not by hand.\n")


def main() -> None:
    commit = subprocess.run(["git", "log", "-1", "--format=%h %cs", "--", str(RESULTS)],
                            capture_output=True, text=True, cwd=RESULTS.parent).stdout.strip()
    source = f"bench/results/control_plane.json of {commit or 'an uncommitted run'}"
    content = packaged(json.loads(RESULTS.read_text()), source)
    DEFAULT_CONTROL_PLANE.write_text(HEADER + yaml.safe_dump(content, sort_keys=False))
    print(f"wrote {DEFAULT_CONTROL_PLANE}: worlds {[r['world'] for r in content['rows']]}")


if __name__ == "__main__":
    main()
