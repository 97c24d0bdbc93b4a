#!/usr/bin/env python3
"""List the Triton kernels built into a cache directory after a given unix time: which kernels
a run compiled while it was being timed, and the specialization each was built for.

    python3 benchmarks/triton_builds.py CACHE_DIR SINCE
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> None:
    cache, since = Path(sys.argv[1]), float(sys.argv[2])
    for meta in sorted(cache.rglob("*.json"), key=lambda p: p.stat().st_mtime):
        t = meta.stat().st_mtime
        if t < since or meta.name.startswith("__grp__"):
            continue
        try:
            info = json.loads(meta.read_text())
        except (OSError, ValueError):
            continue
        keep = {k: v for k, v in info.items() if len(json.dumps(v, default=str)) < 300}
        print(f"+{t - since:8.3f} s  {info.get('name')}  {json.dumps(keep, default=str)[:900]}")


if __name__ == "__main__":
    main()
